"""Time-to-target verdicts: to_target.csv (a row per model, variant and seed) -> one row per
variant, with the speed-up over the baseline from the paired seeds.

- time to target: the median over seeds of the training time to the first evaluation at or
  below the target, a miss counted as infinite (so a variant that misses in most seeds has an
  infinite median);
- speed-up: the geometric mean of the per-seed ratios baseline time / variant time, with a
  t interval on their logs (intervals.paired_ratio_ci, the engine of the speed rounds), at the
  Bonferroni level of the run's comparisons; its verdict by intervals.classify with
  bench.noise_threshold. It splits exactly into step-speed ratio x steps ratio: the geometric
  means over seeds of (baseline time per step / variant time per step) and of (baseline steps /
  variant steps), so a user sees whether a variant won by faster steps or lost by needing more
  of them;
- a variant that missed the target in any seed gets no ratio: its verdict says how many seeds
  it missed in; a baseline that missed in any seed gives no verdict at all (the target was out
  of reach: raise target.margin or target.max_steps).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.results.schema import MISSED, OK, TOO_SLOW, parse_status

COLUMNS = ["experiment", "model", "variant", "is_baseline", "status", "seeds", "reached",
           "time_to_target_s", "cold_s", "one_time_s", "steps_to_target", "step_ms",
           "speedup", "speedup_lo", "speedup_hi", "ci_level", "step_speed_ratio", "steps_ratio",
           "verdict", "target_loss", "entropy_floor", "reached_loss", "target_source"]
MISSED_VERDICT = "missed the target"
# The experiment name of a recipe search's closing check: its final recipe against naive
RECIPE_CHECK = "recipe: time to target"
NO_TARGET = "no verdict: the baseline missed the target"


def comparisons(runs: pd.DataFrame) -> int:
    """The run's time-to-target comparisons: each non-baseline variant of each model."""
    rows = runs.drop_duplicates(["experiment", "model", "variant"])
    return int((~rows["is_baseline"].astype(bool)).sum())


def summarise(runs: pd.DataFrame, threshold: float = intervals.DEFAULT_THRESHOLD,
              family: float = intervals.FAMILY_LEVEL) -> pd.DataFrame:
    """One row per (experiment, model, variant), baseline first, in COLUMNS."""
    if runs.empty:
        return pd.DataFrame(columns=COLUMNS)
    level = intervals.comparison_level(comparisons(runs), family)
    out = []
    for (exp, model), group in runs.groupby(["experiment", "model"], sort=False):
        base = group[group["is_baseline"].astype(bool)]
        for variant, rows in group.groupby("variant", sort=False):
            out.append(_row(exp, model, variant, rows, base, level, threshold))
    frame = pd.DataFrame(out, columns=COLUMNS)
    return frame.sort_values(["experiment", "model", "is_baseline"], ascending=[True, True, False],
                             kind="stable").reset_index(drop=True)


def _times(rows: pd.DataFrame) -> pd.Series:
    """Per seed: the time to target, infinite for a run that did not reach it."""
    reached = rows["status"].map(lambda s: parse_status(s).ok)
    return rows["time_s"].astype(float).where(reached, math.inf)


def _row(exp, model, variant, rows, base, level, threshold) -> dict:
    is_base = bool(rows["is_baseline"].astype(bool).iloc[0])
    statuses = [parse_status(s) for s in rows["status"]]
    reached = sum(s.ok for s in statuses)
    ok = rows[[s.ok for s in statuses]]
    times = _times(rows)
    row = {"experiment": exp, "model": model, "variant": variant, "is_baseline": is_base,
           "status": _status(statuses), "seeds": len(rows), "reached": reached,
           "time_to_target_s": float(np.median(times)),
           "cold_s": _median(ok["cold_s"]) if reached == len(rows) else math.inf,
           "one_time_s": _median(ok["one_time_s"]),
           "steps_to_target": _median(ok["steps"]), "step_ms": _median(ok["step_ms"]),
           "target_loss": _first(rows, "target_loss"), "entropy_floor": _first(rows,
                                                                               "entropy_floor"),
           "reached_loss": _median(ok["final_loss"]), "target_source": _first(rows,
                                                                            "target_source"),
           "speedup": math.nan, "speedup_lo": math.nan, "speedup_hi": math.nan,
           "ci_level": math.nan, "step_speed_ratio": math.nan, "steps_ratio": math.nan}
    if is_base:
        return {**row, "verdict": intervals.BASELINE}
    if all(s.na for s in statuses):
        return {**row, "verdict": "n/a"}
    if not len(base) or all(parse_status(s).na for s in base["status"]):
        return {**row, "verdict": "no verdict: the baseline has no time to target here"}
    base_missed = int((~np.isfinite(_times(base))).sum())
    if base_missed:
        return {**row, "verdict": f"{NO_TARGET} in {base_missed} of {len(base)} seeds"}
    if any(s.kind == TOO_SLOW or (s.kind == MISSED and "stopped" in s.reason)
           for s in statuses):
        return {**row, "verdict": intervals.SLOWER + " (stopped early: far too slow)"}
    if reached < len(rows):
        failed = [s for s in statuses if s.failed]
        what = f"{failed[0].kind} in {len(failed)} seeds" if failed else \
            f"{MISSED_VERDICT} in {len(rows) - reached} of {len(rows)} seeds"
        return {**row, "verdict": what}
    return {**row, **_speedup(ok, base, level, threshold)}


