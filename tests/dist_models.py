"""Tiny `_target_` models for the distributed tests (importable by the ranks: tests/ is put on
their PYTHONPATH). No BatchNorm, so DDP over 2 ranks and one process on the global batch
must end with the same weights."""
from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

VOCAB, SEQ = 32, 8
# A model config for `model=...`: tokens in, logits out (loss: cross_entropy).
TINY_LM = {"_target_": "dist_models.TinyLM", "dataset": {"kind": "tokens", "seq_len": SEQ,
                                                         "vocab_size": VOCAB},
           "loss": "cross_entropy", "batch_size": 4}


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


class FailsOnRank(TinyLM):
    """Raises in its `after`-th forward pass on rank `rank` (the RANK torchrun sets), or with
    `hang=True` stops there for an hour, as a deadlocked rank would. `others_busy_s` keeps the
    other ranks in that forward pass a while, so that torchrun's SIGTERM reaches them mid-step."""

    def __init__(self, rank: int = 1, after: int = 2, hang: bool = False,
                 others_busy_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.fail_rank, self.after, self.hang, self.calls = rank, after, hang, 0
        self.others_busy_s = others_busy_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.after and os.environ.get("RANK") != str(self.fail_rank):
            time.sleep(self.others_busy_s)
        if os.environ.get("RANK") == str(self.fail_rank) and self.calls >= self.after:
            if self.hang:
                time.sleep(3600)
            raise RuntimeError(f"injected failure on rank {self.fail_rank}")
        return super().forward(x)
