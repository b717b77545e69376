"""FLOPs per optimizer step, and the hardware limit they are compared with.

- `step_flops`: the FLOPs of one optimizer step (forward + backward of each micro-batch),
  counted with torch.utils.flop_counter.FlopCounterMode inside the trial, on its model under
  the variant's settings (`reading`), once per run and recipe. It counts what
  that mode counts (matrix products, convolutions, attention), not elementwise work or the
  optimizer: the convention of MFU figures. torch's table misses the CPU attention kernel
  (`_scaled_dot_product_flash_attention_for_cpu` and its backward): CPU_ATTENTION adds them
  with torch's own SDPA formulas. The count depends on shapes only, so it is taken in fp32
  whatever the variant's precision (a CPU runs fp16 far too slowly to count in it).
- `matmul_peak_tflops`: a peak measured on the spot, the best rate of a large square matrix
  product in the variant's dtype on the same device, timed between device synchronisations, in
  windows repeated until the best three agree within PEAK_TOL (or PEAK_MAX_S runs out).
  FlopsBook measures it once per run and dtype and caches it; `bench.peak_s` bounds it per
  layout (0: not measured, the peak NaN), and the run's clock all of it (PEAK_SHARE of
  bench.time_budget_s: the peaks are a phase of the run like the others). It is a best window,
  for "% of peak".
- `paired_peak_ratio`: what precision's forecast uses instead of two such peaks: a 16-bit
  dtype's rate over fp32's in alternated windows (RATIO_PAIRS pairs), the median of the
  per-pair ratios, refused as unstable where they disagree beyond RATIO_TOL.
- On CUDA, fp32 work may run as TF32 (cuDNN convolutions by default, matrix products when
  torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision allow it), as the
  trial's own flags say. The fp32 peak is then measured with TF32 on as well, so like is
  compared with like; `peak_kind` says which ("fp32" or "tf32").
"""
from __future__ import annotations

import math
import warnings
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import default_collate
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from speedbench import distributed, techniques
from speedbench.config import ModelSpec
from speedbench.measure.batches import to_device
from speedbench.measure.data import loader_functions
from speedbench.measure.timing import synchronize
from speedbench.measure.train import compute_loss
from speedbench.results.schema import OK

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PEAK_TOL = 0.02  # the best three windows of the peak measurement agree within 2 %
PEAK_MAX_S = 1.5  # ...or the measurement stops after this long (per layout)
# The 16-bit / fp32 peak ratio behind precision's forecast: RATIO_PAIRS alternated windows of
# each dtype (fp32, 16-bit, 16-bit, fp32, ...), each about RATIO_WINDOW_S, one ratio per pair;
# the median of them, unless their middle spread (the second-lowest to the second-highest)
# exceeds RATIO_TOL of it: then the ratio is unstable and there is no forecast. Five
# consecutive single measurements under load read 3.35, 2.33, 17.5, 0.0089 and 355.
RATIO_PAIRS, RATIO_WINDOW_S, RATIO_TOL = 6, 0.05, 0.2
# of the run's budget (bench.time_budget_s), the most the matmul peaks take, every dtype and
# layout together: bench.peak_s per layout, or less where the budget is short
PEAK_SHARE = 0.05


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,
                       out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _cpu_attention() -> dict:
    """FlopCounterMode custom_mapping for the CPU SDPA kernels, where this torch has them."""
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward
    return out


CPU_ATTENTION = _cpu_attention()


