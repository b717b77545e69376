"""Sequence packing: variable-length documents packed into full rows instead of padded.

The data: a token model's `dataset.documents` (a median length in tokens) makes the synthetic
tokens documents of varying length, each batch padded to its longest (`pad`, the default and
the baseline). `pack` and `pack_reset` keep the batch's documents (the same ones, so a step
trains the same tokens) and pack them first-fit-decreasing into rows of at most the model's
context (`seq_len`), the rows cut to the longest one; attention is block-diagonal (a boolean
SDPA mask: a token sees only the earlier tokens of its own document), and the positions run on
across the row (`pack`) or restart at each document (`pack_reset`).

The model takes x as (tokens, document ids, positions) (the reference transformer does:
models/transformer.py) and counts its samples as documents, so samples/s compares the same
documents per step. It changes the numerics (`pack` trains documents at positions the padded
model never sees at their start), so the held-out loss of the quality probe judges it beside
the speed. FlexAttention's block masks would skip the masked blocks' arithmetic; the SDPA mask
here computes them and throws them away, so its gain comes from the padding removed.
FlexAttention is not used on a CPU: torch 2.14.1 raises "FlexAttention does not support
backward on CPU" (eager and compiled alike), so training there needs the SDPA mask.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Literal, Optional

import torch

from speedbench.techniques.base import ActsOn, Bound, Context, Field, Technique, percent, \
    times

MODES = ("pad", "pack", "pack_reset")
PAD_LABEL = -100  # cross_entropy's ignore_index: a padded position, no loss
COUNTER = "padded_positions"  # (padded, all) label positions of the profiled batches


def pack_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing: the documents' indices per row, each row's lengths summing to at
    most `row_len` (a document longer than a row gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_len - lengths[i])
    return rows


def pack_documents(items: list, row_len: int, reset: bool) -> tuple[tuple, torch.Tensor]:
    """A collate_fn: (x, y) documents as ((tokens, document ids, positions), labels), rows of
    at most `row_len`, cut to the longest; the rows' unused tail holds token 0, document id -1
    and label PAD_LABEL. Positions restart at each document when `reset`."""
    rows = pack_rows([len(x) for x, _ in items], row_len)
    width = max(sum(len(items[i][0]) for i in row) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), PAD_LABEL, dtype=torch.long)
    docs = torch.full((len(rows), width), -1, dtype=torch.long)
    positions = torch.arange(width).repeat(len(rows), 1)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            x, y = items[i]
            n = len(x)
            tokens[r, at:at + n], labels[r, at:at + n], docs[r, at:at + n] = x, y, i
            if reset:
                positions[r, at:at + n] = torch.arange(n)
            at += n
    return (tokens, docs, positions), labels


def takes_documents(model) -> bool:
    return model is not None and callable(getattr(model, "speedbench_samples", None)) \
        and isinstance(getattr(model, "seq_len", None), int)


@contextlib.contextmanager
def counting_padding(trainer):
    """The profiled batches' padded and all label positions (labels that are one tensor)."""
    counts = [0, 0]
    inner = getattr(trainer, "batches", None)
    if inner is None:  # a user's own step (step_hook.HookTrainer): its batches are its own
        yield counts
        return

    def counted():
        for batch in inner:
            y = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
            if isinstance(y, torch.Tensor):
                counts[0] += int((y == PAD_LABEL).sum())
                counts[1] += y.numel()
            yield batch

    trainer.batches = counted()
    try:
        yield counts
    finally:
        trainer.batches = inner


class Packing(Technique):
    name = "packing"
    card = """\
**What**: variable-length documents (a token model's `dataset.documents`) packed several to a
row of the model's context, first-fit decreasing, instead of each padded to the batch's
longest; attention made block-diagonal by a boolean SDPA mask (a token sees only its own
document), positions running on across the row (`pack`) or restarting at each document
(`pack_reset`, what Hugging Face's `DataCollatorWithFlattening` passes as position ids).
**Helps**: when documents are much shorter than the context: padded positions cost the same
arithmetic as real ones; the most it can gain is 1 / (1 - the padding share).
**Costs**: the mask is built every step and the packed rows are longer (attention per token
grows with the row); `pack` changes what the model learns (documents seen at offsets): the
held-out loss judges it. Fused kernels (FlexAttention, varlen flash) skip the masked blocks;
an SDPA mask computes them."""
    fields = (Field("data.packing", Literal[MODES], "pad",
                    "variable-length documents: padded to the batch's longest, or packed "
                    "(pack_reset: positions restart per document)", column="packing"),)
    example = {"data.packing": "pack_reset"}
    acts_on = ActsOn()  # the transformer (on fixed-length data each row is one document)
    snippets = {"data.packing": {mode: (
        f"pack documents into full rows ({mode})", f"""\
# collate: documents first-fit decreasing into rows of seq_len; per token its document id
{"pos = torch.cat([torch.arange(len(d)) for d in row_docs])  # restart per document"
         if mode == "pack_reset" else "pos = torch.arange(row_len)  # positions run on"}
same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
mask = torch.ones(T, T, dtype=torch.bool).tril() & same_doc        # block-diagonal causal
att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))""")
        for mode in MODES[1:]}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.data.packing != "pad" and ctx.model is not None \
                and not takes_documents(ctx.model):
            return ("n/a: packing needs a model that takes packed documents, x as (tokens, "
                    "document ids, positions), with a seq_len and speedbench_samples (the "
                    "reference transformer has them)")
        return None

    def loader_options(self, opts: dict, recipe, ctx: Context) -> dict:
        if recipe.data.packing == "pad" or not takes_documents(ctx.model):
            return opts
        collate = functools.partial(pack_documents, row_len=ctx.model.seq_len,
                                    reset=recipe.data.packing == "pack_reset")
        return {**opts, "collate_fn": collate}

    def profile_counters(self, trainer, ctx: Context):
        return _counters(trainer)

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound | str]:
        if baseline.data.packing != "pad" or recipe.data.packing == "pad":
            return None  # positions only, or padding added back: no forecast
        padded, total = getattr(profile, "counters", {}).get(COUNTER) or (0, 0)
        if not total:
            return "n/a: the baseline's profile counted no labels (no padding share)"
        share = padded / total
        gain = 1 / (1 - share) if share < 1 else float("inf")
        return Bound(gain, share, f"padding is {percent(share)} of the batches' positions: "
                                  f"packing cannot gain more than {times(gain)}")


@contextlib.contextmanager
def _counters(trainer):
    with counting_padding(trainer) as counts:
        out: dict = {}
        yield out
    out[COUNTER] = tuple(counts)
