"""Fused linear cross-entropy (Liger): the LM head's matmul and the cross-entropy in one Triton
kernel over chunks of tokens, so the B x T x V logits are never made, in forward or backward.

Written against liger-kernel's README and its `LigerFusedLinearCrossEntropyLoss` (forward:
lin_weight, input, target, bias); the model opts in with a `fused_loss` switch (the reference
transformer has one). Triton kernels need a GPU (CUDA or ROCm): n/a on a CPU, and n/a with the
install command where liger_kernel does not import.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

from speedbench.techniques.base import ActsOn, Context, Field, Technique

INSTALL = "pip install 'speedbench[liger]' (or pip install liger-kernel)"


@functools.lru_cache(maxsize=None)
def import_problem() -> Optional[str]:
    """Why liger_kernel's fused loss does not import here, or None."""
    try:
        importlib.import_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # absent, or present without a Triton it can use
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None


def takes_fused(model) -> bool:
    return model is not None and hasattr(type(model), "fused_loss")


class FusedCE(Technique):
    name = "fused_ce"
    after = ("chunked_ce",)  # it replaces the loss chunked_ce would slice
    card = """\
**What**: Liger's `LigerFusedLinearCrossEntropyLoss`: the LM head's matmul and the
cross-entropy fused in one Triton kernel that walks chunks of tokens and writes the gradients
in forward, so the B x T x V logits (`logits_mb` under chunked_ce) are never made.
**Helps**: memory and speed of large-vocabulary language models: Liger reports "+20 %
throughput" and "-60 % memory" for multi-GPU training; the saving is the logits' memory.
**Costs**: a GPU (Triton, CUDA or ROCm) and the liger-kernel package; the head's weight
gradient is made in forward; a model must expose its hidden states and head (`fused_loss`)."""
    fields = (Field("fused_linear_ce", bool, False,
                    "Liger's fused linear cross-entropy for the LM loss (GPU, liger-kernel)"),)
    example = {"fused_linear_ce": True}
    acts_on = ActsOn(device="cuda", why="Liger's kernels are Triton GPU kernels")
    snippets = {"fused_linear_ce": {True: ("Liger fused linear cross-entropy", """\
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
fused_ce = LigerFusedLinearCrossEntropyLoss()
hidden = model.backbone(x)  # (B, T, D): the hidden states before the LM head
loss = fused_ce(model.head.weight, hidden.view(-1, hidden.shape[-1]), y.view(-1))""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if not recipe.fused_linear_ce:
            return None
        if not ctx.cuda:
            return ("n/a: Liger's fused linear cross-entropy is a Triton GPU kernel (this run "
                    f"is on {ctx.device.type})")
        problem = import_problem()
        if problem:
            return f"n/a: liger_kernel does not import ({problem}): {INSTALL}"
        if ctx.model is not None and not takes_fused(ctx.model):
            return ("n/a: fused linear cross-entropy needs a model with a `fused_loss` switch "
                    "(the reference transformer has one)")
        if recipe.loss_chunks > 1:
            return "n/a: fused_linear_ce replaces the chunked loss: set loss_chunks=1"
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.fused_linear_ce and takes_fused(ctx.model) and import_problem() is None:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            # a bound method, not the module: a module attribute would be registered as a
            # submodule and hidden behind the class's `fused_loss = None`
            ctx.model.fused_loss = LigerFusedLinearCrossEntropyLoss().__call__
        return model

    def bound(self, recipe, baseline, profile, peaks):
        if recipe.fused_linear_ce == baseline.fused_linear_ce:
            return None
        return ("n/a: chiefly a memory technique: its forecast is the logits' memory, B x T x V "
                "x 4 bytes (chunked_ce's logits_mb column)")
