"""Quality verdicts: quality.csv (the probe's held-out loss per model, variant and seed) -> one
row per variant, joined to summary.csv.

- held-out loss: the median over seeds of the loss after the same samples seen;
- loss ratio: the geometric mean of the per-seed ratios variant loss / baseline loss (seed k
  gives both the same initial weights and data order), with a t interval on their logs
  (intervals.paired_ratio_ci, the speed rounds' engine), at the Bonferroni level of the run's
  quality comparisons;
- verdict, a non-inferiority test against bench.quality_tolerance (tol): `non-inferior` when the
  CI's upper end is at most 1 + tol, `worse` when its lower end is above 1 + tol, else
  `inconclusive`. A variant whose loss is not finite in a seed where the baseline's is
  `diverged`. Identical numerics give a ratio of exactly 1 in every seed, so [1, 1]:
  non-inferior at any tolerance.

A few steps from a handful of seeds judge whether a technique breaks training, not how well it
trains in the end: that is time to target's question (analysis/to_target.py).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.results.schema import parse_status

NON_INFERIOR, WORSE, DIVERGED = "non-inferior", "worse", "diverged"
NO_LOSS = "no loss"
TOLERANCE = 0.05  # bench.quality_tolerance's default; keep in step with config
COLUMNS = ["experiment", "model", "variant", "quality_loss", "quality_seeds", "loss_ratio",
           "loss_ratio_lo", "loss_ratio_hi", "quality_level", "quality_tolerance",
           "quality_verdict"]


def comparisons(quality: pd.DataFrame) -> int:
    """The run's quality comparisons: each non-baseline variant with a loss, of each model."""
    rows = quality[pd.to_numeric(quality["loss"], errors="coerce").notna()]
    rows = rows.drop_duplicates(["experiment", "model", "variant"])
    return int((~rows["is_baseline"].astype(bool)).sum())


def verdict(lo: float, hi: float, tolerance: float) -> str:
    """non-inferior / worse / inconclusive for a loss ratio's CI and the margin."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return intervals.INCONCLUSIVE
    if hi <= 1 + tolerance:
        return NON_INFERIOR
    if lo > 1 + tolerance:
        return WORSE
    return intervals.INCONCLUSIVE


def summarise(quality: pd.DataFrame, tolerance: float,
              family: float = intervals.FAMILY_LEVEL) -> pd.DataFrame:
    """One row per (experiment, model, variant), in COLUMNS."""
    if quality is None or quality.empty:
        return pd.DataFrame(columns=COLUMNS)
    quality = quality.assign(loss=pd.to_numeric(quality["loss"], errors="coerce"))
    level = intervals.comparison_level(max(1, comparisons(quality)), family)
    out = []
    for (exp, model), group in quality.groupby(["experiment", "model"], sort=False):
        base = group[group["is_baseline"].astype(bool)]
        for variant, rows in group.groupby("variant", sort=False):
            out.append({"experiment": exp, "model": model, "variant": variant,
                        **_judged(rows, base, level, tolerance)})
    return pd.DataFrame(out, columns=COLUMNS)


def _judged(rows: pd.DataFrame, base: pd.DataFrame, level: float, tolerance: float) -> dict:
    ok = rows[[parse_status(s).ok for s in rows["status"]]]
    losses = ok["loss"]
    row = {"quality_loss": float(losses.median()) if losses.notna().any() else math.nan,
           "quality_seeds": int(np.isfinite(losses).sum()), "quality_level": level,
           "quality_tolerance": tolerance}
    row.update(dict.fromkeys(("loss_ratio", "loss_ratio_lo", "loss_ratio_hi"), math.nan))
    if bool(rows["is_baseline"].astype(bool).iloc[0]):
        return {**row, "quality_verdict": intervals.BASELINE}
    if not len(ok):
        return {**row, "quality_verdict": f"{NO_LOSS} ({rows['status'].iloc[0]})"}
    pairs = pd.merge(ok[["seed", "loss"]], base[["seed", "loss"]], on="seed",
                     suffixes=("", "_base"))
    pairs = pairs[np.isfinite(pairs["loss_base"])]
    if (~np.isfinite(pairs["loss"])).any():
        return {**row, "quality_verdict": DIVERGED}
    ratio, lo, hi = intervals.paired_ratio_ci(pairs["loss"], pairs["loss_base"], level)
    return {**row, "loss_ratio": ratio, "loss_ratio_lo": lo, "loss_ratio_hi": hi,
            "quality_verdict": verdict(lo, hi, tolerance) if len(pairs) > 1 else
            f"{NO_LOSS} (one seed: no CI)"}


def attach(summary: pd.DataFrame, quality: pd.DataFrame | None,
           tolerance: float) -> pd.DataFrame:
    """summary with the quality columns joined on (experiment, model, variant); unchanged
    without quality.csv (runs written before it)."""
    if quality is None or quality.empty or summary.empty:
        return summary
    judged = summarise(quality, tolerance)
    kept = summary.drop(columns=[c for c in COLUMNS[3:] if c in summary])
    return kept.merge(judged, on=["experiment", "model", "variant"], how="left")
