"""Medians, bootstrap confidence intervals of speed-up ratios, and verdicts.

A difference is called only when the CI of the ratio excludes 1; never from a hand-set threshold.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

FASTER, SLOWER, SAME = "faster", "slower", "no significant difference"
TOO_FEW = "too few trials"
BASELINE = "baseline"


def bootstrap_ratio_ci(num: np.ndarray, den: np.ndarray, level: float = 0.95,
                       resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of medians num/den with a percentile bootstrap CI (trials resampled per side)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    point = float(np.median(num) / np.median(den))
    if len(num) < 2 or len(den) < 2:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    a = np.median(rng.choice(num, (resamples, len(num))), axis=1)
    b = np.median(rng.choice(den, (resamples, len(den))), axis=1)
    lo, hi = np.quantile(a / b, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)


def verdict(lo: float, hi: float) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return TOO_FEW
    if lo > 1:
        return FASTER
    if hi < 1:
        return SLOWER
    return SAME


def _short(status: str) -> str:
    """`n/a`, `error`, `oom`, `diverged`: the kind of a failure, for the verdict column."""
    return status.split(":")[0]


def _status(statuses: pd.Series) -> str:
    """`ok` when any trial measured; otherwise the most common failure."""
    if (statuses == "ok").any():
        return "ok"
    return statuses.mode().iloc[0]


def summarise(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, variant): medians over ok trials, speed-up over the baseline with CI."""
    rows = []
    keys = ["experiment", "model"]
    for (experiment, model), per_model in trials.groupby(keys, sort=False):
        base_rows = per_model[per_model["is_baseline"] & (per_model["status"] == "ok")]
        base_tp = base_rows["samples_per_s"].to_numpy()
        base_loss = base_rows["final_loss"].median() if len(base_rows) else math.nan
        for variant, g in per_model.groupby("variant", sort=False):
            ok = g[g["status"] == "ok"]
            row = {
                "experiment": experiment, "model": model, "variant": variant,
                "is_baseline": bool(g["is_baseline"].iloc[0]), "status": _status(g["status"]),
                "trials": len(ok),
                "samples_per_s": ok["samples_per_s"].median() if len(ok) else math.nan,
                "step_ms": ok["step_ms"].median() if len(ok) else math.nan,
                "cv": _cv(ok["samples_per_s"]),
                "data_wait_frac": ok["data_wait_frac"].median() if len(ok) else math.nan,
                "peak_mem_mb": ok["peak_mem_mb"].median() if len(ok) else math.nan,
                "host_rss_mb": ok["host_rss_mb"].median() if len(ok) else math.nan,
                "final_loss": ok["final_loss"].median() if len(ok) else math.nan,
            }
            mem, base_mems = ok["peak_mem_mb"].dropna().to_numpy(), base_rows["peak_mem_mb"].dropna().to_numpy()
            if len(mem) and len(base_mems) and np.median(base_mems) > 0:
                row["mem_ratio"], row["mem_ratio_lo"], row["mem_ratio_hi"] = \
                    bootstrap_ratio_ci(mem, base_mems)
            else:
                row["mem_ratio"] = row["mem_ratio_lo"] = row["mem_ratio_hi"] = math.nan
            row["loss_delta"] = row["final_loss"] - base_loss
            if row["is_baseline"]:
                speed = (1.0, math.nan, math.nan) if len(ok) else (math.nan,) * 3
                row["verdict"] = BASELINE if len(ok) else _short(row["status"])
            elif len(ok) and len(base_tp):
                speed = bootstrap_ratio_ci(ok["samples_per_s"].to_numpy(), base_tp)
                row["verdict"] = verdict(speed[1], speed[2])
            else:
                speed = (math.nan,) * 3
                row["verdict"] = _short(row["status"]) if not len(ok) else "no baseline"
            row["speedup"], row["speedup_lo"], row["speedup_hi"] = speed
            rows.append(row)
    return pd.DataFrame(rows)


def median_ci(values, level: float = 0.95, resamples: int = 4000, seed: int = 0):
    """Median with a percentile bootstrap CI; (median, nan, nan) below two values."""
    values = np.asarray(values, float)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(values))
    if len(values) < 2:
        return med, math.nan, math.nan
    boots = np.median(np.random.default_rng(seed).choice(values, (resamples, len(values))), axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return med, float(lo), float(hi)


def _cv(values: pd.Series) -> float:
    """Coefficient of variation of the trials' throughput (spread relative to the mean)."""
    if len(values) < 2:
        return math.nan
    return float(values.std(ddof=1) / values.mean())
