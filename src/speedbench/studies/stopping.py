"""When a quality probe stops a variant before its rounds: by evidence, or by the budget.

Every probe step is timed (quality.py). The steps after the first `1 + one_time_steps` (the
first step's allocations and kernel choices; a technique's declared one-time costs, such as
compilation) are the probe's steady steps.

- **Far slower, by evidence** (bench.too_slow_factor, F): a one-sided test of the run's family.
  The variant's speed relative to the baseline's (samples per second) is estimated from its
  steady probe steps against the baseline's (Welch's t on the logs of the seconds per sample,
  its variance widened by the trial-to-trial level of two fresh models, TRIAL_LEVEL_SD, which
  the steps of one model cannot show); the first look only flags a variant (`flagged`: its
  probe then runs on to the last look), and the last look calls it where the test holds both
  on all its steady steps and on the fresh ones after the first look alone, a re-check that a
  load burst covering the first look's steps cannot pass;
  at STOP_LOOKS steady steps the test looks, and the variant is stopped when the upper
  confidence bound of that ratio is below 1/F: its whole interval is F times slower or more.
  Each look spends an equal part of the comparison's STOP_SHARE of the family's error
  (analysis/intervals.py), so the call keeps the run's family-wise level. Status `too slow:
  ...`, verdict `slower (stopped early)` with that interval.
- **Too slow for the budget, no call**: a variant whose trials could not fit two rounds in
  what the model's budget leaves the rounds (fewer than two rounds give no interval; one where
  bench.repeats asks for one) is not measured: status `not measured: ...`, with its measured
  step and the bench.time_budget_s that would let it run. What the rounds have is their share
  of the run, or what the model's budget has left at that moment where that is less
  (Reference.rounds_left), and the status names which. It is judged on the lower median of the
  steady steps so far, from the second on (one slow step, a load's burst, cannot decide
  alone; the single steady step of a probe that has no more), and on a first step where even
  a third of it is far too long. The baseline is held to neither rule: its trials run, and the
  deadline cuts them short where need be.

A load that rises F-fold between the baseline's probe and the variant's could still fake a
stop: the two probes are not paired, and the trial level fitted on a quiet machine does not
cover a load that comes and goes (a transformer step went from 50 ms to 1.8 s and 60 s within
20 minutes on a shared machine). The widened interval makes the F-fold margin about 8-fold for
a quiet pair (an identical pair's stop interval covers 1 as its level says), but not that; a
busy machine is flagged in the report, and such a stop's interval is approximate there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from speedbench.analysis.intervals import FAMILY_LEVEL, STOP_SHARE, t_quantile
from speedbench.studies.costs import trial_seconds
from speedbench.results.schema import NOT_MEASURED, TOO_SLOW, format_status

STOP_LOOKS = (3, 6)  # the variant's steady probe steps at which the far-slower test looks
# The baseline's steady probe steps the test compares with: as many as its last look has. With
# 3, Welch's t had 2-4 degrees of freedom and, at the level a look spends, a 30-fold margin: a
# baseline whose 3 steps spread 15 % let fp16 on a CPU (12x slower) run in every round.
REFERENCE_STEPS = STOP_LOOKS[-1]
FIRST_STEP_MARGIN = 3  # a first step this many times too long decides the budget check alone
# The sd of a trial's level (its mean log step) from one fresh model to the next, beyond what its
# steps' own noise explains: 0.04-0.15 over the reference models and precisions on the quiet
# machine (benchmarks/data/step_times*.csv, benchmarks/README.md "Trial noise"); the largest.
# The two probes are two fresh models, so their ratio carries two such levels, which the steps
# of either cannot show: without it the stop's 99.92 % interval covered an identical pair's 1
# in 78-89 % of 4,480 quiet pairs (measurement audit 5).
TRIAL_LEVEL_SD = 0.15
MAX_DF = 200  # the degrees of freedom the widened test is given at most


def probe_floor(reference: bool) -> int:
    """The steady steps a probe runs at least for the far-slower test: REFERENCE_STEPS for
    the baseline's (the reference), the first look's for a variant's."""
    return REFERENCE_STEPS if reference else STOP_LOOKS[0]


def stop_level(comparisons: int, family: float = FAMILY_LEVEL) -> float:
    """One-sided level of each look of the far-slower test: the comparison's STOP_SHARE of the
    family, split over the looks."""
    return 1 - STOP_SHARE * family / max(1, comparisons) / len(STOP_LOOKS)


@dataclass
class Reference:
    """What a variant's probe is held to: the baseline's steady probe steps (seconds) and
    samples per step, the factor F (bench.too_slow_factor; None: never stopped by evidence),
    the test's one-sided level per look, the seconds the model's rounds may take and what the
    other variants' trials take of each round."""

    step_s: list[float]
    per_step: int
    factor: float | None
    level: float
    rounds_s: float = math.inf
    others_s: float = 0.0
    rounds: int | None = None  # a request's exact rounds (study.Request), else bench.repeats
    left: Optional[Callable[[], float]] = None  # what the model's budget has left, now

    def rounds_left(self) -> float:
        """The seconds the model's rounds can still count on: their share of the run
        (`rounds_s`), or what the model's budget has left now where that is less (a slow start,
        a load, the probes before this one)."""
        return self.rounds_s if self.left is None else min(self.rounds_s, self.left())


