"""Time to a target quality: how soon each variant trains a model to the same held-out loss.

Speed per step cannot judge a technique that changes the numerics (16-bit precision, a larger
batch with a scaled learning rate, accumulation): a faster step is worth nothing if it needs
more steps, or never gets there. This stage trains each variant from `target.seeds` paired seeds
(seed s: the same weights and data order for every variant) until the loss on held-out data
reaches the target, or a cap runs out, in the way MLPerf Training and AlgoPerf measure
(a miss counts as infinite time).

- The held-out data: for the synthetic tokens, sequences of the same Markov chain beyond the
  training set; for the synthetic pictures, pictures made from another seed; for a user's own
  data (`data.path`), a seeded random share set aside from training.
- The target: `target.loss` when given. Else, for the Markov tokens, whose entropy rate
  speedbench knows exactly, the floor (the lowest loss any model can reach) plus
  `target.margin`. Else the baseline's seeds train first for `target.steps` steps, and the target
  is the worst of their held-out losses then, so that every baseline seed reaches it.
- Timing: each optimizer step is timed alone (device synchronised); evaluation runs at a fixed
  cadence of samples seen and is not timed. The first step carries the one-time costs
  (compilation, allocation); `one_time_s` is its excess over the median step, and `time_s`
  (the figure compared) leaves it out; `cold_s` adds it and the set-up back.
- A variant whose speed rounds stopped it as far too slow, or that cannot act here (n/a), is not
  trained: its rows say so. One that is stopped here by the same rule (bench.too_slow_factor,
  against the baseline's speed-round throughput) is a miss.
- The rounds run in a balanced random order per seed block (rounds.round_order).

Writes to_target.csv (a row per model, variant and seed) and curves.csv (a row per evaluation).
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from speedbench import distributed, errors, techniques
from speedbench.config import Plan
from speedbench.measure.budget import Budget
from speedbench.measure.held_out import evaluate, held_out
from speedbench.measure.quality import far_slower, seeded, too_slow
from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.measure.timing import synchronize
from speedbench.measure.trial import context
from speedbench.results import atomic, schema


# --- one variant, one seed -----------------------------------------------------------------------
def train_to_target(spec, recipe, ctx, train, xy, target: float | None, *, every: int,
                    cap_samples: int, cap_s: float | None, baseline_rate: float | None = None,
                    stop_at_target: bool = True) -> tuple[dict, list[dict]]:
    """Train `recipe` from its seed until the held-out loss is at most `target` (evaluated every
    `every` samples seen), or `cap_samples` samples or `cap_s` seconds of training are spent.
    Returns (the run's record, its curve). target None: train to the cap (the baseline's seeds
    that set the target)."""
    per_step = batching(spec, recipe, ctx).per_step
    factor = recipe.bench.too_slow_factor
    step_s, curve, status, loss = [], [], schema.OK, math.nan
    t0 = time.perf_counter()
    try:
        with applied(spec, recipe, ctx, train) as trainer:
            setup_s = time.perf_counter() - t0
            torch.manual_seed(recipe.bench.seed)  # dropout: the same stream for every variant
            loss = evaluate(trainer.model, spec, xy, ctx.device)
            curve.append({"steps": 0, "samples": 0, "train_s": 0.0, "loss": loss})
            next_eval = every
            while True:
                errors.stop_if_asked()
                synchronize(trainer.device)
                start = time.perf_counter()
                trainer.step()
                synchronize(trainer.device)
                step_s.append(time.perf_counter() - start)
                samples = len(step_s) * per_step
                if far_slower(step_s, per_step, baseline_rate, factor):
                    status = too_slow(step_s, per_step, baseline_rate)
                    break
                capped = samples >= cap_samples or (cap_s is not None and sum(step_s) >= cap_s)
                if samples < next_eval and not capped:
                    continue
                while next_eval <= samples:
                    next_eval += every
                loss = evaluate(trainer.model, spec, xy, ctx.device)
                curve.append({"steps": len(step_s), "samples": samples,
                              "train_s": sum(step_s), "loss": loss})
                if not math.isfinite(loss):
                    status = schema.DIVERGED
                    break
                if stop_at_target and target is not None and loss <= target:
                    break
                if capped:
                    if target is not None and stop_at_target:
                        status = schema.format_status(schema.MISSED, _cap_text(
                            samples, len(step_s), sum(step_s), loss, target))
                    break
    except NotApplicable as exc:
        return {"status": str(exc)}, []
    except Exception as exc:  # a fault in one run must not stop the others
        return {"status": distributed.failure_status(exc)}, curve
    return _record(step_s, per_step, setup_s, loss, status), curve


def _cap_text(samples: int, steps: int, took_s: float, loss: float, target: float) -> str:
    return (f"held-out loss {loss:.4g} > target {target:.4g} after {steps} steps "
            f"({samples:,} samples, {took_s:.1f} s of training)")


def _record(step_s: list[float], per_step: int, setup_s: float, loss: float,
            status: str) -> dict:
    steady = statistics.median(step_s[1:]) if len(step_s) > 1 else step_s[0]
    one_time = max(0.0, step_s[0] - steady)
    took = sum(step_s)
    return {"status": status, "final_loss": loss, "steps": len(step_s),
            "samples": len(step_s) * per_step, "per_step": per_step, "time_s": took - one_time,
            "cold_s": took + setup_s, "one_time_s": one_time, "step_ms": 1000 * steady}


def reached_at(curve: list[dict], target: float) -> dict | None:
    """The first evaluation of a curve at or below `target`, or None."""
    return next((c for c in curve if c["loss"] <= target), None)


# --- a plan ----------------------------------------------------------------------------------------
class ToTarget:
    """The time-to-target stage of one plan: every model, variant and seed."""

    def __init__(self, plan: Plan, run_dir: Path, speed_rows: list[dict], progress: bool,
                 order_seed: int, budget: Budget | None = None):
        from speedbench.measure.rounds import round_order

        self.plan, self.run_dir, self.order_seed = plan, run_dir, order_seed
        self.budget = budget or Budget(None)  # the run's clock: each run caps at its share
        self.first = plan.variants[plan.baseline]
        self.cfg = plan.config.target
        self.speed_rows = [r for r in speed_rows if r.get("experiment") == plan.experiment]
        self.round_order = round_order
        self.ctx = context(plan)
        seeds = self.cfg.seeds
        total = self.left = len(plan.models) * len(plan.variants) * seeds  # runs still to go
        self.bar = tqdm(total=total, desc=f"{plan.experiment}: time to target", unit="run",
                        disable=not progress, dynamic_ncols=True, smoothing=0)

    def run(self) -> None:
        for stream, spec in enumerate(self.plan.models):
            self._model(spec, stream)
        self.bar.close()

    def _model(self, spec, stream: int) -> None:
        cfg, first = self.cfg, self.first
        base_step = batching(spec, first, self.ctx).per_step
        every = cfg.eval_every * base_step
        cap_samples = cfg.max_steps * base_step
        train, xy, floor = held_out(spec, first, cap_samples, cfg.eval_samples)
        skip = self._not_trained(spec)
        rate = self._baseline_rate(spec)
        runs: dict[tuple[str, int], tuple[dict, list]] = {}
        target, source = self._fixed_target(floor)
        if target is None:  # the baseline's seeds set it: they train first, to target.steps
            for s in range(cfg.seeds):
                self.bar.set_postfix_str(f"{spec.name} {self.plan.baseline} seed {s} (target)")
                runs[(self.plan.baseline, s)] = train_to_target(
                    spec, seeded(first, s), self.ctx, train, xy, None, every=every,
                    cap_samples=cfg.steps * base_step, cap_s=self._cap_s(), stop_at_target=False)
                self._done()
            losses = [r[0].get("final_loss", math.nan) for r in runs.values()]
            target = max(losses) if all(map(math.isfinite, losses)) else math.nan
            source = f"the worst of the baseline's {cfg.seeds} seeds after {cfg.steps} steps"
        for s in range(cfg.seeds):
            names = self.round_order(list(self.plan.variants), self.order_seed, s, stream)
            for position, name in enumerate(names):
                errors.stop_if_asked()
                if (name, s) in runs:
                    record, curve = runs[(name, s)]
                    record = {**record, **self._judged(record, curve, target)}
                elif name in skip or not math.isfinite(target):
                    why = skip.get(name) or schema.na("no target: a baseline seed failed")
                    record, curve = {"status": why}, []
                    self._done()
                else:
                    self.bar.set_postfix_str(f"{spec.name} {name} seed {s}")
                    record, curve = train_to_target(
                        spec, seeded(self.plan.variants[name], s), self.ctx, train, xy,
                        target, every=every, cap_samples=cap_samples, cap_s=self._cap_s(),
                        baseline_rate=rate)
                    self._done()
                self._write(spec, name, s, position, record, curve, target, source, floor)

    def _cap_s(self) -> float | None:
        """A run's cap on its training time: target.max_s, or its even share of what the run's
        budget has left for the runs still to go, where that is less."""
        share = self.budget.left() / max(1, self.left)
        return self.cfg.max_s if share >= (self.cfg.max_s or math.inf) else max(0.1, share)

    def _done(self) -> None:
        self.left -= 1
        self.bar.update()

    def _fixed_target(self, floor: float | None) -> tuple[float | None, str]:
        if self.cfg.loss is not None:
            return float(self.cfg.loss), "target.loss"
        if floor is not None:
            return floor + self.cfg.margin, (f"the data's entropy floor {floor:.4f} + "
                                             f"target.margin {self.cfg.margin:g}")
        return None, ""

    def _judged(self, record: dict, curve: list[dict], target: float) -> dict:
        """A baseline seed that trained to target.steps: its time to the target, read off its
        curve (the training time up to the first evaluation at or below it)."""
        if not schema.parse_status(record["status"]).ok:
            return {}
        hit = reached_at(curve, target)
        if hit is None:
            return {"status": schema.format_status(schema.MISSED, "the target is this run's "
                                                                  "own loss, not reached")}
        per_step, one_time = record["per_step"], record["one_time_s"]
        return {"steps": hit["steps"], "samples": hit["samples"],
                "time_s": hit["train_s"] - one_time,
                "cold_s": record["cold_s"] - (record["time_s"] + one_time) + hit["train_s"],
                "final_loss": hit["loss"], "per_step": per_step}

    def _not_trained(self, spec) -> dict:
        """variant -> why it is not trained: n/a in the speed rounds, or stopped there as far
        too slow (it would spend the cap at that pace)."""
        out = {}
        for row in self.speed_rows:
            if row.get("model") != spec.name or row["variant"] == self.plan.baseline:
                continue
            st = schema.parse_status(row.get("status"))
            if st.na:
                out[row["variant"]] = row["status"]
            elif st.kind == schema.TOO_SLOW:
                out[row["variant"]] = schema.format_status(
                    schema.MISSED, f"not trained: the speed rounds stopped it ({st.reason})")
        for name, recipe in self.plan.variants.items():
            if techniques.processes(recipe, self.ctx) or techniques.environment(recipe,
                                                                                self.ctx):
                out[name] = schema.na("time to target trains in this process; this variant "
                                      "needs processes of its own (torchrun or a fresh "
                                      "environment), so it has no time to target here")
        if distributed.from_environ() is not None:
            reason = "time to target trains in one process; run it without torchrun"
            out.update({n: schema.na(reason) for n in self.plan.variants})
        return out

    def _baseline_rate(self, spec) -> float | None:
        """The baseline's samples per second in its speed trials (median), for the too-slow
        rule; None without them."""
        rates = [r.get("samples_per_s") for r in self.speed_rows
                 if r.get("model") == spec.name and r["variant"] == self.plan.baseline
                 and schema.parse_status(r.get("status")).ok]
        rates = [x for x in rates if x == x and x]
        return statistics.median(rates) if rates else None

    def _write(self, spec, name, seed, position, record, curve, target, source, floor) -> None:
        row = {"experiment": self.plan.experiment, "model": spec.name, "variant": name,
               "is_baseline": name == self.plan.baseline, "seed": self.first.bench.seed + seed,
               "position": position, "order_seed": self.order_seed, "target_loss": target,
               "target_source": source, "entropy_floor": math.nan if floor is None else floor,
               **record}
        atomic.append_rows(self.run_dir / "curves.csv", schema.CURVE_COLUMNS,
                [{"experiment": self.plan.experiment, "model": spec.name, "variant": name, "seed": row["seed"], **p} for p in curve])
        # last: a run in to_target.csv has its whole curve
        atomic.append_rows(self.run_dir / "to_target.csv", schema.TO_TARGET_COLUMNS, [row])


def measure(plan: Plan, run_dir: Path, speed_rows: list[dict], progress: bool,
            order_seed: int, budget: Budget | None = None) -> None:
    """The time-to-target stage of `plan`, into run_dir (target.enabled), each run capped at
    its share of what `budget` has left."""
    ToTarget(plan, run_dir, speed_rows, progress, order_seed, budget).run()
