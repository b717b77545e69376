"""DistributedDataParallel's own knobs: the gradient bucket size (`bucket_cap_mb`), gradients
as views into the buckets (`gradient_as_bucket_view`) and a graph declared static
(`static_graph`).

They are arguments of DDP's constructor, which the `parallel` technique calls: this one hands
them over in `ctx.extra` (parallel.DDP_OPTIONS) before the model is wrapped. A variant that
sets them without running as DDP is n/a.
"""
from __future__ import annotations

from typing import Optional

from speedbench.techniques import parallel
from speedbench.techniques.base import ANY, ActsOn, Context, Field, Technique

DDP = """\
model = torch.nn.parallel.DistributedDataParallel(
    model, {argument}={value})"""


def options(recipe) -> dict:
    """DDP's constructor arguments the recipe sets away from their defaults."""
    opts = {}
    if recipe.bucket_cap_mb is not None:
        opts["bucket_cap_mb"] = recipe.bucket_cap_mb
    if recipe.gradient_as_bucket_view:
        opts["gradient_as_bucket_view"] = True
    if recipe.static_graph:
        opts["static_graph"] = True
    return opts


def _snippet(argument: str) -> tuple[str, str]:
    return (f"DistributedDataParallel({argument}={{value}})",
            DDP.replace("{argument}", argument))


class DdpTuning(Technique):
    name = "ddp_tuning"
    card = """\
**What**: DistributedDataParallel's constructor arguments: `bucket_cap_mb` (gradients are
all-reduced in buckets of this many MiB as backward produces them; DDP's default 25),
`gradient_as_bucket_view` (the gradients are views into the all-reduce buckets instead of
copies) and `static_graph` (the same parameters are used every step, so DDP stops searching
the graph and can overlap more).
**Helps**: smaller buckets start communicating earlier, larger ones make fewer calls; bucket
views save one gradient-sized copy and its memory; a static graph skips per-step bookkeeping.
**Costs**: bucket views forbid `detach_()` on gradients; a static graph must really be static
(no parameter used in one step and not the next)."""
    fields = (
        Field("bucket_cap_mb", Optional[int], None,
              "DDP's gradient bucket size in MiB; null: DDP's default (25)", low=1),
        Field("gradient_as_bucket_view", bool, False,
              "DDP's gradients as views into its all-reduce buckets"),
        Field("static_graph", bool, False, "DDP told the trained graph is the same every step"),
    )
    example = {"static_graph": True}
    # DDP on a CPU: tests/test_process_tips.py launches it under torchrun
    acts_on = ActsOn(device="cuda", gpus=2, why="it tunes DistributedDataParallel, which the "
                     "generic one-process trial does not run; on a CPU see "
                     "tests/test_process_tips.py")
    snippets = {
        "bucket_cap_mb": {ANY: _snippet("bucket_cap_mb")},
        "gradient_as_bucket_view": {True: _snippet("gradient_as_bucket_view")},
        "static_graph": {True: _snippet("static_graph")},
    }

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        mode = parallel.effective(recipe, ctx.dist_env)
        if options(recipe) and mode != "ddp":
            keys = ", ".join(options(recipe))
            return (f"n/a: {keys} are arguments of DistributedDataParallel, and this variant "
                    f"runs parallel={mode}: set parallel=ddp")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if options(recipe):
            ctx.extra[parallel.DDP_OPTIONS] = options(recipe)
        return model
