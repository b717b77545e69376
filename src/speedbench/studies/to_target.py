"""Time to a target quality: how soon each variant trains a model to the same held-out loss.

Speed per step cannot judge a technique that changes the numerics (16-bit precision, a larger
batch with a scaled learning rate, accumulation): a faster step is worth nothing if it needs
more steps, or never gets there. This stage trains each variant from `target.seeds` paired seeds
(seed s: the same weights and data order for every variant) until the loss on held-out data
reaches the target, or a cap runs out, in the way MLPerf Training and AlgoPerf measure
(a miss counts as infinite time).

- The held-out data: for the synthetic tokens, sequences of the same Markov chain beyond the
  training set; for the synthetic pictures, pictures made from another seed; for a user's own
  data (`data.path`), a seeded random share set aside from training. Evaluation recalibrates
  BatchNorm's running statistics first (held_out.evaluate).
- The target: `target.loss` when given. Else, for the Markov tokens, whose entropy rate
  speedbench knows exactly, the floor (the lowest loss any model can reach) plus
  `target.margin`. Else the baseline trains first from TARGET_RERUNS (3, at most target.seeds)
  other seeds (reruns, not timed against the target: seeds bench.seed + target.seeds onwards)
  for `target.steps` steps, and the target is the worst of their held-out losses then.
- Timing: each optimizer step is timed alone (device synchronised); evaluation runs at a fixed
  cadence of samples seen and is not timed. The first step and the steps a technique declares
  one-time (techniques.one_time_steps: compile's eager and compiling steps) carry one-time
  costs: `one_time_s` is their excess over the median of the later steps, left out of `time_s`
  (the figure compared) and shown apart; `step_ms` is time_s / steps, so that the figures
  multiply; `cold_s` adds the one-time costs and the set-up back.
- Caps: `target.max_steps` baseline steps' worth of samples and `target.max_s` of training, or
  the run's even share of what bench.time_budget_s has left where that is less (`cap_s`); that
  share is also a wall-clock deadline for the whole run, its set-up and evaluations included
  (under load they cost more than its steps), and no run starts once the budget is spent. A run
  the first two stop is `missed: ...` (its time a lower bound; at target.max_s, a wall clock a
  load can run out, analysis/to_target.py counts it as censoring where the baseline did not hit
  it); one the budget stops is `not measured: ...` (no call; its time a lower bound too).
- Every variant is trained, including one the speed rounds stopped (too slow, not measured):
  its runs are capped like the others', and no step-time rule stops them early (such a rule,
  against the speed rounds' unpaired throughput, stopped fine variants, and the baseline
  itself, under load). Only a variant that cannot act here (n/a), or that needs torchrun, is
  not trained.
- A variant whose techniques set variables at a process's start (LD_PRELOAD, OMP_*) trains in
  a fresh worker of its arm (studies/arms.py, arms.variant_arm), as its speed trials do: the
  same seeds, data, target and caps (its deadline passed as wall-clock time), its record and
  curve read back as JSON. The worker's start and torch's import count on the budget's clock,
  not in its time.
- The rounds run in a balanced random order per seed block (orders.round_order).

Writes to_target.csv (a row per model, variant and seed) and curves.csv (a row per evaluation).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from speedbench import distributed, errors, techniques
from speedbench.config import Plan
from speedbench.measure.budget import Budget
from speedbench.studies import arms
from speedbench.studies.orders import round_order
from speedbench.measure.held_out import evaluate, held_out
from speedbench.studies.quality import seeded
from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.measure.timing import synchronize
from speedbench.measure.trial import context
from speedbench.results import atomic, schema


TARGET_RERUNS = 3  # baseline reruns that set a target the data gives no floor for (at most)


@dataclass(frozen=True)
class Caps:
    """Where a run stops: an evaluation every `every` samples, at most `samples` samples and
    `seconds` of training (None: no time cap); `budget`: the seconds are the run's share of
    bench.time_budget_s rather than target.max_s."""

    every: int
    samples: int
    seconds: float | None
    budget: bool = False
    # the time on the budget's clock (time.perf_counter in a run) by which the run ends, its
    # set-up and evaluations included: its share of bench.time_budget_s (None: no budget)
    deadline: float | None = None


# --- one variant, one seed -----------------------------------------------------------------------
def train_to_target(spec, recipe, ctx, train, xy, target: float | None,
                    caps: Caps) -> tuple[dict, list[dict]]:
    """Train `recipe` from its seed until the held-out loss is at most `target` (evaluated every
    caps.every samples seen), or a cap is reached. Returns (the run's record, its curve).
    target None: train to the cap (the baseline reruns that set the target)."""
    per_step = batching(spec, recipe, ctx).per_step
    step_s, curve, setup_s = [], [], 0.0
    t0 = time.perf_counter()
    try:
        with applied(spec, recipe, ctx, train) as trainer:
            setup_s = time.perf_counter() - t0
            torch.manual_seed(recipe.bench.seed)  # dropout: the same stream for every variant
            curve.append({"steps": 0, "samples": 0, "train_s": 0.0,
                          "loss": evaluate(trainer.model, spec, xy, ctx.device, train,
                                           recipe.bench.seed)})
            status = _train(trainer, spec, recipe, train, xy, target, caps, per_step, step_s,
                            curve)
    except NotApplicable as exc:
        return {"status": str(exc)}, []
    except Exception as exc:  # a fault in one run must not stop the others
        return {"status": distributed.failure_status(exc)}, curve
    record = _record(step_s, per_step, setup_s, curve[-1]["loss"], status,
                     1 + techniques.one_time_steps(recipe))
    return {**record, "cap_s": math.nan if caps.seconds is None else caps.seconds}, curve


def _train(trainer, spec, recipe, train, xy, target, caps: Caps, per_step: int,
           step_s: list[float], curve: list[dict]) -> str:
    """The training loop of train_to_target, filling step_s and curve; the run's status."""
    next_eval = caps.every
    while True:
        errors.stop_if_asked()
        synchronize(trainer.device)
        start = time.perf_counter()
        trainer.step()
        synchronize(trainer.device)
        step_s.append(time.perf_counter() - start)
        samples = len(step_s) * per_step
        by_samples = samples >= caps.samples
        late = caps.deadline is not None and time.perf_counter() >= caps.deadline
        by_time = late or (caps.seconds is not None and sum(step_s) >= caps.seconds)
        if samples < next_eval and not (by_samples or by_time):
            continue
        while next_eval <= samples:
            next_eval += caps.every
        loss = evaluate(trainer.model, spec, xy, trainer.device, train, recipe.bench.seed)
        curve.append({"steps": len(step_s), "samples": samples, "train_s": sum(step_s),
                      "loss": loss})
        if not math.isfinite(loss):
            return schema.DIVERGED
        if target is not None and loss <= target:
            return schema.OK
        if by_samples or by_time:
            return schema.OK if target is None else _cap_status(
                caps, by_samples, samples, len(step_s), sum(step_s), loss, target, late)


def _cap_status(caps: Caps, by_samples: bool, samples: int, steps: int, took_s: float,
                loss: float, target: float, late: bool = False) -> str:
    """`missed: ...` at target.max_steps or target.max_s; `not measured: ...` where the run's
    share of bench.time_budget_s stopped it first (a limit, not evidence)."""
    text = (f"held-out loss {loss:.4g} > target {target:.4g} after {steps} steps "
            f"({samples:,} samples, {took_s:.1f} s of training)")
    if not by_samples and (caps.budget or late):
        share = ("as wall time, set-up and evaluations included" if late else
                 f"{caps.seconds:.3g} s of training")
        return schema.format_status(schema.NOT_MEASURED, f"its share of bench.time_budget_s "
                                    f"({share}) ran out: {text}; a larger "
                                    "bench.time_budget_s lets it run to the target")
    which = "the cap target.max_steps" if by_samples else schema.TIME_CAP
    return schema.format_status(schema.MISSED, f"{text}, {which}")


def _record(step_s: list[float], per_step: int, setup_s: float, loss: float, status: str,
            one_time_steps: int = 1) -> dict:
    """The run's figures: its first `one_time_steps` steps' excess over the median of the later
    ones (the median of all but the first where no later one ran) is one_time_s, left out of
    time_s; step_ms = time_s / steps (the mean, so that steps x step_ms = time_s)."""
    if not step_s:
        return {"status": status, "final_loss": loss, "steps": 0, "samples": 0,
                "per_step": per_step, "time_s": 0.0, "cold_s": setup_s, "one_time_s": 0.0,
                "step_ms": math.nan}
    later = step_s[one_time_steps:] or step_s[1:] or step_s
    steady = statistics.median(later)
    one_time = sum(max(0.0, t - steady) for t in step_s[:one_time_steps])
    took = sum(step_s)
    return {"status": status, "final_loss": loss, "steps": len(step_s),
            "samples": len(step_s) * per_step, "per_step": per_step, "time_s": took - one_time,
            "cold_s": took + setup_s, "one_time_s": one_time,
            "step_ms": 1000 * (took - one_time) / len(step_s)}


def caps_data(caps: Caps, left_s: float | None) -> dict:
    """Caps as plain data for another process: the deadline as wall-clock time (time.time),
    `left_s` from now, since perf_counter's zero is the process's own."""
    return {**asdict(caps), "deadline": None if left_s is None else time.time() + left_s}


def caps_of(data: dict) -> Caps:
    """caps_data's Caps again, in this process: the deadline back on perf_counter."""
    at = data.get("deadline")
    return Caps(**{**data, "deadline": None if at is None else
                   time.perf_counter() + at - time.time()})


def trained_here(plan: Plan, spec, name: str, seed: int, target: float | None,
                 caps: Caps) -> tuple[dict, list[dict]]:
    """One run of variant `name` from seed bench.seed + `seed`, on the data ToTarget._model
    builds (the baseline's, from its seed): an arm worker's `to_target` call."""
    cfg, first, ctx = plan.config.target, plan.variants[plan.baseline], context(plan)
    base_step = batching(spec, first, ctx).per_step
    train, xy, _ = held_out(spec, first, cfg.max_steps * base_step, cfg.eval_samples)
    return train_to_target(spec, seeded(plan.variants[name], seed), ctx, train, xy, target,
                           caps)


def fixed_target(cfg, floor: float | None) -> tuple[float | None, str]:
    """(target, where it comes from) known before any training: `target.loss` (cfg.loss) when
    given, else the data's entropy floor + target.margin; (None, "") where neither is known and
    the baseline's reruns must set it (ToTarget._reruns_target)."""
    if cfg.loss is not None:
        return float(cfg.loss), "target.loss"
    if floor is not None:
        return floor + cfg.margin, (f"the data's entropy floor {floor:.4f} + "
                                    f"target.margin {cfg.margin:g}")
    return None, ""


# --- a plan ----------------------------------------------------------------------------------------
class ToTarget:
    """The time-to-target stage of one plan: every model, variant and seed."""

    def __init__(self, plan: Plan, run_dir: Path, speed_rows: list[dict], progress: bool,
                 order_seed: int, budget: Budget | None = None, *,
                 train: Callable | None = None, data: Callable | None = None):
        self.plan, self.run_dir, self.order_seed = plan, run_dir, order_seed
        self.budget = budget or Budget(None)  # the run's clock: each run caps at its share
        # the instruments, train_to_target and held_out: benchmarks/to_target_sim.py hands in
        # simulated ones on a simulated clock (the budget's), all else stays the CLI's
        self.train_run = train or train_to_target
        self.data = data or held_out
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
        train, xy, floor = self.data(spec, first, cfg.max_steps * base_step, cfg.eval_samples)
        skip = self._not_trained(spec)
        target, source = fixed_target(cfg, floor)
        if target is None:  # baseline reruns set it; the timed seeds are others
            target, source = self._reruns_target(spec, train, xy, base_step)
        for s in range(cfg.seeds):
            names = self.round_order(list(self.plan.variants), self.order_seed, s, stream)
            for position, name in enumerate(names):
                errors.stop_if_asked()
                if name in skip or not math.isfinite(target):
                    why = skip.get(name) or schema.na("no target: a baseline rerun failed")
                    record, curve = {"status": why}, []
                elif (over := self._over()) is not None:
                    record, curve = over, []
                else:
                    self.bar.set_postfix_str(f"{spec.name} {name} seed {s}")
                    record, curve = self._one_run(spec, name, s, train, xy, target,
                                                  self._caps(base_step, cfg.max_steps))
                self._done()
                self._write(spec, name, s, position, record, curve, target, source, floor)

    def _reruns_target(self, spec, train, xy, base_step: int) -> tuple[float, str]:
        """The target where the data has no known floor: the worst held-out loss of
        TARGET_RERUNS baseline reruns (seeds after the timed ones) after target.steps steps.
        Not timed against it: a target set by the very runs it times would favour the
        baseline."""
        cfg, losses = self.cfg, []
        reruns = min(cfg.seeds, TARGET_RERUNS)
        self.left += reruns
        self.bar.total += reruns
        for s in range(cfg.seeds, cfg.seeds + reruns):
            self.bar.set_postfix_str(f"{spec.name} {self.plan.baseline} rerun {s} (target)")
            record = self._over() or self._one_run(
                spec, self.plan.baseline, s, train, xy, None, self._caps(base_step, cfg.steps))[0]
            self._done()
            ok = schema.parse_status(record["status"]).ok
            losses.append(record.get("final_loss", math.nan) if ok else math.nan)
        target = max(losses) if all(map(math.isfinite, losses)) else math.nan
        first = self.first.bench.seed + cfg.seeds
        seeds = f"{first}-{first + reruns - 1}"
        return target, (f"the worst of {reruns} baseline reruns (seeds {seeds}, not timed) "
                        f"after {cfg.steps} steps: " + ", ".join(f"{x:.4g}" for x in losses))

    def _one_run(self, spec, name: str, s: int, train, xy, target: float | None,
                 caps: Caps) -> tuple[dict, list[dict]]:
        """Variant `name` from seed bench.seed + s: in this process, or in a worker of its arm
        where its techniques set variables at a process's start (trained_here there)."""
        arm = arms.variant_arm(self.plan, name, self.ctx)
        if arm is None:
            return self.train_run(spec, seeded(self.plan.variants[name], s), self.ctx, train,
                                  xy, target, caps)
        left = None if caps.deadline is None else caps.deadline - self.budget.clock()
        return arms.to_target(self.plan, spec, arm, name,
                              {"seed": s, "target": target, "caps": caps_data(caps, left)},
                              left)

    def _caps(self, base_step: int, steps: int) -> Caps:
        """A run's caps: target.max_s of training, or its even share of what the run's budget
        has left for the runs still to go where that is less; that share is also its
        wall-clock deadline."""
        share = self.budget.left() / max(1, self.left)
        cap = self.cfg.max_s if share >= (self.cfg.max_s or math.inf) else max(0.1, share)
        return Caps(self.cfg.eval_every * base_step, steps * base_step, cap,
                    budget=cap is not None and cap != self.cfg.max_s,
                    deadline=self.budget.clock() + share if math.isfinite(share) else None)

    def _over(self) -> dict | None:
        """The record of a run that does not start: the run's budget is spent."""
        if not self.budget.over():
            return None
        return {"status": schema.format_status(
            schema.NOT_MEASURED, "bench.time_budget_s ran out before this run started; a "
            "larger bench.time_budget_s lets it run to the target")}

    def _done(self) -> None:
        self.left -= 1
        self.bar.update()

    def _not_trained(self, spec) -> dict:
        """variant -> why it is not trained: n/a in the speed rounds, or torchrun's processes.
        A variant the rounds stopped (too slow, not measured) is trained all the same, within
        its share of the budget: its time to target is a question of its own."""
        out = {}
        for row in self.speed_rows:
            if row.get("model") != spec.name or row["variant"] == self.plan.baseline:
                continue
            if schema.parse_status(row.get("status")).na:
                out[row["variant"]] = row["status"]
        for name, recipe in self.plan.variants.items():
            if techniques.processes(recipe, self.ctx) is not None:
                out[name] = schema.na("time to target trains in one process; this variant "
                                      "needs torchrun's processes, so it has no time to "
                                      "target here")
        if distributed.from_environ() is not None:
            reason = "time to target trains in one process; run it without torchrun"
            out.update({n: schema.na(reason) for n in self.plan.variants})
        return out

    def _write(self, spec, name, seed, position, record, curve, target, source, floor) -> None:
        row = {"experiment": self.plan.experiment, "model": spec.name, "variant": name,
               "is_baseline": name == self.plan.baseline, "seed": self.first.bench.seed + seed,
               "position": position, "order_seed": self.order_seed, "target_loss": target,
               "target_source": source, "entropy_floor": math.nan if floor is None else floor,
               **record}
        head = {"experiment": self.plan.experiment, "model": spec.name, "variant": name,
                "seed": row["seed"]}
        atomic.append_rows(self.run_dir / "curves.csv", schema.CURVE_COLUMNS,
                           [{**head, **p} for p in curve])
        # last: a run in to_target.csv has its whole curve
        atomic.append_rows(self.run_dir / "to_target.csv", schema.TO_TARGET_COLUMNS, [row])


def measure(plan: Plan, run_dir: Path, speed_rows: list[dict], progress: bool,
            order_seed: int, budget: Budget | None = None) -> None:
    """The time-to-target stage of `plan`, into run_dir (target.enabled), each run capped at
    its share of what `budget` has left."""
    ToTarget(plan, run_dir, speed_rows, progress, order_seed, budget).run()
