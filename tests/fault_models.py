"""Models that fail on purpose, for the fault-handling tests (given to speedbench via _target_)."""
from __future__ import annotations

import torch
import torch.nn as nn


class Tiny(nn.Module):
    """A small image classifier without BatchNorm: forward(x) returns logits."""

    def __init__(self, num_classes: int = 10, fail: str = "none"):
        super().__init__()
        self.fail = fail
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = torch.is_autocast_enabled(x.device.type)
        if half and self.fail == "error_in_autocast":
            raise RuntimeError("this model breaks under autocast")
        if half and self.fail == "oom_in_autocast":
            raise torch.OutOfMemoryError("pretend the device ran out of memory")
        out = self.net(x)
        if half and self.fail == "nan_in_autocast":
            out = out * float("nan")
        return out
