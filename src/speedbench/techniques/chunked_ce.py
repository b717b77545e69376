"""Chunked cross-entropy: the language-model loss over slices of the tokens, so that the
B x T x V logits never live whole.

A model opts in with a `loss_chunks` attribute (the reference transformer has one:
models/transformer.py, `chunked_loss`): each slice's logits are made, reduced to a summed loss
and dropped; backward makes them again (torch.utils.checkpoint), so at most one slice's
logits live at a time. The plain-PyTorch form of what fused kernels (Liger's
FusedLinearCrossEntropy, CUDA) do without the extra matmul.
"""
from __future__ import annotations

import math
from typing import Optional

from speedbench.techniques.base import ActsOn, Context, Field, Technique

FP32_BYTES = 4  # the loss takes the logits in fp32 (logits.float())


def takes_chunks(model) -> bool:
    return model is not None and hasattr(type(model), "loss_chunks")


def logits_mb(model, batch: int) -> float:
    """The fp32 logits of one micro-batch, B x T x V x 4 bytes, in MiB: what the whole loss
    holds at once (and its softmax again for backward); NaN for a model without a head and a
    seq_len to say it."""
    head, seq_len = getattr(model, "head", None), getattr(model, "seq_len", None)
    vocab = getattr(head, "out_features", None)
    if not (isinstance(vocab, int) and isinstance(seq_len, int)):
        return math.nan
    return batch * seq_len * vocab * FP32_BYTES / 2 ** 20


class ChunkedCE(Technique):
    name = "chunked_ce"
    card = """\
**What**: the language-model loss computed over `loss_chunks` slices of the tokens; each
slice's logits (tokens / k x vocabulary) are made, reduced to a summed loss and dropped, and
made again in backward (`torch.utils.checkpoint` around each slice's head and loss).
**Helps**: memory, when the vocabulary is large: the logits of a step are B x T x V numbers
(GPT-2 small at batch 16: 16 x 1024 x 50,257 x 4 bytes = 3.1 GiB in fp32, its softmax as much
again), often the largest single activation of a language model. The `logits_mb` column is that
forecast for the trial's micro-batch; the chunks keep 1/k of it.
**Costs**: the head's matmul once more per step (in backward), and k smaller matmuls in place of
one. Fused kernels (Liger's fused linear cross-entropy, CUDA) avoid the extra matmul."""
    fields = (Field("loss_chunks", int, 1, "the LM loss over this many slices of the tokens, "
                    "logits recomputed in backward (1: the whole loss at once)", low=1),)
    example = {"loss_chunks": 4}
    acts_on = ActsOn(model="transformer")
    extra_columns = ("logits_mb",)
    snippets = {"loss_chunks": {"*": ("cross-entropy in {value} chunks of tokens", """\
from torch.utils.checkpoint import checkpoint
def chunk_loss(h, y):  # this slice's logits live only inside it
    return F.cross_entropy(head(h).float(), y, reduction="sum")
h, y = hidden.flatten(0, 1), targets.flatten()
loss = sum(checkpoint(chunk_loss, hc, yc, use_reentrant=False)
           for hc, yc in zip(h.chunk({value}), y.chunk({value}))) / (y != -100).sum()""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.loss_chunks > 1 and ctx.model is not None and not takes_chunks(ctx.model):
            return ("n/a: chunked cross-entropy needs a model that computes its own LM loss "
                    "with a `loss_chunks` switch (the reference transformer has one)")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.loss_chunks > 1 and takes_chunks(ctx.model):
            ctx.model.loss_chunks = recipe.loss_chunks
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        trainer = ctx.trainer
        batch = getattr(trainer, "loader", None)
        size = getattr(batch, "batch_size", None) or recipe.batch_size or 0
        return {**super().columns(recipe, ctx),
                "logits_mb": logits_mb(ctx.model, size) if ctx.model is not None else math.nan}
