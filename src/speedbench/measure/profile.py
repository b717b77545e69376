"""The `profile` knob: where a step's time goes, and which speed tip would pay.

`profile=off` runs nothing here. Otherwise, once a trial's timed window is over (its
throughput, unprofiled, is what trials.csv reports), the same trainer runs more windows of
the same number of steps:

1. every mode, the *phase window*: a PhaseClock that synchronises the device at each phase
   end, so device work is charged to the phase that queued it. That changes the step (it
   removes all overlap), which is why it happens here and never in the timed window. Counters
   run alongside: the loop's host reads of the loss, per-step tensors born on the host,
   CUDA synchronisations inside forward/backward (counted with
   torch.cuda.set_sync_debug_mode), and each technique's own (Technique.profile_counters).
2. `advanced`: a window under cProfile, one profile per phase: cprofile.txt, cprofile_<phase>.prof.
3. `pytorch`: a window under torch.profiler (wait, warm-up, active): trace.json (Chrome /
   Perfetto), tensorboard/ (TensorBoard trace files), torch_ops.txt (key_averages by self
   time and by memory) and, on CUDA, a memory snapshot.
4. every mode, two unprofiled *reference windows*, one before and one after the others,
   so that drift (warm-up, other load) hits the reference as it hits the profiled windows;
   the timed window, first after warm-up, would not do. A profiled window's step time
   over the references' is that profiler's overhead, recorded per trial.
The measurements go back in the trial's record (`profile_data`, a diagnosis.TrialProfile);
after the run, diagnosis.py pools them into phases.csv and turns them into findings.csv.
"""
from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import shutil
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from speedbench import techniques
from speedbench.measure.diagnosis import TrialProfile
from speedbench.results import atomic
from speedbench.results.schema import PHASES
from speedbench.measure import batches
from speedbench.models.per_step import PerStepTensors
from speedbench.measure.timing import PhaseClock, synchronize, timed_steps

SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says
TORCH_WAIT, TORCH_WARMUP = 1, 1  # torch.profiler schedule; the active span is bench.steps
CPROFILE_ROWS = 25


def extra_steps(recipe) -> int:
    """Optimizer steps the profile windows add to one trial (to size the data set)."""
    n = recipe.bench.steps
    return {"off": 0, "simple": 3 * n, "advanced": 4 * n,
            "pytorch": 4 * n + TORCH_WAIT + TORCH_WARMUP}[recipe.profile]


# --- clocks for the profile windows ------------------------------------------------------------
class CountingClock(PhaseClock):
    """The phase window's clock: synchronises the device at every phase end and counts the
    synchronising CUDA calls each phase made itself (before that closing synchronisation)."""

    def __init__(self, device: torch.device, sync_log: Optional[list] = None):
        super().__init__(device, sync=True)
        self.sync_log = sync_log
        self.syncs: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        with super().__call__(phase):
            start = len(self.sync_log) if self.sync_log is not None else 0
            yield
            if self.sync_log is not None:
                self.syncs[phase] += sum(SYNC_WARNING in str(w.message)
                                         for w in self.sync_log[start:])


class CProfileClock:
    """One cProfile.Profile per phase, enabled only while that phase runs (main thread only:
    DataLoader workers are other processes)."""

    def __init__(self):
        self.profiles: dict[str, cProfile.Profile] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        prof = self.profiles.setdefault(phase, cProfile.Profile())
        prof.enable()
        try:
            yield
        finally:
            prof.disable()


class LabelClock:
    """Marks each phase in the torch.profiler trace (record_function), times nothing."""

    @contextlib.contextmanager
    def __call__(self, phase: str):
        with torch.profiler.record_function(f"speedbench.{phase}"):
            yield


# --- counters -------------------------------------------------------------------------------------
@contextlib.contextmanager
def cuda_sync_log(device: torch.device):
    """On CUDA, records a warning for every synchronising call (torch.cuda.set_sync_debug_mode);
    yields the list of warnings, or None elsewhere."""
    if device.type != "cuda":
        yield None
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield log
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def host_creations(model: nn.Module) -> int:
    return sum(m.host_creations for m in model.modules() if isinstance(m, PerStepTensors))


# --- the windows ---------------------------------------------------------------------------------
def _phase_window(trainer, device: torch.device, steps: int, budget_s: Optional[float],
                  tp: TrialProfile) -> float:
    """Times `steps` steps with the counting clock; fills tp; returns the window's seconds."""
    trainer.meter.reset()
    born = host_creations(trainer.model)
    with cuda_sync_log(device) as log, \
            techniques.profile_counters(trainer, trainer.ctx) as counters:
        clock = CountingClock(device, log)
        trainer.clock = clock
        elapsed, done = timed_steps(trainer.step, steps, device, budget_s=budget_s)
    tp.steps, tp.window_s = done, elapsed
    tp.phase_s = {p: clock.totals.get(p, 0.0) for p in PHASES}
    tp.host_reads = trainer.meter.host_reads
    tp.host_creations = host_creations(trainer.model) - born
    tp.counters = counters
    if log is not None:
        tp.cuda_syncs = sum(clock.syncs.values())
        tp.model_syncs = clock.syncs["forward"] + clock.syncs["backward"]
    return elapsed / done


def _cprofile_window(trainer, device: torch.device, steps: int, out: Optional[Path]) -> float:
    clock = CProfileClock()
    trainer.clock = clock
    elapsed, done = timed_steps(trainer.step, steps, device)
    if out is not None:
        _write_cprofile(clock.profiles, done, out)
    return elapsed / done


