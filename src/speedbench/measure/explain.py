"""Why a variant is faster, and how much it ever could be: profiled steps split by category.

Never inside a timed window. `bench.explain` (on by default) adds two untimed stages to a
model's rounds (explain_phases.py, study.py's pipeline), each drawing on the run's budget and skipped with the
reason when it has no time left:

1. before the rounds, the *forecast*: a few profiled baseline steps; each variant's technique
   declares from them the most it could gain (Technique.bound: Amdahl on the share of the
   step it acts on, with the measured matmul peaks); forecast.csv.
2. after the rounds, the *paired profile*: a fresh model of the baseline before, between and
   after those of the measured variants (drift hits both sides), a few profiled steps each,
   warmed up as a trial is; explain.csv. analysis/explain.py turns the two sides into each
   comparison's parts.

A profiled step is split by operator category (schema.EXPLAIN_CATEGORIES) so that the parts
sum to its wall time:
- CPU (torch.profiler's CPU activity): each event's self time (its time less its children's)
  on the step's thread goes to a category: the step's `data` and `optimizer` phases whole
  (profile.LabelClock marks them), else by the operator's name: matmul/conv kernels,
  host-device syncs (`item`), other aten operators (elementwise: pointwise, reductions,
  copies, casts), compiled code (dynamo/inductor regions), the Python between operators
  (the self time of speedbench's phase labels) and other framework frames (autograd's
  engine, record_function wrappers). What no event holds is `other`.
- CUDA (kernels): the device timeline. Busy time goes to the category of the operator that
  launched each kernel; idle time to the data wait where the host was in the data phase, to
  `sync` from the end of a synchronising call (cudaStreamSynchronize, ...) to the next kernel,
  and the rest to `python` (the host could not launch fast enough).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from speedbench import techniques
from speedbench.analysis.explain import Breakdown
from speedbench.measure import env, watchdog
from speedbench.measure.data import rank_sampler
from speedbench.measure.profile import LabelClock
from speedbench.measure.session import applied, batching
from speedbench.measure.timing import synchronize, timed_steps, warm_up
from speedbench.measure.trial import BUDGET_GRACE_S, BUDGET_LIMIT, context
from speedbench.results import atomic, schema

CATEGORIES = schema.EXPLAIN_CATEGORIES
STEP = "speedbench.step"  # the record_function around each profiled step
LABEL = "speedbench."  # LabelClock's phase labels: speedbench.<phase>
# A fresh model warms up as a trial does (timing.warm_up: bench.warmup at least, then until
# steady), at least WARMUP steps, plus a technique's one-time steps (compile's)
WARMUP = 2
FORECAST_STEPS = schema.FORECAST_STEPS  # profiled baseline steps behind the forecasts
PAIRED_STEPS = 8  # profiled steps of each profile (the baseline: one more than the variants)
MIN_PAIRED_STEPS = 3  # fewer where the budget is short (paired_steps); Welch needs 2 a side
PLAIN_STEPS = 3  # unprofiled steps after the warm-up: the profiler's cost is the excess over them
PROFILER_FACTOR = 2.0  # a profiled step's time over a plain one's, in the time estimate
SETUP_S = 0.5  # a model, its loader and the profiler started
RESERVE_SHARE = 0.25  # of a model's budget left after its probes, the most kept for explaining

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv",
              "dot", "vdot", "einsum", "_int_mm", "_scaled_mm"}
MATMUL_PREFIXES = ("conv", "_conv", "cudnn_conv", "miopen_conv", "mkldnn_conv", "slow_conv",
                   "_slow_conv", "thnn_conv", "_nnpack", "mkldnn_linear", "_mkldnn_linear",
                   "mkldnn_matmul", "scaled_dot_product", "_scaled_dot_product",
                   "_flash_attention", "_efficient_attention", "_cudnn_attention")
SYNC_OPS = {"item", "_local_scalar_dense", "is_nonzero"}
COMPILE_MARKERS = ("compiled", "dynamo", "inductor")
# CUDA runtime calls in which the host waits for the device (cudaMemcpyAsync does not)
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy"}


def category(name: str, phase: Optional[str]) -> str:
    """The category of an event's self time: its phase's where that says it all (the data
    wait, the optimizer step), else its operator's."""
    if phase in ("data", "optimizer"):
        return phase
    low = name.lower()
    if any(m in low for m in COMPILE_MARKERS):
        return "compiled"
    if name.startswith(LABEL):
        return "python"  # a phase label's self time: the Python between operators
    if not name.startswith("aten::"):
        return "other"
    op = name[len("aten::"):]
    if op in SYNC_OPS:
        return "host_sync"
    if op in MATMUL_OPS or op.startswith(MATMUL_PREFIXES):
        return "matmul"
    return "elementwise"


