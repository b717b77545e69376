"""One cost model: what a trial, a round and a measurement cost, predicted before they run and
learned from what they took.

- `trial_seconds`: a trial from its step (set-up, warm-up floor, window, two untimed steps);
  the probes' budget check (stopping.py), the plan line and the forecasts' screens use it.
- `round_seconds` and `plan_line`: a model's round from its probes' steady steps, and the line
  beside the progress bar that says what the rounds the budget leaves can decide.
- `observed_trial_seconds` and `MeasurementCosts`: what the recipe search's measurements took,
  as a fixed part, a part per recipe and a part per trial (search/selection.py asks it).
The paired profile's cost is explain.seconds (it is the profiler's); explain.reserve_s keeps it
back from the rounds.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from speedbench.analysis import intervals, power
from speedbench.results import schema

# A trial's cost beyond its steps: the model, optimizer and loader built, garbage collected,
# its row written. Measured on the quiet 2-core EPYC (2026-12-03, every trial of a run timed):
# 0.09 s a trial (7 identical transformer variants) to 0.17 s (amp's three models, the memory
# step of the first rounds included); it was 0.5 s, which put the plan's rounds 1.6x too long.
TRIAL_SETUP_S = 0.2
# The per-round sd of a paired log speed-up the plan assumes: measured on the reference models'
# bf16/fp32 trials on a quiet 2-core CPU, 5-step windows, 0.13 (VAE) to 0.29 (transformer)
# (benchmarks/step_noise.py): the trials' levels move ~10 % between trials, bare loops too
ROUND_SD = 0.15


def trial_seconds(step_s: float, bench, setup_s: float = TRIAL_SETUP_S) -> float:
    """What one trial of a recipe whose step takes `step_s` costs: its set-up, its warm-up
    floor, its window and two untimed steps (memory, FLOPs; the steady-state warm-up's extra
    steps about make up for the memory step taken in the first rounds only), the window cut by
    bench.max_trial_s."""
    steps = bench.warmup + bench.steps + 2
    cap = bench.max_trial_s
    return setup_s + (steps * step_s if cap is None else min(steps * step_s, cap + 3 * step_s))


def step_seconds(probe_steps: dict[str, list[float]], rows: list[dict]) -> dict[str, float]:
    """variant -> seconds of a plain step: the rounds' median where measured (`rows`, ok
    records), else the probe's steady steps' median."""
    out = {n: statistics.median(s) for n, s in probe_steps.items() if s}
    by_variant: dict[str, list[float]] = {}
    for r in rows:
        if r.get("status") == schema.OK and r.get("step_ms"):
            by_variant.setdefault(r["variant"], []).append(r["step_ms"])
    out.update({n: statistics.median(ms) / 1000 for n, ms in by_variant.items()})
    return out


@dataclass(frozen=True)
class RoundFacts:
    """What a model's round cost is predicted from: each variant's probe throughput (samples
    per second; None or NaN where none), samples per step and bench, and the variants left out
    (n/a or stopped)."""

    rates: dict
    per_step: dict[str, int]
    skipped: set
    benches: dict


def round_seconds(facts: RoundFacts, settings=None) -> tuple[float, int]:
    """(seconds of a round from the probes' steady steps, variants left to measure that no
    probe timed)."""
    round_s, unknown = 0.0, 0
    for name, bench in facts.benches.items():
        if name in facts.skipped:
            continue
        rate = facts.rates.get(name)
        if rate is None or not rate > 0:
            unknown += 1  # launched in processes of its own, or its probe failed
            continue
        round_s += trial_seconds(facts.per_step[name] / rate, bench)
    return round_s, unknown


def plan_line(model: str, facts: RoundFacts, settings, comparisons: int, spent: float,
              left: float) -> str:
    """The plan, from the probes' steady steps (before any round): what a round takes, the
    rounds `left` seconds buy, the smallest effect they call in most runs (power.py, with
    ROUND_SD) and the bench.time_budget_s a 1.1x verdict needs. `spent`: what the data and the
    probes took."""
    round_s, unknown = round_seconds(facts, settings)
    head = f"{model}: data and probes took {spent:.0f} s"
    if not round_s > 0:
        return head + "; no probe timed a round: rounds run while the budget lasts"
    uncounted = f" (not counting {unknown} variant(s) without a probe)" if unknown else ""
    repeats, sequential = settings.repeats, settings.target_ci is not None
    # adaptive rounds stop at their last look, the later looks spread over the budget
    if sequential:
        looks = intervals.planned_looks(left, repeats, round_s)
        most = intervals.most_rounds(repeats, looks, intervals.look_spacing(
            left, repeats, round_s, looks))
    else:
        most = repeats
    by_time = int(left // round_s) if math.isfinite(left) else most
    fit = min(by_time, most)
    text = (f"{head}; about {fit} rounds of {round_s:.1f} s{uncounted} fit in the "
            + (f"{left:.0f} s left" if math.isfinite(left) else "plan (no time budget)"))
    level = intervals.sequential_level(comparisons)
    small = power.smallest_call(fit, ROUND_SD, level, settings.noise_threshold) \
        if fit >= 2 else math.inf
    if fit < 2:
        text += ": fewer than 2, so no interval"
    elif small > 1:  # an interval wider than a doubling decides nothing
        text += f": {fit} rounds give intervals too wide to decide an effect under 2x"
    else:
        text += f": effects under about {small:.0%} will likely stay inconclusive"
    need = power.rounds_for(1.1, ROUND_SD, intervals.sequential_level(comparisons))
    if need and need > fit:  # what stops short of it: the rounds' cap, the budget, or both
        give = []
        # the most rounds any budget buys (the later looks at their widest spacing)
        per = intervals.most_rounds(1, intervals.MAX_LOOKS, intervals.MAX_SPACING) \
            if sequential else 1  # rounds per bench.repeats
        if need > repeats * per:
            give.append(f"bench.repeats={math.ceil(need / per)}")
        if need > by_time:  # the run's one figure is said once, before the plans
            give.append("a larger bench.time_budget_s (the run's figure above)")
        text += f"; a verdict on 1.1x needs about {need} rounds: give {' and '.join(give)}"
    return text


def verdict_budget_s(facts: RoundFacts, settings, comparisons: int, spent: float,
                     left: float) -> float | None:
    """The bench.time_budget_s that gives this model the rounds a verdict on 1.1x needs, its
    share of the run scaled alike (None: no probe timed a round, or no budget)."""
    round_s = round_seconds(facts, settings)[0]
    need = power.rounds_for(1.1, ROUND_SD, intervals.sequential_level(comparisons))
    if not (round_s > 0 and need and settings.time_budget_s and spent + left > 0):
        return None
    return settings.time_budget_s * (spent + need * round_s) / (spent + left)


def run_budget_figure(figures: list[float | None], budget_s: float | None) -> float | None:
    """The run's one budget figure as the plan knows it, in two significant figures: the
    largest of the models' verdict_budget_s and the probes' needs (stopping.budget_status);
    None where the run's budget is enough (or nothing was timed)."""
    known = [f for f in figures if f is not None and math.isfinite(f)]
    if not known or budget_s is None or max(known) <= budget_s:
        return None
    return float(f"{max(known):.2g}")


def run_budget_line(figures: list[float | None], budget_s: float | None) -> str:
    """The run's one budget advice (run_budget_figure), said once before any round: '' where
    the run's budget is enough (or nothing was timed)."""
    figure = run_budget_figure(figures, budget_s)
    if figure is None:
        return ""
    return (f"speedbench: budget: about bench.time_budget_s={figure:g} for the whole run (this "
            f"run has {budget_s:g} s) measures every variant and calls a 1.1x effect on every "
            "model; smaller effects need more")


# --- learned from what the measurements took (the recipe search) --------------------------------
def observed_trial_seconds(elapsed_s, steps, warmup_steps) -> float:
    """Median seconds of a trial, warm-up included, from its records' columns (sequences of
    one value per ok trial): its timed window scaled by the steps it ran in all."""
    e, s, w = (np.asarray(x, float) for x in (elapsed_s, steps, warmup_steps))
    with np.errstate(divide="ignore", invalid="ignore"):
        seconds = e * (s + w) / s
    seconds = seconds[seconds > 0]
    return float(np.median(seconds)) if len(seconds) else math.nan


@dataclass
class MeasurementCosts:
    """What a measurement of R recipes in N rounds costs, from what the ones so far took: a
    fixed part (data, the n/a checks, one-time costs) plus R x (a per-recipe part, its quality
    probe, at most one trial's time, + N x seconds per trial). `record` takes a measurement's
    seconds and, per recipe, its measured rounds and its trials' seconds (NaN: not timed: then
    everything is charged per trial)."""

    per_trial: list[float] = field(default_factory=list)
    per_recipe: list[float] = field(default_factory=list)
    fixed: list[float] = field(default_factory=list)

    def record(self, seconds: float, trials: dict[str, tuple[int, float]]) -> None:
        counts = {k: n for k, (n, _) in trials.items() if n}
        total = sum(counts.values())
        if not total:
            return
        timed = all(np.isfinite(trials[k][1]) for k in counts)
        in_trials = sum(n * trials[k][1] for k, n in counts.items()) if timed else seconds
        in_trials = min(in_trials, seconds)
        self.per_trial.append(in_trials / total)
        rest = seconds - in_trials
        per_recipe = min(rest / len(trials), in_trials / total)
        self.per_recipe.append(per_recipe)
        self.fixed.append(rest - per_recipe * len(trials))

    @property
    def known(self) -> bool:
        return bool(self.per_trial)

    def cost(self, recipes: int, rounds: int) -> float:
        """Seconds a measurement of `recipes` recipes in `rounds` rounds should take."""
        if not self.per_trial:
            return 0.0
        return float(np.mean(self.fixed)) + recipes * (
            float(np.mean(self.per_recipe)) + rounds * float(np.mean(self.per_trial)))
