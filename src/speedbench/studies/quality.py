"""Quality at equal work, and the rule that stops a variant far slower than the baseline.

The loss compared across variants cannot come from the timed trials: their warm-up adapts to
the machine (3 to 10 steps), so a loss taken after it measures how long the warm-up ran. The
quality probe trains fresh models from bench.quality_seeds paired seeds (seed k: the same
initial weights and data order for every variant), each for the same number of samples seen:
bench.quality_steps optimizer steps of the baseline (a variant that takes k times the samples
per step, accumulation with accumulate_mode=add, runs 1/k as many), on a training order fixed
per seed (held_out.probe_pool: not a function of the data set's length). Each is evaluated on
held-out data (held_out.py: samples never trained on), in fp32 with the model in eval mode and
its BatchNorm statistics recalibrated, before its first step and after its last: the step-0
loss tells whether the baseline has learned anything (analysis/quality.py's guard). Identical
recipes give identical losses on the CPU. analysis/quality.py turns the paired
per-seed losses into a ratio with a CI and a non-inferiority verdict. The probe runs once per
(model, variant), before the first round, untimed, and writes quality.csv.

Every step of the probe's first seed is timed. The steps after the first (and after a
technique's declared one-time steps, such as compilation) are its steady steps: they give its
steady throughput, and stopping.py's rules stop a variant far slower than the baseline (a call
of the family, with an interval) or too slow for its rounds to fit the budget (not measured).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from speedbench import techniques
from speedbench.measure import held_out, watchdog
from speedbench.studies import stopping
from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.techniques import Context
from speedbench.measure.timing import synchronize
from speedbench.results.schema import NOT_MEASURED, na, parse_status

EVAL_SAMPLES = 128  # held-out samples the probe evaluates


PROBE_LIMIT_TRIALS = 10  # the probe may take as long as this many capped trials


def probe_limit_s(recipe) -> float | None:
    """The probe's own time limit: PROBE_LIMIT_TRIALS x bench.max_trial_s (None without a
    cap), so that a huge bench.quality_steps or a very slow model cannot hold a run in the
    untimed probe. The run's deadline limits it too (Limits)."""
    cap = recipe.bench.max_trial_s
    return None if cap is None else PROBE_LIMIT_TRIALS * cap


BUDGET_GRACE_S = 2.0  # a probe step still running this long past the budget's share is stopped


@dataclass
class Limits:
    """A probe's two limits: its own (`cap_s`, probe_limit_s: on its timed steps, never
    before the far-slower test's first look) and what the model's budget leaves it (`left_s`:
    wall time from `started`, model building and evaluation included, with no floor)."""

    cap_s: float | None
    left_s: float | None
    started: float = field(default_factory=time.perf_counter)

    def reached(self, step_s: list[float], floor: int) -> str | None:
        """Which limit the probe has reached after its latest step: "cap", "budget" or None."""
        if self.left_s is not None and time.perf_counter() - self.started > self.left_s:
            return "budget"
        if self.cap_s is not None and sum(step_s) > self.cap_s and len(step_s) >= floor:
            return "cap"
        return None

    def hard(self) -> tuple[float | None, str]:
        """The watchdog's limit on the probe's steps, and what it is: the cap, or the budget's
        share and a grace where that comes first."""
        left = None if self.left_s is None else \
            self.left_s - (time.perf_counter() - self.started) + BUDGET_GRACE_S
        if left is not None and (self.cap_s is None or left < self.cap_s):
            return max(0.1, left), "what bench.time_budget_s left it"
        if self.cap_s is not None:
            return self.cap_s, f"{PROBE_LIMIT_TRIALS} x bench.max_trial_s"
        return None, ""

    def status(self, which: str, done: int, steps: int) -> str:
        """quality.csv's status of a probe that reached a limit after `done` of `steps`."""
        if which == "budget":
            return na(f"no held-out loss: the quality probe reached what bench.time_budget_s "
                      f"left it ({self.left_s:.3g} s) after {done} of {steps} steps")
        return na(f"no held-out loss: the quality probe reached its limit of {self.cap_s:.3g} "
                  f"s ({PROBE_LIMIT_TRIALS} x bench.max_trial_s) after {done} of {steps} steps")


