"""The verdicts' simulation (benchmarks/verdict_sim.py): its noise is fitted to real trials, and
it runs the command line's own code for whole runs: every phase of the study (probes and
stopping rules, budget, rounds loop and looks), then the summary; only its instruments are
simulated."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from speedbench.analysis import intervals
from speedbench.studies import costs, study
from speedbench.results.schema import NOT_MEASURED, STOPPED_SLOWER

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "verdict_sim.py"
_spec = importlib.util.spec_from_file_location("verdict_sim", _path)
sim = importlib.util.module_from_spec(_spec)
sys.modules["verdict_sim"] = sim  # its dataclasses look their module up
_spec.loader.exec_module(sim)

NOISE = sim.fit()


def test_noise_is_fitted_to_the_reference_trials():
    assert NOISE["measurements"] >= 3
    assert 0.005 < NOISE["trial_sd"] < 0.12 and 0.01 < NOISE["round_sd"] < 0.12
    z = NOISE["residuals"]
    assert abs(z.mean()) < 1e-9 and abs(z.std() - 1) < 1e-9


def test_the_simulation_runs_the_command_lines_code(monkeypatch):
    # the phases (probes, stopping rules, plan, rounds) are the study's own: the simulation
    # hands study.study_models its instruments, nothing else
    training = sim.SimTraining(sim.SimModel("m", 0.05, {"a": 1.0}), NOISE, None, sim.Clock())
    assert isinstance(training.instruments(), study.Instruments)
    assert not any(isinstance(v, type) and issubclass(v, (study.ModelContext,))
                   and v is not study.ModelContext for v in vars(sim).values())
    ran = []
    real = study.study_models
    monkeypatch.setattr(study, "study_models", lambda *a: ran.append(1) or real(*a))
    rng = np.random.default_rng(0)
    models = sim.amp_models(bf16=(1.45, 1.26, 1.0))  # the reference ResNet's 1.45x
    s, took = sim.simulate_run(models, NOISE, rng, sim.Settings(time_budget_s=900))
    v = s.set_index(["model", "variant"])["verdict"]
    assert v[("resnet", "bf16")] == intervals.FASTER  # 1.45x with a long budget
    # 25x slower: stopped by the far-slower test (a call with its interval), or not measured
    assert v[("resnet", "fp16")] in (STOPPED_SLOWER, NOT_MEASURED)
    stopped = s[s["verdict"] == STOPPED_SLOWER]
    assert (stopped["speedup_hi"] < 1 / 4).all()  # the whole interval F = 4 times slower
    assert took <= 900 and ran == [1]


def test_identical_variants_are_rarely_called_and_intervals_cover():
    r = sim.scenario(sim.identical(3), 30, NOISE, seed=3, position_effect=0.05)
    # 30 runs: a 5 % family-wise rate gives 1.5 false runs on average; 7 would mean > 15 %
    assert r["family_false"] <= 0.2 and r["coverage"] >= 0.9, r


def test_a_simulated_run_keeps_its_budget():
    r = sim.scenario(sim.amp_models(), 10, NOISE, seed=5, settings=sim.Settings(time_budget_s=60))
    assert r["seconds_max"] <= 60 + 2, r  # a trial's window stops at the deadline


def test_balanced_orders_absorb_a_position_effect():
    rng = np.random.default_rng(4)
    logs = []
    for _ in range(15):
        s, _ = sim.simulate_run(sim.identical(3, 1), NOISE, rng,
                                sim.Settings(time_budget_s=300, target_ci=None, repeats=6),
                                position_effect=0.05)
        logs += [math.log(x) for x in s[~s["is_baseline"]]["speedup"]]
    # with a fixed order, one variant would sit first every round: a 5 % bias
    assert abs(np.mean(logs)) < 0.025


def _plan_line(budget_s: float, repeats: int = 5, variants: int = 2) -> str:
    """The plan's line (costs.plan_line) for `variants` identical variants of a 50 ms model,
    after the probes (study.prepare), with `budget_s` for the run."""
    from types import SimpleNamespace

    from speedbench.measure.budget import Budget

    clock = sim.Clock()
    settings = sim.Settings(time_budget_s=budget_s, repeats=repeats)
    bench = SimpleNamespace(**{k: v for k, v in vars(settings).items() if k != "extra"})
    model = sim.SimModel("m", 0.05, {name: 1.0 for name in "abcdefg"[:variants]})
    training = sim.SimTraining(model, NOISE, np.random.default_rng(1), clock)
    mc = sim.model_context(model, bench, training, variants - 1, 0)
    budget = Budget.of_run(budget_s, clock=clock)
    state = study.prepare(mc, budget)
    return costs.plan_line("m", state.plan_facts(mc), mc.settings, mc.comparisons,
                           state.prepared_s, budget.left())


def _run_line(budget_s: float) -> str:
    """The run's one budget line (costs.run_budget_line) for _plan_line's model."""
    from types import SimpleNamespace

    from speedbench.measure.budget import Budget

    clock = sim.Clock()
    settings = sim.Settings(time_budget_s=budget_s)
    bench = SimpleNamespace(**{k: v for k, v in vars(settings).items() if k != "extra"})
    model = sim.SimModel("m", 0.05, {"a": 1.0, "b": 1.0})
    mc = sim.model_context(model, bench, sim.SimTraining(model, NOISE, np.random.default_rng(1),
                                                         clock), 1, 0)
    budget = Budget.of_run(budget_s, clock=clock)
    state = study.prepare(mc, budget)
    figure = costs.verdict_budget_s(state.plan_facts(mc), mc.settings, 1, state.prepared_s,
                                    budget.left())
    return costs.run_budget_line([figure], budget_s)


def test_the_plan_names_what_stops_it_short_of_a_verdict_on_1_1x():
    from speedbench.analysis.intervals import MAX_LOOKS, MAX_SPACING, most_rounds

    # a day of budget: MAX_LOOKS looks at their widest spacing, 5 + 7 x 4 x 5 = 145 rounds
    ample = _plan_line(86_400)
    most = most_rounds(5, MAX_LOOKS, MAX_SPACING * 5)
    assert f"about {most} rounds of" in ample and "a verdict on 1.1x" not in ample, ample
    # one repeat and 6 comparisons: the rounds' cap (1 + 7 x 4 = 29 rounds) is what stops
    # short of the 34 rounds 1.1x needs, not the budget
    capped = _plan_line(86_400, repeats=1, variants=7)
    most = most_rounds(1, MAX_LOOKS, MAX_SPACING)
    assert f"about {most} rounds of" in capped and "give bench.repeats=2" in capped, capped
    assert "bench.time_budget_s=" not in capped, capped
    # 20 s: the budget stops short too; the run's one budget line says how much would do
    short = _plan_line(20)
    assert "a larger bench.time_budget_s (the run's figure above)" in short, short
    figure = _run_line(20)
    assert figure.startswith("speedbench: budget: about bench.time_budget_s="), figure
    assert "calls a 1.1x effect on every model" in figure
    assert float(figure.split("bench.time_budget_s=")[1].split()[0]) > 20
    assert _run_line(86_400) == ""  # a day is enough: nothing to advise
    assert "bench.repeats=" not in short, short  # a larger budget spreads the looks wider


def test_the_simulation_learns_a_fresh_models_level_and_load_episodes():
    """Measurement audit 5 (finding 8 there): the simulated probe steps were drawn around the
    true step with no trial level and no load, so no A/A stop could appear. A probe now shares
    a level fitted on step_times*.csv, and Load episodes slow every step while they last."""
    assert 0.02 < NOISE["level_sd"] < 0.3
    rng = np.random.default_rng(0)
    load = sim.Load(per_minute=6.0, seconds=(5.0, 10.0), factor=(5.0, 50.0))
    seen = [load.at(t, rng) for t in np.arange(0.0, 600.0, 0.5)]
    assert min(seen) == 1.0 and 5.0 <= max(seen) <= 50.0
    assert 0.02 < np.mean([s > 1 for s in seen]) < 0.9  # episodes come and go
    summary, took = sim.simulate_run(sim.identical(3, models=1), NOISE, rng,
                                     sim.Settings(time_budget_s=60.0), load=load)
    assert len(summary) == 3 and took <= 60.0 + 30.0


def test_the_forecast_screen_is_simulated_through_the_searchs_rule():
    """The recipe search's forecast screen (verdict_sim --forecasts): a simulated profile made
    into the CLI's Breakdown (measure.explain.cpu_breakdown), judged by search.forecasts
    .set_aside; an option that cannot gain is set aside, one that gains 1.3x is screened."""
    none = sim.forecast_screen(20, NOISE, 1.004, 600, None)
    real = sim.forecast_screen(20, NOISE, 1.3, 600, sim.Load())
    assert none["profiles"] == 20 and none["now"] > 0.5 and real["now"] == 0.0
    assert min(none["steps"]) >= 1 and real["covered_now"] >= 0.9


def test_time_to_target_stages_are_simulated_through_the_clis_stage():
    """to_target_sim --load: whole stages through studies.to_target.ToTarget on a simulated
    clock; at 140 s the stage's share cannot hold a run (not measured, no call)."""
    _tt = importlib.util.spec_from_file_location(
        "to_target_sim", Path(__file__).resolve().parents[1] / "benchmarks" / "to_target_sim.py")
    tts = importlib.util.module_from_spec(_tt)
    _tt.loader.exec_module(tts)
    tight = tts.load_rates(140, [1.0] * 5, 0.0, NOISE, 0.054, None, runs=1, seeds=5)
    assert tight["false"] == 0 and tight["cis"] == 0
    assert all(v.startswith("not measured") for v in tight["mix"].index)
    roomy = tts.load_rates(3000, [1.0, 1.3, 1.0, 1.0, 1.0], 0.0, NOISE, 0.054, None, runs=2,
                           seeds=5)
    assert roomy["cis"] > 0 and roomy["false"] == 0
