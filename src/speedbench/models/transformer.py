"""Decoder-only transformer language model (GPT-style); forward(x, y) returns the LM loss.

The causal mask and the position indices are made every step through `new_tensor`, so the
tensor_creation knob decides where they are born.

Attention goes through F.scaled_dot_product_attention, so the attention technique can choose
its kernel (math, flash, efficient, cudnn) with torch.nn.attention.sdpa_kernel. Fused kernels
such as CUDA's flash attention take no explicit mask: `causal = "is_causal"` (set by that
technique) passes is_causal=True instead of the per-step boolean mask (`"mask"`, the default).
Both give the same result. `checkpoint_blocks = True` (set by the checkpointing technique)
recomputes each block's activations in the backward pass instead of storing them.

`loss_chunks = k` (set by the chunked_ce technique) computes the loss over k slices of the
tokens, each slice's logits recomputed in backward, so the B x T x V logits never live whole.
`fused_loss` (set by the fused_ce technique): a callable (head weight, hidden states (N*T, D),
targets (N*T)) -> the mean loss, such as Liger's fused linear cross-entropy, which never makes
the logits at all. `flex = True` (set by the flex_attention technique): attention through
FlexAttention with a block mask (causal, and block-diagonal for packed documents).

Packed documents: x may be a tuple (tokens, document ids, positions), each (rows, T), as a
packing collate makes it (several documents per row): attention is then block-diagonal, each
token seeing only the earlier tokens of its own document (an explicit boolean mask), and the
positions are the ones given (restarting at each document, or running on across the row). Its
samples are the documents (`speedbench_samples`), so a packed step and a padded one count the
same documents.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from speedbench.models.per_step import PerStepTensors


def _init(module: nn.Module) -> None:
    """GPT-2's initialisation: small normal weights, so the first loss is near log(vocab)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:
        """`mask`: the boolean causal mask, None for SDPA's own is_causal=True, or a
        FlexAttention BlockMask."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, BlockMask):
            att = compiled_flex()(q, k, v, block_mask=mask)
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


CAUSAL_MODES = ("mask", "is_causal")
_FLEX: list = []  # the compiled flex_attention, made once (eager FlexAttention is for debugging)


def compiled_flex():
    if not _FLEX:
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def flex_mask(doc: Optional[torch.Tensor], rows: int, t: int, device) -> BlockMask:
    """FlexAttention's block mask: causal, and within one document where `doc` gives the
    document ids (rows, T); blocks wholly masked out are skipped, not computed."""
    def causal(b, h, q, kv):
        return q >= kv

    def same_document(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    if doc is None:
        return create_block_mask(causal, None, None, t, t, device=device)
    return create_block_mask(same_document, rows, None, t, t, device=device)


def _chunk_loss(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), y, reduction="sum")


def chunked_loss(head: nn.Module, h: torch.Tensor, y: torch.Tensor, chunks: int) -> torch.Tensor:
    """The mean next-token loss computed over `chunks` slices of the tokens, each slice's
    logits made again in backward (checkpoint) rather than kept: at most one slice's logits
    (tokens / chunks x vocabulary) live at once, for one more head matmul per step."""
    flat_h, flat_y = h.reshape(-1, h.shape[-1]), y.reshape(-1)
    total = flat_h.new_zeros((), dtype=torch.float32)
    for part_h, part_y in zip(flat_h.chunk(chunks), flat_y.chunk(chunks)):
        total = total + checkpoint(_chunk_loss, head, part_h, part_y, use_reentrant=False)
    return total / (flat_y != -100).sum().clamp(min=1)


class TransformerLM(nn.Module, PerStepTensors):
    checkpoint_blocks: bool = False  # recompute each block's activations in backward
    checkpoint_options: dict = {}  # checkpoint()'s keywords (selective: context_fn); per instance
    causal: str = "mask"  # how attention is made causal: see CAUSAL_MODES and the docstring
    loss_chunks: int = 1  # > 1: the loss in that many chunks of tokens (chunked_loss)
    fused_loss = None  # (head weight, hidden, targets) -> loss: the logits never made
    flex: bool = False  # FlexAttention with a block mask instead of SDPA

    def __init__(self, vocab_size: int = 256, seq_len: int = 64, dim: int = 128, layers: int = 2,
                 heads: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim: {dim} must be divisible by heads ({heads})")
        self.head_dim = dim // heads  # the attention technique probes kernels with it
        self.seq_len = seq_len  # the longest row packed documents may fill
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        self.apply(_init)

    def forward(self, x, y: torch.Tensor) -> torch.Tensor:
        """`x`: tokens (N, T), or packed documents (tokens, document ids, positions)."""
        x, doc, pos = x if isinstance(x, (tuple, list)) else (x, None, None)
        t = x.shape[1]
        if pos is None:
            pos = self.new_tensor(torch.arange, t, device=x.device)
        mask = self._mask(doc, x.shape[0], t, x.device)
        h = self.tok(x) + self.pos(pos)
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            h = checkpoint(block, h, mask, use_reentrant=False, **self.checkpoint_options) \
                if recompute else block(h, mask)
        h = self.ln(h)
        if self.fused_loss is not None and self.training and torch.is_grad_enabled():
            return self.fused_loss(self.head.weight, h.reshape(-1, h.shape[-1]), y.reshape(-1))
        if self.loss_chunks > 1 and self.training and torch.is_grad_enabled():
            return chunked_loss(self.head, h, y, self.loss_chunks)
        logits = self.head(h)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    def _mask(self, doc: Optional[torch.Tensor], rows: int, t: int, device):
        """The attention mask of a step: FlexAttention's block mask (`flex`), SDPA's boolean
        causal mask, block-diagonal for packed documents, or None (SDPA's is_causal)."""
        if self.flex:
            return flex_mask(doc, rows, t, device)
        mask = None
        if self.causal == "mask" or doc is not None:
            mask = self.new_tensor(torch.ones, t, t, device=device, dtype=torch.bool).tril()
        if doc is not None:  # block-diagonal: (N, 1, T, T), the heads broadcast
            mask = mask & (doc.unsqueeze(-1) == doc.unsqueeze(-2)).unsqueeze(1)
        return mask

    def speedbench_samples(self, batch) -> int:
        """The documents in a batch: its rows, or the distinct ids of packed documents."""
        x = batch[0]
        if isinstance(x, (tuple, list)):
            return int(torch.unique(x[1][x[1] >= 0]).numel())
        return int(x.shape[0])


def build(vocab_size: int = 256, seq_len: int = 64, dim: int = 128, layers: int = 2,
          heads: int = 4) -> nn.Module:
    return TransformerLM(vocab_size, seq_len, dim, layers, heads)
