"""The training loop. It applies the techniques through their interface (speedbench.techniques)
and knows none of them by name; it knows nothing about timing or results.

`Trainer.step()` is one optimizer step over the micro-batches the techniques ask for (one, or
`accumulate`). A forward may return the loss (or the logits) bare, first in a tuple, in a dict
or as an attribute (`output_tensor`). The phase clock it is given only reads the host clock (see timing.PhaseClock);
by default it measures the data wait. Phases (schema.PHASES): data, h2d, forward, backward,
optimizer, and other (reading the loss, the techniques' after-step hooks).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.utils import instantiate

from speedbench import techniques
from speedbench.config import ModelSpec
from speedbench.techniques import Context
from speedbench.measure.batches import samples_of, to_device
from speedbench.measure.timing import NullClock


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """A fresh model, the same weights for the same seed."""
    torch.manual_seed(seed)
    model = instantiate(spec.target)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec.name}: _target_ {spec.target.get('_target_')} returned "
                        f"{type(model).__name__}, not a torch.nn.Module")
    return KeywordInputs(model, spec.inputs) if spec.inputs else model


class KeywordInputs(nn.Module):
    """A model whose forward takes keyword inputs (`model(**batch)`, Hugging Face style): the
    batch's x and y are handed over under the names the model config's `inputs` gives."""

    def __init__(self, inner: nn.Module, names: list[str]):
        super().__init__()
        self.inner, self.names = inner, list(names)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None):
        return self.inner(**dict(zip(self.names, (x, y))))


class DataOutOfMemory(Exception):
    """The host ran out of memory while a batch was read (the data set, its loader): the row
    says so, rather than blame the model's step."""


WRAPPERS = {"KeywordInputs": "inner", "DataParallel": "module",
            "DistributedDataParallel": "module", "OptimizedModule": "_orig_mod"}


def user_model(model: nn.Module) -> nn.Module:
    """The user's own module inside speedbench's and the techniques' wrappers (KeywordInputs,
    DataParallel and DDP's `.module`, torch.compile's `._orig_mod`): where its methods are.
    Only those wrappers are opened, never a user's module that has a `module` of its own."""
    for _ in range(8):
        attr = WRAPPERS.get(type(model).__name__)
        inner = model.__dict__.get("_modules", {}).get(attr) if attr else None
        if inner is None:
            return model
        model = inner
    return model


def forever(loader) -> Iterator:
    """Batches without end: a new epoch starts when one runs out."""
    from speedbench.distributed import CPU_OOM

    while True:
        try:
            yield from loader
        except (MemoryError, RuntimeError) as exc:
            if isinstance(exc, MemoryError) or CPU_OOM.search(str(exc)):
                raise DataOutOfMemory(f"{type(exc).__name__}: {str(exc)[:100]}") from None
            raise


