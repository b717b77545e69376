"""fp32 matmul precision: torch.set_float32_matmul_precision, and cuDNN's TF32 for convolutions.

What a CPU does with it (torch 2.14, measured on an AMD EPYC with AVX-512 BF16): `medium` sets
oneDNN's matmul `fp32_precision` to bf16 and routes fp32 matmuls through oneDNN with
`fpmath:bf16` (ONEDNN_VERBOSE shows it), `high` sets it to tf32; on that CPU the results kept
fp32 accuracy (relative error 4e-7 for a 1024x1024 product, bf16 would give ~1e-3), so the flag
changes which kernel runs, not the arithmetic. CPUs with AMX-BF16 may compute in bf16.
"""
from __future__ import annotations

import contextlib
from typing import Literal, Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique, global_flag

# set_float32_matmul_precision also sets oneDNN's flag; restoring the precision alone may not
# put oneDNN's back as it was ("none" becomes "ieee"): restore it by name too.
_MKLDNN = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
if _MKLDNN is not None and hasattr(_MKLDNN, "fp32_precision"):
    global_flag("mkldnn.matmul.fp32_precision", lambda: _MKLDNN.fp32_precision,
                lambda v: setattr(_MKLDNN, "fp32_precision", v))


class MatmulPrecision(Technique):
    name = "matmul_precision"
    card = """\
**What**: `torch.set_float32_matmul_precision`: `highest` (full fp32; here also cuDNN TF32
off), `high` (TF32 tensor cores for fp32 matmuls on Ampere+ GPUs; cuDNN TF32 on), `medium`
(bf16 allowed too). null (the default) leaves PyTorch's defaults: fp32 matmuls, TF32 convs.
**Helps**: fp32 training on Ampere or newer GPUs (TF32 runs on tensor cores, up to 8x an
A100's fp32 rate) without autocast. On CPUs it selects oneDNN's reduced-precision path,
which computes in bf16 only where the CPU has bf16 matrix units.
**Costs**: TF32 keeps 10 mantissa bits (fp32 has 23): look at the loss column."""
    fields = (Field("matmul_precision", Optional[Literal["highest", "high", "medium"]], None,
                    "null: PyTorch's defaults; high: TF32 matmuls; medium: bf16 too"),)
    example = {"matmul_precision": "medium"}
    acts_on = ActsOn()
    snippets = {"matmul_precision": {
        value: (f"float32 matmul precision '{value}' (TF32 on Ampere+ GPUs)",
                f'torch.set_float32_matmul_precision("{value}")')
        for value in ("high", "medium")}}
    extra_columns = ("cudnn_tf32",)

    def global_state(self, recipe, ctx: Context):
        if recipe.matmul_precision is None:
            return contextlib.nullcontext()
        return _precision(recipe.matmul_precision)

    def columns(self, recipe, ctx: Context) -> dict:
        return {"matmul_precision": recipe.matmul_precision or "default",
                "cudnn_tf32": cudnn_tf32(recipe.matmul_precision)}


def cudnn_tf32(precision: Optional[str]) -> bool:
    """cuDNN convolutions in TF32: off only for `highest` (PyTorch's default is on)."""
    return precision != "highest"


@contextlib.contextmanager
def _precision(precision: str):
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32(precision)
    try:
        yield
    finally:  # the trial restores every registered flag as well
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]
