"""Quality verdicts: quality.csv (the probe's held-out loss per model, variant and seed, and the
same model's before its first step) -> one row per variant, joined to summary.csv.

- held-out loss: the median over seeds of the loss after the same samples seen (nats: every
  loss here is in the model's own units, nats for a cross-entropy);
- the learned-something guard: each baseline seed must have beaten its own step-0 loss by
  LEARNED_MARGIN nats, and chance (ln classes, ln vocabulary; quality.csv's chance_loss) by
  the same margin where the task has one. Else no variant gets a verdict: "no quality verdict:
  the baseline has not learned in 12 steps; give bench.quality_steps=M" (M estimated from the
  pace so far). A few steps of an untrained model compare noise;
- learning lost: per seed, the variant's loss less the baseline's (nats) over what the baseline
  learned in that seed (its step-0 loss less its loss, nats): 0 for the same loss, 1 for a
  recipe that learned nothing, below 0 for one that learned more. Its mean over seeds comes
  with a Student t interval at the Bonferroni level of the run's quality comparisons: a family of its own (FAMILY_LEVEL over them, apart
  from the speed calls and the time-to-target verdicts). Normalising per seed removes the
  seeds' spread in how far the baseline got, which the raw difference keeps;
- verdict, a non-inferiority test against bench.quality_tolerance (tol, a share of what the
  baseline learned; `quality_tolerance_nats` states it in nats, tol x the baseline's mean
  learning): `non-inferior` when the CI's upper end is at most tol, `worse` when its lower end
  is above tol, else `inconclusive`. A variant whose loss is not finite in a seed where the
  baseline's is `diverged`. Identical numerics give exactly 0 in every seed, [0, 0] (and a loss
  ratio of exactly 1): non-inferior at any tolerance; a recipe that learns nothing gives about
  1 in every seed: worse;
- loss_ratio: the geometric mean of the per-seed ratios variant loss / baseline loss, shown.

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
NO_VERDICT = "no quality verdict"
TOLERANCE = 0.05  # bench.quality_tolerance's default; keep in step with config
# nats (the loss's own units) by which every baseline seed must beat its step-0 loss and chance:
# far above the evaluation's own noise (the same held-out batch before and after; the VAE's
# sampling moves its loss by 0.0003), and cleared by a dozen steps of every model here (the
# small VAE's 12 steps gain 0.097, the ResNet's 1.4-2.3 with recalibrated BatchNorm)
LEARNED_MARGIN = 0.05
COLUMNS = ["experiment", "model", "variant", "quality_loss", "quality_seeds", "loss_ratio",
           "learned_nats", "learning_lost", "learning_lost_lo", "learning_lost_hi",
           "quality_level", "quality_tolerance", "quality_tolerance_nats", "quality_verdict"]


def comparisons(quality: pd.DataFrame) -> int:
    """The run's quality comparisons: each non-baseline variant with a loss, of each model."""
    rows = quality[pd.to_numeric(quality["loss"], errors="coerce").notna()]
    rows = rows.drop_duplicates(["experiment", "model", "variant"])
    return int((~rows["is_baseline"].astype(bool)).sum())


