"""Where per-step tensors (noise, masks) are born: on the device, or on the host then copied."""
from __future__ import annotations

from typing import Literal, Optional

from speedbench.models.per_step import PerStepTensors
from speedbench.techniques.base import ActsOn, Context, Field, Finding, Technique

PER_STEP = 0.5  # host-born tensors per step from which it is "every step"
TIP = "create per-step tensors where they are used: torch.randn(..., device=x.device)"


def listeners(model) -> list:
    """The modules of `model` that make per-step tensors through speedbench."""
    return [m for m in model.modules() if isinstance(m, PerStepTensors)] if model is not None else []


def set_tensor_creation(model, where: str) -> int:
    """Tell every module that makes per-step tensors where to make them; returns how many listen."""
    found = listeners(model)
    for m in found:
        m.tensor_creation = where
    return len(found)


class TensorCreation(Technique):
    name = "tensor_creation"
    card = """\
**What**: models that make tensors every step (the VAE's noise, the transformer's mask) create
them directly on the device (`device`, the default) or on the host and copy them (`host`).
**Helps**: creating on the device saves a host-to-device copy, and its synchronisation, per
tensor per step.
**Costs**: none; `host` is the anti-pattern it measures."""
    fields = (Field("tensor_creation", Literal["host", "device"], "device",
                    "where per-step tensors are born"),)
    example = {"tensor_creation": "host"}
    acts_on = ActsOn(device="cuda", why="host and device are one on a CPU")
    snippets = {"tensor_creation": {"device": ("create per-step tensors on the device", """\
noise = torch.randn(shape, device=x.device)     # not torch.randn(shape).to(device)
mask = torch.ones(n, n, device=x.device, dtype=torch.bool).tril()""")}}

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.tensor_creation != "host":
            return None
        if ctx.device.type == "cpu":
            return "n/a: tensor_creation=host needs an accelerator (on the CPU host and device are one)"
        if ctx.model is not None and not listeners(ctx.model):
            return "n/a: this model makes no per-step tensors through speedbench"
        return None

    def prepare_model(self, model, recipe, ctx: Context):
        set_tensor_creation(model, recipe.tensor_creation)
        return model

    def diagnose(self, tp) -> list[Finding]:
        born = tp.host_creations / tp.steps if tp.steps else 0.0
        if born < PER_STEP:
            return []
        return [Finding("per-step tensors created on the host",
                        f"{born:.1f} tensors per step created on the CPU and copied to the "
                        f"{tp.device} (forward: {tp.ms('forward'):.1f} ms per step)",
                        TIP, "tensor_creation=device")]
