"""FSDP2's `reshard_after_forward`: whether each block frees its gathered parameters after its
forward (and all-gathers them again in backward), keeps them until backward, or reshards them
to a smaller group of ranks.

It is an argument of `fully_shard`, which the `parallel` technique calls for each block: this
one hands it over in `ctx.extra` (parallel.FSDP_OPTIONS) before the model is wrapped. The root
module keeps FSDP2's own choice (None: not resharded, its parameters are needed first in
backward). Written against the docs of torch.distributed.fsdp.fully_shard (torch 2.14).
"""
from __future__ import annotations

from typing import Optional, Union

from speedbench.techniques import parallel
from speedbench.techniques.base import (ActsOn, Bound, ConfigError, Context, Field, Technique,
                                        amdahl, percent, times)

WORDS = {"true": True, "false": False}


def setting(text: str) -> Union[bool, int]:
    """The key's text as fully_shard takes it: True, False or a group size. ValueError when it
    is none of these."""
    low = str(text).strip().lower()
    if low in WORDS:
        return WORDS[low]
    if low.isdigit() and int(low) >= 2:
        return int(low)
    raise ValueError(low)


def group_problem(size: int, world: int) -> Optional[str]:
    """Why `size` cannot be the group fully_shard reshards to in a `world` of ranks (it must be
    a divisor other than 1 and the world size), or None."""
    if 1 < size < world and world % size == 0:
        return None
    divisors = [d for d in range(2, world) if world % d == 0]
    allowed = ", ".join(map(str, divisors)) if divisors else \
        "none (a group needs 4 ranks or more: nproc=4 makes 2 one)"
    return (f"reshard_after_forward={size} must divide the {world} ranks and lie strictly "
            f"between 1 and {world}; allowed here: {allowed}")


def after_forward(model) -> dict[str, int]:
    """How the FSDP2 modules under `model` (the root left out) treat their parameters after
    forward, as fully_shard recorded it: {"reshard": n, "keep": n, "group": n}."""
    counts = {"reshard": 0, "keep": 0, "group": 0}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if module is model or group is None:
            continue
        kind = "keep" if not group._reshard_after_forward else \
            "group" if group._use_post_forward_mesh else "reshard"
        counts[kind] += 1
    return counts


class FsdpReshard(Technique):
    name = "fsdp_reshard"
    card = """\
**What**: FSDP2's `fully_shard(block, reshard_after_forward=...)` for every block: `true`
(FSDP2's default: free the gathered parameters after forward, all-gather them again in
backward), `false` (keep them until backward: no second all-gather, like ZeRO-2), or an integer
n (reshard to groups of n ranks: the backward all-gather runs within the group, e.g. a node).
**Helps**: `false` saves one all-gather per block per step when communication is the limit and
memory is not; an int saves part of it over a slow inter-node link.
**Costs**: `false` keeps every block's whole parameters alive from forward to backward (memory
as DDP's); an int keeps 1/n of them. Over gloo on one machine the all-gather is a memory copy on
the loopback (no real interconnect): gains or losses here are CPU work, not network time."""
    fields = (Field("reshard_after_forward", str, "true",
                    "FSDP2 blocks: true (reshard after forward), false (keep until backward), "
                    "or n >= 2: reshard to groups of n ranks"),)
    example = {"reshard_after_forward": "false"}
    acts_on = ActsOn(device="cuda", gpus=2, why="it is an argument of FSDP2's fully_shard, which "
                     "the generic one-process trial does not run; on a CPU see "
                     "tests/test_comm_hooks.py")
    extra_columns = ("fsdp_after_forward",)
    snippets = {"reshard_after_forward": {"*": (
        "FSDP2 reshard_after_forward={value}", """\
from torch.distributed.fsdp import fully_shard
for block in model.blocks:
    fully_shard(block, reshard_after_forward={value})
fully_shard(model)""")}}

    def check(self, recipe, where: str = "") -> None:
        try:
            setting(recipe.reshard_after_forward)
        except ValueError:
            raise ConfigError(f"{where}reshard_after_forward: '{recipe.reshard_after_forward}' "
                              "is not allowed; choose true, false or an integer >= 2") from None

    def normalise(self, recipe) -> None:
        recipe.reshard_after_forward = str(setting(recipe.reshard_after_forward)).lower()

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        value = setting(recipe.reshard_after_forward)
        if value is True:
            return None
        mode = parallel.effective(recipe, ctx.dist_env)
        if mode != "fsdp":
            return (f"n/a: reshard_after_forward is an argument of FSDP2's fully_shard, and "
                    f"this variant runs parallel={mode}: set parallel=fsdp")
        if not isinstance(value, bool):
            world = ctx.dist_env.world_size if ctx.dist_env is not None else \
                parallel.launch_nproc(recipe, str(ctx.device))
            problem = group_problem(value, world)
            if problem:
                return f"n/a: {problem}"
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        value = setting(recipe.reshard_after_forward)
        if value is not True:
            ctx.extra[parallel.FSDP_OPTIONS] = {"reshard_after_forward": value}
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        """What the FSDP2 blocks did after forward, as fully_shard recorded it: `keep 2`,
        `reshard 2`, `group 2` (blocks per kind; empty without FSDP)."""
        model = getattr(ctx.trainer, "model", None)
        seen = after_forward(model) if model is not None else {}
        text = ", ".join(f"{kind} {n}" for kind, n in seen.items() if n)
        return {**super().columns(recipe, ctx), "fsdp_after_forward": text}

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if setting(baseline.reshard_after_forward) is not True:
            return "n/a: a forecast against FSDP2's default (true) only"
        share = profile.share("other")
        best = amdahl(share)
        # `other` holds the waits on the all-gathers and reduce-scatters (not aten operators)
        # and more; at most the backward all-gather goes, so it bounds the gain if the cores it
        # frees do not speed the compute beside it: shown, not a bound
        return Bound(best, share, f"non-aten time (the collectives' waits, and more) is "
                     f"{percent(share)} of the step: dropping the backward all-gather gains at "
                     f"most {times(best)}; over gloo on one machine these are loopback copies, "
                     "not a real interconnect", sound=False)
