"""One small function per speed-up technique: how each knob acts on the loop, and when it can't.

Method cards (what each knob toggles, and the article claim it tests) are in README.md.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn as nn

from speedbench.models.per_step import PerStepTensors

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# --- precision ---------------------------------------------------------------------------------
def autocast(precision: str, device: torch.device):
    """fp16/bf16 autocast through torch.amp; fp32 runs as is."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.amp.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """fp16 needs loss scaling against gradient underflow; bf16 has fp32's range and does not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


# --- host-to-device copies (data.pin_memory is applied by the DataLoader) ----------------------
def to_device(batch, device: torch.device, non_blocking: bool):
    return tuple(t.to(device, non_blocking=non_blocking) for t in batch)


# --- per-step tensors ----------------------------------------------------------------------------
def makes_per_step_tensors(model: nn.Module) -> bool:
    """Whether any module of `model` makes per-step tensors the tensor_creation knob places."""
    return any(isinstance(m, PerStepTensors) for m in model.modules())


def set_tensor_creation(model: nn.Module, where: str) -> int:
    """Tell every module that makes per-step tensors where to make them; returns how many listen."""
    listeners = [m for m in model.modules() if isinstance(m, PerStepTensors)]
    for m in listeners:
        m.tensor_creation = where
    return len(listeners)


# --- sync points ---------------------------------------------------------------------------------
class LossMeter:
    """Keeps the running loss the way the `sync` knob says.

    item: `loss.item()` every step (a host read, which waits for the device);
    numpy: `loss.detach().cpu().numpy()` every step (a copy to the host, which waits too);
    deferred: `loss.detach()` summed on the device, read on the host every `every` steps.
    `host_reads` counts the reads, so tests and diagnosis can see them.
    """

    def __init__(self, mode: str, every: int, device: torch.device):
        self.mode, self.every, self.device = mode, every, device
        self.reset()

    def reset(self) -> None:
        self.host_sum, self.count, self.host_reads = 0.0, 0, 0
        self.pending = torch.zeros((), device=self.device)
        self.pending_n = 0

    def add(self, loss: torch.Tensor) -> None:
        self.count += 1
        if self.mode == "item":
            self.host_sum += loss.item()
            self.host_reads += 1
        elif self.mode == "numpy":
            self.host_sum += float(loss.detach().float().cpu().numpy())
            self.host_reads += 1
        else:
            self.pending += loss.detach().float()
            self.pending_n += 1
            if self.pending_n >= self.every:
                self._drain()

    def _drain(self) -> None:
        if self.pending_n:
            self.host_sum += self.pending.item()
            self.host_reads += 1
            self.pending.zero_()
            self.pending_n = 0

    def mean(self) -> float:
        self._drain()
        return self.host_sum / self.count if self.count else math.nan


# --- caching allocator -----------------------------------------------------------------------------
def maybe_empty_cache(enabled: bool, device: torch.device) -> None:
    if enabled and device.type == "cuda":
        torch.cuda.empty_cache()


# --- global state that must not leak from one variant into the next -----------------------------------
@contextlib.contextmanager
def restored_global_state():
    saved = (torch.get_num_threads(), torch.backends.cudnn.benchmark,
             torch.get_float32_matmul_precision())
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.set_float32_matmul_precision(saved[2])


# --- knobs that cannot act here ------------------------------------------------------------------------
def not_applicable(recipe, device: torch.device, makes_per_step_tensors: bool) -> Optional[str]:
    """Why this recipe cannot be measured honestly on this device, or None when it can.

    A knob left at its plain-PyTorch default never makes a recipe n/a; one moved away from it
    that has nothing to act on here does.
    """
    cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    if recipe.parallel == "dp" and gpus < 2:
        return f"n/a: DataParallel needs at least two CUDA devices (this run has {gpus})"
    if recipe.data.pin_memory and not cuda:
        return "n/a: pin_memory needs CUDA (no pinned host-to-device copy without it)"
    if recipe.data.non_blocking and not cuda:
        return "n/a: non_blocking needs CUDA (copies to the CPU are synchronous)"
    if recipe.empty_cache and not cuda:
        return "n/a: empty_cache needs CUDA (the CPU has no caching allocator to empty)"
    if recipe.tensor_creation == "host":
        if device.type == "cpu":
            return "n/a: tensor_creation=host needs an accelerator (on the CPU host and device are one)"
        if not makes_per_step_tensors:
            return "n/a: this model makes no per-step tensors through speedbench"
    return None
