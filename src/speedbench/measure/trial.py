"""One trial of one (model, variant): build -> warm up -> time -> (profile) -> record.

The techniques act through their interface (speedbench.techniques) in registry order: the
trial asks whether any cannot act here (the row is then `n/a: <reason>`), enters their global
state (restored afterwards), takes their loader options and lets them prepare the model; the
Trainer applies the rest every step; their columns join the record. A fault (OOM, exception,
NaN loss) becomes the row's status, except under torchrun, where it must stop the job.
"""
from __future__ import annotations

import math
import os
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig

from speedbench import distributed, techniques
from speedbench.measure import profile
from speedbench.results import schema
from speedbench.config import ModelSpec, Plan, micro_batch
from speedbench.measure.data import build_dataset, build_loader
from speedbench.errors import ConfigError
from speedbench.techniques import Context
from speedbench.measure.timing import PeakRss, PhaseClock, device_peak_mb, release_host_memory, \
    reset_device_peak, step_memory, timed_steps, warm_up
from speedbench.measure.train import Trainer, build_model


def dataset_length(plan: Plan, spec: ModelSpec, world_size: int = 1) -> int:
    """Enough samples that no trial crosses an epoch end (unless data.samples says otherwise),
    on every one of `world_size` ranks."""
    need = 0
    for r in plan.variants.values():
        if r.data.samples:
            return r.data.samples
        micro, k = techniques.micro_batching(r.batch_size or spec.batch_size, r)
        batch = micro * techniques.replicas(r, Context(device=torch.device(plan.device)))
        warmup = max(r.bench.warmup, r.bench.warmup_max) if r.bench.steady_tol else r.bench.warmup
        steps = warmup + r.bench.steps + profile.extra_steps(r) + 2
        need = max(need, steps * batch * k * world_size)
    return need


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
    if not first.data.path and not first.data.samples:
        return  # synthetic data is made as long as the trials need
    # a synthetic data set is as long as asked; a file or folder is read to know
    have = len(build_dataset(spec.dataset, length, first.data.path, seed=first.bench.seed)) \
        if first.data.path else length
    ctx = Context(device=torch.device(plan.device))
    for name, r in plan.variants.items():
        micro, _ = techniques.micro_batching(r.batch_size or spec.batch_size, r)
        need = micro * techniques.replicas(r, ctx) * (techniques.processes(r, ctx) or world_size)
        if have < need:
            key = "data.path" if first.data.path else "data.samples"
            raise ConfigError(f"{key}: model {spec.name} gets {have} sample(s), fewer than one "
                              f"batch of {need} (variant {name}); give more data or a smaller "
                              "batch_size")


def context(plan: Plan, dist_env: distributed.DistEnv | None = None) -> Context:
    """What the techniques see of this process: its device and torchrun job."""
    return Context(device=distributed.rank_device(plan.device, dist_env), dist_env=dist_env)


def header(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
           dist_env: distributed.DistEnv | None = None) -> dict:
    """The record's identifying columns and the techniques' settings, before anything runs."""
    ctx = context(plan, dist_env)
    world = dist_env.world_size if dist_env else 1
    replicas = techniques.replicas(recipe, ctx)  # devices one process drives (DataParallel)
    return {
        "experiment": plan.experiment, "model": spec.name, "variant": variant,
        "is_baseline": variant == plan.baseline, "trial": trial, "round": trial,
        "device": str(ctx.device), "world_size": world, "devices": world * replicas,
        "batch_size": micro_batch(recipe, spec),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "torch_threads": torch.get_num_threads(),
        **techniques.columns(recipe, ctx),
    }


