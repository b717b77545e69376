"""CUDA graphs in eager mode: the model's forward and backward captured once with
`torch.cuda.make_graphed_callables` and replayed every step (the optimizer step stays eager).

Written against the PyTorch docs ("CUDA Graphs" in the CUDA semantics notes;
torch.cuda.make_graphed_callables). The capture needs the first batch's tensors as its sample
arguments, so the model is wrapped and captured on its first training call; every later batch
must have the same shapes (the graph replays fixed addresses). `compile=reduce-overhead` is
the compiled route to the same graphs. n/a on a CPU, and with what capture cannot take: DDP's
and FSDP's hooks, autocast's cache, packed batches of varying shapes, a compiled model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Technique, amdahl,
                                        percent, times)


class GraphedOnFirstCall(nn.Module):
    """Wraps `inner`; its first call in training mode captures inner's forward and backward
    with make_graphed_callables (that call's tensors as the sample arguments) and every call
    replays them. Calls in eval mode run `inner` eagerly."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.graphed = None
        self.shapes: Optional[list] = None

    def forward(self, *args):
        if not self.training:
            return self.inner(*args)
        shapes = [tuple(a.shape) for a in args]
        if self.graphed is None:
            self.graphed = torch.cuda.make_graphed_callables(self.inner, tuple(args))
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ValueError(f"cuda_graphs: the graph was captured for inputs of shapes "
                             f"{self.shapes} and is replayed only for those; this batch has "
                             f"{shapes} (keep batches the same size: drop_last, fixed lengths)")
        return self.graphed(*args)


def obstacle(recipe) -> Optional[str]:
    """What in the recipe stops a capture, or None."""
    if recipe.parallel in ("ddp", "fsdp", "dp"):
        return (f"parallel={recipe.parallel}: make_graphed_callables takes a module without "
                "hooks, and DDP/FSDP register theirs (graph the whole step by hand instead)")
    if recipe.precision != "fp32":
        return (f"precision={recipe.precision}: a captured autocast region needs "
                "autocast(cache_enabled=False), which the precision technique does not set")
    if recipe.compile != "off":
        return "compile is on: compile=reduce-overhead makes CUDA graphs the compiled way"
    if recipe.tensor_creation == "host":
        return ("tensor_creation=host: a per-step copy from pageable host memory synchronises, "
                "which a capture cannot hold")
    if recipe.data.packing != "pad":
        return (f"data.packing={recipe.data.packing}: packed rows change shape from batch to "
                "batch, and a graph replays one shape")
    return None


class CudaGraphs(Technique):
    name = "cuda_graphs"
    # it captures the model as these leave it
    after = ("checkpointing", "attention", "chunked_ce", "float8", "flex_attention", "fused_ce",
             "offload")
    card = """\
**What**: `torch.cuda.make_graphed_callables(model, sample_args)`: the model's forward and
backward kernels are captured once into CUDA graphs and replayed each step with one launch
(the optimizer step stays eager).
**Helps**: launch-bound training (small kernels, small batches, a slow host): MLPerf v1.0
reported 1.70x on Mask R-CNN at 272 GPUs and 1.12x on BERT at 4,096 (the PyTorch blog
"Accelerating PyTorch with CUDA Graphs").
**Costs**: static shapes and addresses (every batch the same size), no CPU syncs or hooks
inside, a private memory pool for the graph; autocast only without its cache. CUDA only;
`compile=reduce-overhead` is the compiled route to the same graphs."""
    fields = (Field("cuda_graphs", bool, False,
                    "capture forward and backward in CUDA graphs (make_graphed_callables)"),)
    example = {"cuda_graphs": True}
    acts_on = ActsOn(device="cuda", why="CUDA graphs capture CUDA kernels")
    extra_columns = ("graph_captured",)
    snippets = {"cuda_graphs": {True: ("CUDA graphs for forward and backward", """\
x0, y0 = next(iter(loader))  # a batch of the size every step has (drop_last=True)
model = torch.cuda.make_graphed_callables(model, (x0.cuda(), y0.cuda()))
for x, y in loader:  # forward and backward replay the graphs; the optimizer stays eager
    loss = model(x.cuda(), y.cuda())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if not recipe.cuda_graphs:
            return None
        if not ctx.cuda:
            return f"n/a: CUDA graphs capture CUDA kernels (this run is on {ctx.device.type})"
        why = obstacle(recipe)
        return f"n/a: cuda_graphs with {why}" if why else None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.cuda_graphs and ctx.cuda and obstacle(recipe) is None:
            return GraphedOnFirstCall(model)
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        model = getattr(ctx.trainer, "model", None)
        captured = isinstance(model, GraphedOnFirstCall) and model.graphed is not None
        return {**super().columns(recipe, ctx), "graph_captured": captured}

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if baseline.cuda_graphs or not recipe.cuda_graphs:
            return None
        # what a graph removes is the host's launch time: on CUDA's timeline, the step's
        # `python` share (the device idle while the host could not launch fast enough)
        share = profile.share("python")
        best = amdahl(share)
        return Bound(best, share, f"the device waited on the host's launches for "
                     f"{percent(share)} of the step: graphs gain at most {times(best)}")
