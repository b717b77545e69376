"""The A/B's simulation (benchmarks/ab_sim.py): whole A/B runs through the CLI's study with an
arm's worker start on the clock, and real paired rounds judged paired (summary.summarise) and
as two separate runs (report/compare.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.results.schema import TRIAL_COLUMNS

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_sim.py"
_spec = importlib.util.spec_from_file_location("ab_sim", _path)
ab_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_sim)

NOISE = {"trial_sd": 0.08, "round_sd": 0.05, "step_residuals": None, "measurements": 1,
         "residuals": np.random.default_rng(0).standard_normal(500), "source": "test"}


def _ab_trials(rounds: int, drift: float, ratio: float = 1.0) -> pd.DataFrame:
    """A/B trials.csv rows of arms a and b, paired by round, the machine `drift` faster (log)
    each round, b `ratio` times a, a little noise."""
    rng = np.random.default_rng(1)
    rows = [{"experiment": "default", "model": "m", "variant": arm, "arm": arm, "reference": "",
             "is_baseline": arm == "a", "status": "ok", "trial": r, "round": r,
             "position": int(arm == "b"), "noise_threshold": 0.05,
             "samples_per_s": 100 * (ratio if arm == "b" else 1.0)
             * np.exp(drift * r + rng.normal(0, 0.01))}
            for r in range(rounds) for arm in ("a", "b")]
    frame = pd.DataFrame(rows)
    frame["step_ms"] = 1000 / frame["samples_per_s"]
    for column in TRIAL_COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    return frame


def test_a_drift_between_two_separate_runs_is_called_where_the_pairing_cancels_it(tmp_path):
    """A/A on a machine that speeds up 10 % a round: paired, no call in any window; as two
    separate runs (arm a's first rounds against arm b's later ones), compare.py calls b
    faster, as it would two runs on two days."""
    _ab_trials(10, 0.1).to_csv(tmp_path / "trials.csv", index=False)
    rows = pd.DataFrame(ab_sim.split_rows(str(tmp_path), 3))
    assert len(rows) == 5  # 10 rounds hold 5 windows of 3 + 3
    assert not rows["paired"].isin(ab_sim.CALLS).any(), rows
    assert (rows["separate"] == intervals.FASTER).all(), rows
    # a true 2x on a steady machine: both call it
    _ab_trials(6, 0.0, ratio=2.0).to_csv(tmp_path / "trials.csv", index=False)
    rows = pd.DataFrame(ab_sim.split_rows(str(tmp_path), 3))
    assert list(rows["paired"]) == list(rows["separate"]) == [intervals.FASTER]


def test_a_simulated_a_b_run_pays_each_worker_s_start_in_rounds():
    """Through the CLI's study at the default budget: every trial and probe of an arm starts a
    worker, so a costlier start leaves fewer rounds in the same budget."""
    quick = ab_sim.cli_runs(1.0, 1, NOISE, 0, start_s=0.0)
    slow = ab_sim.cli_runs(1.0, 1, NOISE, 0, start_s=15.0)
    assert quick["rounds"].min() >= 5  # bench.repeats' floor, at least
    assert slow["rounds"].mean() < quick["rounds"].mean() / 2
    assert quick["seconds"] <= ab_sim.default_settings().time_budget_s * 1.05
