"""What the rounds loop (studies/rounds.py) asks between rounds: the paired speed-ups so far,
their CIs' half-widths, whether every comparison is decided, and whether to go on to the next
look of the group-sequential rounds. The intervals are analysis/intervals.py's, at the level
summary.csv reports."""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis.intervals import (
    INCONCLUSIVE, LOOKS, classify, comparison_level, count_comparisons, is_look, look_of,
    pair_key, paired, paired_ratio_ci, relative_halfwidth, sequential_level, threshold_of)
from speedbench.results.schema import OK


def speedups(trials: pd.DataFrame, level: float) -> dict[str, tuple]:
    """(speed-up, lo, hi, verdict) of each non-baseline variant's paired speed-up so far, at
    `level`; variants with no ok trial are left out."""
    if "samples_per_s" not in trials or "status" not in trials:
        return {}
    ok = trials[trials["status"] == OK]
    key = pair_key(trials)
    base = ok[ok["is_baseline"].astype(bool)]
    out = {}
    for variant, g in ok[~ok["is_baseline"].astype(bool)].groupby("variant", sort=False):
        ci = paired_ratio_ci(*paired(g, base, "samples_per_s", key), level) \
            if len(base) else (math.nan,) * 3
        out[variant] = (*ci, classify(*ci, threshold=threshold_of(g)))
    return out


def speedup_halfwidths(trials: pd.DataFrame, comparisons: int | None = None,
                       level: float | None = None) -> dict[str, float]:
    """Relative half-width of each non-baseline variant's paired speed-up CI so far, at
    `level` (default: Bonferroni for `comparisons`, default this frame's own count). NaN
    below two rounds."""
    level = level or comparison_level(comparisons or count_comparisons(trials))
    return {v: relative_halfwidth(lo, hi) for v, (_, lo, hi, _) in speedups(trials, level).items()}


def decided(trials: pd.DataFrame, level: float, target_ci: float | None) -> bool:
    """Every comparison called (faster, slower or equivalent) at `level`, or its CI no wider
    than +-target_ci: nothing more to learn from more rounds."""
    for _, lo, hi, verdict in speedups(trials, level).values():
        narrow = target_ci is not None and relative_halfwidth(lo, hi) <= target_ci
        if verdict == INCONCLUSIVE and not narrow:  # NaN (too few rounds) is not narrow
            return False
    return True


def wants_more_rounds(rows: list[dict], bench, rounds: int, elapsed_s: float,
                      comparisons: int | None = None, min_rounds: int | None = None,
                      looks: int = LOOKS, budget_s: float | None = None,
                      every: int | None = None) -> bool:
    """Group-sequential rounds. The first look after `min_rounds` rounds (bench.repeats, the
    floor), then one every `every` rounds (intervals.look_spacing; default `min_rounds`),
    `looks` at most (planned_looks); bench.target_ci null: one look. Between two looks the
    rounds go on while the next one fits in `budget_s` (default bench.time_budget_s; the
    rounds' share of it) at the pace so far. At a look the rounds stop when every comparison is
    decided (`decided`, at that look's level for the run's `comparisons`, the level
    summary.csv reports) or when not one more round fits in `budget_s` at the mean pace so
    far."""
    min_rounds = min_rounds or bench.repeats
    every = every or min_rounds
    budget_s = bench.time_budget_s if budget_s is None else budget_s
    if bench.target_ci is None or not rows or rounds < 1:
        return rounds < min_rounds
    if not is_look(rounds, min_rounds, every):  # between looks: on while the next round fits
        return elapsed_s * (rounds + 1) / rounds <= budget_s
    look = look_of(rounds, min_rounds, looks, every)
    if look >= looks:
        return False
    frame = pd.DataFrame(rows)
    level = sequential_level(comparisons or count_comparisons(frame), look, looks)
    if decided(frame, level, bench.target_ci):
        return False
    # on while a round fits, though the next look may not: rounds that end between two looks
    # are reported at the next look's level (intervals.reported_look), so the budget is spent
    return elapsed_s * (rounds + 1) / rounds <= budget_s


def halfwidth_note(rows: list[dict], level: float | None = None) -> str:
    widths = speedup_halfwidths(pd.DataFrame(rows), level=level)
    return ", ".join(f"{v} +-{w:.1%}" for v, w in widths.items()) or "no speed-up to narrow"