def _speedup(ok: pd.DataFrame, base: pd.DataFrame, level: float, threshold: float) -> dict:
    """The paired ratios over the seeds both reached the target in."""
    pairs = ok.merge(base[base["status"].map(lambda s: parse_status(s).ok)], on="seed",
                     suffixes=("", "_b"))
    point, lo, hi = intervals.paired_ratio_ci(pairs["time_s_b"], pairs["time_s"], level)
    per_step_b = pairs["time_s_b"] / pairs["steps_b"]
    per_step = pairs["time_s"] / pairs["steps"]
    step_ratio = _geomean(per_step_b / per_step)
    steps_ratio = _geomean(pairs["steps_b"].astype(float) / pairs["steps"].astype(float))
    return {"speedup": point, "speedup_lo": lo, "speedup_hi": hi, "ci_level": level,
            "step_speed_ratio": step_ratio, "steps_ratio": steps_ratio,
            "verdict": intervals.classify(point, lo, hi, threshold)}


def _geomean(values: pd.Series) -> float:
    v = values.astype(float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(np.exp(np.log(v).mean())) if len(v) else math.nan


def _median(values: pd.Series) -> float:
    v = pd.to_numeric(values, errors="coerce").dropna()
    return float(v.median()) if len(v) else math.nan


def _first(rows: pd.DataFrame, column: str):
    v = rows[column].dropna()
    return v.iloc[0] if len(v) else math.nan


def _status(statuses) -> str:
    """ok when every seed reached the target; else the first other status."""
    return next((str(s) for s in statuses if not s.ok), OK)


def recipe_line(runs: pd.DataFrame | None, model: str,
                threshold: float = intervals.DEFAULT_THRESHOLD) -> str:
    """Whether a recipe search's final recipe trained `model` to the target sooner than the
    naive recipe, with the CI; "" when that was not measured."""
    if runs is None or runs.empty:
        return ""
    mine = runs[(runs["experiment"] == RECIPE_CHECK) & (runs["model"] == model)]
    if mine.empty:
        return ""
    rows = summarise(mine, threshold).set_index("variant")
    if "final" not in rows.index or "naive" not in rows.index:
        return ""
    final, naive = rows.loc["final"], rows.loc["naive"]
    head = (f"time to target (held-out loss {final['target_loss']:.4g}, {int(final['seeds'])} "
            f"seeds): the final recipe ")
    if not math.isfinite(final["speedup"]):
        return head + f"has no ratio to naive: {final['verdict']}"
    ci = (f"[{final['speedup_lo']:.2f}, {final['speedup_hi']:.2f}]"
          if math.isfinite(final["speedup_lo"]) else "(no CI)")
    sooner = {intervals.FASTER: "sooner than naive, significantly",
              intervals.SLOWER: "later than naive, significantly",
              intervals.EQUIVALENT: "as soon as naive (equivalent)"}.get(final["verdict"],
                                                                   "not significantly sooner "
                                                                   "than naive")
    return (head + f"took {final['time_to_target_s']:.3g} s, naive "
            f"{naive['time_to_target_s']:.3g} s (medians): {final['speedup']:.2f}x {ci}, "
            f"{sooner}")


def _effect(row) -> str:
    lo, hi = row["speedup_lo"], row["speedup_hi"]
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{row['variant']} {row['speedup']:.2f}x{ci}"


def verdict_line(runs: pd.DataFrame | None, model: str,
                 threshold: float = intervals.DEFAULT_THRESHOLD) -> str:
    """`model`'s time-to-target verdicts in one line (sooner / later / as soon / not settled /
    no ratio), for the recommendation; "" when no experiment of the run measured them."""
    if runs is None or runs.empty:
        return ""
    summary = summarise(runs, threshold)
    rows = summary[(summary["model"] == model) & (summary["experiment"] != RECIPE_CHECK)]
    if rows.empty:
        return ""
    parts = {"sooner, significantly": [], "later, significantly": [], "as soon (equivalent)": [],
             "not settled": [], "no ratio": []}
    for r in rows[~rows["is_baseline"].astype(bool)].to_dict("records"):
        if not math.isfinite(r["speedup"]):
            parts["no ratio"].append(f"{r['variant']} ({r['verdict']})")
            continue
        key = {intervals.FASTER: "sooner, significantly", intervals.SLOWER: "later, significantly",
               intervals.EQUIVALENT: "as soon (equivalent)"}.get(r["verdict"], "not settled")
        parts[key].append(_effect(r))
    base = rows[rows["is_baseline"].astype(bool)]
    if base.empty:
        return ""
    head = base.iloc[0]
    said = "; ".join(f"{k}: {', '.join(v)}" for k, v in parts.items() if v)
    return (f"time to target (held-out loss {head['target_loss']:.4g}, {int(head['seeds'])} "
            f"seeds, against {head['variant']} at {head['time_to_target_s']:.3g} s): "
            f"{said or 'no variant'}")