def measure_trial(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
                  dataset, dist_env: distributed.DistEnv | None = None,
                  run_dir: Path | None = None) -> dict:
    """One trial in this process: a record for trials.csv, whatever happens.

    Under torchrun (`dist_env`) it runs on every rank and returns the ranks' combined record;
    a fault on a rank is raised, not recorded, so that torchrun stops the whole job. With
    `profile` on, profile windows follow the timed one; trial 0 writes the profiler's files
    under run_dir/profile/<model>/<variant>/.
    """
    ctx = context(plan, dist_env)
    device = ctx.device
    record = header(plan, spec, variant, recipe, trial, dist_env)
    micro, k = techniques.micro_batching(recipe.batch_size or spec.batch_size, recipe)
    replicas = techniques.replicas(recipe, ctx)
    trainer = None
    try:
        with techniques.global_state(recipe, ctx):
            release_host_memory()
            reset_device_peak(device)
            with PeakRss() as rss:
                ctx.model = build_model(spec, recipe.bench.seed)
                reason = techniques.not_applicable(recipe, ctx)
                if reason:
                    return {**record, "status": reason}
                seed = recipe.bench.seed
                loader = build_loader(dataset, micro * replicas,
                                      techniques.loader_options(recipe, ctx), seed=seed,
                                      sampler=distributed.sampler(dataset, dist_env, seed))
                clock = PhaseClock(device)
                model = techniques.prepare_model(ctx.model.to(device), recipe, ctx)
                trainer = Trainer(spec, recipe, device, loader, clock=clock, model=model, ctx=ctx)
                ctx.extra["trainer"] = trainer
                budget, b = recipe.bench.max_trial_s, recipe.bench
                if dist_env is None:
                    warm, steady = warm_up(trainer.step, device, b.warmup, max(b.warmup, b.warmup_max),
                                           b.steady_tol, budget_s=budget and budget / 4)
                    window = b.steps
                else:  # the ranks must agree on every step count, or one waits forever
                    # untimed warm-up steps that stop on every rank once one is over budget
                    warm_s, warm = timed_steps(trainer.step, b.warmup, device, budget and budget / 4,
                                               agree=lambda over: distributed.any_rank(over, device))
                    window = distributed.agree_steps(b.steps, warm_s, warm,
                                                     budget and budget * 3 / 4, device)
                    budget, steady = None, None
                clock.reset()
                trainer.meter.reset()
                elapsed, steps = timed_steps(trainer.step, window, device,
                                             budget_s=budget and budget * 3 / 4)
                loss = trainer.meter.mean()
                reads = trainer.meter.host_reads
                # One more step, untimed, for the tensor memory split (not under torchrun: the
                # ranks would all have to take it).
                memory = step_memory(trainer.step, trainer.model, trainer.optimizer, device) \
                    if dist_env is None else {}
            dev_peak = device_peak_mb(device)
            if recipe.profile != "off":
                out = run_dir / "profile" / spec.name / variant if run_dir and trial == 0 else None
                record.update(profile.profile_trial(trainer, recipe, device, steps, out))
        samples = steps * micro * replicas * k
        record.update({
            "status": schema.OK if math.isfinite(loss) else schema.DIVERGED,
            "samples_per_s": samples / elapsed, "step_ms": 1000 * elapsed / steps,
            "data_wait_frac": clock.totals["data"] / elapsed,
            "peak_mem_mb": dev_peak if dev_peak is not None else rss.main_mb - rss.start_mb,
            "host_rss_mb": rss.total_mb, "host_rss_main_mb": rss.main_mb,
            # final_loss: the timed window's mean until run.py puts the quality probe's there
            "final_loss": loss, "window_loss": loss, "steps": steps, "warmup_steps": warm,
            "warmup_steady": steady, "elapsed_s": elapsed, "host_reads": reads,
            "samples": samples, "noise_threshold": recipe.bench.noise_threshold,
            **techniques.columns(recipe, ctx),
        })
        if memory.get("peak_mem_mb") == memory.get("peak_mem_mb"):  # measured (not NaN)
            record.update(memory)  # peak tensor memory of a step, and its split
        if dist_env is not None:
            record = distributed.gather_record(record, dist_env)
    except torch.OutOfMemoryError:
        if dist_env is not None:
            raise
        record["status"] = schema.OOM
    except Exception as exc:  # a fault in one variant must not stop the others
        if dist_env is not None:
            raise  # under DDP the peers are mid-collective: the job must stop
        record["status"] = distributed.failure_status(exc)
        if os.environ.get("SPEEDBENCH_DEBUG"):
            traceback.print_exc()
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None
        ctx.extra.pop("trainer", None)
        ctx.model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record
