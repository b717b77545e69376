"""A plan's study (studies/study.py): the request is plain data, the run-level keys are read
once from the run's config, nothing writes a key, and every phase draws on one clock."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import TINY, compose_cfg

from speedbench.config import build_plan
from speedbench.errors import ConfigError
from speedbench.measure.budget import Budget
from speedbench.search import check_findings, driver
from speedbench.studies import study


def test_a_request_is_plain_data_both_ways():
    request = study.Request(rounds=3, probes="screen", explain=False, budget_s=12.5)
    assert json.loads(request.to_json()) == {"rounds": 3, "probes": "screen",
                                             "explain": False, "budget_s": 12.5, "min_s": 0.0}
    assert study.Request.from_json(request.to_json()) == request
    with pytest.raises(ConfigError, match="request.probes: 'quick' is not one of full, screen"):
        study.Request(probes="quick")
    with pytest.raises(ConfigError, match="request.rounds"):
        study.Request(rounds=0)


def test_settings_come_from_the_runs_config_with_the_request_applied_and_nothing_is_written():
    plan = build_plan(compose_cfg(*TINY, "model=transformer", "bench.quality_steps=12",
                                  "bench.quality_seeds=3", "bench.target_ci=0.03",
                                  experiment="amp"), "amp")
    full = study.Settings.of(plan)
    assert (full.repeats, full.target_ci, full.quality_steps, full.quality_seeds) == (2, 0.03,
                                                                                     12, 3)
    assert full.explain == bool(plan.config.bench.explain)
    screen = study.Settings.of(plan, study.Request(rounds=4, probes="screen", explain=False))
    assert (screen.repeats, screen.target_ci, screen.quality_steps, screen.quality_seeds,
            screen.explain) == (4, None, study.SCREEN_PROBE_STEPS, 1, False)
    assert all(screen.repeats_of(r) == 4 for r in plan.variants.values())
    # the plan is as it was built: a request writes no key
    for recipe in plan.variants.values():
        assert (recipe.bench.repeats, recipe.bench.target_ci, recipe.bench.quality_steps) \
            == (2, 0.03, 12)


def test_each_recipe_search_step_is_a_request_within_its_time():
    cfg = compose_cfg(*TINY, "model=transformer", experiment="recipe")
    screen = driver.step_request(cfg, "step 1", 100.0, 3)
    least = driver.MIN_MEASUREMENT_S
    assert screen == study.Request(rounds=3, probes="screen", explain=False, budget_s=50.0,
                                   min_s=least)
    confirm = driver.step_request(cfg, "step 1 confirm", 1000.0, None)
    assert confirm == study.Request(probes="full", explain=False,
                                    budget_s=cfg.recipe.step_budget_s, min_s=least)
    closing = driver.step_request(cfg, "closing", None, None)
    assert closing.explain and closing.budget_s == cfg.recipe.step_budget_s
    assert driver.step_request(cfg, "pilot", 0.5, 1).budget_s == driver.MIN_MEASUREMENT_S


def test_a_findings_check_the_run_has_no_time_left_for_says_so(tmp_path):
    from speedbench import results

    plan = build_plan(compose_cfg(*TINY, "model=transformer", experiment="sync"), "sync")
    pd.DataFrame([{"experiment": "sync", "model": "transformer", "variant": "item",
                   "symptom": "host reads of device values every step", "figure": "1 per step",
                   "tip": "read the loss every K steps", "knob": "sync=deferred"}]
                 ).to_csv(tmp_path / "findings.csv", index=False)
    writer = results.TrialWriter(tmp_path / "trials.csv")
    spent = Budget(1.0, clock=lambda: 0.0, start=-5.0)  # its one second spent 4 s ago
    findings = check_findings.check([plan], tmp_path, writer, False, budget=spent)
    assert findings["check"].iloc[0] == ("not checked: the run's bench.time_budget_s had 0 s "
                                         "left for it, about 0 s needed")
    assert writer.rows == []  # nothing measured past the run's clock


def _fake_study(prepare, clock, budget_s: float = 60.0):
    """A one-model study whose instruments' prepare is `prepare`; the trials never run."""
    from types import SimpleNamespace

    bench = SimpleNamespace(repeats=2, target_ci=None, quality_steps=0, quality_seeds=1,
                            too_slow_factor=None, time_budget_s=60.0, noise_threshold=0.05,
                            max_trial_s=6.0, warmup=3, steps=5)
    plan = SimpleNamespace(variants={n: SimpleNamespace(bench=bench) for n in ("a", "b")},
                           baseline="a", models=[SimpleNamespace(name="m")], experiment="e")
    settings = study.Settings(repeats=2, target_ci=None, quality_steps=0, quality_seeds=1,
                              explain=False, skip_by_forecast=False, find_largest_batch=False,
                              too_slow_factor=None, time_budget_s=60.0, noise_threshold=0.05,
                              seed=0)
    said, rows = [], []
    bar = SimpleNamespace(total=0, write=lambda text, *_: said.append(text),
                          set_postfix_str=lambda *_: None, update=lambda *_: None)
    writer = SimpleNamespace(append=rows.append)

    def trial(*_):
        raise AssertionError("no trial runs once the data overran")
    instruments = study.Instruments(
        prepare=prepare, trial=trial,
        header=lambda mc, name, r, p: {"experiment": "e", "model": "m", "variant": name,
                                       "round": r, "position": p})
    mc = study.ModelContext(plan, plan.models[0], settings, instruments, writer=writer, bar=bar)
    study.study_models([mc], Budget(budget_s, clock=clock))
    return said, rows


