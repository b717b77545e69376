"""Clocks that respect device asynchrony, a per-phase host clock, and a memory sampler.

The throughput window is synchronised at its two ends only: synchronising every step would
erase the very effects of the sync-point and non_blocking knobs. Each of its steps is still
timed (StepTimes, without synchronising) so that a stalled window can be flagged (stall_ms).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Optional

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class PhaseClock:
    """Host time spent per phase of a step (data wait, forward, ...).

    With `sync=False` (the default) it only reads the host clock, which is right for the data
    wait and costs about a microsecond. With `sync=True` it synchronises the device at each
    phase end so device work is attributed to its phase: profiling only, it changes timing.
    """

    def __init__(self, device: torch.device, sync: bool = False):
        self.device, self.sync = device, sync
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                synchronize(self.device)
            self.totals[phase] += time.perf_counter() - t0
            self.counts[phase] += 1

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()

    @contextmanager
    def paused(self):
        """Steps run inside leave the totals as they were (the untimed steps after a window:
        the memory step, the profile windows), so that the totals stay the window's."""
        totals, counts = dict(self.totals), dict(self.counts)
        try:
            yield
        finally:
            self.totals.clear()
            self.totals.update(totals)
            self.counts.clear()
            self.counts.update(counts)


class NullClock:
    """Stand-in when no phase timing is wanted (a bare loop, a benchmark)."""

    @contextmanager
    def __call__(self, phase: str):
        yield


class StepTimes:
    """Each step's duration in a timed window, taken without synchronising (timed_steps'
    `step_times`), for stall_ms.

    On the CPU the host clock times each step: one time.perf_counter() per step. On CUDA the
    host runs ahead of the device and waits for it only at a host read (the loss every
    sync_every steps), so a step's host time is not what it cost: a CUDA event recorded after
    each step (no synchronisation, a few microseconds of host time) times the device's own
    timeline instead, idle gaps (a paused host) included. Other devices: not measured."""

    def __init__(self, device: torch.device, steps: int):
        self.device, self.host = device, []
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] \
            if device.type == "cuda" else None
        self.stream = None

    def start(self) -> None:
        if self.events:
            self.stream = torch.cuda.current_stream(self.device)
            self.events[0].record(self.stream)

    def add(self, seconds: float) -> None:
        self.host.append(seconds)
        if self.events is not None and len(self.host) < len(self.events):
            self.events[len(self.host)].record(self.stream)

    def seconds(self) -> Optional[list[float]]:
        """The steps' durations (s), once the window has ended; None where not measured."""
        if self.device.type == "cpu":
            return list(self.host)
        if not self.events:
            return None
        marks = self.events[:len(self.host) + 1]
        try:
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        except RuntimeError:  # an event not recorded: no figure rather than a wrong one
            return None


def timed_steps(step: Callable[[], None], max_steps: int, device: torch.device,
                budget_s: Optional[float] = None, min_steps: int = 1,
                agree: Optional[Callable[[bool], bool]] = None,
                step_times: Optional[StepTimes] = None) -> tuple[float, int]:
    """Run up to `max_steps` steps between two device synchronisations; (seconds, steps).

    The budget is checked on the host clock between steps, without synchronising: a
    slow variant (fp16 on a CPU, say) stops early and its throughput is still exact.
    `agree` turns this process's "over budget" into the decision of all ranks (DDP).
    `step_times` gets each step's time (StepTimes: no synchronisation either).
    """
    synchronize(device)
    if step_times is not None:
        step_times.start()
    t0 = last = time.perf_counter()
    n = 0
    while n < max_steps:
        step()
        n += 1
        now = time.perf_counter()
        if step_times is not None:
            step_times.add(now - last)
        last = now
        over = budget_s is not None and n >= min_steps and now - t0 > budget_s
        if agree is not None:
            over = agree(over)
        if over:
            break
    synchronize(device)
    return time.perf_counter() - t0, n


# A stalled window: its longest step took over STALL_FACTOR times its median step.
STALL_FACTOR = 5
STALL_MIN_STEPS = 3  # fewer steps have no median to stand out from


