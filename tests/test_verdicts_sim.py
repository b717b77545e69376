"""The verdicts' simulation (benchmarks/verdict_sim.py): its noise is fitted to the reference
trials, and it runs the command line's own rounds loop, stopping rule and summary."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from speedbench.analysis import intervals
from speedbench.measure.rounds import ModelRounds

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "verdict_sim.py"
_spec = importlib.util.spec_from_file_location("verdict_sim", _path)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

NOISE = sim.fit()


def test_noise_is_fitted_to_the_reference_trials():
    assert NOISE["measurements"] >= 3
    assert 0.02 < NOISE["trial_sd"] < 0.12 and 0.01 < NOISE["round_sd"] < 0.12
    z = NOISE["residuals"]
    kurtosis = float(((z - z.mean()) ** 4).mean() / z.var() ** 2)
    assert kurtosis < 5  # light tails, as measured: no t3 with outliers
    share = NOISE["round_sd"] ** 2 / (NOISE["round_sd"] ** 2 + NOISE["trial_sd"] ** 2)
    assert 0.2 < share < 0.6  # the round effect pairing removes


def test_the_simulation_runs_the_command_lines_loop():
    # The loop, orders and stopping are ModelRounds' own, only measure is simulated.
    for name in ("rounds", "order", "run_round"):
        assert getattr(sim.SimRounds, name) is getattr(ModelRounds, name)
    rng = np.random.default_rng(0)
    long = dict(repeats=5, target_ci=0.03, time_budget_s=600.0, trial_s=1.0)
    clear = sim.simulate({"a": 1.0, "b": 1.5, "c": 0.6}, NOISE, rng, **long)
    assert (clear["rounds"] == 5).all()  # decided at the first look
    assert set(clear["verdict"]) == {intervals.BASELINE, intervals.FASTER, intervals.SLOWER}
    unclear = sim.simulate({"a": 1.0, "b": 1.03}, NOISE, rng, **long)
    assert unclear["rounds"].max() in (10, 15)  # undecided at 5 rounds: more looks
    level = unclear[~unclear["is_baseline"]]["ci_level"].iloc[0]
    assert level > 1 - 0.05  # each look spends a share of the 5 %
    tight = sim.simulate({"a": 1.0, "b": 1.03}, NOISE, rng, **dict(long, time_budget_s=15))
    assert tight["rounds"].max() == 5  # the budget allows no second look


def test_identical_variants_are_rarely_called_and_intervals_cover():
    r = sim.cell(3, 1.0, 30, NOISE, seed=3, position_effect=0.05, **sim.AMP_SETTINGS)
    # 30 runs: a 5 % family-wise rate gives 1.5 false runs on average; 7 would mean > 15 %
    assert r["family_false"] <= 0.2 and r["coverage"] >= 0.9, r
    # amp's 60 s: a round of 3 variants takes about 6 s, so the first round's pace plans two
    # looks (5 and 10 rounds)
    assert 5 <= r["rounds"] <= 10, r


def test_balanced_orders_absorb_a_position_effect():
    rng = np.random.default_rng(4)
    logs = []
    for _ in range(15):
        s = sim.simulate({"a": 1.0, "b": 1.0, "c": 1.0}, NOISE, rng, repeats=6,
                         target_ci=None, position_effect=0.05)
        logs += [math.log(x) for x in s[~s["is_baseline"]]["speedup"]]
    # with a fixed order, one variant would sit first every round: a 5 % bias
    assert abs(np.mean(logs)) < 0.025
