"""One trial of one (model, variant): build -> warm up -> time -> (profile) -> record.

The recipe is applied by session.applied (every technique hook, in registry order: a technique
that cannot act here makes the row `n/a: <reason>`), and the trial reads everything while it is
applied: timings, memory, the techniques' columns, the FLOPs per step and the TF32 decision.
The record it returns is whole: identity, round and position, measurements, the quality
probe's loss and the peak it is compared with. A fault (OOM, exception, NaN loss) becomes the
row's status, except under torchrun, where it must stop the job. bench.max_trial_s is a hard
cap on a trial in this process (watchdog.py, trial_limit_s): a step past it is stopped and the
row's status is `too slow: step exceeded bench.max_trial_s ...`.
"""
from __future__ import annotations

import contextlib
import math
import os
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig

from speedbench import distributed, techniques
from speedbench.measure import energy, flops, profile, watchdog
from speedbench.results import file_name, schema
from speedbench.config import ModelSpec, Plan
from speedbench.measure.budget import Budget
from speedbench.measure.data import build_dataset, rank_sampler
from speedbench.measure.flops import FlopsBook
from speedbench.measure.session import NotApplicable, applied, batching
from speedbench.errors import ConfigError
from speedbench.techniques import Context
from speedbench.measure.timing import PeakRss, PhaseClock, StepTimes, device_peak_mb, \
    release_host_memory, reset_device_peak, stall_ms, step_memory, synchronize, timed_steps, \
    typical_step_s, warm_up
from speedbench.measure.train import DataOutOfMemory, Trainer


def dataset_length(plan: Plan, spec: ModelSpec, world_size: int = 1) -> int:
    """Enough samples that no trial crosses an epoch end (unless data.samples says otherwise),
    on every one of `world_size` ranks."""
    need = 0
    for r in plan.variants.values():
        if r.data.samples:
            return r.data.samples
        per_step = batching(spec, r, Context(device=torch.device(plan.device))).per_step
        warmup = max(r.bench.warmup, r.bench.warmup_max) if r.bench.steady_tol else r.bench.warmup
        steps = warmup + r.bench.steps + profile.extra_steps(r) + 2
        need = max(need, steps * per_step * world_size)
    return need


# A trial in this process may take this many times bench.max_trial_s (watchdog.deadline): its
# warm-up and window stop near 1x between steps; the memory step and the FLOP count add a step
# or two. Past it, a step that has itself run bench.max_trial_s is stopped (status `too slow`);
# a trial of shorter steps (warm-up's floor of bench.warmup steps) runs on.
OVERRUN_FACTOR = 2
# The tensor-memory step (an untimed step under a dispatch-mode tracker, slower than a plain
# one) runs in the first rounds only: a recipe's memory is the same in every round.
MEMORY_ROUNDS = 2
MAX_SAMPLES = 10_000_000  # per trial: the loader's shuffle alone holds 8 bytes per sample


def check_data(plan: Plan, spec: ModelSpec, world_size: int = 1) -> None:
    """Before anything is written: no trial asks for more than MAX_SAMPLES samples, and the
    data set (data.path, or data.samples) holds a full batch for every variant, else its
    trials would wait for one forever. ConfigError otherwise."""
    length = dataset_length(plan, spec, world_size)
    if length > MAX_SAMPLES:
        raise ConfigError(f"bench.steps: model {spec.name} would need {length:,} samples per trial "
                          f"(steps x batch_size x accumulate), over the {MAX_SAMPLES:,} allowed; "
                          "lower bench.steps, batch_size or data.samples")
    first = plan.variants[plan.baseline]
    own = "_target_" in spec.dataset  # the user's own data set (own_data.py): built to know
    if not first.data.path and not first.data.samples and not own:
        return  # synthetic data is made as long as the trials need
    # a synthetic data set is as long as asked; a file or folder is read to know
    have = len(build_dataset(spec.dataset, length, first.data.path, seed=first.bench.seed,
                             keep=own)) if first.data.path or own else length
    ctx = Context(device=torch.device(plan.device))
    for name, r in plan.variants.items():
        need = batching(spec, r, ctx).loader_batch * (techniques.processes(r, ctx) or world_size)
        if have < need:
            key = "data.path" if first.data.path else "data._target_" if own else "data.samples"
            raise ConfigError(f"{key}: model {spec.name} gets {have} sample(s), fewer than one "
                              f"batch of {need} (variant {name}); give more data or a smaller "
                              "batch_size")