def overrun_status(hard: tuple[float, str], elapsed_s: float) -> str:
    """quality.csv's status of a probe its hard cap (`hard`: Limits.hard) stopped in a step
    (watchdog.deadline)."""
    return na(f"no held-out loss: a step of the quality probe ran past its limit of "
              f"{hard[1]} ({hard[0]:.3g} s); stopped after {elapsed_s:.1f} s")


class SeedLoss(float):
    """A seed's held-out loss after the probe's steps (the float itself), with the same model's
    held-out loss before its first step (`initial`) and the task's chance loss (`chance`,
    held_out.chance_loss; NaN where it has none), all in nats."""

    def __new__(cls, loss: float, initial: float = math.nan, chance: float = math.nan):
        self = super().__new__(cls, loss)
        self.initial, self.chance = float(initial), float(chance)
        return self


def loss_columns(loss) -> dict:
    """quality.csv's columns of a seed's loss besides `loss`: initial_loss and chance_loss."""
    return {"initial_loss": getattr(loss, "initial", math.nan),
            "chance_loss": getattr(loss, "chance", math.nan)}


def quality_probe(spec, recipe, ctx: Context, dataset, steps: int,
                  ref: stopping.Reference | None = None, seeds: int = 1, what: str = "",
                  left_s: float | None = None) -> dict:
    """{final_loss, seed_losses, quality_steps, quality_samples, first_step_ms, second_step_ms,
    probe_samples_per_s, probe_step_s}: `steps` optimizer steps from each of `seeds` seeds
    (bench.seed, bench.seed + 1, ...), each then evaluated on held-out data (held_out.py);
    final_loss is the first seed's. The first seed's steps are timed (probe_step_s: its steady
    ones); where bench.too_slow_factor is set it runs at least the steps the far-slower test
    needs (past `steps`, only timed). The probe stops at its limits (Limits: its own, and
    `left_s`, what the model's budget leaves it), checked between steps and within a step by
    a hard cap (watchdog.deadline): no loss then, and `quality_status` says why.
    Held to `ref` (the baseline's steady steps, stopping.Reference), a variant is stopped as
    far slower by the test of stopping.far_slower (status 'too slow: ...', no loss), or as too
    slow for the budget (stopping.over_budget: 'not measured: ...'); the baseline (`ref` None)
    is held to neither. `n/a: ...` when a technique cannot act on the model. `what` names the
    probe in the watchdog's message."""
    if left_s is not None and left_s <= 0:
        return {"quality_status": na("no held-out loss: no time was left for the quality "
                                     "probe (bench.time_budget_s)"), "final_loss": math.nan,
                "quality_steps": 0, "quality_samples": 0}
    train, xy = _data(dataset, spec, recipe)
    started = time.perf_counter()
    got = _first_seed(spec, recipe, ctx, train, xy, steps, ref,
                      Limits(probe_limit_s(recipe), left_s), what or f"model {spec.name}")
    if "status" in got or not steps or "quality_status" in got:
        return got  # n/a or stopped; no loss asked for; or none: the limit came first
    left_s = None if left_s is None else left_s - (time.perf_counter() - started)
    return {**got, "seed_losses": [got["final_loss"],
                                   *more_seeds(spec, recipe, ctx, dataset, steps, seeds, left_s)]}


def more_seeds(spec, recipe, ctx: Context, dataset, steps: int, seeds: int,
               left_s: float | None = None) -> list[float]:
    """The held-out losses of seeds 1 .. seeds - 1 (the first is quality_probe's), untimed;
    those done within the probe's own limit and `left_s` (the budget's share) where a limit
    stops them."""
    train, xy = _data(dataset, spec, recipe)
    limits = [t for t in (probe_limit_s(recipe), left_s) if t is not None]
    started, limit, losses = time.perf_counter(), min(limits) if limits else None, []
    for k in range(1, seeds):
        left = None if limit is None else limit - (time.perf_counter() - started)
        if left is not None and left <= 0:
            break  # no time left: no seed started
        loss = _seed_loss(spec, seeded(recipe, k), ctx, train, xy, steps, left)
        if loss is None:
            break  # the time limit: the seeds done so far
        losses.append(loss)
    return losses


def _data(dataset, spec, recipe):
    """(the probe's training pool, the held-out batch): fixed per bench.seed, whatever the data
    set's length (held_out.probe_pool)."""
    train, xy, _ = held_out.split(dataset, spec, recipe.bench.seed, EVAL_SAMPLES)
    return held_out.probe_pool(train), xy


def _evaluated(trainer, spec, xy, train, seed: int, initial: float) -> SeedLoss:
    """The trained model's held-out loss (BatchNorm recalibrated on `train`), with `initial`."""
    loss = held_out.evaluate(trainer.model, spec, xy, trainer.device, train, seed)
    return SeedLoss(loss, initial, held_out.chance_loss(spec))


def seeded(recipe, k: int):
    """`recipe` from seed bench.seed + k: other initial weights and data order."""
    r = recipe.copy()
    r.bench.seed = recipe.bench.seed + k
    return r


def _first_seed(spec, recipe, ctx, train, xy, steps, ref, limits: Limits, what) -> dict:
    """The first seed: timed steps, the stopping rules (stopping.py), the held-out loss after
    `steps`."""
    per_step = batching(spec, recipe, ctx).per_step
    steady_from = 1 + techniques.one_time_steps(recipe)  # the first steady step's index
    # the steps the far-slower test needs: a variant its first look, the baseline (held to
    # nothing) the reference's steps
    need = steady_from + stopping.probe_floor(ref is None) if recipe.bench.too_slow_factor \
        else 1
    total = max(steps, need)
    # its own limit never stops the probe before the test's first look (a variant far slower
    # would otherwise escape it into the rounds); the budget's share does
    floor = min(total, need)
    times, loss, why = [], None, {}  # loss: None until evaluated
    try:
        hard = limits.hard()
        with applied(spec, recipe, ctx, train) as trainer, _capped(hard[0], what):
            initial = _initial(trainer, spec, xy, train, recipe, steps)
            torch.manual_seed(recipe.bench.seed)  # dropout, per-step noise: the same stream
            while len(times) < total:
                times.append(_timed_step(trainer))
                stop = _stopped(times, steady_from, per_step, recipe.bench, ref,
                                last=len(times) >= total)
                if stop:
                    return {**_timings(times, steady_from, per_step), **stop}
                if stopping.flagged(times[steady_from:], per_step, ref):  # re-check it
                    total = max(total, steady_from + stopping.STOP_LOOKS[-1])
                if len(times) == steps:
                    loss = _evaluated(trainer, spec, xy, train, recipe.bench.seed, initial)
                reached = limits.reached(times, floor)
                if reached:
                    if len(times) < steps:  # no loss: the probe's steps are not all done
                        why = {"quality_status": limits.status(reached, len(times), steps)}
                    break
    except NotApplicable as exc:
        return {"status": str(exc)}
    except watchdog.StepOverrun as exc:  # a step past the limit: no loss, and why
        # the step cut short took at least that long: too slow for the budget's rounds, the
        # variant is not measured (not left to burn a capped trial in every round)
        cut = _stopped([*times, exc.elapsed_s], steady_from, per_step, recipe.bench, ref,
                       overran=True)
        if parse_status(cut.get("status")).kind == NOT_MEASURED:
            return {**_timings(times, steady_from, per_step), **cut}
        if loss is None and steps:
            why = {"quality_status": overrun_status(hard, exc.elapsed_s)}
    done = min(steps, len(times))  # fewer where the time limit stopped it
    return {**_timings(times, steady_from, per_step),
            "final_loss": math.nan if loss is None else loss,
            "quality_steps": done, "quality_samples": done * per_step, **why}


def _stopped(times: list[float], steady_from: int, per_step: int, bench,
             ref: stopping.Reference | None, last: bool = False, overran: bool = False) -> dict:
    """The probe's record when a stopping rule stops it after its latest step, else {}
    (`last`: the probe has no more steps; `overran`: the latest step was cut short by the
    probe's hard cap, and took at least that long)."""
    steady = times[steady_from:]
    over = _over_budget(times, steady_from, bench, ref, last, overran)
    if over:  # its need feeds the run's one budget figure (recommend.more_budget)
        return {"status": over[0], "budget_need_s": over[1],
                "probe_speedup": _ratio(steady or times[-1:], per_step, ref),
                "final_loss": math.nan}
    hit = stopping.far_slower(steady, per_step, ref)
    if hit is None:
        return {}
    step = statistics.median(steady)
    return {"status": stopping.stopped_status(hit, steady, ref, len(times)),
            "steps": len(steady), "samples_per_s": per_step / step, "step_ms": 1000 * step,
            "final_loss": math.nan, "probe_speedup": hit[0], "probe_speedup_lo": hit[1],
            "probe_speedup_hi": hit[2]}


def _over_budget(times: list[float], steady_from: int, bench, ref: stopping.Reference | None,
                 last: bool, overran: bool) -> tuple[str, float] | None:
    """The budget check's `not measured: ...` status and the budget that would measure the
    variant (stopping.budget_status), else None. It judges the lower median of
    the steady steps from the second on (a single slow step, a load's burst, never decides
    alone; the one steady step of a probe with no more does), a step cut short by the hard cap
    (`overran`), and a plain first step (with its margin); never a step a technique declares
    one-time (compilation: a trial after the first finds its kernels in Inductor's cache)."""
    if ref is None:
        return None
    steady = times[steady_from:]
    plain_first = len(times) == 1 and steady_from == 1
    if overran and (steady or plain_first):
        step, first, n = times[-1], not steady, 1
    elif not overran and (len(steady) >= 2 or (steady and last)):
        step, first, n = statistics.median_low(steady), False, len(steady)
    elif plain_first and not overran:
        step, first, n = times[0], True, 1
    else:
        return None
    rounds_s = ref.rounds_left()  # once: the clock moves
    if not stopping.over_budget(step, first, bench, ref, ref.others_s, rounds_s):
        return None
    return stopping.budget_status(step, first, bench, ref, ref.others_s, bench.time_budget_s,
                                  rounds_s, n)


def _ratio(step_s: list[float], per_step: int, ref: stopping.Reference | None) -> float:
    """The variant's speed over the baseline's probe steps (NaN without them)."""
    if ref is None or not ref.step_s:
        return math.nan
    return stopping.speed_ratio(step_s, per_step, ref, 0.5)[0]


def _capped(limit: float | None, what: str) -> watchdog.Deadline:
    """The probe's limit as a hard cap on its steps (entered once the model is built, left
    before the recipe's cleanup): a step that would overrun it is stopped (StepOverrun)."""
    return watchdog.deadline(limit, f"the quality probe of {what}",
                             f"{PROBE_LIMIT_TRIALS} x bench.max_trial_s or the time budget's "
                             f"share, {limit:.3g} s" if limit is not None else "")


def _seed_loss(spec, recipe, ctx, train, xy, steps: int, left_s: float | None) -> float | None:
    """The held-out loss after `steps` untimed steps from recipe's seed; None past `left_s`
    (checked between steps, and within a step by a hard cap: _capped)."""
    if left_s is not None and left_s <= 0:
        return None
    started = time.perf_counter()
    try:
        with applied(spec, recipe, ctx, train) as trainer, \
                _capped(None if left_s is None else
                        max(0.1, left_s - (time.perf_counter() - started)),
                        f"model {spec.name}"):
            initial = _initial(trainer, spec, xy, train, recipe, steps)
            torch.manual_seed(recipe.bench.seed)
            for _ in range(steps):
                trainer.step()
                if left_s is not None and time.perf_counter() - started > left_s:
                    return None
            return _evaluated(trainer, spec, xy, train, recipe.bench.seed, initial)
    except watchdog.StepOverrun:
        return None


def _initial(trainer, spec, xy, train, recipe, steps: int) -> float:
    """The fresh model's held-out loss before its first step (NaN where no loss is asked for);
    taken before the seed's random stream is set, so training is as without it."""
    if not steps:
        return math.nan
    return held_out.evaluate(trainer.model, spec, xy, trainer.device, train, recipe.bench.seed)


def _timings(step_s: list[float], steady_from: int, per_step: int) -> dict:
    """The probe's step times: its first two, its steady throughput and its steady steps."""
    steady = step_s[steady_from:]
    return {"first_step_ms": 1000 * step_s[0] if step_s else math.nan,
            "second_step_ms": 1000 * step_s[1] if len(step_s) > 1 else math.nan,
            "probe_samples_per_s": per_step / statistics.median(steady) if steady else math.nan,
            "probe_step_s": steady}


def _timed_step(trainer) -> float:
    synchronize(trainer.device)
    t0 = time.perf_counter()
    trainer.step()
    synchronize(trainer.device)
    return time.perf_counter() - t0
