"""AdamW's implementation: a Python for-loop over parameters, foreach (multi-tensor) or fused.

PyTorch's default (`default` here) picks foreach when every parameter is on a device with
foreach kernels (CUDA), else the for-loop (CPU). `foreach` on a CPU runs torch's multi-tensor
code path over the per-tensor CPU kernels; `fused` is one kernel per parameter group, which
torch has for CUDA and, since 2.4, for the CPU.
"""
from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Technique, amdahl,
                                        percent, times)

# TrainingArguments' `optim` -> the implementation of torch's AdamW it names
HF_OPTIM = {"adamw_torch": "default", "adamw_torch_fused": "fused"}
IMPL_OPTIONS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
                "fused": {"fused": True}}


def fused_unsupported(device: torch.device) -> Optional[str]:
    """Why torch's fused AdamW refuses this device, or None (asked of torch, not assumed)."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


class Optimizer(Technique):
    name = "optimizer"
    card = """\
**What**: how AdamW updates the parameters: `for-loop` (one small kernel per tensor per
operation), `foreach` (`_foreach_*` multi-tensor ops: fewer launches), `fused` (one fused
kernel for the whole update). `default` is PyTorch's choice (foreach on CUDA, for-loop on CPU).
**Helps**: models with many small parameter tensors, where the optimizer step is bound by
kernel launches; the GPU gains most.
**Costs**: foreach holds intermediates for all tensors at once (more peak memory); fused needs
a device torch has the kernel for."""
    fields = (Field("optimizer.impl", Literal[tuple(IMPL_OPTIONS)], "default",
                    "AdamW's implementation; default: PyTorch's choice"),)
    example = {"optimizer.impl": "fused"}
    acts_on = ActsOn()  # fused AdamW has a CPU kernel since torch 2.4
    snippets = {"optimizer.impl": {
        value: (f"{value} optimizer kernels",
                f"opt = torch.optim.AdamW(model.parameters(), lr=lr, {value}=True)")
        for value in ("foreach", "fused")}}
    extra_columns = ("optimizer_ms",)

    def from_loop(self, loop: str, flags: dict) -> dict:
        """TrainingArguments' `optim`: torch's AdamW, by its implementation."""
        if loop != "hf" or flags.get("optim") is None:
            return {}
        optim = str(flags["optim"])
        if optim not in HF_OPTIM:
            raise ValueError(f"optim: {optim!r}: speedbench trains with torch's AdamW, so yours "
                             f"would not be the one measured; choose {' or '.join(HF_OPTIM)}")
        return {"optimizer.impl": HF_OPTIM[optim]}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.optimizer.impl == "fused":
            reason = fused_unsupported(ctx.device)
            if reason:
                return f"n/a: torch has no fused AdamW for {ctx.device.type} ({reason})"
        return None

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        """Another implementation can at most remove the optimizer step's time."""
        share = profile.share("optimizer")
        gain = amdahl(share)
        return Bound(gain, share, f"the optimizer step is {percent(share)} of the step: "
                                  f"{recipe.optimizer.impl} cannot gain more than {times(gain)}")

    def optimizer_options(self, opts: dict, recipe, ctx: Context) -> dict:
        return {**opts, **IMPL_OPTIONS[recipe.optimizer.impl]}

    def columns(self, recipe, ctx: Context) -> dict:
        """optimizer_ms: host time per optimizer phase (step + zero_grad) in the timed window;
        on CUDA it is the launch time, the device runs asynchronously."""
        ms = math.nan
        clock = getattr(ctx.trainer, "clock", None)
        if clock is not None and getattr(clock, "counts", {}).get("optimizer"):
            ms = 1000 * clock.totals["optimizer"] / clock.counts["optimizer"]
        return {**super().columns(recipe, ctx), "optimizer_ms": ms}
