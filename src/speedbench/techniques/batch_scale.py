"""A larger batch with the learning rate scaled: `batch_scale` times the model's batch per
optimizer step, and the learning rate scaled by a rule.

The rules (`lr_scaling`), for a batch `batch_scale` = k times larger:

- `sqrt` (the default): lr x sqrt(k). The square-root rule for Adam-style optimizers: Malladi,
  Lyu, Panigrahi, Arora, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms",
  NeurIPS 2022 (derived from the SDE approximation of Adam and RMSprop); proposed earlier by
  Hoffer, Hubara, Soudry, "Train longer, generalize better: closing the generalization gap in
  large batch training of neural networks", NeurIPS 2017. speedbench's optimizer is AdamW, so
  this is the default.
- `linear`: lr x k. The linear scaling rule for SGD: Goyal et al., "Accurate, Large Minibatch
  SGD: Training ImageNet in 1 Hour", 2017, with its gradual warm-up.
- `none`: the lr is left as it is (only the batch grows).

Warm-up (`lr_warmup_steps` = N > 0): Goyal et al.'s gradual warm-up. The first optimizer step
runs at the base lr (the recipe's `lr`), and the lr rises linearly, by an equal amount per step,
to the scaled lr, which step N and every later one use: lr_t = lr + (scaled - lr) * min(t, N)/N
for the optimizer step t = 0, 1, ... of the Trainer. The lr is set on the optimizer's parameter
groups after each step (`after_step`).

Where the extra samples come from (`batch_scale_by`): `batch` makes each micro-batch k times
larger; `accumulate` keeps the model's micro-batch and takes k of them per optimizer step
(gradient accumulation), so both reach the same effective batch and the same scaled lr. They
compose with `accumulate` as the registry composes micro_batching: this technique runs after
accumulation, on the micro-batch it leaves (`accumulate_mode=split` cuts the model's batch, this
scales the pieces), and the micro-batch counts multiply.

Speed per step does not judge this technique: it changes the numerics (the optimizer takes k
times fewer steps per sample, each with another lr). The quality probe compares the variants
at an equal number of samples; time to a target loss is what decides.
"""
from __future__ import annotations

import math
from typing import Literal

from speedbench.techniques.base import ActsOn, ANY, Context, Field, Technique

LR_RULES = {"sqrt": math.sqrt, "linear": float, "none": lambda k: 1.0}


def scaled_lr(recipe) -> float:
    """The lr the rule gives for this recipe's batch_scale (what the warm-up reaches)."""
    return float(recipe.lr) * LR_RULES[recipe.lr_scaling](recipe.batch_scale)


def lr_at(recipe, step: int) -> float:
    """The lr of optimizer step `step` (0 first): the base lr rising linearly to the scaled lr
    over `lr_warmup_steps` steps, then the scaled lr."""
    target, n = scaled_lr(recipe), recipe.lr_warmup_steps
    if n <= 0 or step >= n:
        return target
    base = float(recipe.lr)
    return base + (target - base) * step / n


class BatchScale(Technique):
    name = "batch_scale"
    after = ("accumulation",)  # it scales the micro-batch accumulation leaves
    card = """\
**What**: each optimizer step takes `batch_scale` times the model's batch, as one larger
micro-batch (`batch_scale_by=batch`) or as that many micro-batches (`accumulate`), and the
learning rate is scaled to match: `lr_scaling=sqrt` (lr x sqrt(batch_scale); the rule for
Adam-style optimizers: Malladi, Lyu, Panigrahi, Arora, "On the SDEs and Scaling Rules for
Adaptive Gradient Algorithms", NeurIPS 2022; Hoffer, Hubara, Soudry, "Train longer, generalize
better", 2017), `linear` (lr x batch_scale; the rule for SGD, with warm-up: Goyal et al.,
"Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017) or `none`.
`lr_warmup_steps=N`: the lr rises linearly from the base lr to the scaled lr over the first N
optimizer steps (Goyal et al.'s gradual warm-up). speedbench's optimizer is AdamW: sqrt is the
default.
**Helps**: a device that a small batch leaves idle: more samples per second, fewer optimizer
steps and all-reduces per sample.
**Costs**: memory grows with the micro-batch; it changes the training (fewer, larger steps), so
samples per second alone does not judge it: compare the loss at equal samples (the quality
probe) or the time to a target loss."""
    fields = (
        Field("batch_scale", int, 1, "the optimizer step takes batch_scale times the model's "
              "batch", low=1),
        Field("batch_scale_by", Literal["batch", "accumulate"], "batch",
              "batch: a batch_scale times larger micro-batch; accumulate: batch_scale "
              "micro-batches of the model's batch per optimizer step"),
        Field("lr_scaling", Literal["sqrt", "linear", "none"], "sqrt",
              "the lr for the larger batch: lr x sqrt(batch_scale) (Adam), x batch_scale (SGD) "
              "or unchanged"),
        Field("lr_warmup_steps", int, 0, "optimizer steps over which the lr rises linearly from "
              "lr to the scaled lr; 0: the scaled lr from the first step", low=0),
    )
    example = {"batch_scale": 2}
    acts_on = ActsOn()
    snippets = {
        "batch_scale": {ANY: ("a {value}x larger batch with the learning rate scaled", """\
loader = DataLoader(dataset, batch_size={value} * batch_size, shuffle=True, drop_last=True)
# AdamW: the square-root rule (Malladi et al. 2022); for SGD: lr * {value} (Goyal et al. 2017)
opt = torch.optim.AdamW(model.parameters(), lr=lr * {value} ** 0.5)""")},
        "lr_warmup_steps": {ANY: ("warm the scaled learning rate up over {value} steps", """\
opt = torch.optim.AdamW(model.parameters(), lr=scaled_lr)
warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=lr / scaled_lr,
                                           total_iters={value})
for x, y in loader:
    loss_fn(model(x), y).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    warmup.step()  # lr rises linearly from lr to scaled_lr over {value} steps""")},
    }
    extra_columns = ("lr_effective",)

    def micro_batching(self, batch: int, recipe):
        k = recipe.batch_scale
        if k == 1:
            return None
        return (batch * k, 1) if recipe.batch_scale_by == "batch" else (batch, k)

    def capacity_overrides(self, recipe) -> dict:
        return {"batch_scale": 1}  # the largest micro-batch is searched at the model's batch

    def optimizer_options(self, opts: dict, recipe, ctx: Context) -> dict:
        lr = lr_at(recipe, 0)
        # off (the base lr): no key, so a loop that passes its own lr= keeps working
        return opts if lr == recipe.lr else {**opts, "lr": lr}

    def after_step(self, recipe, ctx: Context) -> None:
        """Sets the next step's lr during the warm-up; nothing once it is over (or without
        one). The count of steps is kept in ctx.extra, for the model the Trainer trains."""
        n = recipe.lr_warmup_steps
        if n <= 0:
            return
        done = ctx.extra.get("batch_scale_steps", 0) + 1
        ctx.extra["batch_scale_steps"] = done
        if done > n:
            return
        lr = lr_at(recipe, done)
        for group in ctx.trainer.optimizer.param_groups:
            group["lr"] = lr

    def columns(self, recipe, ctx: Context) -> dict:
        """lr_effective: the lr the rule gives for the larger batch (after any warm-up)."""
        return {**super().columns(recipe, ctx), "lr_effective": scaled_lr(recipe)}
