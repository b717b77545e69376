"""The verdicts' error rates, on a synthetic timing source (benchmarks/verdict_sim.py): no
training, heavy-tailed noise, interference outliers, drift within and across rounds."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

from speedbench.analysis import stats

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "verdict_sim.py"
_spec = importlib.util.spec_from_file_location("verdict_sim", _path)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

DEFAULTS = dict(min_rounds=5, max_rounds=12, target_ci=0.03)  # bench.repeats, bench.target_ci


def test_aa_family_wise_false_call_rate_at_most_5_percent():
    for kw in (DEFAULTS, dict(min_rounds=5, max_rounds=5, target_ci=None)):
        r = sim.aa_rate(runs=2000, variants=7, seed=11, **kw)
        assert r["runs"] == 2000
        assert r["family_false_call"] <= 0.05, (kw, r)


def test_true_30_percent_speed_up_is_called_in_most_runs():
    r = sim.power(1.3, runs=1000, min_rounds=5, max_rounds=5, target_ci=None, seed=12)
    assert r["called"] > 0.5, r
    assert sim.power(1 / 1.3, runs=1000, min_rounds=5, max_rounds=5, target_ci=None,
                     seed=13)["called"] > 0.5


def test_noise_model_is_heavy_tailed_and_drifts():
    rng = np.random.default_rng(0)
    tp = sim.throughputs(rng, 2000, 8, np.ones(2))
    d = np.log(tp[:, :, 1] / tp[:, :, 0]).ravel()
    kurtosis = ((d - d.mean()) ** 4).mean() / d.var() ** 2
    assert kurtosis > 4  # a normal distribution has 3
    # Drift: later rounds wander from the first more than paired ratios do.
    wander = np.log(tp[:, -1, 0] / tp[:, 0, 0]).std()
    assert wander > d.std()


def _frame(tp: np.ndarray) -> pd.DataFrame:
    rounds, v = tp.shape
    return pd.DataFrame([{"experiment": "e", "model": "m", "variant": f"v{j}",
                          "is_baseline": j == 0, "round": i, "trial": i, "status": "ok",
                          "samples_per_s": tp[i, j], "step_ms": 1.0, "data_wait_frac": 0.0,
                          "peak_mem_mb": 1.0, "host_rss_mb": 1.0, "final_loss": 1.0}
                         for i in range(rounds) for j in range(v)])


def test_simulation_applies_the_same_rule_as_summarise():
    rng = np.random.default_rng(5)
    effects = np.array([1.0, 1.0, 1.04, 1.08, 1.3, 0.85, 1.0])
    tp = sim.throughputs(rng, 15, 6, effects)
    code, used, _ = sim.verdicts(tp, min_rounds=6, threshold=0.05, target_ci=None)
    names = {1: stats.FASTER, -1: stats.SLOWER, 0: stats.EQUIVALENT, 2: stats.INCONCLUSIVE}
    for run in range(15):
        s = stats.summarise(_frame(tp[run])).set_index("variant")
        got = [s.loc[f"v{j}", "verdict"] for j in range(1, 7)]
        assert got == [names[c] for c in code[run]]