def stall_ms(step_s: Optional[list[float]]) -> float:
    """The window's stall, in ms: its longest step's excess over the window's median step,
    when that step took over STALL_FACTOR x the median (a pause of the process or the
    machine, far outside the trial's own distribution); else 0. `step_s`: each step's time
    (StepTimes.seconds()); NaN where they were not measured."""
    if step_s is None:
        return math.nan
    if len(step_s) < STALL_MIN_STEPS:
        return 0.0
    median, longest = statistics.median(step_s), max(step_s)
    return 1000 * (longest - median) if longest > STALL_FACTOR * median else 0.0


# A step over this many times its window's median is a stall, left out of the typical step.
TYPICAL_CUT = 3


def typical_step_s(step_s: list[float]) -> float:
    """A trial's step time: the mean of its steps, those over TYPICAL_CUT x the window's median
    left out (a stall). Chosen on per-step times of the three reference models, speedbench's
    trials and a bare loop side by side (benchmarks/step_noise.py): as sharp as the window's
    mean where nothing stalls (the ResNet, the VAE) and sharper than it where a step stalls
    (the transformer: the paired speed-up's per-round sd 0.286 against 0.327 on 5-step
    windows), where a median loses 10 % on the VAE. The window's mean is kept beside it
    (window_samples_per_s): a technique whose stalls recur shows there."""
    cut = TYPICAL_CUT * statistics.median(step_s)
    return statistics.fmean([s for s in step_s if s <= cut])


STEADY_WINDOW = 3  # warm-up step times compared by the steady-state rule


