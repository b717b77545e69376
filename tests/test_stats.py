"""Confidence intervals and verdicts: call a difference only when the CI excludes 1."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench import stats


def test_clear_speedup_is_called_faster():
    rng = np.random.default_rng(1)
    base = 100 + rng.normal(0, 1, 7)
    fast = 150 + rng.normal(0, 1, 7)
    ratio, lo, hi = stats.bootstrap_ratio_ci(fast, base)
    assert 1.4 < lo <= ratio <= hi < 1.6
    assert stats.verdict(lo, hi) == stats.FASTER
    assert stats.verdict(*stats.bootstrap_ratio_ci(base, fast)[1:]) == stats.SLOWER


def test_same_distribution_is_no_significant_difference():
    rng = np.random.default_rng(2)
    a, b = 100 + rng.normal(0, 5, 9), 100 + rng.normal(0, 5, 9)
    _, lo, hi = stats.bootstrap_ratio_ci(a, b)
    assert lo < 1 < hi and stats.verdict(lo, hi) == stats.SAME


def test_one_trial_gives_no_verdict():
    ratio, lo, hi = stats.bootstrap_ratio_ci([2.0], [1.0])
    assert ratio == 2.0 and math.isnan(lo) and stats.verdict(lo, hi) == stats.TOO_FEW


def _trials(rows):
    cols = ["experiment", "model", "variant", "is_baseline", "trial", "status", "samples_per_s",
            "step_ms", "data_wait_frac", "peak_mem_mb", "host_rss_mb", "final_loss"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows])


def test_summary_keeps_failed_variants_with_their_status():
    rows = []
    for t in range(3):
        rows.append(("e", "m", "base", True, t, "ok", 100 + t, 10, 0.1, 50, 500, 1.0))
        rows.append(("e", "m", "fast", False, t, "ok", 200 + t, 5, 0.1, 25, 480, 1.0))
        rows.append(("e", "m", "broken", False, t, "oom", math.nan, math.nan, math.nan, math.nan,
                     math.nan, math.nan))
    s = stats.summarise(_trials(rows)).set_index("variant")
    assert s.loc["base", "verdict"] == "baseline" and s.loc["base", "speedup"] == 1
    assert s.loc["fast", "verdict"] == "faster" and 1.9 < s.loc["fast", "speedup"] < 2.1
    assert s.loc["fast", "mem_ratio"] == 0.5
    assert s.loc["broken", "status"] == "oom" and s.loc["broken", "verdict"] == "oom"
    assert math.isnan(s.loc["broken", "speedup"])