# --- the split of one profiled step --------------------------------------------------------
def _start(e) -> float:
    return e.time_range.start


def _end(e) -> float:
    return e.time_range.end


def _nested(span, events) -> list[tuple]:
    """(event, category, self µs) of every CPU event inside `span` on its thread, nested by
    time (the stack of enclosing events); the span itself first."""
    inside = sorted((e for e in events if e is not span and e.thread == span.thread
                     and _start(e) >= _start(span) and _end(e) <= _end(span)),
                    key=lambda e: (_start(e), -_end(e)))
    children = {id(span): 0.0}
    phase = {id(span): None}
    stack, out = [span], []
    for e in inside:
        while len(stack) > 1 and _start(e) >= _end(stack[-1]):
            stack.pop()
        parent = stack[-1]
        children[id(parent)] += _end(e) - _start(e)
        children[id(e)] = 0.0
        own = e.name[len(LABEL):] if e.name.startswith(LABEL) else None
        phase[id(e)] = own if own in schema.PHASES else phase[id(parent)]
        stack.append(e)
    for e in [span, *inside]:
        self_us = max(0.0, _end(e) - _start(e) - children[id(e)])
        out.append((e, category(e.name, phase[id(e)]), self_us))
    return out


def _exact(parts: dict, total_ms: float) -> dict:
    """The parts with `other` taking what they leave of the step (rounding, uncovered time),
    so that they sum to the step's wall time."""
    parts["other"] = parts.get("other", 0.0) + total_ms - sum(parts.values())
    return parts


def split_cpu(span, events) -> dict:
    """category -> ms of one profiled step (a `STEP` span) from its CPU events."""
    parts = dict.fromkeys(CATEGORIES, 0.0)
    for _, cat, self_us in _nested(span, events):
        parts[cat] += self_us / 1000
    return _exact(parts, (_end(span) - _start(span)) / 1000)


def without_overhead(steps: list[dict], plain_ms: float) -> tuple[list[dict], float]:
    """Each part scaled by the same model's unprofiled step over the mean profiled one (at
    most 1: the profiler only adds time), so that the parts sum to what the steps take
    unprofiled; the shares, which the forecasts read, stay as profiled. Returns the parts and
    the profiler's cost taken out (ms a step). Spread by time rather than by event, it leaves
    a category of many small operators a little over-stated, and never wipes one out."""
    profiled = sum(sum(p.values()) for p in steps) / len(steps)
    factor = min(1.0, plain_ms / profiled) if profiled > 0 else 1.0
    return [{c: v * factor for c, v in p.items()} for p in steps], profiled * (1 - factor)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


SYNC_SLACK_US = 50.0


def _linked(ev) -> bool:
    return bool(getattr(ev, "linked_correlation_id", 0))