def _write_cprofile(profiles: dict[str, cProfile.Profile], steps: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = [f"cProfile per phase over {steps} optimizer steps (main process; functions sorted "
            f"by cumulative time, top {CPROFILE_ROWS}). Load a phase's .prof with "
            "`python -m pstats` or snakeviz.", ""]
    for phase in [p for p in PHASES if p in profiles] + [p for p in profiles if p not in PHASES]:
        buf = io.StringIO()
        stats = pstats.Stats(profiles[phase], stream=buf)
        stats.sort_stats("cumulative").print_stats(CPROFILE_ROWS)
        per_step_ms = 1000 * stats.total_tt / steps
        text += [f"=== phase {phase}: {per_step_ms:.2f} ms per step under cProfile ===",
                 buf.getvalue().strip(), ""]
        with atomic.naming(out / f"cprofile_{phase}.prof"):
            profiles[phase].dump_stats(out / f"cprofile_{phase}.prof")
    atomic.write_text(out / "cprofile.txt", "\n".join(text) + "\n")


def _torch_window(trainer, device: torch.device, steps: int, out: Optional[Path]) -> float:
    """torch.profiler over wait + warm-up + `steps` active steps; times the active ones."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ready = None if out is None else (lambda prof: _write_torch_outputs(prof, device, steps, out))
    trainer.clock = LabelClock()
    memory_history = out is not None and device.type == "cuda" \
        and hasattr(torch.cuda.memory, "_record_memory_history")
    plan = schedule(wait=TORCH_WAIT, warmup=TORCH_WARMUP, active=steps, repeat=1)
    if memory_history:  # allocator events for pytorch.org/memory_viz
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        with profile(activities=activities, record_shapes=True, profile_memory=True,
                     schedule=plan, on_trace_ready=ready) as prof:
            for _ in range(TORCH_WAIT + TORCH_WARMUP):
                trainer.step()
                prof.step()
            synchronize(device)
            t0 = time.perf_counter()
            for i in range(steps):
                trainer.step()
                if i < steps - 1:
                    prof.step()
            synchronize(device)
            elapsed = time.perf_counter() - t0
            prof.step()  # closes the active span: on_trace_ready writes the files, untimed
        if memory_history:
            torch.cuda.memory._dump_snapshot(str(out / "cuda_memory_snapshot.pickle"))
    finally:
        if memory_history:
            torch.cuda.memory._record_memory_history(enabled=None)
    return elapsed / steps


def _write_torch_outputs(prof, device: torch.device, steps: int, out: Path) -> None:
    from torch.profiler import tensorboard_trace_handler

    out.mkdir(parents=True, exist_ok=True)
    # A profile exports its trace once: TensorBoard's handler writes it, trace.json is a copy.
    with atomic.naming(out / "tensorboard"):
        tensorboard_trace_handler(str(out / "tensorboard"))(prof)
    written = max((out / "tensorboard").glob("*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
    with atomic.naming(out / "trace.json"):
        shutil.copyfile(written, out / "trace.json")
    on = "cuda" if device.type == "cuda" else "cpu"
    averages = prof.key_averages()
    atomic.write_text(
        out / "torch_ops.txt", f"torch.profiler, {steps} active steps (schedule: wait {TORCH_WAIT}, warm-up "
        f"{TORCH_WARMUP}), operators sorted by self {on.upper()} time\n"
        + averages.table(sort_by=f"self_{on}_time_total", row_limit=30)
        + f"\n\nOperators sorted by self {on.upper()} memory\n"
        + averages.table(sort_by=f"self_{on}_memory_usage", row_limit=15) + "\n")


def profile_trial(trainer, recipe, device: torch.device, steps: int,
                  out: Optional[Path] = None) -> dict:
    """Run the profile windows of one trial after its timed window (of `steps` steps).
    Writes profiler files into `out` when given. Returns the trial's extra record fields,
    with the raw measurements under `profile_data`."""
    budget = recipe.bench.max_trial_s
    if int(os.environ.get("RANK", "0")) != 0:
        out = None  # under torchrun, rank 0 alone writes
    tp = TrialProfile(mode=recipe.profile, device=device.type,
                      cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1,
                      settings=techniques.columns(recipe, trainer.ctx))
    if device.type == "cuda":
        tp.device_name = torch.cuda.get_device_name(device)
        tp.capability = torch.cuda.get_device_capability(device)
    clock = trainer.clock  # the timed window's: host clock only, as in the references
    try:
        before = timed_steps(trainer.step, steps, device, budget_s=budget and budget / 4)
        phase_s = _phase_window(trainer, device, before[1], budget and budget * 3 / 4, tp)
        profiled_s = phase_s
        if recipe.profile == "advanced":
            profiled_s = _cprofile_window(trainer, device, tp.steps, out)
        elif recipe.profile == "pytorch":
            profiled_s = _torch_window(trainer, device, tp.steps, out)
        trainer.clock = clock
        after = timed_steps(trainer.step, tp.steps, device)
        plain_s = (before[0] + after[0]) / (before[1] + after[1])
        batch = next(trainer.batches)  # what the loader really hands over
    finally:
        trainer.clock = clock
    tensors = batches.tensors(batch)
    tp.batch_pinned = all(t.is_pinned() for t in tensors)
    tp.batch_mb = sum(t.nbytes for t in tensors) * trainer.micro_steps / 2**20
    return {"profile": recipe.profile, "reference_step_ms": 1000 * plain_s,
            "phase_step_ms": 1000 * phase_s, "profiled_step_ms": 1000 * profiled_s,
            "profile_overhead": profiled_s / plain_s - 1, "profile_data": tp}