def context(plan: Plan, dist_env: distributed.DistEnv | None = None) -> Context:
    """What the techniques see of this process: its device and torchrun job."""
    return Context(device=distributed.rank_device(plan.device, dist_env), dist_env=dist_env)


def header(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
           dist_env: distributed.DistEnv | None = None, position: int = 0) -> dict:
    """The record's identifying columns and the techniques' settings, before anything runs."""
    ctx = context(plan, dist_env)
    world = dist_env.world_size if dist_env else 1
    replicas = techniques.replicas(recipe, ctx)  # devices one process drives (DataParallel)
    return {
        "experiment": plan.experiment, "model": spec.name, "variant": variant,
        "is_baseline": variant == plan.baseline, "trial": trial, "round": trial,
        "position": position,
        "device": str(ctx.device), "world_size": world, "devices": world * replicas,
        "batch_size": batching(spec, recipe, ctx).micro,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "torch_threads": torch.get_num_threads(),
        **techniques.columns(recipe, ctx),
    }


def measure_trial(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
                  dataset, dist_env: distributed.DistEnv | None = None,
                  run_dir: Path | None = None, *, position: int = 0, probe: dict | None = None,
                  book: FlopsBook | None = None, budget: Budget | None = None,
                  window: Optional[Callable[..., dict]] = None) -> dict:
    """One trial in this process: its whole record for trials.csv, whatever happens.

    `trial` is the round, `position` the trial's place in it. `probe`, the variant's quality
    probe (quality.py), gives final_loss; `book` holds the run's FLOP counts and peaks.
    Under torchrun (`dist_env`) it runs on every rank and returns the ranks' combined record;
    a fault on a rank is raised, not recorded, so that torchrun stops the whole job. With
    `profile` on, profile windows follow the timed one; trial 0 writes the profiler's files
    under run_dir/profile/<model>/<variant>/. `budget`: the run's clock (budget.py); the warm-up
    and the window stop at its deadline between steps, and a step still running BUDGET_GRACE_S
    past it is stopped (status `not measured: ...`). `window`: what runs the warm-up and the
    timed steps, called like timed_window (the default); a test passes one that wraps it to
    see what the trial ran with.
    """
    ctx = context(plan, dist_env)
    record = header(plan, spec, variant, recipe, trial, dist_env, position)
    try:
        out = run_dir / "profile" / file_name(spec.name) / file_name(variant) \
            if run_dir and trial == 0 else None
        record.update(_measured(spec, recipe, ctx, dataset, out, book,
                                f"model {spec.name}, variant {variant}", budget,
                                memory_step=trial < MEMORY_ROUNDS, window=window))
        if dist_env is not None:
            record = distributed.gather_record(record, dist_env)
            record.update(rates(record))  # the job's steps: each the slowest rank's
    except NotApplicable as exc:
        record["status"] = str(exc)
    except watchdog.StepOverrun as exc:  # a step past a limit: not measured, not a fault
        record["status"] = overrun_status(recipe, exc)
    except torch.OutOfMemoryError:
        if dist_env is not None:
            raise
        record["status"] = schema.OOM
    except DataOutOfMemory:  # not the model's: the host ran out while a batch was read
        if dist_env is not None:
            raise
        record["status"] = schema.format_status(schema.OOM, "reading the data, not the model")
    except Exception as exc:  # a fault in one variant must not stop the others
        if dist_env is not None:
            raise  # under DDP the peers are mid-collective: the job must stop
        record["status"] = distributed.failure_status(exc)
        if os.environ.get("SPEEDBENCH_DEBUG"):
            traceback.print_exc()
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    if probe and schema.parse_status(record["status"]).kind in (schema.OK, schema.TOO_SLOW,
                                                                 schema.NOT_MEASURED):
        record.update(probe)  # final_loss: the quality probe's, at equal work
    if book is not None and distributed.is_main(dist_env):
        book.annotate(record)
    return record