def is_steady(step_times: list[float], tol: float, window: int = STEADY_WINDOW) -> bool:
    """The last `window` step times agree within `tol`: (max - min) / median <= tol."""
    if len(step_times) < window:
        return False
    last = sorted(step_times[-window:])
    median = last[len(last) // 2]
    return median > 0 and (last[-1] - last[0]) / median <= tol


def warm_up(step: Callable[[], None], device: torch.device, min_steps: int, max_steps: int,
            tol: Optional[float], budget_s: Optional[float] = None) -> tuple[int, Optional[bool]]:
    """Warm up until the step time is steady; (steps run, steady: True/False, None if unchecked).

    The rule: run at least `min_steps` (a floor: the budget never cuts it); then stop as soon
    as the last STEADY_WINDOW step times agree within `tol` (is_steady); never more than
    `max_steps`, and stop once `budget_s` has passed. Each warm-up step is timed between
    device synchronisations (warm-up is not
    measured, so these syncs cost nothing that counts). `tol` None or `min_steps` 0: exactly
    `min_steps` steps, steady state assumed rather than detected.
    """
    if min_steps == 0:
        return 0, None
    if tol is None:  # exactly min_steps: no budget cuts below the floor
        return timed_steps(step, min_steps, device)[1], None
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < max_steps:
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= min_steps and is_steady(times, tol):
            return len(times), True
        # bench.warmup is a floor: the budget only cuts the steps beyond it
        if budget_s is not None and len(times) >= min_steps \
                and time.perf_counter() - started > budget_s:
            break
    return len(times), False


def unique_mb(processes) -> Optional[float]:
    """Memory only these processes hold (their USS summed: pages no other process maps), in
    MB; None when it cannot be read on this platform."""
    import psutil

    total, got = 0, False
    for p in processes:
        try:
            total, got = total + p.memory_full_info().uss, True
        except (psutil.Error, OSError, AttributeError):
            continue  # a worker that just exited, or no USS here
    return total / 2**20 if got else None


class PeakRss:
    """Peak resident memory (MB) of this process (`main_mb`, RSS) and of it with its child
    processes (DataLoader workers: `total_mb`), sampled on a background thread while the
    block runs.

    A forked worker shares copy-on-write pages with the main process, so summing RSS counts
    them once per process. What the workers add is the memory only they hold: `total_mb` is
    the main process's RSS plus the workers' USS (see unique_mb), or their RSS where USS
    cannot be read (an upper bound). Both terms are in the same unit (resident pages), so
    the total is never below the main process alone.

    The thread must stay light (benchmarks/ measures it): finding the children scans every
    process on the machine and USS walks /proc/<pid>/smaps, so both are refreshed only every
    `rescan_s`; reading the main process's RSS is cheap and done every `interval_s`.
    """

    def __init__(self, interval_s: float = 0.05, rescan_s: float = 1.0):
        import psutil

        self.proc = psutil.Process()
        self.interval, self.rescan_s = interval_s, rescan_s
        self.start_mb = self.main_mb = self.total_mb = 0.0
        self._stop = threading.Event()
        self._children_mb = 0.0
        self._scanned = -math.inf

    def _workers_mb(self) -> float:
        import psutil

        children = self.proc.children(recursive=True)
        unique = unique_mb(children)
        if unique is not None or not children:
            return unique or 0.0
        rss = 0
        for child in children:
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass  # a worker that just exited
        return rss / 2**20

    def sample(self, rescan: bool = False) -> None:
        main = self.proc.memory_info().rss / 2**20
        if rescan or time.monotonic() - self._scanned > self.rescan_s:
            self._children_mb = self._workers_mb()
            self._scanned = time.monotonic()
        self.main_mb = max(self.main_mb, main)
        self.total_mb = max(self.total_mb, main + self._children_mb)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample(rescan=True)
        self.start_mb = self.main_mb
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample(rescan=True)
        return False


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_mb(device: torch.device) -> Optional[float]:
    """Peak memory allocated on the accelerator since the last reset; None on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 2**20
    return None


@contextmanager
def settled_heap():
    """What is alive before the first trial (modules, the config, the data's code) is nobody's
    garbage: gc.freeze moves it out of the collector's sight while the run measures, so that a
    trial's gc.collect (release_host_memory) walks only what the trials made. With torch,
    Hydra and matplotlib loaded that is ~400,000 objects and 0.2 s a trial on a laptop CPU."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # in a process that goes on (a test), collected as before


def release_host_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so that a trial's resident
    memory growth measures that trial rather than what earlier trials left cached."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: growth is then a lower bound


# ---- memory of the tensors a training step allocates -------------------------------------------

def _storages(tree) -> list:
    from torch.utils._pytree import tree_flatten

    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class TensorMemory:
    """Live and peak bytes of the tensors torch allocates while the block runs (a
    TorchDispatchMode: every op's new output storage is counted until it is freed), and which
    storages were alive at the peak (`peak_storages`: serial -> bytes; `serial` names a storage
    whatever address it had).

    `preexisting` tensors (parameters, gradients, optimizer state) are counted from the start,
    and their release (gradients set to None) is seen too. While `ignoring` is set, new
    storages are not counted (the loader making a batch: a DataLoader worker's batch cannot be
    seen, so no variant's is counted). `phase` names the part of the step running now, and
    `peak_phase` the part the peak fell in. The mode slows every op: use it on an untimed
    step, never in the timed window.
    """

    def __init__(self, preexisting=()):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if tracker.ignoring:
                    return out
                inputs = {st.data_ptr() for st in _storages((args, kwargs))}
                for st in _storages(out):
                    if st.data_ptr() not in inputs:  # in-place and view outputs are not new
                        tracker._add(st)
                return out

        self.live = self.peak = 0
        self.phase, self.peak_phase, self.ignoring = None, None, False
        self.peak_storages: dict[int, int] = {}
        self._seen: dict[int, tuple[int, int]] = {}  # address -> (serial, bytes), while alive
        self._serials = 0
        self._mode = _Mode()
        for st in _storages(list(preexisting)):
            self._add(st)

    def _add(self, storage) -> None:
        import weakref

        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self._seen or storage.device.type == "meta":
            return
        self._serials += 1
        self._seen[key] = (self._serials, n)
        self.live += n
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase
            self.peak_storages = dict(self._seen.values())
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if self._seen.pop(key, None) is not None:
            self.live -= n

    def serials(self, tensors) -> set[int]:
        """The serials of these tensors' storages (those counted)."""
        found = (self._seen.get(st.data_ptr()) for st in _storages(list(tensors)))
        return {got[0] for got in found if got is not None}

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class PhaseMarks:
    """A phase clock (the trainer's `clock`) that tells a TensorMemory which phase of the step
    runs, has it ignore the loader's batch (the "data" phase), and calls `on_enter(phase)` as
    each phase begins."""

    def __init__(self, tracker: TensorMemory, inner, on_enter: Callable[[str], None]):
        self.tracker, self.inner, self.on_enter = tracker, inner, on_enter

    @contextmanager
    def __call__(self, phase: str):
        before = self.tracker.phase
        self.tracker.phase, self.tracker.ignoring = phase, phase == "data"
        self.on_enter(phase)
        try:
            with self.inner(phase):
                yield
        finally:
            self.tracker.phase, self.tracker.ignoring = before, False


def optimizer_state(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def state_tensors(model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """Parameters, their gradients, and the optimizer's state tensors."""
    return list(model.parameters()) + gradients(model) + optimizer_state(optimizer)


def storage_mb(tensors) -> float:
    """MB held by these tensors' storages, each storage once."""
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in tensors if t.device.type != "meta"}
    return sum(sizes.values()) / 2**20


def state_mb(model: torch.nn.Module, optimizer=None) -> float:
    """MB held by parameters + gradients + optimizer state (each storage once)."""
    return storage_mb(state_tensors(model, optimizer))


MEMORY_COLUMNS = ("peak_mem_mb", "state_mem_mb", "params_mem_mb", "grads_mem_mb",
                  "opt_state_mem_mb", "activation_mem_mb")


def step_memory(trainer, device: torch.device) -> dict:
    """Peak tensor memory of one optimizer step of `trainer` (its step(), model, optimizer and
    phase clock), and what it holds (MB):

    - `peak_mem_mb`: the peak; `peak_phase`: the phase of the step it falls in (forward,
      backward, optimizer, ...);
    - at the peak: `params_mem_mb`, `grads_mem_mb` (gradients alive then), `opt_state_mem_mb`
      (the optimizer's state) and `activation_mem_mb`, the rest: activations saved for
      backward, autocast copies, temporaries (the optimizer's, when the peak falls in its
      step);
    - `state_mem_mb`: parameters + gradients + optimizer state when all are alive, right after
      the optimizer's step and before zero_grad frees the gradients.

    The batch the loader delivers is never counted (a DataLoader worker's cannot be seen);
    its copy to an accelerator is. CPU: counted by TensorMemory during the step (untimed: it
    slows each op). CUDA: the peak is the caching allocator's (torch.cuda.max_memory_allocated)
    over the step, less what was allocated before it besides the state; the split is
    TensorMemory's, activations taking what the allocator saw beyond it. Other devices: NaN.
    """
    if device.type not in ("cpu", "cuda"):
        return dict.fromkeys(MEMORY_COLUMNS, math.nan)
    model, optimizer = trainer.model, trainer.optimizer
    synchronize(device)
    other = torch.cuda.memory_allocated(device) / 2**20 - state_mb(model, optimizer) \
        if device.type == "cuda" else 0.0
    reset_device_peak(device)
    tracker, state = _tracked_step(trainer)
    synchronize(device)
    peak = tracker.peak / 2**20
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20 - max(other, 0.0)

    def held(tensors_or_serials) -> float:  # MB of these storages alive at the peak
        serials = tensors_or_serials if isinstance(tensors_or_serials, set) \
            else tracker.serials(tensors_or_serials)
        return sum(tracker.peak_storages.get(s, 0) for s in serials) / 2**20

    split = {"params_mem_mb": held(list(model.parameters())),
             "grads_mem_mb": held(state.get("grads", set())),
             "opt_state_mem_mb": held(optimizer_state(optimizer))}
    return {"peak_mem_mb": peak, "state_mem_mb": state.get("mb", math.nan), **split,
            "activation_mem_mb": max(peak - sum(split.values()), 0.0),
            "peak_phase": tracker.peak_phase or ""}


def _tracked_step(trainer) -> tuple[TensorMemory, dict]:
    """One step of `trainer` under a TensorMemory that knows its phases; with the state's MB
    (`mb`) and the gradients' serials (`grads`) taken while the gradients are alive."""
    model, optimizer, state = trainer.model, trainer.optimizer, {}
    tracker = TensorMemory(state_tensors(model, optimizer))

    def take_state(*_):  # before zero_grad(set_to_none=True) frees the gradients
        state["mb"] = state_mb(model, optimizer)
        state["grads"] = tracker.serials(gradients(model))

    def on_enter(phase: str) -> None:  # also where the optimizer skips its step (inf grads)
        if phase == "optimizer":
            take_state()

    hook = optimizer.register_step_post_hook(take_state)  # a first step makes its state
    clock = trainer.clock
    try:
        trainer.clock = PhaseMarks(tracker, clock, on_enter)
        with tracker:
            trainer.step()
    finally:
        trainer.clock = clock
        hook.remove()
    return tracker, state