def compute_loss(model: nn.Module, loss_kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of one batch: the model's own (`module`), the cross-entropy of its logits with
    the labels, or the mean squared error of its output against the targets (`mse`); a shape
    the loss cannot take is one line naming both shapes and what to change."""
    if loss_kind == "module":
        loss = output_tensor(model(x, y), "loss")
    elif loss_kind == "mse":
        out = output_tensor(model(x), "logits")
        if out.shape != y.shape:
            if out.numel() != y.numel():
                raise ValueError(shape_hint("mse", out.shape, y.shape))
            out = out.reshape(y.shape)  # (N, 1) against (N,)
        loss = F.mse_loss(out.float(), y.float())
    else:
        logits = output_tensor(model(x), "logits")
        if logits.shape[:-1].numel() != y.numel():  # (N*T, C) against (N, T) is fine
            raise ValueError(shape_hint("cross_entropy", logits.shape, y.shape,
                                        y.is_floating_point()))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    # DataParallel returns one loss per replica.
    return loss.mean() if loss.dim() else loss


def shape_hint(loss: str, out: torch.Size, y: torch.Size, numbers: bool = False) -> str:
    """One line (a trial's status keeps 160 characters): the output's and the labels' shapes
    and the setting that makes them meet (`numbers`: the labels are floats)."""
    got = f"{loss}: model output {tuple(out)}, labels {tuple(y)}"
    if numbers:
        return f"{got}: labels that are numbers take loss: mse (dataset task: regression)"
    if loss == "mse":
        return f"{got}: give the model {y[-1] if len(y) > 1 else 1} outputs (dataset targets)"
    if len(out) == 2 and len(y) == 2:
        return (f"{got}: one label per sequence needs dataset num_classes: {out[-1]} (kind "
                "tokens gives next-token labels)")
    if len(out) == 3 and len(y) == 1:
        return f"{got}: labels per token need dataset task next_token or token_classification"
    if len(out) == 4:
        return f"{got}: the output is a picture, not class scores: loss: module or mse?"
    return f"{got}: the output's last axis must be the classes, the rest the labels' shape"


def output_tensor(out: Any, key: str) -> torch.Tensor:
    """The loss (`loss: module`) or the logits (`loss: cross_entropy`) in a forward's output,
    in the forms models are written in; anything else is one line naming those forms."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        found = out.get(key)
    elif isinstance(out, (tuple, list)):
        found = out[0] if out else None
    else:
        found = getattr(out, key, None)
    if isinstance(found, torch.Tensor):
        return found
    what = (f"a dict with keys {', '.join(map(str, list(out)[:4]))}" if isinstance(out, Mapping)
            else type(out).__name__)
    kind = "module" if key == "loss" else "cross_entropy"
    raise TypeError(f"forward returned {what}; loss: {kind} takes a tensor, ({key}, ...), "
                    f"{{'{key}': ...}} or an object with .{key} (Hugging Face's ModelOutput)")


class Trainer:
    """One model's training loop under one recipe.

    Without `model` it builds the model, puts it on `device` and lets the techniques prepare it
    (techniques.prepare_model); a `model` given is used as it is (the trial prepares its own).
    """

    def __init__(self, spec: ModelSpec, recipe, device: torch.device, loader, clock=None,
                 model: Optional[nn.Module] = None, ctx: Optional[Context] = None):
        self.spec, self.recipe, self.device = spec, recipe, device
        self.ctx = ctx or Context(device=device)
        self.clock = clock or NullClock()
        if model is None:
            model = build_model(spec, recipe.bench.seed).to(device)
            self.ctx.model = model
            model = techniques.prepare_model(model, recipe, self.ctx)
        self.model = model
        # The techniques may set the lr as well as the implementation (foreach, fused).
        opts = techniques.optimizer_options(recipe, self.ctx)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **{"lr": recipe.lr, **opts})
        self.scaler = techniques.grad_scaler(recipe, self.ctx)
        self.meter = techniques.loss_meter(recipe, self.ctx)
        self.micro_steps = techniques.micro_batching(1, recipe)[1]
        self.copy_options = techniques.copy_options(recipe, self.ctx)
        self.step_hooks = techniques.step_contexts(recipe, self.ctx)
        self.zero_grad_options = techniques.zero_grad_options(recipe, self.ctx)
        self.forward_only = techniques.forward_only(recipe)
        self.after_step_hooks = techniques.after_step_hooks()
        self.loader = loader
        self.batches = forever(loader)
        self.optimizer_steps = 0
        self.samples = 0  # counted as the batches come (batches.samples_of)
        self.count_model = user_model(self.ctx.model or model)
        self.ctx.trainer = self  # the after-step hooks reach the optimizer through it

    def step(self) -> None:
        r, clock, k, ctx = self.recipe, self.clock, self.micro_steps, self.ctx
        if self.forward_only:
            self.evaluate()
            return
        self.model.train()
        for i in range(k):
            with clock("data"):
                batch = next(self.batches)
            with clock("h2d"):
                x, y = self._to_device(batch)
            # Under DDP only the last micro-batch all-reduces: forward and backward of the
            # others run inside no_sync().
            skip_sync = i < k - 1 and hasattr(self.model, "no_sync")
            with self.model.no_sync() if skip_sync else contextlib.nullcontext():
                with clock("forward"), self._step_context():
                    loss = compute_loss(self.model, self.spec.loss, x, y)
                with clock("other"):  # reading the loss (the way the techniques say)
                    self.meter.add(loss)
                with clock("backward"):
                    scaled = loss / k if k > 1 else loss  # no extra op (and its backward) at k=1
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        with clock("optimizer"):
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(**self.zero_grad_options)
        if self.after_step_hooks:
            with clock("other"):
                for t in self.after_step_hooks:
                    t.after_step(r, ctx)
        self.optimizer_steps += 1

    def evaluate(self) -> None:
        """One evaluation pass in place of a step: the same batches, forward and loss only, in
        eval mode, under the techniques' step contexts (which decide whether autograd records)."""
        clock = self.clock
        self.model.eval()
        for _ in range(self.micro_steps):
            with clock("data"):
                batch = next(self.batches)
            with clock("h2d"):
                x, y = self._to_device(batch)
            with clock("forward"), self._step_context():
                loss = compute_loss(self.model, self.spec.loss, x, y)
            with clock("other"):
                self.meter.add(loss)
        self.optimizer_steps += 1

    def _to_device(self, batch) -> tuple:
        """The batch's (x, y) on the device, each of any structure (batches.py), its samples
        counted; anything but an (x, y) pair is one line naming the forms."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"a batch is {type(batch).__name__}"
                            f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
                            "; speedbench trains on (x, y) pairs, each a tensor or a tuple, "
                            "list or dict (nested) of tensors")
        self.samples += samples_of(batch, self.count_model)
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):  # the usual batch
            return x.to(self.device, **self.copy_options), y.to(self.device, **self.copy_options)
        return (to_device(x, self.device, **self.copy_options),
                to_device(y, self.device, **self.copy_options))

    def _step_context(self):
        """The techniques' contexts around a forward pass (none: nothing entered per step)."""
        if not self.step_hooks:
            return contextlib.nullcontext()
        if len(self.step_hooks) == 1:
            return self.step_hooks[0].step_context(self.recipe, self.ctx)
        return techniques.step_context(self.recipe, self.ctx)

    def close(self) -> None:
        """Stop the DataLoader's workers now rather than whenever the iterator is collected."""
        self.batches.close()
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