def speed_ratio(step_s: list[float], per_step: int, ref: Reference, level: float,
                level_sd: float = TRIAL_LEVEL_SD) -> tuple[float, float, float]:
    """The variant's speed over the baseline's (samples per second) from steady steps, with an
    interval whose ends are one-sided bounds at `level`: Welch's t on the logs of seconds per
    sample, its variance widened by the two fresh models' levels (2 x `level_sd` squared, a
    known term that adds no degrees of freedom; degrees of freedom rounded down); NaN ends
    below two steps on a side; all NaN where a side has none (the baseline's probe failed)."""
    if not len(step_s) or not len(ref.step_s):
        return math.nan, math.nan, math.nan
    x = np.log(np.asarray(step_s, float) / per_step)
    y = np.log(np.asarray(ref.step_s, float) / ref.per_step)
    point = math.exp(float(y.mean() - x.mean()))
    if len(x) < 2 or len(y) < 2:
        return point, math.nan, math.nan
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy + 2 * level_sd ** 2)
    df = (vx + vy + 2 * level_sd ** 2) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1)) \
        if vx + vy > 0 else math.inf
    df = min(df, MAX_DF)  # past it t is the normal within 1 % (and a little wider: safe)
    half = t_quantile(2 * level - 1, max(1, int(df))) * se
    return point, point * math.exp(-half), point * math.exp(half)


def far_slower(steady_s: list[float], per_step: int, ref: Reference | None
               ) -> tuple[float, float, float] | None:
    """The far-slower test, a call at the last look only and re-checked: the variant's (ratio,
    lo, hi) when the upper bound of its ratio over all its steady steps, and that of the steps
    after the first look alone (fresh ones, taken after `flagged` asked for them), are both
    below 1/F at the look's level; None otherwise (not the last look, no reference, no F). A
    load burst that covers the first look's steps cannot make a call alone."""
    if ref is None or not ref.factor or len(steady_s) != STOP_LOOKS[-1]:
        return None
    ratio, lo, hi = speed_ratio(steady_s, per_step, ref, ref.level)
    fresh = speed_ratio(steady_s[STOP_LOOKS[0]:], per_step, ref, ref.level)[2]
    return (ratio, lo, hi) if hi * ref.factor < 1 and fresh * ref.factor < 1 else None


def flagged(steady_s: list[float], per_step: int, ref: Reference | None) -> bool:
    """Whether the test holds at the first look (its steps alone): the probe then runs on to
    the last look, whose fresh steps re-check it before it becomes a call (far_slower)."""
    if ref is None or not ref.factor or len(steady_s) != STOP_LOOKS[0]:
        return False
    return speed_ratio(steady_s, per_step, ref, ref.level)[2] * ref.factor < 1


def stopped_status(ratio: tuple[float, float, float], steady_s: list[float], ref: Reference,
                   steps: int) -> str:
    """`too slow: 14.2x slower [11.0, 18.3] than the baseline in steady probe steps ...`."""
    point, lo, hi = ratio
    return format_status(TOO_SLOW, f"{1 / point:.3g}x slower [{1 / hi:.3g}, {1 / lo:.3g}] than "
                                   f"the baseline in steady probe steps ({np.median(steady_s):.3g}"
                                   f" s/step, {len(steady_s)} against {len(ref.step_s)}; one-"
                                   f"sided {ref.level:.4%} per look), stopped after {steps} "
                                   "steps")


def needed_s(step_s: float, bench, others_s: float = 0.0, rounds: int | None = None) -> float:
    """What the rounds an interval needs take with this recipe's trials (`step_s` a step;
    `others_s` the other variants' trials in a round): two rounds, one where the recipe asks
    for one (bench.repeats=1, or a request's `rounds`=1: a quick look, a recipe search's
    pilot)."""
    return min(2, rounds or bench.repeats) * (trial_seconds(step_s, bench) + others_s)


def over_budget(step_s: float, first: bool, bench, ref: Reference | None,
                others_s: float = 0.0, rounds_s: float | None = None) -> bool:
    """Whether the rounds an interval needs (needed_s) would not fit the seconds the model's
    rounds have (`rounds_s`, default ref.rounds_left()); a first step (with its one-time
    costs) decides only when FIRST_STEP_MARGIN times too long."""
    if ref is None or not math.isfinite(ref.rounds_s):
        return False
    have = ref.rounds_left() if rounds_s is None else rounds_s
    return needed_s(step_s, bench, others_s, ref.rounds) > have * (FIRST_STEP_MARGIN if first
                                                                   else 1)


def budget_status(step_s: float, first: bool, bench, ref: Reference, others_s: float,
                  budget_s: float, rounds_s: float | None = None, steps: int = 1
                  ) -> tuple[str, float]:
    """(`not measured: its first probe step took 8.2 s ...; to measure it give a larger
    bench.time_budget_s`, the bench.time_budget_s that would: 900). The status names no
    figure: the run's one figure (recommend.more_budget, the largest such need) is said once.
    `step_s` is the step judged: the first, or the lower median of `steps` steady steps;
    `rounds_s` what the rounds had (ref.rounds_left()), named as their share of the run or
    as what was left of it."""
    have = ref.rounds_left() if rounds_s is None else rounds_s
    need = needed_s(step_s, bench, others_s, ref.rounds)
    rounds = "two rounds" if (ref.rounds or bench.repeats) > 1 else "a round"
    enough = budget_s * need / have if have > 0 else math.inf
    which = "its first probe step took" if first else "a steady probe step took" \
        if steps == 1 else f"its steady probe steps took (lower median of {steps})"
    where = (f"the {have:.0f} s of rounds its share of the run holds" if have >= ref.rounds_s
             else f"the {have:.0f} s its model's budget had left for the rounds (their share "
             f"of the run: {ref.rounds_s:.0f} s)")
    return format_status(NOT_MEASURED, f"{which} {step_s:.3g} s; {rounds} with its "
                                       f"trials would need about {need:.0f} s, more than "
                                       f"{where}; to measure it give a larger "
                                       f"bench.time_budget_s"), 1.2 * enough
