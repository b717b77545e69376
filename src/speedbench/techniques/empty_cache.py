"""torch.cuda.empty_cache() after every optimizer step (an anti-pattern, measured)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Finding, Technique

TIP = ("do not empty the caching allocator during training: the next step has to cudaMalloc "
       "its memory again, and that synchronises")


class EmptyCache(Technique):
    name = "empty_cache"
    card = """\
**What**: calls `torch.cuda.empty_cache()` after every optimizer step, handing the caching
allocator's free blocks back to the driver.
**Helps**: only other processes sharing the GPU; it does not give this process more memory.
**Costs**: the next step must `cudaMalloc` again, which synchronises; often a visible slow-down."""
    fields = (Field("empty_cache", bool, False, "torch.cuda.empty_cache() after every step"),)
    example = {"empty_cache": True}
    acts_on = ActsOn(device="cuda", why="it empties CUDA's caching allocator")
    snippets = {"empty_cache": {False: ("never call torch.cuda.empty_cache() in the loop", """\
# delete: torch.cuda.empty_cache()   # it frees the allocator's cache, which the next step refills""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.empty_cache and not ctx.cuda:
            return "n/a: empty_cache needs CUDA (the CPU has no caching allocator to empty)"
        return None

    def after_step(self, recipe, ctx: Context) -> None:
        if recipe.empty_cache and ctx.cuda:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def profile_counters(self, trainer, ctx: Context):
        """Counts torch.cuda.empty_cache() calls made in the window, by anyone (this knob or
        the user's model)."""
        counters = {"empty_cache_calls": 0}
        original = torch.cuda.empty_cache

        def counted(*args, **kwargs):
            counters["empty_cache_calls"] += 1
            return original(*args, **kwargs)

        torch.cuda.empty_cache = counted
        try:
            yield counters
        finally:
            torch.cuda.empty_cache = original

    def diagnose(self, tp) -> list[Finding]:
        calls = tp.counters.get("empty_cache_calls")
        if not calls:
            return []
        return [Finding("empty_cache called in the loop",
                        f"torch.cuda.empty_cache() called {calls} times in {tp.steps} steps",
                        TIP, "empty_cache=false")]