def test_data_building_is_held_to_the_budget_and_the_console_says_when_it_overran():
    """Finding 3 (measurement audit 5): the ResNet's data took 52 s of a 60 s budget with no
    deadline; the run ended at 109 s. The data's building is held to what the budget leaves
    (DataOutOfTime) and timed; a model whose data used its share is not measured, said once."""
    from speedbench.measure import data

    with pytest.raises(data.DataOutOfTime, match="after 0 of 4 pictures"):
        data.JpegImages(4, 8, 2, left_s=-1.0)
    assert len(data.JpegImages(4, 8, 2, left_s=60.0).jpegs) == 4
    now = [0.0]

    def slow(mc):  # the data took 70 s of the 60
        assert mc.data_left_s == pytest.approx(60.0)
        now[0] += 70.0
        return study.Prepared(None, {}, {"a": 1, "b": 1})
    said, rows = _fake_study(slow, lambda: now[0])
    assert any("m: preparing its data took 70 s, all of its 60 s share" in s for s in said)
    assert {r["variant"]: r["status"].split(":")[0] for r in rows} == {"a": "not measured",
                                                                       "b": "not measured"}

    # c_budget_5_amp: the start-up and the peaks took the run's 5 s before this model began;
    # it said "preparing its data took 0 s, all of its 0 s share"
    said, rows = _fake_study(lambda mc: study.Prepared(None, {}, {"a": 1, "b": 1}),
                             lambda: now[0], budget_s=0.0)
    assert [" ".join(s.split()) for s in said if "not measured" in s] == [  # (wrapped)
        "m: bench.time_budget_s had nothing left for it: the run's start-up, its matmul peaks "
        "and the models before it took the budget: not measured (a larger budget lets it run)"]
    assert all("had nothing left for it" in r["status"] for r in rows) and len(rows) == 2

    def cut(mc):  # the pictures' pool stopped at the deadline
        raise data.DataOutOfTime("building its data ran past what bench.time_budget_s left it")
    said, rows = _fake_study(cut, lambda: now[0])
    assert all("building its data ran past" in r["status"] for r in rows) and len(rows) == 2


def test_the_console_says_when_a_run_overran_its_budget():
    from speedbench.run import overrun_line

    assert overrun_line(65.0, 60.0) is None  # within max(5 %, 10 s)
    assert overrun_line(109.0, 60.0).startswith("speedbench: the run took 109 s, 49 s over its "
                                                "bench.time_budget_s of 60 s")
    assert overrun_line(500.0, None) is None
    # what no budget shortens is named: at a 4 % CPU share the start-up and the report alone
    # took longer than a 15 s budget
    line = overrun_line(55.0, 15.0, {"Python's start-up and the imports": 21.4,
                                     "the tables and the report": 18.0, "nothing": 0.2})
    assert line.endswith("; Python's start-up and the imports took 21 s; the tables and the "
                         "report took 18 s)") and "nothing" not in line


def test_a_far_slower_stop_is_rechecked_against_a_fresh_probe_of_the_baseline():
    """Measurement round 5: a load episode that covered a variant's whole probe could stop an
    identical variant. The stop now holds only where the baseline's fresh steps, taken right
    after, confirm it: slowed by the same episode, they withdraw it."""
    from speedbench.studies import probes, stopping
    from speedbench.results import schema

    rng = np.random.default_rng(0)
    fast = list(0.1 * np.exp(0.05 * rng.standard_normal(6)))
    slow = list(1.0 * np.exp(0.05 * rng.standard_normal(6)))  # 10x: past the factor 4
    ref = stopping.Reference(fast, 32, 4.0, stopping.stop_level(2))
    assert stopping.far_slower(slow, 32, ref) is not None  # the unpaired test stops it
    assert probes.confirmed(slow, 32, ref, fresh_base_s=list(np.array(fast) * 1.02))
    assert not probes.confirmed(slow, 32, ref, fresh_base_s=list(np.array(slow) * 0.98))
    assert probes.confirmed(slow, 32, ref, fresh_base_s=[])  # no fresh steps: it stands

    found = probes.ProbeResult()
    found.keep("b", {"status": "too slow: 10x slower ...", "probe_step_s": slow})
    assert "b" in found.status
    found.withdraw_stop("b")
    assert "b" not in found.status and schema.parse_status(found.no_loss["b"]).kind == schema.NA
