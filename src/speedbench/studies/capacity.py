"""The largest micro-batch that fits in device memory: the other half of the accumulation story.

Gradient accumulation reaches an effective batch that does not fit in one step; this says where
"does not fit" begins on the device at hand. After a model's trials, batches double from the
model's own until one runs out of memory, then the gap between the largest that fitted and the
smallest that did not is halved until it is within 1/16 of the former. Each try is two optimizer
steps of a fresh model under the baseline's recipe (its global state and prepared model, with
one micro-batch per step on one device), on one real batch repeated to size on the device (the
loader is not what is measured here). The search ends early, with what it found,
after `bench.largest_batch_s` seconds or at `LIMIT_FACTOR` times the model's batch.

CUDA only: on a CPU the limit is host RAM and swap, and running past it brings the kernel's OOM
killer rather than an error to catch. The row says so instead.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import OmegaConf

from speedbench import results, techniques
from speedbench.results.schema import CAPACITY_LIMIT_FACTOR, OK, na
from speedbench.measure.batches import map_tensors
from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.measure.timing import device_peak_mb, reset_device_peak
from speedbench.techniques import Context

LIMIT_FACTOR = CAPACITY_LIMIT_FACTOR  # no search past this many times the model's batch


@dataclass
class Search:
    largest: int  # the largest batch that fitted (0: none did)
    first_oom: Optional[int]  # the smallest that ran out of memory (None: none did)
    tries: int
    stopped: str  # "resolved", "limit" (still fitting at the limit) or "time"


def search(fits: Callable[[int], bool], start: int, limit: int, budget_s: float,
           clock: Callable[[], float] = time.perf_counter) -> Search:
    """Double from `start` until `fits` says no, then bisect; bounded by `limit` and `budget_s`."""
    lo, hi, tries = 0, None, 0
    deadline = clock() + budget_s
    while True:
        if hi is None:
            b = start if lo == 0 else 2 * lo
            if b > limit:
                return Search(lo, hi, tries, "limit")
        else:
            if hi - lo <= max(1, lo // 16):
                return Search(lo, hi, tries, "resolved")
            b = (lo + hi) // 2
        if tries and clock() > deadline:
            return Search(lo, hi, tries, "time")
        tries += 1
        if fits(b):
            lo = b
        else:
            hi = b


def _grow(t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """`t` repeated along the batch dimension to `n` rows, made on the device."""
    t = t.to(device)
    reps = -(-n // t.shape[0])
    return t.repeat(reps, *[1] * (t.dim() - 1))[:n]


def _peak_at(spec, recipe, ctx: Context, sample: tuple, n: int) -> Optional[float]:
    """Peak MB of two optimizer steps at micro-batch n, the recipe applied (session.applied);
    None when it ran out of memory."""
    device = ctx.device
    try:
        batch = tuple(map_tensors(lambda t: _grow(t, n, device), part) for part in sample)
        with applied(spec, recipe, ctx, loader=[batch]) as trainer:
            reset_device_peak(device)
            trainer.step()
            trainer.step()
            torch.cuda.synchronize(device)
            return device_peak_mb(device)
    except torch.OutOfMemoryError:
        return None  # the frame, and every tensor it held, goes when this returns


def head(experiment: str, spec, variant: str) -> dict:
    """The identifying columns of a capacity.csv row (the variant names the settings)."""
    return {"experiment": experiment, "model": spec.name, "variant": variant}


def probe(experiment: str, spec, variant: str, recipe, device: torch.device, dataset) -> dict:
    """One row for capacity.csv: the largest micro-batch of `spec` that fits under `variant`'s
    recipe (one micro-batch per step, on one device: the techniques' capacity_overrides)."""
    row = head(experiment, spec, variant)
    if device.type != "cuda":
        return {**row, "status": na("the largest batch that fits is searched on CUDA only (on "
                                    "a CPU the limit is host RAM and swap, not an error to catch)")}
    recipe = OmegaConf.merge(recipe, techniques.capacity_overrides(recipe))
    ctx = Context(device=device)
    start = batching(spec, recipe, ctx).micro
    loader = torch.utils.data.DataLoader(dataset, batch_size=start)
    sample = tuple(next(iter(loader)))
    peaks: dict[int, float] = {}

    def fits(n: int) -> bool:
        peak = _peak_at(spec, recipe, ctx, sample, n)
        gc.collect()
        torch.cuda.empty_cache()  # the next try starts from an empty cache
        if peak is not None:
            peaks[n] = peak
        return peak is not None

    began = time.perf_counter()
    try:
        found = search(fits, start, LIMIT_FACTOR * start, recipe.bench.largest_batch_s)
    except NotApplicable as exc:
        return {**row, "status": str(exc)}
    except Exception as exc:  # a fault other than OOM: the row says it; the run goes on
        return {**row, "status": f"error: {type(exc).__name__}: {str(exc)[:160]}"}
    total = torch.cuda.get_device_properties(device).total_memory / 2**20
    return {**row, "status": OK if found.largest else "oom", "largest_batch": found.largest,
            "first_oom": found.first_oom, "peak_mem_mb": peaks.get(found.largest),
            "device_mem_mb": total, "tries": found.tries,
            "search_s": time.perf_counter() - began, "stopped": found.stopped}


def append(path: Path, row: dict) -> None:
    """One row appended to capacity.csv (made with its header if new), by the run directory's
    writer."""
    results.append_capacity(path, row)


def largest_batch(mc, dataset) -> None:
    """The largest-batch phase of a model's study: capacity.csv's row for the model's baseline
    (bench.find_largest_batch)."""
    plan, spec = mc.plan, mc.spec
    mc.doing(f"{spec.name}: largest batch that fits")
    if mc.dist_env is None:
        row = probe(plan.experiment, spec, plan.baseline, plan.variants[plan.baseline],
                    torch.device(plan.device), dataset)
    else:  # every rank would search its own device, and time it differently
        row = {**head(plan.experiment, spec, plan.baseline),
               "status": na("the largest batch that fits is searched without torchrun")}
    append(mc.run_dir / "capacity.csv", row)
