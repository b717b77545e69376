"""Time-to-target verdicts: to_target.csv (a row per model, variant and seed) -> one row per
variant, with the speed-up over the baseline from the paired seeds.

- the figures of a row multiply: time to target = the geometric mean over seeds of the training
  time to the first evaluation at or below the target (one-time costs left out and shown apart,
  `one_time_s`), steps = the geometric mean of the steps, ms/step = the geometric mean of each
  seed's time / steps; so time = steps x ms/step exactly. A seed that did not reach the target
  enters with its training time and steps at its stop, a lower bound (`censored` counts them;
  the report prints ">=");
- speed-up: the geometric mean of the per-seed ratios baseline time / variant time, with a
  t interval on their logs (intervals.paired_ratio_ci, the engine of the speed rounds), at the
  Bonferroni level of the run's time-to-target comparisons (a family of its own: FAMILY_LEVEL
  over these comparisons, apart from the speed rounds' and the quality verdicts'); its verdict
  by intervals.classify with bench.noise_threshold. It splits exactly into step-speed ratio x
  steps ratio: the geometric means over seeds of (baseline time per step / variant time per
  step) and of (baseline steps / variant steps), so a user sees whether a variant won by
  faster steps or lost by needing more of them;
- a miss, as AlgoPerf counts it: a variant that did not reach the target in a seed where the
  baseline did, within target.max_steps, or stopped as far too slow, or diverged, took
  infinite time there: its verdict is `missed the target (...)`, its speed-up the bound its
  censored time gives (at most that: `speedup_bound` "<=") or 0 where it was stopped early.
  It has no interval, so it is no call of the family (a `slower` without an interval would
  claim a level it does not have);
- a run that the budget's share stopped (`not measured: ...`), or the wall-clock cap
  target.max_s where the baseline reached the target within it (a load burst can run out a
  wall clock: identical numerics take identical steps), is censored without a call: the
  verdict says not measured, with its bound;
- a baseline that missed in any seed gives no verdict at all (the target was out of reach:
  raise target.margin or target.max_steps), with the bound its censored times give (">=").
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.analysis.numbers import ratio_text
from speedbench.results.schema import (DIVERGED, MISSED, NOT_MEASURED, OK, TOO_SLOW,
                                       parse_status, time_capped)

COLUMNS = ["experiment", "model", "variant", "is_baseline", "status", "seeds", "reached",
           "censored", "time_to_target_s", "cold_s", "one_time_s", "steps_to_target",
           "step_ms", "speedup", "speedup_lo", "speedup_hi", "speedup_bound", "ci_level",
           "step_speed_ratio", "steps_ratio", "verdict", "target_loss", "entropy_floor",
           "reached_loss", "target_source"]
MISSED_VERDICT = "missed the target"
# What a miss means: AlgoPerf's infinite time, with no interval, so no call of the family
MISS_MEANING = "infinite time, no interval: not a call of the 5 % family"
# The experiment name of a recipe search's closing check: its final recipe against naive
RECIPE_CHECK = "recipe: time to target"
NO_TARGET = "no verdict: the baseline missed the target"
NO_BUDGET = "not measured: the baseline's share of the budget ran out before the target"
# A seed's run that did not get there for want of time: its time is a lower bound
CENSORED = (MISSED, NOT_MEASURED)
# A seed's run stopped early, long before any cap: a miss of infinite time, no bound
STOPPED = (TOO_SLOW, DIVERGED)
# speedup_bound: which side of the speed-up the censored seeds bound
AT_MOST, AT_LEAST = "<=", ">="


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


def _kinds(rows: pd.DataFrame) -> pd.Series:
    return rows["status"].map(lambda s: parse_status(s).kind)


def _timed(rows: pd.DataFrame) -> pd.DataFrame:
    """The seeds with a time: reached (exact) or censored at a cap (a lower bound)."""
    return rows[_kinds(rows).isin((OK,) + CENSORED)]


def _figures(rows: pd.DataFrame) -> dict:
    """time, steps and ms/step of a variant's timed seeds (geometric means: they multiply)."""
    timed = _timed(rows)
    t = pd.to_numeric(timed["time_s"], errors="coerce")
    n = pd.to_numeric(timed["steps"], errors="coerce")
    ok = (t > 0) & (n > 0)
    t, n = t[ok], n[ok]
    reached = timed[_kinds(timed) == OK]
    return {"censored": int((_kinds(timed) != OK).sum()),
            "time_to_target_s": _geomean(t), "steps_to_target": _geomean(n),
            "step_ms": 1000 * _geomean(t / n),
            "cold_s": _median(timed["cold_s"]), "one_time_s": _median(timed["one_time_s"]),
            "reached_loss": _median(reached["final_loss"])}


