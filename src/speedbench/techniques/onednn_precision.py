"""oneDNN's reduced-precision math for fp32 ops on the CPU: the CPU counterpart of TF32.

`torch.backends.mkldnn.fp32_precision = "bf16"` (torch >= 2.9; the matmul, conv and rnn
children follow it) *allows* oneDNN to compute fp32 matmuls and convolutions with bf16 inputs
and fp32 accumulation (oneDNN's "fpmath mode"); it also routes fp32 matmuls through oneDNN
instead of the BLAS where PyTorch's CPU check passes. Whether anything changes depends on the
CPU, so each trial measures it rather than assuming it from the CPU's flags. Measured with
torch 2.14.1 on an AMD EPYC with AVX-512 bf16 (oneDNN's verbose log and the errors below):

- matmuls move from the BLAS to oneDNN's `brg_matmul:avx512_core`, which keeps fp32 math: the
  relative error of a 512x512 product goes from 2.4e-7 to 4.1e-7 (another summation order),
  not to the ~1e-3 of bf16 inputs;
- convolutions keep the same kernel and bit-identical outputs;
- capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`) nothing changes at all; `tf32` changes nothing on
  either (no CPU kernel of oneDNN here takes TF32).

oneDNN's documentation describes the bf16 down-conversion for CPUs with AMX. So a row records,
per op family, what the setting did on this CPU (`onednn_math`), the reference products'
errors, and the CPU's bf16 hardware; a reduced setting that changes none of the op families a
model uses is `n/a` rather than a timed no-op.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F

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

# /proc/cpuinfo's names, best first: x86 `flags`, then Arm's `Features` (Neoverse V1 and later)
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
REDUCED_ERR = 1e-5  # relative error: fp32 math gives ~1e-7, bf16 inputs ~1e-3, TF32 ~1e-4


def bf16_hardware(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's bf16 matrix hardware: amx_bf16, avx512_bf16, bf16 (Arm), none, or unknown (no
    cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith(("flags", "Features"))), [])
    return next((f for f in BF16_FLAGS if f in flags), "none")


@dataclass(frozen=True)
class OpEffect:
    """What a setting did to one reference op: its relative error against fp64, and whether
    its output differs at all from the output before the setting."""

    rel_err: float
    changed: bool

    @property
    def math(self) -> str:
        if self.rel_err > REDUCED_ERR:
            return "reduced"  # bf16 (or TF32) inputs
        return "fp32, other kernel" if self.changed else "unchanged"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _reference_ops():
    """(name, fp32 op, its fp64 reference) for the op families the setting governs; the sizes
    are above PyTorch's thresholds for taking oneDNN's path."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)
    x, w = torch.randn(8, 64, 32, 32, generator=gen), torch.randn(64, 64, 3, 3, generator=gen)
    return (("matmul", lambda: a @ b, a.double() @ b.double()),
            ("conv", lambda: F.conv2d(x, w, padding=1),
             F.conv2d(x.double(), w.double(), padding=1)))


def op_effect(before: torch.Tensor, after: torch.Tensor, ref: torch.Tensor) -> OpEffect:
    return OpEffect(_rel_err(after, ref), not torch.equal(before, after))


MEASURED: dict = {}  # (value, the state it was set from) -> {op family: OpEffect}; per process


def measured_effects(set_value) -> dict[str, OpEffect]:
    """Run the reference ops in the current state, then under `set_value()` (which sets the
    precision), and say per op family what changed. Kept per process: it is the CPU's."""
    ops = _reference_ops()
    with torch.no_grad():
        before = [op() for _, op, _ in ops]
        set_value()
        return {name: op_effect(out, op(), ref)
                for (name, op, ref), out in zip(ops, before)}


def model_families(model) -> tuple[str, ...]:
    """The op families a model uses, from its layers; both when it has neither layer (a
    functional model may still multiply matrices)."""
    if model is None:
        return ("matmul", "conv")
    kinds = {type(m) for m in model.modules()}
    conv = any(issubclass(k, torch.nn.modules.conv._ConvNd) for k in kinds)
    matmul = any(issubclass(k, (torch.nn.Linear, torch.nn.MultiheadAttention,
                                torch.nn.RNNBase)) for k in kinds)
    return tuple(f for f, has in (("matmul", matmul), ("conv", conv)) if has) \
        or ("matmul", "conv")


