"""One place applies a recipe to a model: every technique hook, in registry order.

The trial, the quality probe and the largest-batch probe all enter `applied`, so that each of
them measures the recipe under the same settings: the techniques' global state (restored on
exit), a fresh model from the seed, the n/a check of that model, the loader's options, the
prepared model and the Trainer. What a trial reads while inside (its FLOPs, whether fp32 runs
as TF32) is read under the variant's own settings. The model's own code runs isolated
(isolation.py): what it changes of the process (the default dtype, grad mode, the working
directory, ...) is put back on exit and said once, and its sys.exit() is its trial's failure.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from speedbench import techniques
from speedbench.measure import isolation
from speedbench.measure.data import build_loader
from speedbench.measure.step_hook import HookTrainer, NotApplicable, step_hook
from speedbench.measure.train import Trainer, build_model
from speedbench.techniques import Context

__all__ = ["Batching", "NotApplicable", "applied", "batching"]


@dataclass(frozen=True)
class Batching:
    """How one optimizer step of a recipe takes its samples."""

    micro: int  # samples per micro-batch on one device
    k: int  # micro-batches per optimizer step
    replicas: int  # devices one process drives (DataParallel)

    @property
    def loader_batch(self) -> int:
        return self.micro * self.replicas

    @property
    def per_step(self) -> int:
        return self.micro * self.replicas * self.k


def batching(spec, recipe, ctx: Context) -> Batching:
    micro, k = techniques.micro_batching(recipe.batch_size or spec.batch_size, recipe)
    return Batching(micro, k, techniques.replicas(recipe, ctx))


@contextlib.contextmanager
def applied(spec, recipe, ctx: Context, dataset=None, *, loader=None, sampler=None,
            clock=None) -> Iterator[Trainer]:
    """A Trainer for `recipe` on a fresh model of `spec`, built under the techniques' global
    state; everything is undone on exit. `loader` replaces the one built from `dataset`.
    Raises NotApplicable when a technique cannot act on the model."""
    trainer = None
    with techniques.global_state(recipe, ctx), isolation.isolated(spec.name) as watch:
        try:
            ctx.model = build_model(spec, recipe.bench.seed)
            watch.built()
            reason = techniques.not_applicable(recipe, ctx)
            if reason:
                raise NotApplicable(reason)
            if loader is None:
                loader = build_loader(dataset, batching(spec, recipe, ctx).loader_batch,
                                      techniques.loader_options(recipe, ctx),
                                      seed=recipe.bench.seed, sampler=sampler)
            model = techniques.prepare_model(ctx.model.to(ctx.device), recipe, ctx)
            own = HookTrainer if step_hook(ctx.model) else Trainer  # the user's step, or ours
            trainer = own(spec, recipe, ctx.device, loader, clock=clock, model=model, ctx=ctx)
            ctx.trainer = trainer
            yield trainer
        finally:
            if trainer is not None:
                trainer.close()
            ctx.trainer = ctx.model = None
            ctx.extra.clear()  # what the techniques kept for this model goes with it
