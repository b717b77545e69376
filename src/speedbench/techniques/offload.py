"""Activation offloading: the tensors autograd saves for backward are copied to pinned host
memory in forward and brought back in backward (torch.autograd.graph.save_on_cpu).

Written against the PyTorch docs (torch.autograd.graph.save_on_cpu, "Hooks for saved
tensors"). On a CPU the activations live in host memory already: n/a. torchtune's offloading
overlaps the copies with compute on extra CUDA streams; save_on_cpu copies on the current
stream, so this is the plain form, and its cost is the copies' time.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique


class Offload(Technique):
    name = "offload"
    card = """\
**What**: `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward pass: every
tensor autograd keeps for backward is copied to pinned host memory and copied back when
backward needs it.
**Helps**: GPU memory: the activations (`activation_mem_mb`, often the largest part of a
step's memory) leave the GPU, so a larger batch or model fits; a cheaper route than
recomputation when the host link is fast.
**Costs**: two PCIe copies of every saved tensor per step (on the current stream: not
overlapped with compute as torchtune's multi-stream offloading is), and host memory. CUDA
only: on a CPU the activations are in host memory already."""
    fields = (Field("offload_activations", bool, False,
                    "saved activations to pinned host memory in forward, back in backward"),)
    example = {"offload_activations": True}
    acts_on = ActsOn(device="cuda", why="it moves activations from GPU memory to the host")
    snippets = {"offload_activations": {True: ("offload activations to the host", """\
with torch.autograd.graph.save_on_cpu(pin_memory=True):
    loss = loss_fn(model(x), y)
loss.backward()  # the saved tensors come back to the GPU as backward needs them""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.offload_activations and not ctx.cuda:
            return ("n/a: activation offloading moves saved activations from GPU memory to the "
                    f"host; on {ctx.device.type} they are in host memory already")
        return None

    def step_context(self, recipe, ctx: Context):
        if recipe.offload_activations and ctx.cuda:
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def bound(self, recipe, baseline, profile, peaks):
        if recipe.offload_activations == baseline.offload_activations:
            return None
        return ("n/a: a memory technique: it adds copies and saves no time; what it frees is "
                "the baseline's activation memory (activation_mem_mb)")