def trial_limit_s(recipe: DictConfig, ctx: Context) -> float | None:
    """The hard cap on a trial in this process (watchdog.deadline), from build to FLOP count:
    OVERRUN_FACTOR x bench.max_trial_s, as much again when it profiles (the profile windows
    are budgeted between steps as the trial's are); past it, the step running is stopped once
    it has run bench.max_trial_s itself. None without a cap, and under torchrun, where the
    process group's timeouts stop a rank."""
    cap = recipe.bench.max_trial_s
    if cap is None or ctx.dist_env is not None:
        return None
    return OVERRUN_FACTOR * cap * (2 if recipe.profile != "off" else 1)


def overrun_status(recipe: DictConfig, exc: watchdog.StepOverrun) -> str:
    """`not measured: a step ran past bench.max_trial_s (5 s), stopped after 10.0 s; to
    measure it give bench.max_trial_s=40` (or the run's time budget, which ran out)."""
    stopped = f"stopped after {exc.elapsed_s:.1f} s"
    if exc.deadline.limit == BUDGET_LIMIT:
        return schema.format_status(schema.NOT_MEASURED, f"the run's bench.time_budget_s ran "
                                    f"out in a step, {stopped}")
    cap = recipe.bench.max_trial_s
    return schema.format_status(schema.NOT_MEASURED, f"a step ran past bench.max_trial_s "
                                f"({cap:g} s), {stopped}; to measure it give "
                                f"bench.max_trial_s={_enough(exc.elapsed_s)}")


def _enough(seconds: float) -> str:
    """A cap comfortably above `seconds`: twice it, rounded up to 2 significant digits."""
    return f"{float(f'{2 * seconds:.2g}'):g}"


BUDGET_LIMIT = "the run's bench.time_budget_s"
BUDGET_GRACE_S = 2.0  # a step still running this long past the budget's deadline is stopped


def _budget_deadline(budget: Budget | None, ctx: Context, what: str) -> watchdog.Deadline:
    """The run's deadline as a hard limit on the trial (none under torchrun, where every rank
    would have to stop at the same step)."""
    left = None if budget is None or ctx.dist_env is not None else budget.limit(None)
    return watchdog.deadline(None if left is None else left + BUDGET_GRACE_S, what,
                             BUDGET_LIMIT)


def _deadline(recipe: DictConfig, ctx: Context, what: str) -> watchdog.Deadline:
    """The trial's hard cap: once past trial_limit_s, the step running is stopped as soon as
    it has run bench.max_trial_s (a trial of many shorter steps runs on)."""
    limit, cap = trial_limit_s(recipe, ctx), recipe.bench.max_trial_s
    return watchdog.deadline(limit, what, f"{limit / cap:g} x bench.max_trial_s = {cap:g} s"
                             if limit else "", step_s=cap)


def _measured(spec: ModelSpec, recipe: DictConfig, ctx: Context, dataset, profile_out,
              book: FlopsBook | None, what: str = "", budget: Budget | None = None,
              memory_step: bool = True, window: Optional[Callable[..., dict]] = None) -> dict:
    """The measured columns of a trial, the recipe applied (session.applied) for all of it,
    under the trial's hard cap (trial_limit_s): StepOverrun once it passes."""
    device, b = ctx.device, batching(spec, recipe, ctx)
    clock = PhaseClock(device)
    sampler = rank_sampler(dataset, ctx.dist_env, recipe.bench.seed)
    release_host_memory()
    reset_device_peak(device)
    with contextlib.ExitStack() as session:  # outlives the memory watch: profiling is not in it
        guard = session.enter_context(_deadline(recipe, ctx, what or f"model {spec.name}"))
        session.enter_context(_budget_deadline(budget, ctx, what or f"model {spec.name}"))
        with PeakRss() as rss:
            trainer = session.enter_context(
                applied(spec, recipe, ctx, dataset, sampler=sampler, clock=clock))
            session.callback(guard.disarm)  # the recipe's cleanup is never interrupted
            trainer.step = guard.stepping(trainer.step)  # each step's end, for the cap
            session.callback(vars(trainer).pop, "step", None)  # and no cycle left behind
            got = (window or timed_window)(trainer, recipe.bench, ctx, budget or Budget(None))
            # One more step, untimed, for the tensor memory split (not under torchrun: the
            # ranks would all have to take it); the phase totals stay the window's.
            with clock.paused():
                memory = step_memory(trainer, device) \
                    if ctx.dist_env is None and memory_step else {}
        dev_peak = device_peak_mb(device)
        if recipe.profile != "off":
            with clock.paused():
                got.update(profile.profile_trial(trainer, recipe, device, got["steps"],
                                                 profile_out))
        got.update(techniques.columns(recipe, ctx))  # with what they observed of the trainer
        got["torch_threads"] = torch.get_num_threads()  # the count the trial ran with
        guard.step_done()  # the FLOP count: a step's work of its own
        got.update(flops.reading(ctx, spec, recipe, dataset, b.micro, b.k, book))
    loss, elapsed = got.pop("loss"), got["elapsed_s"]
    got.update({
        "status": schema.OK if math.isfinite(loss) else schema.DIVERGED,
        "data_wait_frac": clock.totals["data"] / elapsed,
        # a tensor peak only (the step's split, below; the allocator's on CUDA): under torchrun
        # on the CPU a process's RSS growth is its own column, never compared with a tensor peak
        "peak_mem_mb": dev_peak if dev_peak is not None else math.nan,
        "rss_growth_mb": rss.main_mb - rss.start_mb if ctx.dist_env is not None else math.nan,
        "host_rss_mb": rss.total_mb, "host_rss_main_mb": rss.main_mb,
        "final_loss": loss, "window_loss": loss,
        "samples": got.get("samples") or got["steps"] * b.per_step,
        "noise_threshold": recipe.bench.noise_threshold,
    })
    got.update(rates(got))
    if memory.get("peak_mem_mb") == memory.get("peak_mem_mb"):  # measured (not NaN)
        got.update(memory)  # peak tensor memory of a step, and its split
    return got


def rates(record: dict) -> dict:
    """samples_per_s and step_ms of a trial from its typical step (typical_step_s of its steps'
    times, `step_s`), and the window's mean step beside them (window_*)."""
    per_step, window_s = record["samples"] / record["steps"], record["elapsed_s"] / record["steps"]
    step_s = typical_step_s(record["step_s"]) if record.get("step_s") else window_s
    return {"samples_per_s": per_step / step_s, "step_ms": 1000 * step_s,
            "window_samples_per_s": per_step / window_s, "window_step_ms": 1000 * window_s}


def timed_window(trainer: Trainer, b, ctx: Context, run: Budget) -> dict:
    """Warm-up, then the timed window: its steps, time, mean loss and host reads. Each stops
    between steps at its share of bench.max_trial_s or at the run's deadline (`run`)."""
    device, budget = ctx.device, b.max_trial_s
    if ctx.dist_env is None:
        warm, steady = warm_up(trainer.step, device, b.warmup, max(b.warmup, b.warmup_max),
                               b.steady_tol, budget_s=run.limit(budget and budget / 4))
        window, budget = b.steps, run.limit(budget and budget * 3 / 4)  # from the window's start
    else:  # the ranks must agree on every step count, or one waits forever
        # untimed warm-up steps that stop on every rank once one is over budget (its share of
        # bench.max_trial_s, or the run's deadline: a launched trial's ranks get it)
        warm_s, warm = timed_steps(trainer.step, b.warmup, device,
                                   run.limit(budget and budget / 4),
                                   agree=lambda over: distributed.any_rank(over, device))
        window = distributed.agree_steps(b.steps, warm_s, warm,
                                         run.limit(budget and budget * 3 / 4), device)
        budget, steady = None, None
    trainer.clock.reset()
    trainer.meter.reset()
    times = StepTimes(device, window)  # each step's time: a stalled window stands out
    before = trainer.samples
    counter = energy.counter_for(device)
    if not isinstance(counter, str):
        synchronize(device)  # the warm-up's work done before the counter's first read
    joules_before = energy.read(counter)
    elapsed, steps = timed_steps(trainer.step, window, device, budget_s=budget, step_times=times)
    samples = trainer.samples - before  # counted by batches.samples_of
    return {"warmup_steps": warm, "warmup_steady": steady, "elapsed_s": elapsed, "steps": steps,
            "samples": samples, "loss": trainer.meter.mean(),
            "host_reads": trainer.meter.host_reads,
            "stall_ms": stall_ms(times.seconds()), "step_s": times.seconds(),
            **energy.window_energy(counter, joules_before, energy.read(counter), elapsed,
                                   samples)}
