"""Quality at equal work, and the first-step check that stops a hopeless variant.

The loss compared across variants cannot come from the timed trials: their warm-up adapts to
the machine (3 to 10 steps), so a loss taken after it measures how long the warm-up ran. The
quality probe trains a fresh model from the run's seed, on the same data in the same order, for
the same number of samples seen: bench.quality_steps optimizer steps of the baseline (a variant
that takes k times the samples per step, accumulation with accumulate_mode=add, runs 1/k as
many). Then it evaluates the loss on one fixed batch, the data set's first EVAL_SAMPLES
samples, in fp32 with the model in eval mode. Identical recipes give identical losses on the
CPU. The probe runs once per (model, variant), before the first round, untimed.

Its first two steps are timed: a variant whose first step exceeds `first_step_limit_s` (run.py:
HOPELESS_FACTOR times the baseline's first step, or the trial budget; only when the experiment
sets a trial budget, bench.max_trial_s: compile's first step is its compilation), or whose second step
(past one-time costs) exceeds STEADY_FACTOR times the baseline's second step, is stopped there
and recorded as `too slow: ...`, and not measured again.
"""
from __future__ import annotations

import math
import time

import torch
from torch.utils.data import default_collate

from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.techniques import Context
from speedbench.measure.timing import synchronize
from speedbench.measure.train import compute_loss
from speedbench.results.schema import TOO_SLOW, format_status

EVAL_SAMPLES = 64
HOPELESS_FACTOR = 20  # a first step this many times the baseline's: stopped after that step
BUDGET_FACTOR = 3
MIN_HOPELESS_S = 1.0
# A second step this many times the baseline's: hopeless. fp16 on a 2-core AVX-512 CPU runs the
# small ResNet ~22x slower than fp32 yet its first step stays under the budget; an identical
# recipe's second step on a loaded machine stayed within 2x.
STEADY_FACTOR = 10


def probe_steps(spec, recipe, baseline, ctx: Context) -> int:
    """Optimizer steps that see as many samples as bench.quality_steps steps of the baseline."""
    samples = baseline.bench.quality_steps * batching(spec, baseline, ctx).per_step
    return max(1, round(samples / batching(spec, recipe, ctx).per_step)) if samples else 0


def first_step_limit(baseline_first_s: float, max_trial_s) -> float:
    """The first-step time past which a variant is hopeless: HOPELESS_FACTOR times the
    baseline's first step, or the trial budget if that is smaller, but never under
    BUDGET_FACTOR times the baseline's first step (on a loaded machine one first step of an
    identical recipe took twice the baseline's, while fp16 on the CPU took 4x a loaded fp32
    step) nor under MIN_HOPELESS_S (a step that short cannot stall a run)."""
    limit = HOPELESS_FACTOR * baseline_first_s
    if max_trial_s:
        limit = min(limit, max(max_trial_s, BUDGET_FACTOR * baseline_first_s))
    return max(limit, MIN_HOPELESS_S)


def steady_step_limit(baseline_second_s: float) -> float:
    """The second-step time past which a variant is hopeless (never under MIN_HOPELESS_S)."""
    return max(STEADY_FACTOR * baseline_second_s, MIN_HOPELESS_S)


def too_slow(step_s: float, baseline_s: float | None, steps_done: int = 1) -> str:
    which = "first" if steps_done == 1 else "second"
    ratio = f", {step_s / baseline_s:.0f}x slower than the baseline's {which} step" \
        if baseline_s else ""
    plural = "s" if steps_done > 1 else ""
    return format_status(TOO_SLOW, f"{step_s:.3g} s/step{ratio}, stopped after {steps_done} "
                                   f"step{plural}")


def quality_probe(spec, recipe, ctx: Context, dataset, steps: int,
                  first_step_limit_s: float | None = None,
                  baseline_first_s: float | None = None,
                  second_step_limit_s: float | None = None,
                  baseline_second_s: float | None = None) -> dict:
    """{final_loss, quality_steps, quality_samples, first_step_ms} after `steps` optimizer steps
    from the seed (at least one step runs, to time it); with `status` 'too slow: ...' when the
    first step exceeded `first_step_limit_s`, or its second `second_step_limit_s` (then no
    loss), or `n/a: ...` when a technique cannot act on the model."""
    per_step = batching(spec, recipe, ctx).per_step
    try:
        with applied(spec, recipe, ctx, dataset) as trainer:
            torch.manual_seed(recipe.bench.seed)  # dropout, per-step noise: the same stream
            first_s = _timed_step(trainer)
            out = {"first_step_ms": 1000 * first_s}
            if first_step_limit_s is not None and first_s > first_step_limit_s:
                return {**out, **_stopped(first_s, per_step, 1, baseline_first_s)}
            if steps > 1:
                second_s = _timed_step(trainer)
                out["second_step_ms"] = 1000 * second_s
                if second_step_limit_s is not None and second_s > second_step_limit_s:
                    return {**out, **_stopped(second_s, per_step, 2, baseline_second_s)}
            for _ in range(steps - 2):
                trainer.step()
            loss = _eval_loss(trainer, spec, dataset, recipe.bench.seed) if steps else math.nan
            return {"first_step_ms": out["first_step_ms"], "final_loss": loss,
                    "second_step_ms": out.get("second_step_ms", math.nan),
                    "quality_steps": steps, "quality_samples": steps * per_step}
    except NotApplicable as exc:
        return {"status": str(exc)}


def _timed_step(trainer) -> float:
    synchronize(trainer.device)
    t0 = time.perf_counter()
    trainer.step()
    synchronize(trainer.device)
    return time.perf_counter() - t0


def _stopped(step_s: float, per_step: int, steps_done: int, baseline_s: float | None) -> dict:
    """The probe of a hopeless variant: its step time, no loss."""
    return {"status": too_slow(step_s, baseline_s, steps_done), "steps": steps_done,
            "samples_per_s": per_step / step_s, "step_ms": 1000 * step_s, "final_loss": math.nan}


def _eval_loss(trainer, spec, dataset, seed: int) -> float:
    """The loss on the data set's first EVAL_SAMPLES samples, in eval mode, without autocast."""
    n = min(EVAL_SAMPLES, len(dataset))
    x, y = default_collate([dataset[i] for i in range(n)])
    trainer.model.eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        return float(compute_loss(trainer.model, spec.loss, x.to(trainer.device),
                                  y.to(trainer.device)))
