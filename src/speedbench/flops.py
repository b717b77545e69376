"""FLOPs per optimizer step, and the hardware limit they are compared with.

- `step_flops`: the FLOPs of one optimizer step (forward + backward of `accumulate`
  micro-batches), counted once with torch.utils.flop_counter.FlopCounterMode. It counts what
  that mode counts (matrix products, convolutions, attention), not elementwise work or the
  optimizer: the convention of MFU figures. The count depends on shapes only, so it is taken in
  fp32 whatever the variant's precision (a CPU runs fp16 far too slowly to count in it).
- `matmul_peak_tflops`: a peak measured on the spot, the best rate of a large square matrix
  product in the variant's dtype on the same device, timed between device synchronisations.
  The fraction achieved / peak says how close a step comes to what the device can do.
"""
from __future__ import annotations

import math
import time

import torch
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from speedbench import techniques as knobs  # knobs.py became speedbench/techniques/
from speedbench.config import ModelSpec
from speedbench.timing import synchronize
from speedbench.train import build_model, compute_loss

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def step_flops(spec: ModelSpec, recipe, device: torch.device, dataset, batch: int) -> float:
    """FLOPs of one optimizer step of `recipe` on `spec`; NaN when they cannot be counted."""
    try:
        with knobs.restored_global_state():
            model = build_model(spec, recipe.bench.seed).to(device)
            knobs.set_tensor_creation(model, recipe.tensor_creation)
            x, y = default_collate([dataset[i % len(dataset)] for i in range(batch)])
            x, y = x.to(device), y.to(device)
            with FlopCounterMode(display=False) as counter:
                compute_loss(model, spec.loss, x, y).backward()
            return float(counter.get_total_flops() * recipe.accumulate)
    except Exception:  # a model the counter cannot trace still gets its timings
        return math.nan
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


# Both layouts of the product: a CPU library may have a fast kernel for one only (fp16 linear,
# a @ b.T, runs several times faster than fp16 mm on an AVX-512 CPU); the peak is the faster.
PRODUCTS = (torch.mm, torch.nn.functional.linear)


def _rate(a: torch.Tensor, b: torch.Tensor, reps: int, device: torch.device,
          product=torch.mm) -> float:
    """FLOP/s of `reps` products of a and b timed as one window between two synchronisations."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        product(a, b)
    synchronize(device)
    return 2 * a.shape[0] ** 3 * reps / (time.perf_counter() - t0)


def _size(device: torch.device, dtype: torch.dtype, product, max_n: int,
          slow_s: float = 0.05) -> int:
    """The largest power-of-two size up to `max_n` at which `product` should take under `slow_s`
    (twice the size costs eight times as much), so a dtype the device runs slowly, fp16 on most
    CPUs, is measured in a fraction of a second."""
    n = 256
    while n < max_n:
        a = torch.randn(n, n, device=device, dtype=dtype)
        if max(_rate(a, a, 1, device, product) for _ in range(2)) < 8 * 2 * n ** 3 / slow_s:
            break
        n *= 2
    return n


def matmul_peak_tflops(device: torch.device, precision: str, duration_s: float = 0.2) -> float:
    """Best TFLOP/s of an n x n matrix product in `precision`'s dtype, either layout (n = 8192 on
    CUDA; elsewhere sized per layout, at most 2048): warm-up, then the fastest of several timed
    windows of back-to-back products. NaN on failure."""
    dtype = DTYPES[precision]
    best = 0.0
    try:
        for product in PRODUCTS:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                n = 8192 if free > 3 * 8192 ** 2 * 4 * 2 else 4096
            else:
                n = _size(device, dtype, product, max_n=2048)
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            first = _rate(a, b, 1, device, product)  # warm-up (heuristics, clocks); sizes windows
            reps = max(1, int(duration_s / 10 * first / (2 * n ** 3)))
            started = time.perf_counter()
            for _ in range(20):
                best = max(best, first, _rate(a, b, reps, device, product))
                if time.perf_counter() - started > duration_s / 2:
                    break
            del a, b
        return best / 1e12
    except Exception:
        return math.nan
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


class FlopsBook:
    """FLOPs per step and peaks, each measured once per run and shared by the trials."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flops: dict[tuple, float] = {}
        self.peaks: dict[str, float] = {}

    def step(self, spec: ModelSpec, recipe, dataset, batch: int) -> float:
        key = (spec.name, batch, recipe.accumulate)
        if key not in self.flops:
            self.flops[key] = step_flops(spec, recipe, self.device, dataset, batch)
        return self.flops[key]

    def peak(self, precision: str) -> float:
        if precision not in self.peaks:
            self.peaks[precision] = matmul_peak_tflops(self.device, precision)
        return self.peaks[precision]

    def annotate(self, record: dict, flops_per_step: float) -> dict:
        """Add flops_per_step, achieved_tflops and peak_tflops to a measured trial's record."""
        record["flops_per_step"] = flops_per_step
        if record.get("status") == "ok" and record.get("step_ms"):
            record["achieved_tflops"] = flops_per_step / (record["step_ms"] / 1000) / 1e12
            record["peak_tflops"] = self.peak(record["precision"])
        return record

