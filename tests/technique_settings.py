"""Where each technique of the registry can act, for its generic test (Composer's
algorithm_settings): the model and the device on which its example setting changes the trial.

tests/test_techniques.py fails when a technique has no entry here, so a new technique is tested
where it acts instead of as n/a plumbing. A technique that acts on CUDA only is skipped
without it; its CPU side (the n/a reason) is checked without a trial.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    model: str = "transformer"
    device: str = "cpu"
    gpus: int = 0  # CUDA devices it needs (device="cuda" implies at least 1)
    why: str = ""  # why it cannot act on a CPU (device="cuda" only)


CUDA_ONLY = "cuda"

TECHNIQUE_SETTINGS: dict[str, Setting] = {
    "precision": Setting(),  # bf16 autocast acts on a CPU
    "accumulation": Setting(),
    "loader": Setting(),  # one worker process
    "tensor_creation": Setting(device=CUDA_ONLY, why="host and device are one on a CPU"),
    "sync": Setting(),
    "empty_cache": Setting(device=CUDA_ONLY, why="it empties CUDA's caching allocator"),
    "memory_format": Setting(model="resnet"),  # channels_last needs 2-D convolutions
    "checkpointing": Setting(),  # the transformer's blocks
    "attention": Setting(),  # the transformer's attention
    "matmul_precision": Setting(),
    "cudnn_benchmark": Setting(model="resnet", device=CUDA_ONLY, why="a CPU has no cuDNN"),
    "optimizer": Setting(),  # fused AdamW on a CPU since torch 2.4
    # The example is DataParallel; DDP and FSDP on a CPU run under torchrun in
    # tests/test_distributed.py and tests/test_experiments.py.
    "parallel": Setting(device=CUDA_ONLY, gpus=2, why="DataParallel needs two CUDA devices"),
    "compile": Setting(),
}
