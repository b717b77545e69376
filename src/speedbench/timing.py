"""Clocks that respect device asynchrony, a per-phase host clock, and a memory sampler.

The throughput window is synchronised at its two ends only: synchronising every step would
erase the very effects of the sync-point and non_blocking knobs.
"""
from __future__ import annotations

import math
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


class NullClock:
    """Stand-in when no phase timing is wanted (a bare loop, a benchmark)."""

    @contextmanager
    def __call__(self, phase: str):
        yield


def timed_steps(step: Callable[[], None], max_steps: int, device: torch.device,
                budget_s: Optional[float] = None, min_steps: int = 1,
                agree: Optional[Callable[[bool], bool]] = None) -> tuple[float, int]:
    """Run up to `max_steps` steps between two device synchronisations; (seconds, steps).

    The budget is checked on the host clock between steps, without synchronising: a
    slow variant (fp16 on a CPU, say) stops early and its throughput is still exact.
    `agree` turns this process's "over budget" into the decision of all ranks (DDP).
    """
    synchronize(device)
    t0 = time.perf_counter()
    n = 0
    while n < max_steps:
        step()
        n += 1
        over = budget_s is not None and n >= min_steps and time.perf_counter() - t0 > budget_s
        if agree is not None:
            over = agree(over)
        if over:
            break
    synchronize(device)
    return time.perf_counter() - t0, n


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

    The rule: run at least `min_steps`; then stop as soon as the last STEADY_WINDOW step times
    agree within `tol` (is_steady); never more than `max_steps`, and stop once `budget_s` has
    passed. Each warm-up step is timed between device synchronisations (warm-up is not
    measured, so these syncs cost nothing that counts). `tol` None or `min_steps` 0: exactly
    `min_steps` steps, steady state assumed rather than detected.
    """
    if min_steps == 0:
        return 0, None
    if tol is None:
        return timed_steps(step, min_steps, device, budget_s)[1], None
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
        if budget_s is not None and time.perf_counter() - started > budget_s:
            break
    return len(times), False


class PeakRss:
    """Peak resident memory (MB) of this process and of its child processes (DataLoader
    workers), sampled on a background thread while the block runs.

    The thread must stay light (benchmarks/ measures it): finding the children scans every
    process on the machine, so the list is refreshed only every `rescan_s`; reading the known
    processes' RSS is cheap and done every `interval_s`.
    """

    def __init__(self, interval_s: float = 0.05, rescan_s: float = 1.0):
        import psutil

        self.proc = psutil.Process()
        self.interval, self.rescan_s = interval_s, rescan_s
        self.start_mb = self.main_mb = self.total_mb = 0.0
        self._stop = threading.Event()
        self._children: list = []
        self._scanned = -math.inf

    def sample(self, rescan: bool = False) -> None:
        import psutil

        main = self.proc.memory_info().rss
        if rescan or time.monotonic() - self._scanned > self.rescan_s:
            self._children = self.proc.children(recursive=True)
            self._scanned = time.monotonic()
        children = 0
        for child in self._children:
            try:
                children += child.memory_info().rss
            except psutil.Error:
                pass  # a worker that just exited
        self.main_mb = max(self.main_mb, main / 2**20)
        self.total_mb = max(self.total_mb, (main + children) / 2**20)

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
