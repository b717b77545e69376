"""DistributedDataParallel's communication hooks: the gradients all-reduced in 16 bits (fp16 or
bf16 compression) or as PowerSGD's low-rank factors, instead of DDP's fp32 all-reduce.

A hook is registered on the DDP module once `parallel` has wrapped the model (`after`), before
compile wraps it (the registry's order: compile comes after this). Written against the PyTorch
docs ("DDP Communication Hooks", torch.distributed.algorithms.ddp_comm_hooks). On a CPU the
ranks talk over gloo on the loopback interface: that is not a real interconnect (no wire, no
NIC: the "transfer" is a memory copy between processes sharing the same cores), so what a hook
saves here is the reduction's CPU work and copies, not network time; the report says so.
"""
from __future__ import annotations

import math
from typing import Literal, Optional

from speedbench.techniques import parallel
from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Technique, amdahl,
                                        percent, times)

HOOKS = ("none", "fp16", "bf16", "powersgd")
# PowerSGD all-reduces plainly for its first iterations (start_powerSGD_iter, default 1,000, to
# let the model settle); a benchmark's window would see none of it, so compression starts at
# the second step (the earliest PowerSGDState allows with error feedback and warm start).
POWERSGD_START = 2
LOOPBACK = ("over gloo on one machine the ranks exchange gradients through loopback memory "
            "copies, not a real interconnect: a hook's gain here is CPU work saved, not network "
            "time")
# Seen on this 2-core machine (torch 2.14.1): a PowerSGD trial failing with gloo's "Received
# data size doesn't match expected size ... collective mismatch", and another hanging.
GLOO_POWERSGD = (
    "n/a: PowerSGD over gloo (a CPU): its hook waits on its own all-reduces inside the "
    "callbacks of the bucket's future, which gloo runs on its worker threads; with two buckets "
    "in flight the ranks issue those all-reduces in different orders (gloo: \"collective "
    "mismatch\") or every worker blocks (a hang). NCCL on CUDA has no such limit")


def make_hook(kind: str, rank: int):
    """(state, hook) for DDP.register_comm_hook, or None for DDP's own all-reduce."""
    if kind == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "fp16":
        return None, default_hooks.fp16_compress_hook
    if kind == "bf16":
        return None, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=POWERSGD_START)
    return state, powerSGD_hook.powerSGD_hook


def registered(model) -> list[str]:
    """The names of the comm hooks registered on a DDP module (empty for any other model)."""
    hooks = getattr(model, "_comm_hooks", None) or []
    return [hook.__qualname__ for hook, _ in hooks]


def most_gain(kind: str) -> float:
    """The most a hook can speed the all-reduce up: 16-bit halves the bytes (a transfer takes
    at least half as long), PowerSGD's factors may be arbitrarily smaller."""
    return 2.0 if kind in ("fp16", "bf16") else math.inf


class CommHook(Technique):
    name = "comm_hook"
    after = ("parallel",)  # it registers on the DDP module parallel makes
    card = """\
**What**: a DDP communication hook (`model.register_comm_hook`): `fp16` / `bf16` cast each
gradient bucket to 16 bits, all-reduce it and cast back; `powersgd` all-reduces PowerSGD's
low-rank factors (rank `powersgd_rank`, with error feedback) instead of the gradients.
**Helps**: bandwidth-bound data parallelism (many nodes, slow links): half the bytes for 16 bits,
far fewer for PowerSGD ("very high compression rates", the PyTorch docs).
**Costs**: the casts or PowerSGD's matmuls and orthogonalisation every step; PowerSGD keeps
gradient-sized error-feedback buffers; both change the numerics (the held-out loss judges
them). PowerSGD over gloo (CPUs) is n/a: its hook blocks inside gloo's callbacks (collective
mismatches, hangs). Over gloo on one machine the "network" is a memory copy (loopback): no real interconnect,
so a gain or loss measured here says nothing about one."""
    fields = (
        Field("ddp_comm_hook", Literal[HOOKS], "none",
              "DDP communication hook: none (fp32 all-reduce), fp16, bf16, powersgd"),
        Field("powersgd_rank", int, 1, "PowerSGD's matrix approximation rank", low=1),
    )
    example = {"ddp_comm_hook": "fp16"}
    # DDP on a CPU: tests/test_comm_hooks.py launches it under torchrun
    acts_on = ActsOn(device="cuda", gpus=2, why="it hooks DistributedDataParallel, which the "
                     "generic one-process trial does not run; on a CPU see "
                     "tests/test_comm_hooks.py")
    extra_columns = ("comm_hooks_registered",)
    snippets = {"ddp_comm_hook": {
        "fp16": ("DDP gradients all-reduced in fp16", """\
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # model: the DDP module"""),
        "bf16": ("DDP gradients all-reduced in bf16", """\
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
model.register_comm_hook(None, default_hooks.bf16_compress_hook)  # model: the DDP module"""),
        "powersgd": ("DDP gradients compressed by PowerSGD", """\
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                               start_powerSGD_iter=1000)  # plain all-reduce while it settles
model.register_comm_hook(state, powerSGD.powerSGD_hook)  # model: the DDP module"""),
    }}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        mode = parallel.effective(recipe, ctx.dist_env)
        if recipe.ddp_comm_hook != "none" and mode != "ddp":
            return (f"n/a: ddp_comm_hook={recipe.ddp_comm_hook} hooks DistributedDataParallel's "
                    f"all-reduce, and this variant runs parallel={mode}: set parallel=ddp")
        if recipe.ddp_comm_hook == "powersgd" and not ctx.cuda:
            return GLOO_POWERSGD
        if recipe.powersgd_rank != 1 and recipe.ddp_comm_hook != "powersgd":
            return (f"n/a: powersgd_rank={recipe.powersgd_rank} is PowerSGD's; this variant "
                    f"uses ddp_comm_hook={recipe.ddp_comm_hook}")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        hook = make_hook(recipe.ddp_comm_hook, recipe.powersgd_rank)
        if hook is not None and hasattr(model, "register_comm_hook"):
            model.register_comm_hook(*hook)
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        model = getattr(ctx.trainer, "model", None)
        seen = ",".join(registered(model)) if model is not None else ""
        return {**super().columns(recipe, ctx), "comm_hooks_registered": seen}

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if recipe.ddp_comm_hook == baseline.ddp_comm_hook:
            return None
        if baseline.ddp_comm_hook != "none":
            return "n/a: a forecast against DDP's own fp32 all-reduce only"
        share, gain = profile.share("other"), most_gain(recipe.ddp_comm_hook)
        best = amdahl(share, gain)
        # `other` holds the waits on gloo's all-reduce (c10d calls are not aten operators) and
        # more; on shared CPU cores a lighter reduction can also speed the backward it runs
        # beside, so this is shown but is no bound.
        return Bound(best, share, f"non-aten time (the all-reduce waits, and more) is "
                     f"{percent(share)} of the step: a hook that makes it {times(gain)} faster "
                     f"gains at most {times(best)}; {LOOPBACK}", sound=False)
