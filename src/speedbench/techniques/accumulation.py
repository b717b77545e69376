"""Gradient accumulation: several micro-batches per optimizer step."""
from __future__ import annotations

from typing import Literal

from speedbench.techniques.base import ActsOn, ANY, ConfigError, Field, Finding, Technique

TIP = ("run forward and backward of the first k-1 micro-batches inside model.no_sync(), "
       "so gradients are all-reduced once per optimizer step")


class Accumulation(Technique):
    name = "accumulation"
    card = """\
**What**: sums the gradients of `accumulate` micro-batches before one optimizer step (the
loss is divided by `accumulate`). `accumulate_mode=add`: each micro-batch holds `batch_size`
samples, so the effective batch grows; `split`: the batch is cut into `accumulate` micro-batches.
**Helps**: a large effective batch that does not fit in memory at once; under DDP, fewer
all-reduces per sample (with `no_sync`).
**Costs**: smaller micro-batches use the device less well; more Python per sample."""
    fields = (
        Field("accumulate", int, 1, "micro-batches per optimizer step", low=1),
        Field("accumulate_mode", Literal["add", "split"], "add",
              "add: each micro-batch is batch_size samples; split: the batch is cut into them"),
    )
    example = {"accumulate": 2}
    acts_on = ActsOn()
    snippets = {"accumulate": {ANY: ("gradient accumulation over {value} micro-batches", """\
for i, (x, y) in enumerate(loader):
    loss = loss_fn(model(x), y) / {value}
    loss.backward()
    if (i + 1) % {value} == 0:
        opt.step(); opt.zero_grad(set_to_none=True)""")}}

    def from_loop(self, loop: str, flags: dict) -> dict:
        """Lightning's accumulate_grad_batches; TrainingArguments'
        gradient_accumulation_steps."""
        flag = {"lightning": "accumulate_grad_batches",
                "hf": "gradient_accumulation_steps"}.get(loop)
        value = flags.get(flag) if flag else None
        if value is None:
            return {}
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{flag}: {value!r} is not allowed; a whole number from 1")
        return {"accumulate": value}

    def micro_batching(self, batch: int, recipe):
        k = recipe.accumulate
        return (batch // k if recipe.accumulate_mode == "split" else batch), k

    def capacity_overrides(self, recipe) -> dict:
        return {"accumulate": 1, "accumulate_mode": "add"}  # the batch is one micro-batch

    def check_plan(self, plan, dist_env) -> None:
        for spec in plan.models:
            for name, recipe in plan.variants.items():
                batch = recipe.batch_size or spec.batch_size
                if recipe.accumulate_mode == "split" and batch % recipe.accumulate:
                    where = f"variants.{name}." if name != "default" else ""
                    raise ConfigError(
                        f"{where}accumulate: {recipe.accumulate} does not divide the batch of "
                        f"model {spec.name} ({batch}); with accumulate_mode=split the batch is "
                        "cut into `accumulate` equal micro-batches")

    def diagnose(self, tp) -> list[Finding]:
        forwards, k = tp.counters.get("synced_forwards"), tp.settings.get("accumulate", 1)
        if forwards is None or k <= 1 or not tp.steps:
            return []
        synced = forwards / tp.steps
        if synced <= 1 + 1e-9:
            return []
        return [Finding("gradient accumulation without no_sync under DDP",
                        f"{synced:.1f} of {k} micro-batches per optimizer step "
                        "all-reduce their gradients", TIP, "-")]