def uses_tf32(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether this model's fp32 work may run as TF32 on `device` under the current settings:
    convolutions under cudnn.allow_tf32, matrix products under matmul.allow_tf32."""
    if device.type != "cuda":
        return False
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    return bool(torch.backends.cuda.matmul.allow_tf32
                or (has_conv and torch.backends.cudnn.allow_tf32))


def step_flops(model: torch.nn.Module, loss_kind: str, batch: tuple, micro_batches: int,
               device: torch.device, backward: bool = True) -> float:
    """FLOPs of one optimizer step: forward + backward (forward only without `backward`: an
    evaluation pass) of `micro_batches` micro-batches like `batch`, counted on `model` in eval
    mode (a model that recomputes activations in training would count them twice) and without
    autocast; NaN when they cannot be counted. The model's gradients are dropped afterwards."""
    was_training = model.training
    try:
        x, y = to_device(tuple(batch), device)
        model.eval()
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, \
                warnings.catch_warnings():
            # the counter's module tracker hooks every module globally; a compiled model warns
            # that they fire twice, which moves the per-module split only, not the total
            warnings.filterwarnings("ignore", message=".*global hooks on modules")
            loss = compute_loss(model, loss_kind, x, y)
            if backward:
                loss.backward()
        return float(counter.get_total_flops() * micro_batches)
    except Exception:  # a model the counter cannot trace still gets its timings
        return math.nan
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def first_samples(dataset, n: int) -> tuple:
    """The data set's first `n` samples (repeated if it is shorter) as one batch (collated as
    a user's DataLoader collates them)."""
    collate = loader_functions(dataset).get("collate_fn", default_collate)
    return tuple(collate([dataset[i % len(dataset)] for i in range(n)]))


def peak_kind(dtype: str, tf32: bool) -> str:
    """The peak a trial is compared with: its matmul dtype, or tf32 for fp32 run as TF32."""
    return "tf32" if tf32 and dtype == "fp32" else dtype


def reading(ctx, spec: ModelSpec, recipe, dataset, micro: int, micro_batches: int,
            book: "FlopsBook | None" = None) -> dict:
    """flops_per_step and peak_kind of a trial, read on its model (ctx.model) inside the trial,
    under the variant's own settings (its tensor creation, matmul precision, TF32 flags)."""
    def count() -> float:
        return step_flops(ctx.model, spec.loss, first_samples(dataset, micro), micro_batches,
                          ctx.device, backward=not techniques.forward_only(recipe))

    key = (spec.name, micro, OmegaConf.to_yaml(recipe))  # the count depends on every setting
    flops = book.count(key, count) if book is not None else count()
    tf32 = uses_tf32(ctx.model, ctx.device)
    return {"flops_per_step": flops,
            "peak_kind": peak_kind(techniques.matmul_dtype(recipe), tf32)}


# Both layouts of the product: a CPU library may have a fast kernel for one only (fp16 linear,
# a @ b.T, runs several times faster than fp16 mm on an AVX-512 CPU); the peak is the faster.
PRODUCTS = (torch.mm, torch.nn.functional.linear)


def _rate(a: torch.Tensor, b: torch.Tensor, reps: int, device: torch.device,
          product=torch.mm, until: float = math.inf) -> float:
    """FLOP/s of `reps` products of a and b timed as one window between two synchronisations;
    the window ends early once the clock (perf_counter) passes `until`: a window sized on a
    quiet moment must not run for minutes when a load arrives (2 threads beside a load of 10
    made each product ~100 times slower, and the peaks took 150 s of a 7 s share)."""
    synchronize(device)
    t0 = time.perf_counter()
    done = 0
    while done < reps:
        product(a, b)
        done += 1
        if time.perf_counter() > until:
            break
    synchronize(device)
    return 2 * a.shape[0] ** 3 * done / (time.perf_counter() - t0)


def _size(device: torch.device, dtype: torch.dtype, product, max_n: int,
          slow_s: float = 0.05, until: float = math.inf) -> int:
    """The largest power-of-two size up to `max_n` at which `product` should take under `slow_s`
    (twice the size costs eight times as much), so a dtype the device runs slowly, fp16 on most
    CPUs, is measured in a fraction of a second."""
    n = 256
    while n < max_n and time.perf_counter() < until:
        a = torch.randn(n, n, device=device, dtype=dtype)
        if max(_rate(a, a, 1, device, product) for _ in range(2)) < 8 * 2 * n ** 3 / slow_s:
            break
        n *= 2
    return n


def _stable_best(rate, max_s: float, tol: float = PEAK_TOL, min_windows: int = 5,
                 until: float = math.inf) -> float:
    """Best of repeated windows `rate()`: stops once the best three agree within `tol` (after
    `min_windows`), or after `max_s` seconds, or once the clock passes `until`."""
    rates: list[float] = []
    started = time.perf_counter()
    while True:
        rates.append(rate())
        top = sorted(rates)[-3:]
        if len(rates) >= min_windows and (top[-1] - top[0]) / top[-1] <= tol:
            break
        if time.perf_counter() - started > max_s or time.perf_counter() > until:
            break
    return max(rates)


def matmul_peak_tflops(device: torch.device, precision: str, duration_s: float = PEAK_MAX_S,
                       tf32: bool = False, products=PRODUCTS) -> float:
    """Best TFLOP/s of an n x n matrix product in `precision`'s dtype, either layout (n = 8192 on
    CUDA; elsewhere sized per layout, at most 2048): warm-up, then windows of back-to-back
    products (~0.1 s each) until the best three agree within PEAK_TOL, at most `duration_s`
    per layout, its sizing and warm-up included. `tf32`: fp32 products on CUDA may use TF32.
    NaN on failure."""
    dtype = DTYPES[precision]
    best = 0.0
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        for product in products:
            until = time.perf_counter() + duration_s
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                n = 8192 if free > 3 * 8192 ** 2 * 4 * 2 else 4096
            else:
                n = _size(device, dtype, product, max_n=2048, until=until)
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            first = max(_rate(a, b, 1, device, product) for _ in range(2))  # warm-up; sizing
            reps = max(1, int(0.1 * first / (2 * n ** 3)))
            best = max(best, first, _stable_best(
                lambda: _rate(a, b, reps, device, product, until), duration_s, until=until))
            del a, b
        return best / 1e12
    except Exception:
        return math.nan
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
        if device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class PeakRatio:
    """A dtype's matmul rate over fp32's from alternated windows: the median of the per-pair
    ratios (`ratio`), the ratios themselves, and why it is not to be used ("" where it is)."""

    ratio: float
    ratios: tuple[float, ...]
    unstable: str = ""


def paired_peak_ratio(device: torch.device, precision: str, pairs: int = RATIO_PAIRS,
                      window_s: float = RATIO_WINDOW_S, tol: float = RATIO_TOL,
                      max_s: float = math.inf, products=PRODUCTS) -> PeakRatio:
    """`precision`'s matrix-product rate over fp32's, measured in alternated windows of the
    same size and layout (each dtype's faster layout), so that a load that comes and goes
    hits both sides of a pair alike; unstable where the pairs disagree (RATIO_TOL). Within
    `max_s` (its sizing included): fewer pairs where the clock runs out."""
    until = time.perf_counter() + max_s
    try:
        n = min(_size(device, DTYPES[d], p, max_n=1024 if device.type == "cpu" else 4096,
                      until=until) for d in ("fp32", precision) for p in products)
        gen = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(n, n, device=device, generator=gen) for _ in range(2))
        sides = {}
        for d in ("fp32", precision):
            x, y = a.to(DTYPES[d]), b.to(DTYPES[d])
            product = max(products, key=lambda p: max(_rate(x, y, 1, device, p) for _ in range(2)))
            reps = max(1, int(window_s * _rate(x, y, 1, device, product) / (2 * n ** 3)))
            sides[d] = (x, y, reps, product)
        rates = {d: [] for d in sides}
        for k in range(pairs):
            if time.perf_counter() > until:
                break
            for d in (("fp32", precision) if k % 2 == 0 else (precision, "fp32")):
                x, y, reps, product = sides[d]
                rates[d].append(_rate(x, y, reps, device, product, until))
    except Exception as exc:  # the forecast goes without it
        return PeakRatio(math.nan, (), f"its measurement failed ({type(exc).__name__})")
    return judged_ratio([p / f for p, f in zip(rates[precision], rates["fp32"])], tol)


