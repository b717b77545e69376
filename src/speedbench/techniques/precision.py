"""Mixed precision: autocast the forward pass to fp16/bf16; scale the fp16 loss."""
from __future__ import annotations

import contextlib
import math
from typing import Literal, Optional

import torch

from speedbench.analysis.numbers import ratio_text
from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Finding, Technique,
                                        amdahl, percent, times)

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FP32_COMPUTE_SHARE = 0.30  # of the step in fp32 forward+backward on a GPU with tensor cores
# A Lightning Trainer's precision flag -> speedbench's (autocast, mixed: the weights stay fp32)
LIGHTNING_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16",
                       "16": "fp16", "bf16": "bf16"}
TIP = "train in mixed precision, so matrix work runs on the tensor cores"


class Precision(Technique):
    name = "precision"
    card = """\
**What**: runs the forward pass (and so its backward) under `torch.amp.autocast` in fp16 or
bf16; fp16 also scales the loss with `torch.amp.GradScaler` against gradient underflow.
**Helps**: on GPUs with tensor cores (compute capability 7.0+; bf16 from 8.0) and on CPUs
with bf16/AMX matrix units; 16-bit activations also take half the memory.
**Costs**: casts; fp16 on a CPU without fp16 units can be many times slower; fp16's narrow
range needs the scaler (bf16 has fp32's range and does not)."""
    fields = (Field("precision", Literal["fp32", "fp16", "bf16"], "fp32",
                    "the forward pass's autocast dtype; fp16 adds a GradScaler"),)
    example = {"precision": "bf16"}
    acts_on = ActsOn()  # bf16 autocast acts on a CPU
    snippets = {"precision": {
        "bf16": ("bf16 autocast (no loss scaling needed)", """\
device_type = "cuda" if x.is_cuda else "cpu"
with torch.autocast(device_type, dtype=torch.bfloat16):
    loss = loss_fn(model(x), y)
loss.backward()
opt.step(); opt.zero_grad(set_to_none=True)"""),
        "fp16": ("fp16 autocast with a GradScaler", """\
scaler = torch.amp.GradScaler("cuda")           # once, before the loop
with torch.autocast("cuda", dtype=torch.float16):
    loss = loss_fn(model(x), y)
scaler.scale(loss).backward()
scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)"""),
    }}

    def from_loop(self, loop: str, flags: dict) -> dict:
        """Lightning's `precision` ("bf16-mixed" -> bf16); TrainingArguments' `bf16`/`fp16`."""
        if loop == "lightning" and flags.get("precision") is not None:
            value = str(flags["precision"])
            if value not in LIGHTNING_PRECISION:
                raise ValueError(f"precision: {value!r} has no speedbench counterpart (its "
                                 "precision is mixed, autocast); choose one of "
                                 f"{', '.join(LIGHTNING_PRECISION)}")
            return {"precision": LIGHTNING_PRECISION[value]}
        if loop == "hf" and (flags.get("bf16") or flags.get("fp16")):
            if flags.get("bf16") and flags.get("fp16"):
                raise ValueError("bf16 and fp16: both true; choose one")
            return {"precision": "bf16" if flags.get("bf16") else "fp16"}
        return {}

    def step_context(self, recipe, ctx: Context):
        if recipe.precision == "fp32":
            return contextlib.nullcontext()
        return torch.amp.autocast(ctx.device.type, dtype=AUTOCAST_DTYPES[recipe.precision])

    def grad_scaler(self, recipe, ctx: Context):
        return torch.amp.GradScaler(ctx.device.type) if recipe.precision == "fp16" else None

    def matmul_dtype(self, recipe) -> str:
        return recipe.precision

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound | str]:
        """Amdahl on the matrix work: its share f of the fp32 step runs s times faster, s the
        16-bit / fp32 matmul rate ratio measured in alternated windows (flops.PeakRatio;
        without it, the two peaks'); 1/(1 - f (1 - 1/s)). Not an upper bound: autocast also
        runs element-wise ops (norms, activations, adds) in 16 bits, faster where they are
        memory-bound, which it leaves out; so it is marked (Bound.sound false) and sets nothing
        aside. No ratio (peaks not measured), no forecast; an unstable one: none, and why."""
        if baseline.precision != "fp32" or recipe.precision == "fp32":
            return None
        paired = (peaks.get("ratios") or {}).get(recipe.precision)
        if paired is not None and paired.unstable:
            return (f"n/a: the {recipe.precision}/fp32 matmul rate ratio was unstable, "
                    f"{paired.unstable}")
        s = paired.ratio if paired is not None else \
            peaks.get(recipe.precision, math.nan) / peaks.get("fp32", math.nan)
        if not s > 0:  # NaN: the peaks were not measured (bench.peak_s=0)
            return None
        f = profile.share("matmul")
        gain = amdahl(f, s)
        peak = ratio_text(s, spec=".2g")
        return Bound(gain, f, f"matmul/conv is {percent(f)} of the step and {recipe.precision} "
                              f"matrix products run at {peak} fp32's rate: from them alone "
                              f"{recipe.precision} would gain {times(gain)}; autocast also "
                              "runs element-wise ops in 16 bits, which this leaves out, so it "
                              "is no upper bound", sound=False)

    def diagnose(self, tp) -> list[Finding]:
        cores = tp.device == "cuda" and tp.capability is not None and tp.capability >= (7, 0)
        compute = tp.share("forward") + tp.share("backward")
        fp32 = tp.settings.get("precision") == "fp32"
        if not (cores and fp32 and compute >= FP32_COMPUTE_SHARE):
            return []
        # matmul_precision's column: "default" is PyTorch's, full fp32
        tf32 = "on" if tp.settings.get("matmul_precision") in ("high", "medium") else "off"
        major, minor = tp.capability
        return [Finding("fp32 matrix work on a GPU with tensor cores",
                        f"forward+backward take {100 * compute:.0f}% of the step in fp32 on "
                        f"{tp.device_name} (compute capability {major}.{minor}, TF32 "
                        f"matmuls {tf32})", TIP,
                        "precision=bf16" if major >= 8 else "precision=fp16")]
