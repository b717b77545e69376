"""Tensors a model creates anew every step (VAE noise, causal masks, positions).

The `tensor_creation` knob decides where they are born: `device` creates them where they are
used; `host` creates them on the CPU and copies them over, as the articles' bad example does.
"""
from __future__ import annotations

from typing import Callable

import torch


class PerStepTensors:
    """Mixin for modules that make per-step tensors; the knob sets `tensor_creation`."""

    tensor_creation: str = "device"
    host_creations: int = 0  # how many tensors were born on the host (tests read it)

    def new_tensor(self, factory: Callable[..., torch.Tensor], *args, device: torch.device,
                   **kwargs) -> torch.Tensor:
        if self.tensor_creation == "host" and device.type != "cpu":
            self.host_creations += 1
            return factory(*args, **kwargs).to(device)
        return factory(*args, device=device, **kwargs)
