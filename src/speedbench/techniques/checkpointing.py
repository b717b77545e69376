"""Activation checkpointing: recompute each block's activations in backward instead of storing them.

A model opts in with a `checkpoint_blocks` attribute (the reference models have one: ResNet's
residual blocks, the VAE's encoder and decoder stages, the transformer's blocks); they call
torch.utils.checkpoint.checkpoint(..., use_reentrant=False) per block when it is True.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch.nn as nn

from speedbench.techniques.base import ActsOn, Context, Field, Technique


def checkpointable(model: nn.Module) -> list[nn.Module]:
    """The modules that switch checkpointing of their blocks with `checkpoint_blocks`."""
    return [m for m in model.modules() if hasattr(type(m), "checkpoint_blocks")]


class Checkpointing(Technique):
    name = "checkpointing"
    card = """\
**What**: `torch.utils.checkpoint` (non-reentrant) around each block: the forward pass keeps
only the blocks' inputs; backward runs each block's forward again to get its activations.
**Helps**: memory: activations are most of a large model's training memory, so a larger
batch or model fits (the capacity search says how much larger, on CUDA).
**Costs**: about one extra forward pass per step (a forward is roughly a third of a
training step's arithmetic). BatchNorm's running statistics see the recomputed batch twice
(the training loss is unchanged)."""
    fields = (Field("checkpointing", Literal["off", "blocks"], "off",
                    "blocks: recompute each block's activations in backward"),)
    example = {"checkpointing": "blocks"}
    acts_on = ActsOn()  # the transformer's blocks
    snippets = {"checkpointing": {"blocks": (
        "activation checkpointing per block (less memory, more compute)", """\
from torch.utils.checkpoint import checkpoint
def forward(self, x):
    for block in self.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return self.head(x)""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.checkpointing != "off" and ctx.model is not None \
                and not checkpointable(ctx.model):
            return ("n/a: this model has no blocks speedbench can checkpoint (a model opts in "
                    "with a `checkpoint_blocks` attribute, as the reference models do)")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.checkpointing == "blocks":
            for module in checkpointable(model):
                module.checkpoint_blocks = True
        return model
