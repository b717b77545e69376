"""oneDNN's reduced-precision math for fp32 ops on the CPU: the CPU counterpart of TF32.

`torch.backends.mkldnn.fp32_precision = "bf16"` (torch >= 2.9; the matmul, conv and rnn
children follow it) lets oneDNN compute fp32 matmuls and convolutions with bf16 inputs and fp32
accumulation where the CPU has bf16 matrix hardware (AVX512-BF16, AMX-BF16); it also routes
fp32 matmuls through oneDNN instead of the BLAS. Without that hardware oneDNN keeps fp32
arithmetic (measured on an AVX2-only EPYC, torch 2.14.1: the relative error of a 512x512
product stays 2.5e-7 under bf16; bf16 inputs would give about 1e-3), so a speed difference
there comes from the kernel choice only. Each row records both: the relative error of a
reference matmul under the setting, and the bf16 hardware the CPU has.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Literal, Optional

import torch

from speedbench.techniques.base import ActsOn, Context, Field, Technique, global_flag

_MKLDNN = getattr(torch.backends, "mkldnn", None)
# The backend-wide setting and its children (matmul's is registered by matmul_precision).
_NODES = {"mkldnn.fp32_precision": _MKLDNN,
          "mkldnn.conv.fp32_precision": getattr(_MKLDNN, "conv", None),
          "mkldnn.rnn.fp32_precision": getattr(_MKLDNN, "rnn", None)}
HAS_FLAG = _MKLDNN is not None and hasattr(_MKLDNN, "fp32_precision")
if HAS_FLAG:
    for _name, _node in _NODES.items():
        if _node is not None and hasattr(_node, "fp32_precision"):
            global_flag(_name, lambda n=_node: n.fp32_precision,
                        lambda v, n=_node: setattr(n, "fp32_precision", v))

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names, best first


def bf16_hardware(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's bf16 matrix hardware: amx_bf16, avx512_bf16, none, or unknown (no cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return next((f for f in BF16_FLAGS if f in flags), "none")


def matmul_rel_error(n: int = 512) -> float:
    """Relative error (Frobenius) of an n x n fp32 product under the current settings, against
    the same product in fp64: ~1e-7 in fp32 arithmetic, ~1e-3 with bf16 inputs."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    ref = a.double() @ b.double()
    return float((a @ b).double().sub(ref).norm() / ref.norm())


class OnednnPrecision(Technique):
    name = "onednn_precision"
    after = ("matmul_precision",)  # it reads the float32 matmul precision on entry
    card = """\
**What**: `torch.backends.mkldnn.fp32_precision`: `bf16` lets oneDNN run fp32 matmuls and
convolutions on the CPU with bf16 inputs and fp32 accumulation (`tf32`: TF32 inputs); `ieee`
keeps full fp32. null (the default) leaves PyTorch's default (full fp32).
**Helps**: fp32 training on CPUs with bf16 matrix units (AVX512-BF16, AMX), without autocast.
Without them oneDNN keeps fp32 arithmetic: the row's `onednn_bf16_hw` and
`onednn_matmul_rel_err` say which happened.
**Costs**: bf16 keeps 8 mantissa bits (fp32 has 23): look at the loss column."""
    fields = (Field("onednn_precision", Optional[Literal["ieee", "bf16", "tf32"]], None,
                    "oneDNN's fp32 math on the CPU: null (PyTorch's default), ieee, bf16, tf32"),)
    # ieee acts on every CPU (it sets the flag); bf16 needs the hardware to change the math.
    example = {"onednn_precision": "ieee"}
    acts_on = ActsOn()
    snippets = {"onednn_precision": {
        value: (f"oneDNN {value} math for fp32 ops on the CPU",
                f'torch.backends.mkldnn.fp32_precision = "{value}"  # torch >= 2.9')
        for value in ("bf16", "tf32")}}
    extra_columns = ("onednn_bf16_hw", "onednn_matmul_rel_err")

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.onednn_precision is None:
            return None
        if not HAS_FLAG:
            return "n/a: this torch has no torch.backends.mkldnn.fp32_precision (torch >= 2.9)"
        if ctx.device.type != "cpu":
            return (f"n/a: oneDNN's fp32 precision acts on CPU kernels; this trial runs on "
                    f"{ctx.device.type} (see matmul_precision for TF32 there)")
        return None

    def global_state(self, recipe, ctx: Context):
        if recipe.onednn_precision is None or not HAS_FLAG or ctx.device.type != "cpu":
            return contextlib.nullcontext()
        return _precision(recipe.onednn_precision, ctx)

    def columns(self, recipe, ctx: Context) -> dict:
        return {"onednn_precision": recipe.onednn_precision or "default",
                "onednn_bf16_hw": bf16_hardware() if ctx.device.type == "cpu" else "-",
                "onednn_matmul_rel_err": ctx.extra.get("onednn_rel_err", math.nan)}


@contextlib.contextmanager
def _precision(value: str, ctx: Context):
    """Set the backend-wide precision (its children follow), measure the reference product's
    error under it, and restore every node on exit."""
    saved = {name: node.fp32_precision for name, node in _NODES.items() if node is not None}
    matmul = _MKLDNN.matmul.fp32_precision
    _MKLDNN.fp32_precision = value
    ctx.extra["onednn_rel_err"] = matmul_rel_error()
    try:
        yield
    finally:
        # The children first: torch reads a child's "none" as "follow the backend".
        _MKLDNN.matmul.fp32_precision = matmul
        for name, node in reversed(list(_NODES.items())):
            if node is not None:
                node.fp32_precision = saved[name]
