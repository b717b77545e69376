"""FlexAttention: the transformer's attention through torch.nn.attention.flex_attention
(compiled) with a block mask, causal and, for packed documents, block-diagonal: blocks that
are wholly masked out are skipped instead of computed as SDPA's boolean mask computes them.

Written against the PyTorch docs (torch.nn.attention.flex_attention; the "FlexAttention" blog's
document masking). Whether it trains on this device is asked of torch (a tiny forward and
backward): torch 2.14.1 has no FlexAttention backward on a CPU ("FlexAttention does not support
backward on CPU"), so there it is n/a with torch's own words, and measured where torch has it.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Technique, amdahl,
                                        percent, times)


def takes_flex(model) -> bool:
    return model is not None and hasattr(type(model), "flex")


@functools.lru_cache(maxsize=None)
def cannot_train(device: str) -> Optional[str]:
    """torch's first line of why FlexAttention cannot run forward and backward on `device`,
    or None where it can (asked once per device, eagerly: the compiled kernel needs what the
    eager path needs)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 16, 8, device=device, requires_grad=True)
    try:
        flex_attention(q, q, q).sum().backward()
    except (NotImplementedError, RuntimeError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


class FlexAttention(Technique):
    name = "flex_attention"
    after = ("attention",)
    card = """\
**What**: the transformer's attention through `flex_attention` (compiled) with a
`create_block_mask` mask: causal, and block-diagonal for packed documents (each token sees its
own document only), instead of SDPA with a boolean T x T mask.
**Helps**: masked attention: blocks wholly masked out (across documents, above the diagonal)
are skipped, not computed; the PyTorch blog reports about 90 % of FlashAttention-2's forward
speed and torchtune "71 %" faster sample packing with it.
**Costs**: a compile of the attention kernel, a block mask made every step; CUDA (Triton) for
training: torch 2.14 has no FlexAttention backward on a CPU."""
    fields = (Field("flex_attention", bool, False,
                    "attention through FlexAttention with a block mask (transformer)"),)
    example = {"flex_attention": True}
    acts_on = ActsOn(device="cuda", why="torch 2.14 has no FlexAttention backward on a CPU")
    snippets = {"flex_attention": {True: ("FlexAttention with a document mask", """\
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
flex = torch.compile(flex_attention)
def same_document(b, h, q, kv):  # doc: (batch, T) document ids of the packed rows
    return (q >= kv) & (doc[b, q] == doc[b, kv])
mask = create_block_mask(same_document, batch, None, T, T, device="cuda")
out = flex(q, k, v, block_mask=mask)  # in place of scaled_dot_product_attention""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if not recipe.flex_attention:
            return None
        if ctx.model is not None and not takes_flex(ctx.model):
            return ("n/a: flex_attention needs a model with a `flex` switch (the reference "
                    "transformer has one)")
        if recipe.attention != "auto":
            return (f"n/a: flex_attention replaces scaled_dot_product_attention, whose backend "
                    f"attention={recipe.attention} chooses: set attention=auto")
        why = cannot_train(str(ctx.device))
        return f"n/a: FlexAttention cannot train here: torch says \"{why}\"" if why else None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.flex_attention and takes_flex(ctx.model):
            ctx.model.flex = True
        return model

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if baseline.flex_attention or not recipe.flex_attention:
            return None
        # SDPA is in `matmul` (with the other matmuls), the mask's making in `elementwise`:
        # FlexAttention can remove at most both
        share = min(1.0, profile.share("matmul") + profile.share("elementwise"))
        best = amdahl(share)
        return Bound(best, share, f"attention and the masks' making lie within the matmul and "
                     f"element-wise time, {percent(share)} of the step: FlexAttention gains at "
                     f"most {times(best)}")