def math_text(effects: dict[str, OpEffect]) -> str:
    return "; ".join(f"{name}: {e.math}" for name, e in effects.items())


class OnednnPrecision(Technique):
    name = "onednn_precision"
    after = ("matmul_precision",)  # it reads the float32 matmul precision on entry
    card = """\
**What**: `torch.backends.mkldnn.fp32_precision`: `bf16` allows oneDNN to run fp32 matmuls and
convolutions on the CPU with bf16 inputs and fp32 accumulation (`tf32`: TF32 inputs); `ieee`
keeps full fp32. null (the default) leaves PyTorch's default (full fp32).
**Helps**: fp32 training on CPUs whose oneDNN kernels down-convert (its documentation: AMX),
without autocast. Elsewhere the setting may only move matmuls to oneDNN's fp32 kernel, or change
nothing: each row's `onednn_math` says, per op family, what it did on this CPU (measured on a
reference matmul and convolution), and a reduced setting that changes none of the model's op
families is n/a.
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
    extra_columns = ("onednn_bf16_hw", "onednn_math", "onednn_matmul_rel_err",
                     "onednn_conv_rel_err")

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.onednn_precision is None:
            return None
        if not HAS_FLAG:
            return "n/a: this torch has no torch.backends.mkldnn.fp32_precision (torch >= 2.9)"
        if ctx.device.type != "cpu":
            return (f"n/a: oneDNN's fp32 precision acts on CPU kernels; this trial runs on "
                    f"{ctx.device.type} (see matmul_precision for TF32 there)")
        effects = ctx.extra.get("onednn_effects")
        families = model_families(ctx.model)
        if recipe.onednn_precision != "ieee" and effects and \
                all(effects[f].math == "unchanged" for f in families):
            return (f"n/a: on this CPU (bf16 hardware: {bf16_hardware()}) "
                    f"{recipe.onednn_precision} changes none of this model's "
                    f"{' or '.join(families)} ops: the same kernels and outputs as fp32 "
                    f"(measured on a reference of each)")
        return None

    def global_state(self, recipe, ctx: Context):
        if recipe.onednn_precision is None or not HAS_FLAG or ctx.device.type != "cpu":
            return contextlib.nullcontext()
        return _precision(recipe.onednn_precision, ctx)

    def columns(self, recipe, ctx: Context) -> dict:
        effects = ctx.extra.get("onednn_effects", {})
        err = {name: e.rel_err for name, e in effects.items()}
        return {"onednn_precision": recipe.onednn_precision or "default",
                "onednn_bf16_hw": bf16_hardware() if ctx.device.type == "cpu" else "-",
                "onednn_math": math_text(effects) if effects else math.nan,
                "onednn_matmul_rel_err": err.get("matmul", math.nan),
                "onednn_conv_rel_err": err.get("conv", math.nan)}


@contextlib.contextmanager
def _precision(value: str, ctx: Context):
    """Set the backend-wide precision (its children follow), say what it changed on this CPU
    (measured once per process and starting state), and restore every node on exit."""
    saved = {name: node.fp32_precision for name, node in _NODES.items() if node is not None}
    matmul = _MKLDNN.matmul.fp32_precision

    def set_value():
        _MKLDNN.fp32_precision = value

    key = (value, matmul, *saved.values())
    try:
        if key in MEASURED:
            set_value()
        else:
            MEASURED[key] = measured_effects(set_value)
        ctx.extra["onednn_effects"] = MEASURED[key]
        yield
    finally:
        # The children first: torch reads a child's "none" as "follow the backend".
        _MKLDNN.matmul.fp32_precision = matmul
        for name, node in reversed(list(_NODES.items())):
            if node is not None:
                node.fp32_precision = saved[name]
