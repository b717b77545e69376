"""A convolution's bias directly before a batch norm: computed, stored and updated for nothing.

The Performance Tuning Guide's "Disable bias for convolutions directly followed by a batch
norm": in training, BatchNorm subtracts the batch mean per channel, which cancels a per-channel
bias exactly. torchvision's models are built without it; hand-written models often are not.

`conv_bias=drop` removes the bias of every convolution whose output goes straight into a batch
norm (its value folded into the norm's running mean, so evaluation outputs are unchanged);
`add` gives each of them one (zeros: the same outputs), the model as it is often hand-written;
`keep` (the default) leaves the model as built. The pairs are found on the model's graph
(torch.fx), or, where it cannot be traced, between neighbours of an nn.Sequential. Diagnosis:
a profiled trial counts the pairs that carry a bias and suggests `conv_bias=drop`, which the
findings check measures before it is recommended.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Literal, Optional

import torch
import torch.nn as nn

from speedbench.techniques.base import ActsOn, Context, Field, Finding, Technique

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
TIP = ("build the convolutions that feed a batch norm with bias=False: the norm subtracts the "
       "batch mean, which cancels the bias")
NO_PAIR = "n/a: no convolution directly followed by a batch norm in this model"


def bare(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile's and DDP's/DataParallel's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def _traced_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    import torch.fx

    was_training = model.training
    model.eval()  # the plain forward path (a model may checkpoint its blocks in training)
    try:
        graph = torch.fx.symbolic_trace(model).graph
    finally:
        model.train(was_training)
    modules = dict(model.named_modules())
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), CONVS):
            continue
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_module" \
                and isinstance(modules.get(users[0].target), NORMS):
            pairs.append((modules[node.target], modules[users[0].target]))
    return pairs


def _sequential_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    pairs = []
    for seq in (m for m in model.modules() if isinstance(m, nn.Sequential)):
        children = list(seq)
        pairs += [(a, b) for a, b in zip(children, children[1:])
                  if isinstance(a, CONVS) and isinstance(b, NORMS)]
    return pairs


# Tracing runs the model's forward (on proxies), and with it any side effect of user code: it is
# done once per model, when the model is prepared, never inside a window another technique
# counts in (a forward that empties the CUDA cache would be counted once too often).
_PAIRS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def conv_norm_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(convolution, batch norm) pairs where the convolution's only consumer is the norm, with
    the same channels; found once per model."""
    model = bare(model)
    if model not in _PAIRS:
        try:
            pairs = _traced_pairs(model)
        except Exception:  # data-dependent control flow and the like: fx cannot trace every model
            pairs = _sequential_pairs(model)
        _PAIRS[model] = [(c, n) for c, n in pairs if c.out_channels == n.num_features]
    return _PAIRS[model]


def biased(pairs) -> list[nn.Module]:
    return [c for c, _ in pairs if c.bias is not None]


def drop_bias(conv: nn.Module, norm: nn.Module) -> None:
    """Remove the bias, folding it into the running mean (the norm's eval output is unchanged;
    in training the batch mean absorbs it exactly)."""
    with torch.no_grad():
        if norm.running_mean is not None:
            norm.running_mean -= conv.bias
    conv.register_parameter("bias", None)


def add_bias(conv: nn.Module) -> None:
    if conv.bias is None:
        conv.bias = nn.Parameter(torch.zeros(conv.out_channels, device=conv.weight.device,
                                             dtype=conv.weight.dtype))


class ConvBias(Technique):
    name = "conv_bias"
    card = """\
**What**: the bias of a convolution whose output goes straight into a batch norm: `drop`
removes it (folded into the norm's running mean), `add` gives each such convolution one (the
model as often hand-written), `keep` (the default) leaves the model as built.
**Helps**: a little: one bias add per output element of those convolutions, its gradient
(a reduction over the batch and the spatial dimensions) and its optimizer update. torchvision's
models are already built without these biases.
**Costs**: nothing: in training the batch norm cancels the bias exactly."""
    fields = (Field("conv_bias", Literal["keep", "add", "drop"], "keep",
                    "bias of convolutions directly followed by a batch norm: keep as built, add "
                    "one, drop it"),)
    example = {"conv_bias": "add"}
    acts_on = ActsOn(model="resnet")
    snippets = {"conv_bias": {"drop": ("no bias in convolutions followed by a batch norm", """\
nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),  # the norm cancels a bias
              nn.BatchNorm2d(c_out), nn.ReLU())""")}}
    extra_columns = ("conv_bias_convs",)

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.conv_bias != "keep" and ctx.model is not None \
                and not conv_norm_pairs(ctx.model):
            return NO_PAIR
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        pairs = conv_norm_pairs(model)  # here, outside every timed or counted window
        if recipe.conv_bias == "keep":
            return model
        for conv, norm in pairs:
            if recipe.conv_bias == "add":
                add_bias(conv)
            elif conv.bias is not None:
                drop_bias(conv, norm)
        return model

    def columns(self, recipe, ctx: Context) -> dict:
        """conv_bias_convs: the convolutions that feed a batch norm with a bias, as trained."""
        model = getattr(ctx.trainer, "model", None)
        count = len(biased(conv_norm_pairs(model))) if model is not None else float("nan")
        return {**super().columns(recipe, ctx), "conv_bias_convs": count}

    @contextlib.contextmanager
    def profile_counters(self, trainer, ctx: Context):
        """(convolutions with a bias that feed a batch norm, their bias parameters), of the
        model as it ran; a tuple, so that pooling keeps one trial's figure."""
        convs = biased(conv_norm_pairs(trainer.model))
        yield {"conv_bias_before_norm": (len(convs), sum(c.bias.numel() for c in convs))}

    def diagnose(self, tp) -> list[Finding]:
        convs, params = tp.counters.get("conv_bias_before_norm") or (0, 0)
        if not convs:
            return []
        return [Finding("convolution bias before a batch norm",
                        f"{convs} convolution(s) with a bias feed a batch norm directly "
                        f"({params} bias parameters computed, stored and updated for nothing)",
                        TIP, "conv_bias=drop")]