def _row(exp, model, variant, rows, base, level, threshold) -> dict:
    is_base = bool(rows["is_baseline"].astype(bool).iloc[0])
    statuses = [parse_status(s) for s in rows["status"]]
    row = {"experiment": exp, "model": model, "variant": variant, "is_baseline": is_base,
           "status": _status(statuses), "seeds": len(rows),
           "reached": sum(s.ok for s in statuses), **_figures(rows),
           "target_loss": _first(rows, "target_loss"),
           "entropy_floor": _first(rows, "entropy_floor"),
           "target_source": _first(rows, "target_source"),
           **dict.fromkeys(("speedup", "speedup_lo", "speedup_hi", "ci_level",
                            "step_speed_ratio", "steps_ratio"), math.nan),
           "speedup_bound": ""}
    if is_base:
        return {**row, "verdict": intervals.BASELINE}
    return {**row, **_verdict(rows, base, statuses, level, threshold)}


def _verdict(rows, base, statuses, level: float, threshold: float) -> dict:
    """A variant's verdict and speed-up: a CI where every seed of both reached the target, a
    bound where a seed is censored (no call), `missed the target` for a miss (AlgoPerf's
    infinite time: no interval, so no call of the family)."""
    if all(s.na for s in statuses):
        return {"verdict": "n/a"}
    base_kinds = _kinds(base)
    if not len(base) or (base_kinds == "n/a").all():
        return {"verdict": "no verdict: the baseline has no time to target here"}
    failed = [s for s in statuses if s.kind in ("oom", "error")]
    if failed:
        return {"verdict": f"{failed[0].kind} in {len(failed)} seeds"}
    if (base_kinds != OK).any():
        short = int((base_kinds != OK).sum())
        if base_kinds.isin((OK, NOT_MEASURED)).all():  # the budget, not evidence
            return {**_bound(rows, base), "verdict": f"{NO_BUDGET} in {short} of "
                    f"{len(base)} seeds; a larger bench.time_budget_s lets it"}
        return {**_bound(rows, base), "verdict": f"{NO_TARGET} in {short} of {len(base)} seeds"}
    kinds = [s.kind for s in statuses]
    capped = sum(time_capped(s) for s in rows["status"])  # the wall clock, not the numerics
    misses = sum(k in (MISSED,) + STOPPED for k in kinds) - capped
    if misses:
        early = any(k in STOPPED for k in kinds)
        how = ("stopped early: far too slow" if TOO_SLOW in kinds else
               f"in {misses} of {len(kinds)} seeds")
        return {**(_zero() if early else _bound(rows, base)),
                "verdict": f"{MISSED_VERDICT} ({how}: {MISS_MEANING})"}
    if capped or NOT_MEASURED in kinds:
        return {**_bound(rows, base), "verdict": _censored(kinds, capped)}
    return _speedup(rows, base, level, threshold)


def _censored(kinds: list[str], capped: int) -> str:
    """The verdict of a variant some of whose seeds a limit stopped before the target, where the
    baseline's all got there: the budget's share, or the wall-clock cap target.max_s (a load
    can run it out: censoring, not a miss). No call."""
    parts = [f"the budget's share ran out in {kinds.count(NOT_MEASURED)} of {len(kinds)} "
             "seeds"] if NOT_MEASURED in kinds else []
    if capped:
        parts.append(f"the wall-clock cap target.max_s stopped {capped} of {len(kinds)} seeds, "
                     "which the baseline reached within it: censored, no call")
    return f"{NOT_MEASURED} ({'; '.join(parts)})"


def _zero() -> dict:
    """A run stopped early: infinite time, speed-up 0 (AlgoPerf), no bound of its own."""
    return {"speedup": 0.0, "speedup_bound": AT_MOST}


def _pairs(rows: pd.DataFrame, base: pd.DataFrame) -> pd.DataFrame:
    return _timed(rows).merge(_timed(base), on="seed", suffixes=("", "_b"))


