"""An answer a user can act on: threads that fit the machine said up front, "undecided" never
"skip", one budget advice for the run, the baseline first where one round fits, and a recipe
search that says when it stopped underpowered."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import TINY, compose_cfg

from speedbench.config import ConfigError, build_plan
from speedbench.measure import env, flops
from speedbench.measure.budget import Budget
from speedbench.report import recommend
from speedbench.search import selection as S
from speedbench.studies import study


# --- threads that fit the free cores ------------------------------------------------------------
def test_threads_fit_the_cores_other_processes_leave_free():
    assert env.fitting_threads(2, 0.1) == 2
    assert env.fitting_threads(2, 1.2) == 1
    assert env.fitting_threads(2, 3.0) == 1  # one at least
    assert env.fitting_threads(16, 4.4) == 12


def test_a_busy_machine_is_said_up_front_with_the_threads_that_fit():
    threads, said = env.threads_plan(None, 1.6, current=2, cores_=2)
    assert threads is None  # the default leaves torch's threads, and says what fits
    assert said.startswith("speedbench: other processes keep 1.6 of 2 cores busy, and torch's "
                           "2 threads will share them")
    assert said.endswith("bench.threads=auto (1 here) fits the free cores.")
    assert env.threads_plan(None, 0.1, current=2, cores_=2) == (None, "")  # quiet: nothing
    assert env.threads_plan(None, None, current=2, cores_=2) == (None, "")  # no /proc/stat
    threads, said = env.threads_plan("auto", 1.6, current=2, cores_=2)
    assert threads == 1 and said.startswith("bench.threads=auto: 1 thread(s)")
    assert env.threads_plan("3", None, current=2, cores_=2) == (3, "")


def test_bench_threads_is_checked_before_anything_runs():
    with pytest.raises(ConfigError, match=r"bench.threads: 'many' is not allowed; choose auto, "
                                          r"a whole number from 1, or null"):
        build_plan(compose_cfg(*TINY, "model=transformer", "bench.threads=many"), None)
    build_plan(compose_cfg(*TINY, "model=transformer", "bench.threads=auto"), None)


def test_bench_threads_sets_the_runs_threads_records_them_and_puts_them_back(tmp_path):
    import torch

    from speedbench.run import run

    before = torch.get_num_threads()
    cfg = compose_cfg(*TINY, "model=transformer", "bench.threads=1", "bench.repeats=1",
                      "bench.quality_steps=0", "bench.explain=false", f"out_dir={tmp_path}",
                      "+variants={a:{}}", "baseline=a")
    run_dir = run(cfg, None, progress=False)
    machine = json.loads((run_dir / "env.json").read_text())
    assert machine["bench_threads"] == {"setting": "1", "others_busy_cores": None,
                                        "torch_threads": 1}
    assert machine["torch_threads"] == 1
    assert torch.get_num_threads() == before


# --- verdict words ------------------------------------------------------------------------------
def _row(variant, verdict, speedup, lo, hi, rounds=3, status="ok", baseline=False):
    return {"experiment": "amp", "model": "m", "variant": variant, "is_baseline": baseline,
            "status": status, "verdict": verdict, "speedup": speedup, "speedup_lo": lo,
            "speedup_hi": hi, "rounds": rounds, "ci_level": 0.99}


def test_measured_faster_but_not_settled_is_undecided_with_how_to_settle_it_never_skip():
    summary = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                            _row("bf16", "inconclusive", 1.5, 0.9, 2.49),
                            _row("fp16", "slower", 0.1, 0.08, 0.12)])
    (advice,) = recommend.advise(summary)
    lines = recommend.lines(advice)
    # not "use: nothing": an undecided 1.5x may still pay off (user trial 5, run 05)
    assert lines[0] == ("nothing settled yet: nothing was significantly faster than plain "
                        "PyTorch; 1 undecided")
    undecided = next(line for line in lines if line.startswith("undecided: amp: bf16"))
    assert undecided.startswith("undecided: amp: bf16, 1.50x [0.90, 2.49]; measure longer: "
                                "about ")
    assert "this run had 3" in undecided and "bench.time_budget_s about" in undecided
    assert not any(line.startswith("skip:") and "bf16" in line for line in lines)
    assert any(line.startswith("skip: amp: fp16") for line in lines)


def test_a_model_with_nothing_measured_says_so_not_use_nothing():
    summary = pd.DataFrame([_row("fp32", "", float("nan"), None, None, baseline=True),
                            _row("bf16", "", float("nan"), None, None,
                                 status="not measured: the run's bench.time_budget_s ran out")])
    (advice,) = recommend.advise(summary)
    assert recommend.lines(advice)[0] == ("nothing measured: no technique could be measured for "
                                          "this model (see could not test here)")
    console = recommend.console_lines(summary)  # the same words, not "use nothing was ..."
    said = " ".join(line.strip() for line in console[1:])  # wrapped to the terminal's width
    assert said.startswith("m: nothing measured: no technique could be measured for this model "
                           "(see could not test here)"), console
    only_undecided = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                                   _row("bf16", "inconclusive", 1.2, 0.9, 1.6)])
    (advice,) = recommend.advise(only_undecided)
    assert recommend.lines(advice)[0] == ("nothing settled yet: what was measured is undecided "
                                          "against plain PyTorch")


# --- where one round fits, the baseline runs first in it -----------------------------------------
@pytest.mark.parametrize("order_seed", range(4))
def test_where_one_round_fits_the_baseline_runs_first(order_seed, tmp_path, monkeypatch):
    monkeypatch.setattr(flops, "matmul_peak_tflops", lambda device, precision, **_: 1.0)
    plan = build_plan(compose_cfg(*TINY, "model=transformer", f"bench.order_seed={order_seed}",
                                  "bench.explain=false", experiment="amp"), "amp")
    now, ran = [0.0], []

    def probe(mc, name, dataset, ref, steps, left_s):  # 3 s a step: a round of about 45 s
        return {"probe_samples_per_s": 4 / 3.0, "quality_steps": 0}

    def trial(mc, name, round_, position, *_):
        now[0] += 15.0
        ran.append(name)
        return {**mc.header(name, round_, position), "status": "ok", "samples_per_s": 1.0,
                "step_ms": 3000.0}
    study.measure_plan(plan, tmp_path, progress=False, budget=Budget(60, clock=lambda: now[0]),
                       instruments=study.Instruments(trial=trial, probe=probe))
    assert ran[0] == "fp32"


# --- the recipe search says when it stopped underpowered -----------------------------------------
def test_an_open_confirmation_is_measured_again_and_else_the_search_is_not_decided():
    """A 1.3x option measured in 3 noisy rounds: a confirmation that neither settles nor rules
    it out is measured again, afresh, as the next step, where the budget fits; a search that
    still chose nothing with an option open says it is not decided (recipe.yaml: decided
    false)."""
    from test_search import NAIVE, World, groups

    again = undecided = 0
    for seed in range(40):
        world = World({("precision", "bf16"): 1.3}, seed, rounds=3, sigma=0.25, stall_p=0.0)
        r = S.search(groups()[:1], NAIVE, world, budget=Budget(None, world.clock),
                     min_rounds=3, screen_rounds=3)
        for first, second in zip(r.steps, r.steps[1:]):
            if not second.comparisons:  # a re-confirmation: no screen, its own level
                again += 1
                assert set(second.confirmations) == {c.label for c in S.open_options(
                    first.confirmations.values(), 1.02)}
                assert f"step {second.index} confirm" in r.levels
        open_ = S.open_options(r.steps[-1].confirmations.values(), 1.02) if r.steps else []
        if r.chosen or not open_:
            assert r.chosen or not r.undecided.startswith("not decided: ") or not r.steps
            continue
        undecided += 1
        assert r.undecided.startswith("not decided: "), r.undecided
        assert all(c.label in r.undecided for c in open_), r.undecided
        assert "measured faster in its confirmation but not settled in 3 rounds" in r.undecided
    assert again >= 1 and undecided >= 1  # the noise makes some of the 40 end each way


def test_the_busy_note_never_asks_for_fewer_than_one_thread():
    """User trial, after round 5: with bench.threads=auto at 1 thread the report said 'give
    fewer threads than this run's 1'."""
    from speedbench.report.render import busy_note

    load = {"busy": True, "load_highest": 9.9, "cores": 2, "own_cpu_share": 0.16}
    one = busy_note({"machine_load": load,
                     "bench_threads": {"setting": "auto", "torch_threads": 1}})
    assert one.endswith("Measure again on a quiet machine.") and "fewer" not in one
    two = busy_note({"machine_load": load,
                     "bench_threads": {"setting": "auto", "torch_threads": 2}})
    assert "give fewer threads than this run's 2 (bench.threads=N)" in two


def test_the_headline_counts_each_unsettled_row_by_its_own_word():
    """m1: rows with one round (`no CI`) were counted as `not measured`."""
    from speedbench.report.render import at_a_glance

    summary = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                            _row("bf16", "no CI", 1.21, None, None, rounds=1),
                            _row("fp16", "not measured [1]", float("nan"), None, None),
                            _row("tf32", "inconclusive", 1.1, 0.9, 1.3)])
    assert at_a_glance(summary).startswith(
        "Of 3 (model, variant) pairs: 1 inconclusive, 1 no CI, 1 not measured.")
