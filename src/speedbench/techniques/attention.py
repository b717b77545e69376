"""Attention kernel: which scaled_dot_product_attention backend runs (sdpa_kernel).

`auto` (the default) leaves the choice to PyTorch and the model as it is. Any explicit backend
makes the model use SDPA's own `is_causal=True` rather than its per-step boolean mask (fused
GPU kernels take no explicit mask; the result is the same), for every backend alike, so the
backends are compared on equal terms. The backend is selected for the whole trial (not only
around the forward pass), so backward and checkpointing's recomputation use it too.
Whether a backend has a kernel here is asked of torch (a tiny forward and backward under
sdpa_kernel); on a CPU, torch 2.14 has `math` and `flash` only.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from speedbench.techniques.base import ActsOn, Context, Field, Technique, global_flag

BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
PROBE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# sdpa_kernel sets these process-wide flags; the trial checks they come back as they were.
for _name in ("flash", "mem_efficient", "math", "cudnn"):
    _read = getattr(torch.backends.cuda, f"{_name}_sdp_enabled", None)
    _write = getattr(torch.backends.cuda, f"enable_{_name}_sdp", None)
    if _read is not None and _write is not None:
        global_flag(f"sdp.{_name}", _read, _write)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose attention speedbench can steer: they have a `causal` switch (mask or
    is_causal) and a `head_dim`, as the reference transformer has."""
    return [m for m in model.modules() if hasattr(type(m), "causal") and hasattr(m, "head_dim")]


def kernel_missing(backend: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int) -> Optional[str]:
    """Why torch has no `backend` kernel for these inputs here, or None when it runs."""
    q = torch.randn(1, 2, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(BACKENDS[backend]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return None
        except RuntimeError as exc:
            why = [str(w.message).strip().splitlines()[0] for w in caught
                   if "kernel not used" in str(w.message) or "requires" in str(w.message)]
            return why[0] if why else str(exc).strip().splitlines()[0]


class Attention(Technique):
    name = "attention"
    card = """\
**What**: chooses `F.scaled_dot_product_attention`'s kernel with
`torch.nn.attention.sdpa_kernel`: `math` (plain matmul + softmax, materialises the T x T
scores), `flash` (FlashAttention: tiled, never stores the scores), `efficient`
(memory-efficient attention, xFormers), `cudnn` (cuDNN's fused attention). Transformer only.
**Helps**: long sequences: the fused kernels' memory grows with T, not T squared, and they
read and write far less memory. On GPUs flash and cudnn need fp16/bf16.
**Costs**: nothing when a kernel fits; a backend without a kernel for these inputs is n/a."""
    fields = (Field("attention", Literal[("auto", *BACKENDS)], "auto",
                    "scaled_dot_product_attention's backend; auto: PyTorch chooses"),)
    example = {"attention": "math"}
    acts_on = ActsOn()  # the transformer's attention
    snippets = {"attention": {
        name: (f"SDPA {name} attention backend", f"""\
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.{backend.name}):
    loss = loss_fn(model(x), y)""") for name, backend in BACKENDS.items()}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.attention == "auto" or ctx.model is None:
            return None
        modules = attention_modules(ctx.model)
        if not modules:
            return ("n/a: attention kernels act on scaled_dot_product_attention in the "
                    "transformer; this model has no attention speedbench can steer")
        dtype = PROBE_DTYPES.get(recipe.precision, torch.float32)  # autocast's, if any
        head_dim = modules[0].head_dim
        reason = kernel_missing(recipe.attention, ctx.device, dtype, head_dim)
        if not reason:
            return None
        if "No viable backend" in reason:  # torch's generic words: say which ones do run here
            have = [b for b in BACKENDS if b != recipe.attention
                    and kernel_missing(b, ctx.device, dtype, head_dim) is None]
            reason = f"kernels here: {', '.join(have) or 'none'}"
        return (f"n/a: torch {torch.__version__.split('+')[0]} has no {recipe.attention} "
                f"attention kernel for {ctx.device.type} {str(dtype).replace('torch.', '')} "
                f"inputs ({reason})")

    def global_state(self, recipe, ctx: Context):
        if recipe.attention == "auto":
            return contextlib.nullcontext()
        return sdpa_kernel(BACKENDS[recipe.attention])

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.attention != "auto":
            for module in attention_modules(model):
                module.causal = "is_causal"
        return model