def verdict(lo: float, hi: float, tolerance: float) -> str:
    """non-inferior / worse / inconclusive for the CI of the learning lost and the margin."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return intervals.INCONCLUSIVE
    if hi <= tolerance:
        return NON_INFERIOR
    if lo > tolerance:
        return WORSE
    return intervals.INCONCLUSIVE


def summarise(quality: pd.DataFrame, tolerance: float,
              family: float = intervals.FAMILY_LEVEL) -> pd.DataFrame:
    """One row per (experiment, model, variant), in COLUMNS."""
    if quality is None or quality.empty:
        return pd.DataFrame(columns=COLUMNS)
    quality = quality.assign(**{c: pd.to_numeric(quality[c], errors="coerce") if c in quality
                                else math.nan for c in ("loss", "initial_loss", "chance_loss")})
    level = intervals.comparison_level(max(1, comparisons(quality)), family)
    out = []
    for (exp, model), group in quality.groupby(["experiment", "model"], sort=False):
        base = _ok(group[group["is_baseline"].astype(bool)])
        learned = learned_guard(base)
        for variant, rows in group.groupby("variant", sort=False):
            ref = intervals.reference_rows(group, rows, base)  # an A/B's arm's baseline
            out.append({"experiment": exp, "model": model, "variant": variant,
                        **_judged(rows, ref, level, tolerance,
                                  learned if ref is base else learned_guard(ref))})
    return pd.DataFrame(out, columns=COLUMNS)


def _ok(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[[parse_status(s).ok for s in rows["status"]]]


def learned_guard(base: pd.DataFrame) -> str:
    """"" when every seed of the baseline beat its step-0 loss, and chance where the task has
    one, by LEARNED_MARGIN nats; else the verdict its variants get instead, with the
    bench.quality_steps that should do (`needed_steps`)."""
    rows = base[np.isfinite(base["loss"])]
    if not len(rows):
        return ""  # no baseline loss: the variants say so themselves
    if not np.isfinite(rows["initial_loss"]).all():
        return f"{NO_VERDICT}: quality.csv has no step-0 loss (written before it was recorded)"
    gained = rows["initial_loss"] - rows["loss"]
    chance = rows["chance_loss"].where(np.isfinite(rows["chance_loss"]), math.inf)
    if (gained >= LEARNED_MARGIN).all() and (rows["loss"] <= chance - LEARNED_MARGIN).all():
        return ""
    steps = int(pd.to_numeric(rows["steps"], errors="coerce").max())
    return (f"{NO_VERDICT}: the baseline has not learned in {steps} steps; give "
            f"bench.quality_steps={needed_steps(rows, steps)}")


def needed_steps(rows: pd.DataFrame, steps: int) -> int:
    """Steps at which every seed should beat its step-0 loss and chance by LEARNED_MARGIN:
    twice what the pace of its `steps` steps so far asks (learning slows), rounded up to two
    significant digits; 4 x `steps` where no seed has made progress to go on."""
    gained = (rows["initial_loss"] - rows["loss"]).to_numpy(float)
    chance = rows["chance_loss"].where(np.isfinite(rows["chance_loss"]), math.inf).to_numpy()
    need = np.maximum(LEARNED_MARGIN, rows["initial_loss"].to_numpy(float) - chance
                      + LEARNED_MARGIN)
    pace = gained / max(1, steps)
    if not (pace > 0).all():
        return _round_up(4 * max(1, steps))
    return _round_up(max(2 * steps, 2 * float(np.max(need / pace))))


def _round_up(x: float) -> int:
    """x rounded up to two significant digits (130, 1200)."""
    scale = 10 ** max(0, int(math.floor(math.log10(max(1.0, x)))) - 1)
    return int(math.ceil(round(x / scale, 6)) * scale)  # 240.0000001 is 240


def _judged(rows, base, level: float, tolerance: float, learned: str) -> dict:
    ok = _ok(rows)
    losses = ok["loss"]
    gained = (base["initial_loss"] - base["loss"]).mean()
    row = {"quality_loss": float(losses.median()) if losses.notna().any() else math.nan,
           "quality_seeds": int(np.isfinite(losses).sum()), "quality_level": level,
           "quality_tolerance": tolerance,
           "learned_nats": float(gained) if np.isfinite(gained) else math.nan}
    row["quality_tolerance_nats"] = tolerance * row["learned_nats"]
    row.update(dict.fromkeys(("loss_ratio", "learning_lost", "learning_lost_lo",
                              "learning_lost_hi"), math.nan))
    if bool(rows["is_baseline"].astype(bool).iloc[0]):
        return {**row, "quality_verdict": intervals.BASELINE}
    if not len(ok):
        return {**row, "quality_verdict": f"{NO_LOSS} ({rows['status'].iloc[0]})"}
    pairs = pd.merge(ok[["seed", "loss"]], base[["seed", "loss", "initial_loss"]], on="seed",
                     suffixes=("", "_base"))
    pairs = pairs[np.isfinite(pairs["loss_base"])]
    if not len(pairs):  # the baseline's probe ran out of time before its loss
        return {**row, "quality_verdict": f"{NO_LOSS} (the baseline has no held-out loss to "
                                          "compare with)"}
    if (~np.isfinite(pairs["loss"])).any():
        return {**row, "quality_verdict": DIVERGED}
    row["loss_ratio"] = _geomean(pairs["loss"] / pairs["loss_base"])
    if learned:
        return {**row, "quality_verdict": learned}
    lost, lo, hi = _learning_lost(pairs, level)
    return {**row, "learning_lost": lost, "learning_lost_lo": lo, "learning_lost_hi": hi,
            "quality_verdict": verdict(lo, hi, tolerance) if len(pairs) > 1 else
            f"{NO_LOSS} (one seed: no CI)"}


def _learning_lost(pairs: pd.DataFrame, level: float) -> tuple[float, float, float]:
    """The mean over seeds of (variant loss - baseline loss) / (baseline step-0 loss -
    baseline loss), with its t interval at `level` (the ends NaN below two seeds)."""
    share = ((pairs["loss"] - pairs["loss_base"])
             / (pairs["initial_loss"] - pairs["loss_base"])).to_numpy(float)
    mean = float(share.mean())
    if len(share) < 2:
        return mean, math.nan, math.nan
    half = intervals.t_quantile(level, len(share) - 1) * float(share.std(ddof=1)) \
        / math.sqrt(len(share))
    return mean, mean - half, mean + half


def _geomean(values: pd.Series) -> float:
    v = values.to_numpy(float)
    return float(np.exp(np.log(v).mean())) if len(v) and (v > 0).all() else math.nan


def attach(summary: pd.DataFrame, quality: pd.DataFrame | None,
           tolerance: float) -> pd.DataFrame:
    """summary with the quality columns joined on (experiment, model, variant); unchanged
    without quality.csv (runs written before it)."""
    if quality is None or quality.empty or summary.empty:
        return summary
    judged = summarise(quality, tolerance)
    kept = summary.drop(columns=[c for c in COLUMNS[3:] if c in summary])
    return kept.merge(judged, on=["experiment", "model", "variant"], how="left")
