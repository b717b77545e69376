"""channels_last: convolution models' weights and inputs in NHWC order instead of NCHW."""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn as nn

from speedbench.techniques.base import ActsOn, Context, Field, Technique


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _channels_last(obj):
    """Every 4-D tensor in `obj` (a tensor, or a tuple, list or dict of them, nested) in
    channels_last; the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.contiguous(memory_format=torch.channels_last) if obj.dim() == 4 else obj
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_channels_last(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _channels_last(v) for k, v in obj.items()}
    return obj


def _inputs_channels_last(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the image batch (first argument: a 4-D tensor, or each 4-D tensor of
    a tuple, list or dict of them) in channels_last, as the tutorial does with
    `input = input.to(memory_format=torch.channels_last)`."""
    if args:
        return (_channels_last(args[0]), *args[1:])
    return args


class MemoryFormat(Technique):
    name = "memory_format"
    card = """\
**What**: `model.to(memory_format=torch.channels_last)` and each image batch converted the
same way (NHWC: channels innermost), so convolutions run without layout conversions.
**Helps**: convolution models with fp16/bf16 on tensor-core GPUs (cuDNN's NHWC kernels) and
on CPUs through oneDNN, whose fast convolution kernels are channels-last.
**Costs**: one copy of each input batch; layers without an NHWC kernel convert back and forth.
Convolution models only: n/a for the transformer."""
    fields = (Field("memory_format", Literal["contiguous", "channels_last"], "contiguous",
                    "memory layout of the weights and image batches (convolution models)"),)
    example = {"memory_format": "channels_last"}
    acts_on = ActsOn(model="resnet")  # channels_last needs 2-D convolutions
    snippets = {"memory_format": {"channels_last": (
        "channels_last memory format (convolutional models)", """\
model = model.to(memory_format=torch.channels_last)
x = x.to(device, memory_format=torch.channels_last)""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.memory_format == "channels_last" and ctx.model is not None \
                and not has_conv2d(ctx.model):
            return ("n/a: channels_last changes the layout of 4-D convolution tensors; this "
                    "model has no 2-D convolution")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.memory_format == "contiguous":
            return model
        model = model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last)
        return model