def judged_ratio(ratios: list[float], tol: float = RATIO_TOL) -> PeakRatio:
    """The median of the per-pair ratios, unstable where the middle of them (all but the lowest
    and the highest, from 4 pairs on) spreads over `tol` of it."""
    ordered = sorted(r for r in ratios if r > 0 and math.isfinite(r))
    if not ordered:
        return PeakRatio(math.nan, tuple(ratios), "no window measured")
    mid = ordered[1:-1] if len(ordered) >= 4 else ordered
    median = statistics.median(ordered)
    spread = (mid[-1] - mid[0]) / median
    why = "" if spread <= tol else (f"its {len(ordered)} alternated windows' ratios spread "
                                    f"{spread:.0%} (over {tol:.0%}): " +
                                    ", ".join(f"{r:.3g}" for r in ordered))
    return PeakRatio(median, tuple(ratios), why)


class FlopsBook:
    """FLOP counts and peaks, each measured once per run and shared by the trials.

    Call `measure_peaks(kinds)` at one fixed point of the run (before the first trial) so
    that every run measures its peaks in the same state of the machine."""

    def __init__(self, device: torch.device, peak_s: float = PEAK_MAX_S):
        self.device = device
        self.peak_s = peak_s
        self.counts: dict[tuple, float] = {}
        self.peaks: dict[str, float] = {}
        self.ratios: dict[str, PeakRatio] = {}  # 16-bit dtype -> its rate over fp32's

    def count(self, key: tuple, count: Callable[[], float]) -> float:
        """FLOPs per step under `key`, counted by `count()` the first time."""
        if key not in self.counts:
            self.counts[key] = count()
        return self.counts[key]

    def peak(self, kind: str, max_s: float | None = None) -> float:
        """The peak TFLOP/s of `kind` (a matmul dtype, or tf32), measured for bench.peak_s per
        layout, `max_s` at most (0: not measured, NaN)."""
        if kind not in self.peaks:
            extra = {"tf32": True} if kind == "tf32" else {}
            seconds = self.peak_s if max_s is None else min(self.peak_s, max_s)
            self.peaks[kind] = matmul_peak_tflops(
                self.device, "fp32" if extra else kind, duration_s=seconds,
                **extra) if seconds > 0 else math.nan  # bench.peak_s=0: not measured
        return self.peaks[kind]

    def measure_peaks(self, kinds, budget=None) -> None:
        """The peaks of `kinds` not measured yet, within PEAK_SHARE of `budget` (the run's
        clock, measure/budget.py; None: bench.peak_s each), and each 16-bit kind's paired ratio
        to fp32 (the forecasts')."""
        kinds = list(dict.fromkeys(kinds))
        new = [k for k in kinds if k not in self.peaks]
        ratios = [k for k in kinds if k in DTYPES and k != "fp32" and k not in self.ratios
                  and self.peak_s]
        share = None if budget is None or budget.seconds is None else budget.part(PEAK_SHARE)
        units = len(new) * len(PRODUCTS) + len(ratios)  # a ratio takes about a layout's time
        for i, kind in enumerate(new):
            self.peak(kind, None if share is None
                      else share.left() / (units - i * len(PRODUCTS)))
        for j, kind in enumerate(ratios):
            left = self.peak_s * len(PRODUCTS) if share is None \
                else share.left() / (len(ratios) - j)
            self.ratios[kind] = paired_peak_ratio(self.device, kind, max_s=left) if left > 0 \
                else PeakRatio(math.nan, (), "the run's budget left no time to measure it")

    def bound_inputs(self) -> dict:
        """What the techniques' bounds read (Technique.bound's `peaks`): kind -> TFLOP/s, and
        `ratios`: 16-bit kind -> PeakRatio."""
        return {**self.peaks, "ratios": dict(self.ratios)}

    def annotate(self, record: dict) -> dict:
        """Add achieved_tflops and peak_tflops to a measured trial with flops_per_step. A job
        of several ranks (world_size) is compared with the whole machine's peak: its
        flops_per_step is all ranks' (distributed.combine), and the peak is scaled to the
        machine where it was measured for one rank's share (`peak_units`)."""
        if record.get("status") == OK and record.get("step_ms") and record.get("peak_kind"):
            record["achieved_tflops"] = record["flops_per_step"] / (record["step_ms"] / 1000) / 1e12
            record["peak_tflops"] = self.peak(record["peak_kind"]) * self.peak_units(record)
        return record

    def peak_units(self, record: dict) -> int:
        """How many of the measured peak the job's ranks hold together: on CUDA one device
        per rank (the peak is one device's); on the CPU 1 where this process measured the
        peak with the whole machine (a launched trial's parent), the world size where it is
        itself one rank of the job (its share of the threads)."""
        world = int(record.get("world_size") or 1)
        if world <= 1:
            return 1
        if self.device.type != "cpu":
            return world
        return world if distributed.from_environ() is not None else 1