def _bound(rows: pd.DataFrame, base: pd.DataFrame) -> dict:
    """The speed-up from the censored times: at most this where only the variant's are
    censored, at least where only the baseline's; none where both are."""
    pairs = _pairs(rows, base)
    mine = (_kinds(pairs) != OK).any()
    theirs = (pairs["status_b"].map(lambda s: parse_status(s).kind) != OK).any()
    if not len(pairs) or (mine and theirs):
        return {}
    point = _geomean(pairs["time_s_b"].astype(float) / pairs["time_s"].astype(float))
    return {"speedup": point, "speedup_bound": AT_MOST if mine else AT_LEAST}


def _speedup(rows: pd.DataFrame, base: pd.DataFrame, level: float, threshold: float) -> dict:
    """The paired ratios over the seeds both reached the target in."""
    pairs = _pairs(rows, base)
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
    head = (f"time to target (held-out loss {loss_text(final['target_loss'])}, "
            f"{int(final['seeds'])} seeds): the final recipe ")
    if not math.isfinite(final["speedup_lo"]):
        bound = f"{final['speedup_bound']} {ratio_text(final['speedup'])}, " \
            if math.isfinite(final["speedup"]) else ""
        return head + f"has no interval against naive: {bound}{final['verdict']}"
    sooner = {intervals.FASTER: "sooner than naive, significantly",
              intervals.SLOWER: "later than naive, significantly",
              intervals.EQUIVALENT: "as soon as naive (equivalent)"}.get(final["verdict"],
                                                                   "not significantly sooner "
                                                                   "than naive")
    return (head + f"took {final['time_to_target_s']:.3g} s, naive "
            f"{naive['time_to_target_s']:.3g} s (geometric means over seeds): "
            f"{ratio_text(final['speedup'], final['speedup_lo'], final['speedup_hi'])}, "
            f"{sooner}")


def _effect(row) -> str:
    """`bf16 1.21x [1.05, 1.40]`, `bf16 <= 0.80x`; the variant alone without a speed-up (every
    seed missed the target: no time to bound it with)."""
    if not math.isfinite(row["speedup"]):
        return row["variant"]
    bound = f"{row['speedup_bound']} " if row.get("speedup_bound") else ""
    effect = ratio_text(row["speedup"], row["speedup_lo"], row["speedup_hi"])
    return f"{row['variant']} {bound}{effect}"


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
    missed = "missed the target (infinite time, no interval)"
    parts = {"sooner, significantly": [], "later, significantly": [], "as soon (equivalent)": [],
             missed: [], "not settled": [], "no ratio": []}
    for r in rows[~rows["is_baseline"].astype(bool)].to_dict("records"):
        if r["verdict"].startswith(MISSED_VERDICT + " ("):  # a miss, AlgoPerf's infinite time
            how = r["verdict"].removeprefix(MISSED_VERDICT + " (")[:-1]
            parts[missed].append(f"{_effect(r)} ({how.split(': ' + MISS_MEANING)[0]})")
            continue
        if not math.isfinite(r["speedup"]):
            parts["no ratio"].append(f"{r['variant']} ({r['verdict']})")
            continue
        key = {intervals.FASTER: "sooner, significantly", intervals.SLOWER: "later, significantly",
               intervals.EQUIVALENT: "as soon (equivalent)"}.get(r["verdict"], "not settled")
        parts[key].append(_effect(r) + ("" if key != "not settled" or
                                        math.isfinite(r["speedup_lo"]) else f" ({r['verdict']})"))
    base = rows[rows["is_baseline"].astype(bool)]
    if base.empty:
        return ""
    head = base.iloc[0]
    if parse_status(head["status"]).na:  # (under torchrun, say): no time, no target to say
        return f"time to target: {head['status']}"
    said = "; ".join(f"{k}: {', '.join(v)}" for k, v in parts.items() if v)
    return (f"time to target (held-out loss {loss_text(head['target_loss'])}, "
            f"{int(head['seeds'])} seeds, against {head['variant']}{_at(head)}): "
            f"{said or 'no variant'}")


def loss_text(loss) -> str:
    """A held-out loss as the report prints it; `unknown` where it is no number (a to_target.csv
    edited by hand)."""
    try:
        return f"{float(loss):.4g}" if math.isfinite(float(loss)) else "unknown"
    except (TypeError, ValueError):
        return "unknown"


def _at(base) -> str:
    """` at 8.86 s`, the baseline's time to target; where it has none (no seed's time is a
    number), `, which has no time to target`."""
    t = base["time_to_target_s"]
    return f" at {t:.3g} s" if math.isfinite(t) else ", which has no time to target"