def split_cuda(span, events, kernels) -> dict:
    """category -> ms of one profiled step on CUDA, from the device's timeline: kernel time by
    the category of the operator that launched it, idle time by what the host was doing."""
    s, e = _start(span), _end(span)
    nested = _nested(span, events)
    # A kernel's linked id is its launching operator's id. Runtime calls (linked ids > 0)
    # have ids of another counter: left out. Autograd runs a CUDA backward on a thread of its
    # own: its operators are looked up by name; the step's thread's by phase too.
    by_id = {ev.id: category(ev.name, None) for ev in events
             if not _linked(ev) and _start(ev) >= s and _end(ev) <= e}
    by_id.update({ev.id: cat for ev, cat, _ in nested if not _linked(ev)})
    parts = dict.fromkeys(CATEGORIES, 0.0)
    clipped = [(max(s, _start(k)), min(e, _end(k)), by_id.get(k.linked_correlation_id, "other"))
               for k in kernels if _end(k) > s and _start(k) < e]
    busy = _union([(a, b) for a, b, _ in clipped])
    busy_us = sum(b - a for a, b in busy)
    kernel_us = sum(b - a for a, b, _ in clipped)
    for a, b, cat in clipped:  # overlapping streams: each kernel's share of the busy time
        parts[cat] += (b - a) * busy_us / kernel_us / 1000 if kernel_us else 0.0
    data = [(_start(ev), _end(ev)) for ev, *_ in nested if ev.name == LABEL + "data"]
    sync_ends = sorted(_end(ev) for ev, *_ in nested if ev.name in SYNC_CALLS)
    edges = [s] + [x for ab in busy for x in ab] + [e]
    for g0, g1 in zip(edges[::2], edges[1::2]):  # the idle gaps between busy stretches
        if g1 <= g0:
            continue
        waited = _overlap(g0, g1, data)
        # a sync returns as the device drains: its end may stamp a little before the gap's
        after = [t for t in sync_ends if g0 - SYNC_SLACK_US <= t <= g1]
        synced = min(g1 - max(g0, after[0]), g1 - g0 - waited) if after else 0.0
        parts["data"] += waited / 1000
        parts["host_sync"] += max(0.0, synced) / 1000
        parts["python"] += (g1 - g0 - waited - max(0.0, synced)) / 1000
    return _exact(parts, (e - s) / 1000)


def split(events, device: torch.device, plain_ms: Optional[float] = None) -> Breakdown:
    """The profiled steps' parts (category -> ms), in step order. On the CPU, with `plain_ms`
    (the same model's unprofiled step), the profiler's own cost is taken out (without_overhead);
    on CUDA the device's timeline is the profiler's least disturbed clock and stays as is."""
    from torch.autograd import DeviceType

    cpu = [ev for ev in events if ev.device_type == DeviceType.CPU and not ev.is_async]
    spans = sorted((ev for ev in cpu if ev.name == STEP), key=_start)
    if device.type == "cuda" and torch.cuda.is_available():
        kernels = [ev for ev in events if ev.device_type == DeviceType.CUDA]
        return Breakdown([split_cuda(span, cpu, kernels) for span in spans])
    return cpu_breakdown([split_cpu(span, cpu) for span in spans], plain_ms)


def cpu_breakdown(steps: list[dict], plain_ms: Optional[float]) -> Breakdown:
    """Profiled CPU steps (category -> ms) as a Breakdown: with `plain_ms` (the same model's
    unprofiled step) the profiler's own cost taken out (without_overhead) and the unprofiled
    step kept (the forecasts' steadiness check, Breakdown.upper)."""
    if not steps or plain_ms is None or not math.isfinite(plain_ms):
        return Breakdown(steps)
    scaled, overhead = without_overhead(steps, plain_ms)
    return Breakdown(scaled, overhead_ms=overhead, plain_ms=plain_ms)


# --- profiling a trainer -------------------------------------------------------------------
class OutOfTime(Exception):
    """The budget ran out before a profile had a step."""


