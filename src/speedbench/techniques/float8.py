"""float8 training through torchao (an optional extra): the model's large nn.Linear layers
swapped for torchao's Float8Linear, whose matmuls run in float8 with `tensorwise` or `rowwise`
scaling (torchao.float8.convert_to_float8_training, Float8LinearConfig.from_recipe_name).

Written against torchao's float8 docs (torchao/float8/README.md, docs/source/api_ref_float8.rst);
it needs torch._scaled_mm on a CUDA GPU of compute capability 8.9 or more, so it is n/a on a
CPU. Which layers are converted is decided here from each layer's (out_features, in_features):
both multiples of 16, and not under the sizes below which torchao's H100 microbenchmarks show no
gain (torchao's own auto filter and torchtitan's `auto_filter_small_kn` apply the same
thresholds). The forecast uses the same rule, so a model whose layers are all too small is
forecast to gain nothing.
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Literal, Optional

import torch
import torch.nn as nn

from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Technique, amdahl,
                                        percent, times)

RECIPES = ("off", "tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper, Blackwell
INSTALL = "pip install 'speedbench[float8]' (or pip install torchao)"
# float8 tensor cores' dense peak over 16-bit's on the GPUs torchao benchmarks (H100, B200,
# MI300X): the most a converted matmul gains over a bf16 or fp16 one
GAIN_OVER_16_BIT = 2.0
SHAPES = "float8_linear_shapes"  # profile counter: (out_features, in_features) of each Linear


def have_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None


def large_enough(out_features: int, in_features: int, recipe: str, layers: str = "large"
                 ) -> bool:
    """Whether a Linear of this shape is converted: both sides multiples of 16 (float8 kernels'
    requirement), and (layers="large") not under torchao's thresholds for the recipe (H100
    microbenchmarks: smaller layers lose more to the casts than the float8 matmul saves)."""
    if out_features % 16 or in_features % 16:
        return False
    if layers == "all":
        return True
    if recipe == "tensorwise":
        return not (out_features <= 4096 and in_features <= 1024)
    return not (in_features <= 2048 or out_features <= 1024
                or (in_features <= 4096 and out_features <= 2048))


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(out_features, in_features) of each nn.Linear of the model, once per module."""
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)]


def converted_share(shapes: list[tuple[int, int]], recipe: str, layers: str) -> float:
    """The converted layers' share of the Linear layers' matmul FLOPs: every Linear sees the
    same tokens, so a layer's FLOPs go as out x in."""
    total = sum(o * i for o, i in shapes)
    kept = sum(o * i for o, i in shapes if large_enough(o, i, recipe, layers))
    return kept / total if total else 0.0


def missing(ctx: Context) -> Optional[str]:
    """Why float8 training cannot run here, or None."""
    no_torchao = "" if have_torchao() else f"; torchao is not installed either: {INSTALL}"
    if not ctx.cuda:
        return (f"n/a: float8 training runs its matmuls with torch._scaled_mm, which needs a "
                f"CUDA GPU of compute capability 8.9 or more (this run is on "
                f"{ctx.device.type}){no_torchao}")
    capability = torch.cuda.get_device_capability(ctx.device)
    if capability < MIN_CAPABILITY:
        return (f"n/a: float8 matmuls need compute capability 8.9 or more (Ada, Hopper, "
                f"Blackwell); this GPU has {capability[0]}.{capability[1]}{no_torchao}")
    if no_torchao:
        return f"n/a: float8 training needs torchao, an optional extra: {INSTALL}"
    return None


def convert(model: nn.Module, recipe: str, layers: str) -> nn.Module:
    """The model with its Linear layers (`layers`: the large enough, or all) swapped for
    torchao's Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear)
        and large_enough(mod.out_features, mod.in_features, recipe, layers))


class Float8(Technique):
    name = "float8"
    card = """\
**What**: torchao's float8 training: the model's large `nn.Linear` layers become `Float8Linear`,
whose three matmuls (forward, two in backward) run in float8 on the tensor cores, with
`tensorwise` scaling (one scale per tensor: fastest) or `rowwise` (one per row: more accurate,
slower). Layers too small to gain (torchao's H100 thresholds on out x in) stay as they are.
**Helps**: large matmuls on GPUs with float8 tensor cores (H100, B200, MI300X): torchao reports
+25 % (tensorwise) and +10 % (rowwise) tokens/s for Llama3-8B on 8xH100 with compile and FSDP2.
**Costs**: the casts and scale computations (a loss for small layers, hence the filter); the
numerics change (the held-out loss judges it); CUDA with compute capability >= 8.9 and
torchao (an optional extra); best with torch.compile, which fuses the casts."""
    fields = (Field("float8", Literal[RECIPES], "off",
                    "torchao float8 training of the Linear layers: off, tensorwise, rowwise "
                    "(CUDA, compute capability >= 8.9)"),
              Field("float8_layers", Literal["large", "all"], "large",
                    "float8: only layers large enough to gain (torchao's H100 thresholds), or "
                    "every Linear whose sides are multiples of 16"))
    example = {"float8": "tensorwise", "float8_layers": "all"}
    acts_on = ActsOn(device="cuda", why="float8 matmuls (torch._scaled_mm) need a CUDA GPU of "
                     "compute capability 8.9 or more, and torchao")
    extra_columns = ("float8_converted",)
    snippets = {"float8": {"*": ("float8 training ({value} scaling) with torchao", """\
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
config = Float8LinearConfig.from_recipe_name("{value}")
# convert only layers large enough to gain (torchao's auto filter, torchtitan's
# filter_fqns=["auto_filter_small_kn"])
convert_to_float8_training(model, config=config, module_filter_fn=keep_large_linears)
model = torch.compile(model)  # fuses the casts""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.float8 == "off":
            return None
        why = missing(ctx)
        if why:
            return why
        if ctx.model is not None and not any(
                large_enough(o, i, recipe.float8, recipe.float8_layers)
                for o, i in linear_shapes(ctx.model)):
            return ("n/a: no Linear layer of this model is large enough for float8 to gain "
                    f"({recipe.float8} thresholds on out x in, from torchao's H100 benchmarks; "
                    "float8_layers=all converts them all)")
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.float8 != "off" and missing(ctx) is None:
            model = convert(model, recipe.float8, recipe.float8_layers)
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        model = getattr(ctx.trainer, "model", None)
        count = sum(type(m).__name__ == "Float8Linear" for m in model.modules()) \
            if model is not None else 0
        return {**super().columns(recipe, ctx), "float8_converted": count}

    @contextlib.contextmanager
    def profile_counters(self, trainer, ctx: Context):
        yield {SHAPES: linear_shapes(ctx.model if ctx.model is not None else trainer.model)}

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if baseline.float8 != "off" or recipe.float8 == "off":
            if recipe.float8 == baseline.float8:
                return None
            return "n/a: a forecast from float8 off only"
        shapes = getattr(profile, "counters", {}).get(SHAPES)
        if not shapes:
            return "n/a: the baseline's profile counted no Linear layer"
        kept = converted_share(shapes, recipe.float8, recipe.float8_layers)
        share = profile.share("matmul") * kept
        gain = GAIN_OVER_16_BIT if baseline.precision in ("bf16", "fp16") else float("inf")
        best = amdahl(share, gain)
        return Bound(best, share, f"the layers large enough for {recipe.float8} float8 hold "
                     f"{percent(kept)} of the Linear FLOPs, {percent(share)} of the step (their "
                     f"matmul share); at {times(gain)} on it the step gains at most {times(best)}")
