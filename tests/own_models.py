"""Models written the way people write them (Hugging Face style), given to speedbench via
_target_: they return a dict, a tuple or an output object, or take keyword inputs."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelOutput(OrderedDict):
    """Like transformers.utils.ModelOutput: a dict whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TinyLM(nn.Module):
    """forward(input_ids, labels=None) -> {"loss": ..., "logits": ...} (or a ModelOutput, a
    namespace or a tuple, by `returns`)."""

    def __init__(self, vocab_size: int = 32, dim: int = 16, returns: str = "dict"):
        super().__init__()
        self.returns = returns
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.embed(input_ids))
        loss = None if labels is None else F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if self.returns == "tuple":
            return (loss, logits) if loss is not None else (logits,)
        if self.returns == "namespace":
            return SimpleNamespace(loss=loss, logits=logits)
        if self.returns == "output":
            return ModelOutput(loss=loss, logits=logits) if loss is not None else \
                ModelOutput(logits=logits)
        if self.returns == "string":
            return "not a tensor"
        return {"loss": loss, "logits": logits}


def build_lm(**kwargs) -> nn.Module:
    return TinyLM(**kwargs)
