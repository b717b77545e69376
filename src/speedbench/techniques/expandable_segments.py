"""The CUDA caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF).

The allocator reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA is first used, so the trial runs in
a fresh process started with the variable (`environment`), any settings already in it kept.
Written against the PyTorch docs (docs.pytorch.org/docs/stable/notes/cuda.html, "Optimizing
memory usage with PYTORCH_CUDA_ALLOC_CONF"); n/a on a machine without CUDA.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from speedbench.techniques.base import ActsOn, Context, Field, Technique

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
SETTING = "expandable_segments:True"


def with_setting(current: str) -> str:
    """The variable's value with expandable segments on, its other options kept."""
    kept = [o for o in current.split(",") if o and not o.startswith("expandable_segments")]
    return ",".join([*kept, SETTING])


class ExpandableSegments(Technique):
    name = "expandable_segments"
    card = """\
**What**: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: the CUDA caching allocator maps
memory into segments that grow in place instead of fixed-size blocks.
**Helps**: memory fragmentation: batch or sequence sizes that change from step to step (packed
or padded documents, dynamic shapes) leave blocks the allocator cannot reuse; expandable
segments waste less, so out-of-memory errors come later ("reserved but unallocated" shrinks).
**Costs**: mapping pages is slower than handing out a cached block; little effect when every
step allocates the same sizes. CUDA only; the variable must be set before CUDA starts (a fresh
process per trial)."""
    fields = (Field("expandable_segments", bool, False,
                    "CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),)
    example = {"expandable_segments": True}
    acts_on = ActsOn(device="cuda", why="it configures the CUDA caching allocator")
    extra_columns = ("cuda_alloc_conf",)
    snippets = {"expandable_segments": {True: ("expandable segments in the CUDA allocator", """\
# before the process first touches CUDA (in the shell, or first thing in the script)
import os
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.expandable_segments and not ctx.cuda:
            return ("n/a: expandable_segments configures the CUDA caching allocator "
                    f"(this run is on {ctx.device.type})")
        return None

    def environment(self, recipe, ctx: Context) -> dict[str, str]:
        if not recipe.expandable_segments or not ctx.cuda or ctx.dist_env is not None:
            return {}  # torchrun's ranks are started already: set it in their environment
        return {VARIABLE: with_setting(os.environ.get(VARIABLE, ""))}

    def columns(self, recipe, ctx: Context) -> dict:
        seen = os.environ.get(VARIABLE, "") if ctx.trainer is not None else math.nan
        return {**super().columns(recipe, ctx), "cuda_alloc_conf": seen}
