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
                "spread": spread(ok["samples_per_s"]),
                "unsteady": _unsteady(ok),
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
            row.update(_flops(ok, row["step_ms"]))
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


# torch.utils.benchmark warns when a measurement's IQR exceeds 10 % of its median.
SPREAD_WARN = 0.1


def spread(values: pd.Series) -> float:
    """Interquartile range of the trials' throughput relative to its median (NaN below 2)."""
    v = pd.Series(values, dtype=float).dropna()
    if len(v) < 2 or not v.median() > 0:
        return math.nan
    return float((v.quantile(0.75) - v.quantile(0.25)) / v.median())


def _unsteady(ok: pd.DataFrame) -> int:
    """How many trials timed their window without their warm-up having found a steady step time."""
    if "warmup_steady" not in ok:
        return 0
    return int(ok["warmup_steady"].astype(str).str.lower().isin(["false", "0"]).sum())


def _flops(ok: pd.DataFrame, step_ms: float) -> dict:
    """FLOPs per step, achieved TFLOP/s at the median step time, the measured peak, the fraction."""
    out = dict.fromkeys(("flops_per_step", "achieved_tflops", "peak_tflops", "peak_fraction"),
                        math.nan)
    if "flops_per_step" in ok and ok["flops_per_step"].notna().any():
        out["flops_per_step"] = float(ok["flops_per_step"].dropna().iloc[0])
        out["achieved_tflops"] = out["flops_per_step"] / (step_ms / 1000) / 1e12
    if "peak_tflops" in ok and ok["peak_tflops"].notna().any():
        out["peak_tflops"] = float(ok["peak_tflops"].dropna().median())
        if out["peak_tflops"] > 0:
            out["peak_fraction"] = out["achieved_tflops"] / out["peak_tflops"]
    return out


def spread_warnings(summary: pd.DataFrame) -> list[str]:
    """Warnings about trials too noisy to trust, or timed before a steady state was found."""
    noisy, unsteady = [], []
    for r in summary.itertuples():
        s = float(getattr(r, "spread", math.nan))
        if s > SPREAD_WARN:
            noisy.append(f"{r.model}/{r.variant} {s:.0%}")
        n = float(getattr(r, "unsteady", 0))
        if n > 0:
            unsteady.append(f"{r.model}/{r.variant} {int(n)} of {r.trials}")
    lines = []
    if noisy:
        lines.append(f"WARNING: trial spread (IQR/median of samples/s) over {SPREAD_WARN:.0%}: "
                     + ", ".join(noisy) + ". Something else may be using the machine, or the "
                     "window is too short: add bench.repeats or bench.steps, or set "
                     "bench.target_ci.")
    if unsteady:
        lines.append("WARNING: trials timed before warm-up found a steady step time: "
                     + ", ".join(unsteady)
                     + " (bench.warmup_max or the trial's time cap came first).")
    return lines


def speedup_halfwidths(trials: pd.DataFrame) -> dict[str, float]:
    """Half-width of each non-baseline variant's speed-up CI, from the ok trials so far (NaN
    when either side has fewer than two trials). Variants with no ok trial are left out."""
    if "samples_per_s" not in trials or "status" not in trials:
        return {}
    ok = trials[trials["status"] == "ok"]
    base = ok[ok["is_baseline"].astype(bool)]["samples_per_s"].to_numpy()
    out = {}
    for variant, g in ok[~ok["is_baseline"].astype(bool)].groupby("variant", sort=False):
        _, lo, hi = bootstrap_ratio_ci(g["samples_per_s"].to_numpy(), base) if len(base) else \
            (math.nan, math.nan, math.nan)
        out[variant] = (hi - lo) / 2
    return out


def wants_more_rounds(rows: list[dict], bench, rounds: int, elapsed_s: float) -> bool:
    """Adaptive repetition (bench.target_ci): another interleaved round is wanted while some
    speed-up CI is wider than the target, and the round, at the mean pace so far, still fits in
    bench.time_budget_s."""
    if bench.target_ci is None or not rows or rounds == 0:
        return False
    widths = speedup_halfwidths(pd.DataFrame(rows))
    if all(w <= bench.target_ci for w in widths.values()):  # NaN (too few trials) is not narrow
        return False
    return elapsed_s * (rounds + 1) / rounds <= bench.time_budget_s


def halfwidth_note(rows: list[dict]) -> str:
    widths = speedup_halfwidths(pd.DataFrame(rows))
    return ", ".join(f"{v} +-{w:.3f}" for v, w in widths.items()) or "no speed-up to narrow"
