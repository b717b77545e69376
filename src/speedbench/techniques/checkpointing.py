"""Activation checkpointing: recompute each block's activations in backward instead of storing them.

A model opts in with a `checkpoint_blocks` attribute (the reference models have one: ResNet's
residual blocks, the VAE's encoder and decoder stages, the transformer's blocks); they call
torch.utils.checkpoint.checkpoint(..., use_reentrant=False) per block when it is True, with
the keywords in their `checkpoint_options`.

`selective` is op-level (selective) activation checkpointing, as torchtitan's "per-op SAC": the
same per-block checkpoint with a policy (torch.utils.checkpoint.create_selective_checkpoint_
contexts) that keeps the outputs of the compute-heavy ops (matrix products, convolutions,
attention) and recomputes only the cheap ones (element-wise, normalisation) in backward: less
memory saved than `blocks`, less time lost. The VAE's stages go through checkpoint_sequential,
which takes no policy: selective is n/a there.
"""
from __future__ import annotations

import functools
from typing import Literal, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from speedbench.techniques.base import ActsOn, Context, Field, Technique


# The compute-heavy ops whose outputs selective checkpointing keeps (those this torch has).
SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
SAVED = frozenset(getattr(torch.ops.aten, name).default for name in SAVED_OPS
                  if hasattr(torch.ops.aten, name))


def keep_compute_heavy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what is costly to recompute, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                             keep_compute_heavy)}


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
(the training loss is unchanged).
`selective` (op-level, a policy): the same checkpoint per block, but the outputs of matrix
products, convolutions and attention are kept and only the cheap ops (element-wise,
normalisation) recomputed: part of the memory for a small part of the time."""
    fields = (Field("checkpointing", Literal["off", "blocks", "selective"], "off",
                    "blocks: recompute each block's activations in backward; selective: "
                    "keep matmul/conv/attention outputs, recompute the rest"),)
    example = {"checkpointing": "blocks"}
    acts_on = ActsOn()  # the transformer's blocks
    snippets = {"checkpointing": {"blocks": (
        "activation checkpointing per block (less memory, more compute)", """\
from torch.utils.checkpoint import checkpoint
def forward(self, x):
    for block in self.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return self.head(x)"""), "selective": (
        "selective (op-level) activation checkpointing: recompute only the cheap ops", """\
import functools
import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)
KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default}
def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE
context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
# in forward, per block:
x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.checkpointing != "off" and ctx.model is not None \
                and not checkpointable(ctx.model):
            return ("n/a: this model has no blocks speedbench can checkpoint (a model opts in "
                    "with a `checkpoint_blocks` attribute, as the reference models do)")
        if recipe.checkpointing == "selective" and ctx.model is not None and not all(
                hasattr(type(m), "checkpoint_options") for m in checkpointable(ctx.model)):
            return ("n/a: selective checkpointing passes a policy to the model's checkpoint "
                    "calls; this model's take no `checkpoint_options` (the reference models' do)")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.checkpointing != "off":
            for module in checkpointable(model):
                module.checkpoint_blocks = True
                if recipe.checkpointing == "selective":
                    module.checkpoint_options = SELECTIVE
        return model
