"""ResNet image classifier from torchvision (forward returns logits; loss: cross_entropy).

`checkpoint_blocks = True` (set by the checkpointing technique) recomputes each residual block's
activations in the backward pass instead of storing them (torch.utils.checkpoint, non-reentrant).
The subclass only changes the forward pass: parameters, their names and their same-seed values
are torchvision's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torchvision.models as tvm
from torch.utils.checkpoint import checkpoint

# arch -> (block type, blocks per stage), as torchvision's resnetNN() builders define them.
ARCH_LAYOUT = {
    "resnet18": (tvm.resnet.BasicBlock, [2, 2, 2, 2]),
    "resnet34": (tvm.resnet.BasicBlock, [3, 4, 6, 3]),
    "resnet50": (tvm.resnet.Bottleneck, [3, 4, 6, 3]),
    "resnet101": (tvm.resnet.Bottleneck, [3, 4, 23, 3]),
}
ARCHS = tuple(ARCH_LAYOUT)


class ResNet(tvm.ResNet):
    checkpoint_blocks: bool = False  # recompute each residual block in backward
    checkpoint_options: dict = {}  # checkpoint()'s keywords (selective: context_fn); per instance

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.checkpoint_blocks and self.training and torch.is_grad_enabled()):
            return super()._forward_impl(x)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                x = checkpoint(block, x, use_reentrant=False, **self.checkpoint_options)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(arch: str = "resnet18", num_classes: int = 10) -> nn.Module:
    if arch not in ARCHS:
        raise ValueError(f"arch: '{arch}' is not allowed; choose one of {', '.join(ARCHS)}")
    block, layers = ARCH_LAYOUT[arch]
    return ResNet(block, layers, num_classes=num_classes)