def profile_steps(trainer, device: torch.device, steps: int,
                  left_s: Optional[float] = None, plain_ms: Optional[float] = None
                  ) -> Breakdown:
    """`steps` steps of `trainer` under torch.profiler (CPU activity; CUDA's too on a GPU),
    each in a STEP span that ends with the device synchronised, the phases labelled; stops
    between steps once `left_s` seconds have passed (one step at least). `plain_ms`: an
    unprofiled step of the same trainer, to take the profiler's cost out (split). The
    techniques' counters of the window go with it (Breakdown.counters)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    clock, trainer.clock = trainer.clock, LabelClock()
    started = time.perf_counter()
    prof = profile(activities=activities)
    with kineto_quiet():
        prof.start()
    try:
        with techniques.profile_counters(trainer, trainer.ctx) as counters:
            for i in range(steps):
                if i and left_s is not None and time.perf_counter() - started >= left_s:
                    break
                with torch.profiler.record_function(STEP):
                    trainer.step()
                    synchronize(device)
    finally:
        trainer.clock = clock
        with kineto_quiet():
            prof.stop()
    parts = split(prof.events(), device, plain_ms)
    parts.counters = counters  # what the techniques' bounds may read (packing's padding)
    return parts


# libkineto's own log lines ("USDT:2026-12-03 13:24:12 23983:23983 SyncActivityProfilerHandler
# .cpp:39] profiler_start"), written straight to the process's stderr at each start and stop
KINETO_LINE = re.compile(
    rb"^(USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def kineto_quiet():
    """The profiler started or stopped without libkineto's log lines on the console: fd 2 goes
    to a file meanwhile (only around start and stop, never around a step, so that a watchdog's
    message is never held back) and every other line is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 to redirect: as it is
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [ln for ln in sink.read().splitlines(True) if not KINETO_LINE.match(ln)]
            if kept:
                sys.stderr.write(b"".join(kept).decode(errors="replace"))


def profile_recipe(spec, recipe, ctx, dataset, steps: int, left_s: Optional[float]
                   ) -> Breakdown:
    """A fresh model of `recipe`, warmed up as a trial is (until its steps are steady, within a
    quarter of bench.max_trial_s: warm_up_s), then
    `steps` profiled ones, within `left_s` seconds: checked between steps (OutOfTime before a
    profiled one), and a step still running BUDGET_GRACE_S past them is stopped
    (watchdog.StepOverrun)."""
    started = time.perf_counter()

    def left() -> Optional[float]:
        return None if left_s is None else left_s - (time.perf_counter() - started)

    guard = watchdog.deadline(None if left_s is None else left_s + BUDGET_GRACE_S,
                              f"model {spec.name}: profiled steps", BUDGET_LIMIT)
    b, once = recipe.bench, techniques.one_time_steps(recipe)
    with guard, applied(spec, recipe, ctx, dataset) as trainer:
        warm_up(trainer.step, ctx.device, max(WARMUP, b.warmup) + once,
                max(WARMUP, b.warmup, b.warmup_max) + once, b.steady_tol,
                budget_s=warm_up_s(b, left()))
        window = env.CpuWindow()  # others' share of the CPU meanwhile: a load (Breakdown.upper)
        plain_s, done = timed_steps(trainer.step, PLAIN_STEPS, ctx.device, budget_s=left())
        if left() is not None and left() <= 0:
            raise OutOfTime
        got = profile_steps(trainer, ctx.device, steps, left(), 1000 * plain_s / done)
        got.others_cpu = window.others()
        return got


def profile_on_rank(plan, spec, name: str, recipe, dataset, dist_env, budget,
                    steps: int) -> dict:
    """A launched profile's work on one rank (launch.launch_call): every rank runs the same
    steps, a fixed warm-up (its floor), PLAIN_STEPS and `steps` profiled, so that none waits
    on a peer that stopped early; the run's deadline stops the launch itself. {"profile":
    this rank's Breakdown}."""
    ctx, b = context(plan, dist_env), recipe.bench
    floor = max(WARMUP, b.warmup) + techniques.one_time_steps(recipe)
    with applied(spec, recipe, ctx, dataset,
                 sampler=rank_sampler(dataset, dist_env, b.seed)) as trainer:
        warm_up(trainer.step, ctx.device, floor, floor, None)
        window = env.CpuWindow()
        plain_s, done = timed_steps(trainer.step, PLAIN_STEPS, ctx.device)
        got = profile_steps(trainer, ctx.device, steps, None, 1000 * plain_s / done)
        got.others_cpu = window.others()
    return {"profile": got}


