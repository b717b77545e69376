"""Debugging APIs left on during training: anomaly detection and the autograd profiler.

The Performance Tuning Guide's "Disable debugging APIs": `torch.autograd.set_detect_anomaly(True)`
records a stack trace with every autograd node and checks every backward output for NaN;
`torch.autograd.profiler.profile` records an event per operator; `emit_nvtx` (CUDA) pushes an
NVTX range per operator. Each is switched on for the whole trial and off (restored) after it.
"""
from __future__ import annotations

import contextlib
from typing import Literal, Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique, global_flag

# Anomaly mode is process-wide: every trial puts it back as it found it.
global_flag("autograd.detect_anomaly",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda v: torch.autograd.set_detect_anomaly(*v))

PROFILERS = ("profiler", "nvtx")


class DebugApis(Technique):
    name = "debug_apis"
    card = """\
**What**: leaves a debugging API on for the whole training run: `anomaly`
(`torch.autograd.set_detect_anomaly(True)`: a traceback per autograd node, a NaN check of every
backward output), `profiler` (`torch.autograd.profiler.profile()`: an event per operator, CUDA
kernels too on a GPU) or `nvtx` (`torch.autograd.profiler.emit_nvtx()`, CUDA: an NVTX range
per operator). `off` (the default) is a clean training loop.
**Helps**: nothing for speed: this measures what forgetting one costs.
**Costs**: Python and bookkeeping per operator, in forward and backward; the profiler also
keeps its events in memory until it stops."""
    fields = (Field("debug_api", Literal["off", "anomaly", *PROFILERS], "off",
                    "a debugging API left on during training (anomaly detection, the autograd "
                    "profiler, emit_nvtx on CUDA)"),)
    example = {"debug_api": "anomaly"}
    acts_on = ActsOn()
    snippets = {"debug_api": {"off": ("no debugging APIs in the training loop", """\
# delete, or guard with a debug flag:
# torch.autograd.set_detect_anomaly(True)
# with torch.autograd.profiler.profile(): ...
# with torch.autograd.profiler.emit_nvtx(): ...""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.debug_api == "nvtx" and not ctx.cuda:
            return "n/a: emit_nvtx needs CUDA (NVTX ranges are markers for NVIDIA's profilers)"
        if recipe.debug_api in PROFILERS and recipe.profile == "pytorch":
            return ("n/a: profile=pytorch runs torch.profiler, and only one autograd profiler "
                    "can be on at a time")
        return None

    def global_state(self, recipe, ctx: Context):
        if recipe.debug_api == "anomaly":
            return _anomaly()
        if recipe.debug_api == "profiler":
            return torch.autograd.profiler.profile(use_device="cuda" if ctx.cuda else None)
        if recipe.debug_api == "nvtx" and ctx.cuda:
            return torch.autograd.profiler.emit_nvtx()
        return contextlib.nullcontext()


@contextlib.contextmanager
def _anomaly():
    saved = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    torch.autograd.set_detect_anomaly(True)
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(*saved)
