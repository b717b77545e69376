"""The user's own training step: a model method `speedbench_step(batch, sb)` that speedbench
calls in place of its built-in step, inside its timed windows, once per micro-batch.

`batch` is the loader's (x, y) on the device (any structure, batches.py); `sb`, a `StepKit`,
hands the step what the techniques need: `sb.model` (the model as they prepared it: compiled,
channels_last, DDP; call it, not `self`), `sb.autocast()` (their contexts around a forward:
the precision's autocast), `sb.backward(loss)` (the loss scaled by the GradScaler and divided
by the micro-batches), `sb.step(optimizer=None, clip_norm=None)` (unscale, clip, the
optimizer's step, zero_grad as the recipe says; skipped while `sb.accumulating`, True when it
stepped), `sb.optimizer` (AdamW with the recipe's lr and implementation), `sb.optimizer_like`
(another one, e.g. a GAN's second), `sb.scaler` and `sb.state` (a dict kept across steps: a
scheduler, an EMA). Under DDP the micro-batches before the last run inside `no_sync()`.

What the step leaves out is checked after its first call, and a technique that cannot act
through it makes the variant's row `n/a` with the reason (never a silent no-op): a forward
outside `sb.autocast()` where the recipe enters a context, no `sb.backward()` where it scales
the loss, no call of `sb.model` where the techniques wrapped the model. A step that never
calls `sb.step()` or gives no loss fails in one line. The built-in step (train.Trainer.step)
stays the default; the held-out loss is the model's `speedbench_loss(batch)` where it has one.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from speedbench import techniques
from speedbench.measure.train import Trainer, user_model

STEP_HOOK = "speedbench_step"


class NotApplicable(Exception):
    """A technique cannot act on this model here; the message is the row's `n/a: ...` status."""


def step_hook(model: torch.nn.Module) -> Optional[Callable]:
    """The user's `speedbench_step` on the model inside the techniques' wrappers, or None."""
    hook = getattr(user_model(model), STEP_HOOK, None)
    return hook if callable(hook) else None


class StepKit:
    """What speedbench hands the user's step (the module's docstring); one per trainer."""

    def __init__(self, trainer: "HookTrainer"):
        self._trainer = trainer
        self.model, self.optimizer = trainer.model, trainer.optimizer
        self.scaler = trainer.scaler
        self.k = trainer.micro_steps  # micro-batches per optimizer step
        self.micro = 0  # this micro-batch's index
        self.state: dict = {}  # the user's, kept across steps
        self.used: set[str] = set()
        self.loss: Optional[torch.Tensor] = None  # the first loss given to backward()

    @property
    def accumulating(self) -> bool:
        """True on the micro-batches before the last: sb.step() does not step on them."""
        return self.micro < self.k - 1

    def autocast(self) -> contextlib.AbstractContextManager:
        """The techniques' contexts around a forward (precision's autocast; a no-op in fp32)."""
        self.used.add("autocast")
        return self._trainer._step_context()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), the loss divided by the micro-batches and scaled by the scaler."""
        self.used.add("backward")
        if self.loss is None:
            self.loss = loss
        scaled = loss / self.k if self.k > 1 else loss
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None,
             clip_norm: Optional[float] = None) -> bool:
        """One optimizer step on the last micro-batch (False before it): the gradients
        unscaled and clipped to `clip_norm` where given, the step, zero_grad."""
        if self.accumulating:
            return False
        self.used.add("step")
        opt = optimizer or self.optimizer
        if clip_norm is not None:
            if self.scaler:
                self.scaler.unscale_(opt)
            params = [p for group in opt.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        if self.scaler:
            self.scaler.step(opt)
            self.used.add("scaled step")
        else:
            opt.step()
        opt.zero_grad(**self._trainer.zero_grad_options)
        return True

    def optimizer_like(self, params, cls: type = torch.optim.AdamW, **options):
        """Another optimizer with the recipe's lr and implementation (foreach, fused)."""
        t = self._trainer
        opts = {"lr": t.recipe.lr, **techniques.optimizer_options(t.recipe, t.ctx), **options}
        return cls(params, **opts)


class HookTrainer(Trainer):
    """The Trainer of a model with a step hook: its step calls the user's, once per
    micro-batch; everything else (the loader, the optimizer, the techniques) is Trainer's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook = step_hook(self.ctx.model or self.model)
        self.kit = StepKit(self)
        self.wrapped = user_model(self.model) is not self.model
        self._calls = [0]
        if self.wrapped:  # is the model as the techniques prepared it called?
            self._counting = self.model.register_forward_pre_hook(
                lambda *_: self._calls.__setitem__(0, self._calls[0] + 1))

    def step(self) -> None:
        if self.forward_only:
            raise NotApplicable("n/a: a forward-only variant evaluates with the model "
                                "config's loss; this model trains through its speedbench_step")
        clock, kit, k = self.clock, self.kit, self.micro_steps
        self.model.train()
        for i in range(k):
            with clock("data"):
                batch = next(self.batches)
            with clock("h2d"):
                batch = self._to_device(batch)
            kit.micro, kit.loss = i, None
            skip_sync = i < k - 1 and hasattr(self.model, "no_sync")
            with self.model.no_sync() if skip_sync else contextlib.nullcontext():
                with clock("forward"):  # the user's whole step
                    out = self.hook(batch, kit)
            loss = out if isinstance(out, torch.Tensor) else kit.loss
            if loss is not None:
                with clock("other"):
                    self.meter.add(loss.detach())
        self._finish(loss)

    def _finish(self, loss: Optional[torch.Tensor]) -> None:
        """After the last micro-batch: the scaler's update, the after-step hooks, and, after
        the first step, what the step left out (check)."""
        if "scaled step" in self.kit.used:
            with self.clock("optimizer"):
                self.scaler.update()
        if self.after_step_hooks:
            with self.clock("other"):
                for t in self.after_step_hooks:
                    t.after_step(self.recipe, self.ctx)
        self.optimizer_steps += 1
        if self.optimizer_steps == 1:
            self.check(loss)

    def check(self, loss: Optional[torch.Tensor]) -> None:
        """What the user's first step left out: an error where it breaks the contract, n/a
        where a technique of the recipe cannot act through it."""
        used = self.kit.used
        if "step" not in used:
            raise TypeError("speedbench_step did not call sb.step(): speedbench steps the "
                            "optimizer (the recipe's implementation, zero_grad) through it")
        if loss is None:
            raise TypeError("speedbench_step returned no loss and called no sb.backward(loss)")
        acting = [t.name for t in techniques.step_contexts(self.recipe, self.ctx)
                  if not isinstance(t.step_context(self.recipe, self.ctx),
                                    contextlib.nullcontext)]
        if acting and "autocast" not in used:
            raise NotApplicable(f"n/a: {', '.join(acting)}: speedbench_step ran its forward "
                                "outside sb.autocast(), where the recipe's context acts")
        if self.scaler is not None and "backward" not in used:
            raise NotApplicable("n/a: the recipe scales the loss (GradScaler); speedbench_step "
                                "did not call sb.backward(loss)")
        if self.wrapped and not self._calls[0]:
            raise NotApplicable(f"n/a: the techniques prepared the model as "
                                f"{type(self.model).__name__}; speedbench_step did not call "
                                "sb.model(...)")
        if self.wrapped:
            self._counting.remove()