def warm_up_s(bench, left_s: Optional[float]) -> Optional[float]:
    """The profile's warm-up past its floor, held as a trial's is: a quarter of
    bench.max_trial_s (trial.timed_window), and what the budget leaves (`left_s`)."""
    cap = None if bench.max_trial_s is None else bench.max_trial_s / 4
    return min((s for s in (cap, left_s) if s is not None), default=None)


def seconds(step_s: float, steps: int, recipe) -> float:
    """A profile's wall time, estimated from a plain step's."""
    warm = max(WARMUP, recipe.bench.warmup) + 3 + techniques.one_time_steps(recipe)  # to steady
    return SETUP_S + step_s * (PROFILER_FACTOR * steps + warm + PLAIN_STEPS)


# --- a model's forecasts and paired profiles -----------------------------------------------
class Explainer:
    """The forecast (before a model's rounds) and the paired profile (after them) of one model
    of a plan; writes explain.csv and forecast.csv into `run_dir` (None: keeps the rows)."""

    def __init__(self, plan, spec, ctx, dataset, run_dir: Optional[Path], peaks: dict,
                 launched: Optional[Callable[..., "Breakdown | str"]] = None):
        self.plan, self.spec, self.ctx, self.dataset = plan, spec, ctx, dataset
        self.run_dir, self.peaks = run_dir, peaks
        # (name, steps, budget) -> the profile of a recipe over several processes (torchrun),
        # launched with profile_on_rank as each rank's work, or why there is none
        self.launched = launched
        self.base = plan.baseline
        self.explain_rows: list[dict] = []
        self.forecast_rows: list[dict] = []
        self.profile: Optional[Breakdown] = None  # the baseline's, behind the forecasts

    def _head(self, variant: str) -> dict:
        return {"experiment": self.plan.experiment, "model": self.spec.name,
                "variant": variant, "is_baseline": variant == self.base}

    def _profile(self, name: str, steps: int, budget, step_s: float) -> Breakdown | str:
        """A variant's profile, or the status saying why there is none."""
        recipe = self.plan.variants[name]
        if budget.over() or (math.isfinite(step_s) and budget.left() < seconds(step_s, 1, recipe)):
            return schema.format_status(schema.NOT_MEASURED, "the run's bench.time_budget_s "
                                        "had no time left for its profiled steps")
        try:
            if self.launched is not None and techniques.processes(recipe, self.ctx):
                return self.launched(name, steps, budget)  # its ranks, launched as its trials
            got = profile_recipe(self.spec, recipe, self.ctx, self.dataset, steps,
                                 budget.limit(None))
        except OutOfTime:
            return schema.format_status(schema.NOT_MEASURED, "the run's bench.time_budget_s "
                                        "ran out in its warm-up steps")
        except watchdog.StepOverrun:
            return schema.format_status(schema.NOT_MEASURED, "the run's bench.time_budget_s "
                                        "ran out in a profiled step")
        except Exception as exc:  # the measurement stands without its explanation
            return schema.format_status(schema.ERROR, f"profiling failed: "
                                        f"{type(exc).__name__}: {exc}"[:160])
        return got if got.steps else schema.format_status(
            schema.NOT_MEASURED, "no profiled step fitted in the run's bench.time_budget_s")

    def _rows(self, name: str, stage: str, got: Breakdown | str) -> list[dict]:
        head = {**self._head(name), "stage": stage,
                "per_step": batching(self.spec, self.plan.variants[name], self.ctx).per_step}
        if isinstance(got, str):
            return [{**head, "category": "", "status": got}]
        return [{**head, **row, "status": schema.OK} for row in got.rows()]

    def forecast(self, budget, step_s: float, skip: dict) -> dict:
        """The baseline's profiled steps, then each other variant's forecast: variant ->
        (technique, Bound or why none). `skip`: variants n/a or stopped (no forecast)."""
        got = self._profile(self.base, FORECAST_STEPS, budget, step_s)
        self._write_explain(self._rows(self.base, "forecast", got))
        out, rows = {}, []
        for name, recipe in self.plan.variants.items():
            if name == self.base:
                continue
            if isinstance(got, str):
                tech, bound = "", f"no forecast: the baseline's profile is {got}"
            elif name in skip:
                tech, bound = "", f"no forecast: {skip[name]}"
            else:
                tech, bound = techniques.forecast(recipe, self.plan.variants[self.base], got,
                                                  self.peaks)
            out[name] = (tech, bound)
            rows.append({**self._head(name), "technique": tech,
                         **({"forecast": bound.speedup, "share": bound.share,
                             "reason": bound.why, "status": schema.OK,
                             "is_bound": bound.sound}
                            if isinstance(bound, techniques.Bound) else {"status": bound})})
        if not isinstance(got, str):
            self.profile = got
        self.forecast_rows += rows
        if self.run_dir is not None and rows:
            atomic.append_rows(self.run_dir / "forecast.csv", schema.FORECAST_COLUMNS, rows)
        return out

    def paired(self, budget, measured: list[str], step_s: dict) -> None:
        """The baseline before, between and after the measured variants (base, v1, base, v2,
        base): their profiled steps, the baseline's profiles pooled, so that drift over the
        variants hits both sides of each comparison alike."""
        if not measured:
            return
        base_s = step_s.get(self.base, math.nan)
        kept = kept_profiles(self.base, measured)
        steps = paired_steps([step_s.get(n, math.nan) for n in kept],
                             [self.plan.variants[n] for n in kept], budget.left())
        bases = [self._profile(self.base, steps, budget, base_s)]
        rows = []
        for name in measured:
            got = self._profile(name, steps, budget, step_s.get(name, math.nan))
            rows += self._rows(name, "paired", got)
            bases.append(self._profile(self.base, steps, budget, base_s))
        done = [b for b in bases if isinstance(b, Breakdown)]
        pooled = Breakdown([s for b in done for s in b.steps],
                           sum(b.overhead_ms for b in done) / len(done)) if done else bases[0]
        self._write_explain(self._rows(self.base, "paired", pooled) + rows)

    def _write_explain(self, rows: list[dict]) -> None:
        self.explain_rows += rows
        if self.run_dir is not None and rows:
            atomic.append_rows(self.run_dir / "explain.csv", schema.EXPLAIN_COLUMNS, rows)


