"""ResNet image classifier from torchvision (forward returns logits; loss: cross_entropy)."""
from __future__ import annotations

import torch.nn as nn
import torchvision.models as tvm

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


def build(arch: str = "resnet18", num_classes: int = 10) -> nn.Module:
    if arch not in ARCHS:
        raise ValueError(f"arch: '{arch}' is not allowed; choose one of {', '.join(ARCHS)}")
    return getattr(tvm, arch)(weights=None, num_classes=num_classes)
