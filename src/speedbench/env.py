"""What the machine and software were: enough to explain why two runs differ."""
from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

# Environment variables that change performance.
PERF_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG",
             "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_devices() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return out


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def collect(device: str) -> dict:
    gpus = cuda_devices()
    return {
        "device": device,
        "device_name": gpus[0]["name"] if device.startswith("cuda") and gpus else cpu_model(),
        "cuda_devices": gpus,
        "cuda_device_count": len(gpus),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "nvidia_driver": driver_version() if gpus else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mp_start_method": multiprocessing.get_start_method(allow_none=True) or "default",
        "env": {k: os.environ.get(k) for k in PERF_VARS if k in os.environ},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "versions": {d: _version(d) for d in ("torch", "torchvision", "hydra-core", "omegaconf",
                                                  "pandas", "numpy", "matplotlib", "speedbench")},
        "torch_config_cpu": torch.backends.cpu.get_cpu_capability(),
        "git_revision": git_revision(),
    }
