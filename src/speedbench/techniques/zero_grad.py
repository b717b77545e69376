"""optimizer.zero_grad(set_to_none=...): free the gradients after each step, or zero-fill them.

PyTorch's default has been set_to_none=True since torch 2.0; False is the older habit the
Performance Tuning Guide warns against: every step writes zeros into every gradient, and the
next backward adds into them instead of assigning, and the gradients stay allocated between
steps (through the next forward pass, where activations peak).
"""
from __future__ import annotations

import math

from speedbench.techniques.base import ActsOn, Context, Field, Technique


def held_grad_mb(model) -> float:
    """MB of `.grad` tensors the model holds now (after a step: what zero_grad left)."""
    if model is None:
        return math.nan
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
               if p.grad is not None) / 2**20


class ZeroGrad(Technique):
    name = "zero_grad"
    card = """\
**What**: `optimizer.zero_grad(set_to_none=True)` (PyTorch's default since 2.0) sets every
gradient to None after the step; `False` fills them with zeros and keeps them allocated.
**Helps**: one memset per parameter less per step, and backward assigns the new gradient
instead of adding it; the gradients' memory is free during the next forward pass, where
activations peak.
**Costs**: code that reads `.grad` between steps sees None; an optimizer skips a parameter
whose gradient is None (one that got no gradient), where with zeros it would still decay it."""
    fields = (Field("set_to_none", bool, True,
                    "optimizer.zero_grad(set_to_none=...): true frees the gradients, false "
                    "zero-fills them"),)
    example = {"set_to_none": False}
    acts_on = ActsOn()
    snippets = {"set_to_none": {True: ("free the gradients instead of zeroing them", """\
opt.step()
opt.zero_grad(set_to_none=True)  # the default since torch 2.0
# or: for p in model.parameters(): p.grad = None""")}}
    extra_columns = ("held_grad_mb",)

    def zero_grad_options(self, opts: dict, recipe, ctx: Context) -> dict:
        return {**opts, "set_to_none": bool(recipe.set_to_none)}

    def columns(self, recipe, ctx: Context) -> dict:
        """held_grad_mb: the gradients' memory still held after the trial's last step (0 when
        they are set to None; the model's gradient size when zero-filled)."""
        model = getattr(ctx.trainer, "model", None)
        return {**super().columns(recipe, ctx), "held_grad_mb": held_grad_mb(model)}
