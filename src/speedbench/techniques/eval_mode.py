"""A timed evaluation pass: forward and loss only, with autograd on, under torch.no_grad(), or
under torch.inference_mode().

Setting `eval_mode` turns every step of the trial into an evaluation pass over the same batches
(model.eval(), no backward, no optimizer step: the Trainer's forward_only path), so samples/s
is the evaluation throughput and peak_mem_mb the evaluation's peak tensor memory. With autograd
on, the forward pass records its graph and keeps the activations it would need for a backward
that never comes; no_grad records nothing; inference_mode also skips the version counters and
view tracking of the tensors it makes.
"""
from __future__ import annotations

import contextlib
from typing import Literal, Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique

CONTEXTS = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}


class EvalMode(Technique):
    name = "eval_mode"
    card = """\
**What**: times an evaluation pass (model.eval(), forward and loss, no backward) instead of a
training step: with autograd on (`grad`, the forgotten `no_grad`), under `torch.no_grad()`, or
under `torch.inference_mode()`. null (the default) trains.
**Helps**: validation and inference: without a graph, activations are freed as soon as the next
layer has used them (less memory) and no autograd bookkeeping is done (less time per op).
**Costs**: nothing for evaluation; tensors made under inference_mode cannot be used in autograd
later, so code that trains on them must make them outside it."""
    fields = (Field("eval_mode", Optional[Literal[tuple(CONTEXTS)]], None,
                    "null: train; else time an evaluation pass with autograd on (grad), under "
                    "no_grad or inference_mode"),)
    example = {"eval_mode": "inference_mode"}
    acts_on = ActsOn()
    snippets = {"eval_mode": {
        "no_grad": ("evaluate under torch.no_grad()", """\
model.eval()
with torch.no_grad():
    val_loss = loss_fn(model(x), y)"""),
        "inference_mode": ("evaluate under torch.inference_mode()", """\
model.eval()
with torch.inference_mode():
    val_loss = loss_fn(model(x), y)""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.eval_mode is not None and (ctx.dist_env is not None
                                             or recipe.parallel != "none"):
            return ("n/a: the evaluation pass is measured in one process (parallel=none); "
                    "evaluation has no gradients to all-reduce")
        return None

    def forward_only(self, recipe) -> bool:
        return recipe.eval_mode is not None

    def step_context(self, recipe, ctx: Context):
        if recipe.eval_mode is None:
            return contextlib.nullcontext()
        return CONTEXTS[recipe.eval_mode]()

    def columns(self, recipe, ctx: Context) -> dict:
        return {"eval_mode": recipe.eval_mode or "off"}
