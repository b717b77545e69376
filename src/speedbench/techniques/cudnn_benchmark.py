"""cudnn.benchmark: let cuDNN time its convolution algorithms for each new shape, keep the best."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique


class FirstStep:
    """The first optimizer step's time (synchronised; it is a warm-up step): where cuDNN's
    autotuning is paid."""

    def __init__(self, device: torch.device):
        self.device, self.start, self.seconds = device, time.perf_counter(), math.nan

    def step_done(self) -> None:
        if math.isnan(self.seconds):
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self.start


class CudnnBenchmark(Technique):
    name = "cudnn_benchmark"
    card = """\
**What**: `torch.backends.cudnn.benchmark = True`: for every new input shape cuDNN tries its
convolution algorithms and keeps the fastest (PyTorch's default is a heuristic choice).
**Helps**: convolution models with fixed input shapes on NVIDIA GPUs.
**Costs**: the autotuning in the first steps (`first_step_s`, in the warm-up), again for every
new shape; algorithms may differ from run to run (not bit-reproducible). CUDA only."""
    fields = (Field("cudnn_benchmark", bool, False,
                    "torch.backends.cudnn.benchmark (autotune convolutions; CUDA only)"),)
    example = {"cudnn_benchmark": True}
    acts_on = ActsOn(model="resnet", device="cuda", why="a CPU has no cuDNN")
    snippets = {"cudnn_benchmark": {True: ("cuDNN autotuning for fixed input shapes",
                                           "torch.backends.cudnn.benchmark = True")}}
    extra_columns = ("first_step_s",)

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.cudnn_benchmark and not ctx.cuda:
            return (f"n/a: cudnn_benchmark tunes cuDNN, which only CUDA devices have (this run "
                    f"is on {ctx.device.type})")
        return None

    def global_state(self, recipe, ctx: Context):
        return _benchmark(recipe.cudnn_benchmark) if ctx.cuda else contextlib.nullcontext()

    def prepare_model(self, model, recipe, ctx: Context):
        if ctx.cuda:  # every CUDA trial: the baseline's first step is the comparison
            ctx.extra["first_step"] = FirstStep(ctx.device)
        return model

    def after_step(self, recipe, ctx: Context) -> None:
        first = ctx.extra.get("first_step")
        if first is not None:
            first.step_done()

    def columns(self, recipe, ctx: Context) -> dict:
        first = ctx.extra.get("first_step")
        return {**super().columns(recipe, ctx),
                "first_step_s": first.seconds if first is not None else math.nan}


@contextlib.contextmanager
def _benchmark(on: bool):
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved
