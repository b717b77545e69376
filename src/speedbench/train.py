"""The training loop. It knows the knobs; it knows nothing about timing or results.

`Trainer.step()` is one optimizer step over `accumulate` micro-batches. The phase clock it is
given only reads the host clock (see timing.PhaseClock); by default it measures the data wait.
Phases: data, h2d, forward, backward, optimizer, and other (loss reading, empty_cache).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.utils import instantiate

from speedbench import knobs
from speedbench.config import ModelSpec
from speedbench.timing import NullClock


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """A fresh model, the same weights for the same seed."""
    torch.manual_seed(seed)
    model = instantiate(spec.target)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec.name}: _target_ {spec.target.get('_target_')} returned "
                        f"{type(model).__name__}, not a torch.nn.Module")
    return model


def forever(loader) -> Iterator:
    """Batches without end: a new epoch starts when one runs out."""
    while True:
        yield from loader


def compute_loss(model: nn.Module, loss_kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if loss_kind == "module":
        loss = model(x, y)
    else:
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    # DataParallel returns one loss per replica.
    return loss.mean() if loss.dim() else loss


class Trainer:
    def __init__(self, spec: ModelSpec, recipe, device: torch.device, loader, clock=None,
                 model: Optional[nn.Module] = None):
        self.spec, self.recipe, self.device = spec, recipe, device
        self.clock = clock or NullClock()
        self.model = model if model is not None else build_model(spec, recipe.bench.seed).to(device)
        knobs.set_tensor_creation(self.model, recipe.tensor_creation)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=recipe.lr)
        self.scaler = knobs.grad_scaler(recipe.precision, device)
        self.meter = knobs.LossMeter(recipe.sync, recipe.sync_every, device)
        self.loader = loader
        self.batches = forever(loader)
        self.optimizer_steps = 0

    def step(self) -> None:
        r, clock, k = self.recipe, self.clock, self.recipe.accumulate
        self.model.train()
        for i in range(k):
            with clock("data"):
                batch = next(self.batches)
            with clock("h2d"):
                x, y = knobs.to_device(batch, self.device, r.data.non_blocking)
            # Under DDP only the last micro-batch all-reduces: forward and backward of the
            # others run inside no_sync().
            skip_sync = i < k - 1 and hasattr(self.model, "no_sync")
            with self.model.no_sync() if skip_sync else contextlib.nullcontext():
                with clock("forward"), knobs.autocast(r.precision, self.device):
                    loss = compute_loss(self.model, self.spec.loss, x, y)
                with clock("other"):  # reading the loss (the sync knob)
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
            self.optimizer.zero_grad(set_to_none=True)
        with clock("other"):
            knobs.maybe_empty_cache(r.empty_cache, self.device)
        self.optimizer_steps += 1

    def close(self) -> None:
        """Stop the DataLoader's workers now rather than whenever the iterator is collected."""
        self.batches.close()
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