def kept_profiles(base: str, variants: list[str]) -> list[str]:
    """The paired profiles, in order, that the budget must hold: the baseline before each
    variant, and the variant (the baseline after the last one runs only when time is left:
    it guards against drift; the one before pairs with the variant)."""
    return [n for v in variants for n in (base, v)]


def paired_steps(step_s: list[float], recipes: list, left_s: float) -> int:
    """Profiled steps per paired profile: PAIRED_STEPS, or fewer (MIN_PAIRED_STEPS at least)
    where the profiles, at their estimated cost (`seconds`), would not fit in `left_s`: a
    coarser explanation of every comparison rather than none of the last ones."""
    known = [(s, r) for s, r in zip(step_s, recipes) if math.isfinite(s)]
    if not known or not math.isfinite(left_s):
        return PAIRED_STEPS
    for steps in range(PAIRED_STEPS, MIN_PAIRED_STEPS, -1):
        if sum(seconds(s, steps, r) for s, r in known) <= left_s:
            return steps
    return MIN_PAIRED_STEPS


def reserve_s(plan, variants: list[str], step_s: dict, left_s: float) -> float:
    """Seconds to keep back from a model's rounds for its paired profiles (kept_profiles),
    from their probes' steps; at most RESERVE_SHARE of `left_s`."""
    need = 0.0
    for name in kept_profiles(plan.baseline, variants):
        s = step_s.get(name, math.nan)
        if math.isfinite(s):
            need += seconds(s, PAIRED_STEPS, plan.variants[name])
    return min(need, RESERVE_SHARE * left_s) if math.isfinite(left_s) else need
