"""Entry points from the training loops people already have, measured through speedbench's
step hook (measure/step_hook.py, `speedbench_step`), so the techniques act on them as on any
own step and a technique that cannot act is `n/a` with its reason:

- `lightning(module)`: a LightningModule's own `training_step(batch, batch_idx)`;
- `hf_loss(model)`: a Hugging Face `PreTrainedModel` that takes its labels and returns its own
  `.loss` (what the `Trainer` trains on);
- `hf_trainer(model, args)`: the same, with the step a `Trainer` given those
  `TrainingArguments` takes: its gradients clipped at `max_grad_norm` (1.0 unless set).

A Lightning `Trainer`'s flags (`lightning(module, trainer={...})`) and `TrainingArguments`
(`hf_trainer`'s `args`) where Lightning or the Trainer owns a technique (precision,
accumulation, the optimizer's implementation, the learning rate) become the run's settings
(config/plan.py's loop_settings, each technique's `from_loop`); the step's own behaviour
(gradient clipping) is applied here.

Each wraps the user's module; its forward goes through `sb.model` (the model as the techniques
prepared it: compiled, DDP), so those techniques act on the user's own forward. The optimizer
is the variant's (`sb.optimizer`: AdamW with the recipe's lr and implementation), not the
module's `configure_optimizers` or the `Trainer`'s: it is the one the optimizer technique
varies. Neither library is imported here: the user's module brings its own.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn


def _loss_of(out: Any) -> torch.Tensor:
    """The loss a step returned: a tensor, a dict's `loss` (Lightning's), or `.loss` (HF's)."""
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(f"the step returned {type(out).__name__}, not a loss (a tensor, a dict with "
                    "'loss', or an output with .loss: give the model its labels)")


class _Routed(nn.Module):
    """The user's module, its forward routed through `sb.model` while a step runs (so that the
    techniques' wrappers see it) and straight to its own forward from inside them."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)

    @contextlib.contextmanager
    def _routed(self, sb) -> Iterator[None]:
        """Inside, the module's own calls of itself (`self(x)` in training_step) go through
        sb.model, whose wrappers come back to its forward."""
        self.module.forward = lambda *a, **k: sb.model(*a, **k)
        try:
            yield
        finally:
            del self.module.forward


def _flag(flags: Any, name: str, default: Any = None) -> Any:
    """A flag of a loop's settings: a mapping's entry, or an object's attribute (a Trainer, a
    TrainingArguments built through `_target_`)."""
    if flags is None:
        return default
    if isinstance(flags, Mapping):
        return flags.get(name, default)
    return getattr(flags, name, default)


class LightningStep(_Routed):
    """A LightningModule measured through its own training_step (built by `lightning`), its
    gradients clipped as its Trainer's flags ask (`clip_norm`)."""

    def __init__(self, module: nn.Module, clip_norm: Optional[float] = None):
        super().__init__(module)
        self.batch_idx = 0
        self.clip_norm = clip_norm

    def speedbench_step(self, batch, sb):
        with self._routed(sb), sb.autocast(), _no_trainer_warning():
            loss = _loss_of(self.module.training_step(_as_lightning(batch), self.batch_idx))
        sb.backward(loss)
        if sb.step(clip_norm=self.clip_norm):
            self.batch_idx += 1
        return loss

    def speedbench_loss(self, batch):
        """The held-out loss: training_step's, without gradients (validation_step logs and
        returns nothing in most modules)."""
        with torch.no_grad(), _no_trainer_warning():
            return _loss_of(self.module.training_step(_as_lightning(batch), 0))


@contextlib.contextmanager
def _no_trainer_warning() -> Iterator[None]:
    """Lightning's warning that `self.log()` has no Trainer to log to, kept off the console:
    there is none here, and what it would log is not speedbench's to keep."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer`")
        yield


def _as_lightning(batch):
    """speedbench's (x, y) as a LightningModule unpacks it: `x, y = batch`."""
    return list(batch) if isinstance(batch, tuple) else batch


def lightning(module: nn.Module, trainer: Any = None) -> LightningStep:
    """`_target_: speedbench.models.loops.lightning` with `module: {_target_: your.LitModule}`:
    the LightningModule trained by its own training_step, one call per micro-batch; `trainer`:
    its Trainer's flags (a mapping or a Trainer), of which gradient_clip_val acts here."""
    if not callable(getattr(module, "training_step", None)):
        raise TypeError(f"{type(module).__name__} has no training_step: give a LightningModule")
    if _flag(trainer, "gradient_clip_algorithm") not in (None, "norm"):
        raise TypeError(f"trainer: gradient_clip_algorithm "
                        f"{_flag(trainer, 'gradient_clip_algorithm')!r} is not taken; "
                        "speedbench's step clips by norm (gradient_clip_algorithm: norm)")
    clip = _flag(trainer, "gradient_clip_val")
    return LightningStep(module, float(clip) if clip else None)


class HFLossStep(_Routed):
    """A model that computes its own loss from its labels (built by `hf_loss`, `hf_trainer`),
    its gradients clipped at `clip_norm` where given."""

    def __init__(self, model: nn.Module, inputs: str, labels: str,
                 clip_norm: Optional[float] = None):
        super().__init__(model)
        self.inputs, self.labels, self.clip_norm = inputs, labels, clip_norm

    def forward(self, x, y):
        return type(self.module).forward(self.module, **{self.inputs: x, self.labels: y})

    def speedbench_step(self, batch, sb):
        x, y = batch
        with sb.autocast():
            loss = _loss_of(sb.model(x, y))
        sb.backward(loss)
        sb.step(clip_norm=self.clip_norm)
        return loss

    def speedbench_loss(self, batch):
        x, y = batch
        with torch.no_grad():
            return _loss_of(self(x, y)).float()


def hf_loss(model: nn.Module, inputs: str = "input_ids", labels: str = "labels") -> HFLossStep:
    """`_target_: speedbench.models.loops.hf_loss` with `model: {...}` (a PreTrainedModel): its
    forward(**{inputs: x, labels: y}) returns `.loss`, the loss the Trainer would train on."""
    return HFLossStep(model, inputs, labels)


HF_MAX_GRAD_NORM = 1.0  # TrainingArguments' default: a Trainer clips unless told not to


def hf_trainer(model: nn.Module, args: Any = None, inputs: str = "input_ids",
               labels: str = "labels") -> HFLossStep:
    """`_target_: speedbench.models.loops.hf_trainer` with `model: {...}` and `args:` (the
    TrainingArguments' keys, or `_target_: transformers.TrainingArguments` with them): the
    model's own `.loss` in the step such a Trainer takes, gradients clipped at max_grad_norm
    (1.0 unless set; 0 or null: not clipped). Precision, accumulation, `optim` and
    learning_rate are the run's settings (config/plan.py's loop_settings)."""
    clip = _flag(args, "max_grad_norm", HF_MAX_GRAD_NORM)
    return HFLossStep(model, inputs, labels, float(clip) if clip else None)
