"""Orchestration: plan → trials (models × interleaved variants × repeats) → records → results.

Each trial builds a fresh, same-seeded model and loader, warms up, then times one window of
optimizer steps synchronised only at its ends. A fault in one trial (OOM, exception, NaN loss)
becomes that row's status; the other trials still run.
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from speedbench import env, knobs, results, stats
from speedbench.config import ModelSpec, Plan, micro_batch
from speedbench.data import build_dataset, build_loader
from speedbench.timing import PeakRss, PhaseClock, device_peak_mb, release_host_memory, \
    reset_device_peak, timed_steps
from speedbench.train import Trainer, build_model


def dataset_length(plan: Plan, spec: ModelSpec) -> int:
    """Enough samples that no trial crosses an epoch end (unless data.samples says otherwise)."""
    need = 0
    for r in plan.variants.values():
        if r.data.samples:
            return r.data.samples
        batch = micro_batch(r, spec)
        need = max(need, (r.bench.warmup + r.bench.steps + 2) * batch * r.accumulate)
    return need


def measure_trial(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
                  dataset) -> dict:
    """One trial of one (model, variant): a record for trials.csv, whatever happens."""
    device = torch.device(plan.device)
    batch = micro_batch(recipe, spec)
    record = {
        "experiment": plan.experiment, "model": spec.name, "variant": variant,
        "is_baseline": variant == plan.baseline, "trial": trial, "device": plan.device,
        "world_size": 1, "batch_size": batch, "accumulate": recipe.accumulate,
        "precision": recipe.precision, "num_workers": recipe.data.num_workers,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "torch_threads": torch.get_num_threads(),
    }
    trainer = None
    try:
        with knobs.restored_global_state():
            release_host_memory()
            reset_device_peak(device)
            with PeakRss() as rss:
                model = build_model(spec, recipe.bench.seed)
                listens = knobs.set_tensor_creation(model, recipe.tensor_creation) > 0
                reason = knobs.not_applicable(recipe, device, listens)
                if reason:
                    return {**record, "status": reason}
                loader = build_loader(dataset, batch, recipe.data, seed=recipe.bench.seed)
                clock = PhaseClock(device)
                trainer = Trainer(spec, recipe, device, loader, clock=clock, model=model.to(device))
                budget = recipe.bench.max_trial_s
                _, warm = timed_steps(trainer.step, recipe.bench.warmup, device,
                                      budget_s=budget and budget / 4) if recipe.bench.warmup else (0, 0)
                clock.reset()
                trainer.meter.reset()
                elapsed, steps = timed_steps(trainer.step, recipe.bench.steps, device,
                                             budget_s=budget and budget * 3 / 4)
                loss = trainer.meter.mean()
        samples = steps * batch * recipe.accumulate
        dev_peak = device_peak_mb(device)
        record.update({
            "status": "ok" if math.isfinite(loss) else "diverged",
            "samples_per_s": samples / elapsed, "step_ms": 1000 * elapsed / steps,
            "data_wait_frac": clock.totals["data"] / elapsed,
            "peak_mem_mb": dev_peak if dev_peak is not None else rss.main_mb - rss.start_mb,
            "host_rss_mb": rss.total_mb, "host_rss_main_mb": rss.main_mb,
            "final_loss": loss, "steps": steps, "warmup_steps": warm, "elapsed_s": elapsed,
            "host_reads": trainer.meter.host_reads,
        })
    except torch.OutOfMemoryError:
        record["status"] = "oom"
    except Exception as exc:  # a fault in one variant must not stop the others
        record["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if os.environ.get("SPEEDBENCH_DEBUG"):
            traceback.print_exc()
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def execute(plan: Plan, run_dir: Path, progress: bool = True,
            writer: results.TrialWriter | None = None) -> results.TrialWriter:
    """Every trial of the plan, rows appended to trials.csv as they end (to `writer`'s, when a
    suite gathers several plans in one file)."""
    if writer is None:
        writer = results.TrialWriter(run_dir / "trials.csv")
    repeats = max(r.bench.repeats for r in plan.variants.values())
    total = sum(min(r.bench.repeats, repeats) for r in plan.variants.values()) * len(plan.models)
    bar = tqdm(total=total, desc=plan.experiment, unit="trial", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    for spec in plan.models:
        bar.set_postfix_str(f"{spec.name}: making data")
        first = next(iter(plan.variants.values()))
        dataset = build_dataset(spec.dataset, dataset_length(plan, spec), first.data.path,
                                seed=first.bench.seed)
        skip: dict[str, str] = {}  # variants found n/a: no need to try them again
        for trial in range(repeats):
            for name, recipe in plan.variants.items():  # interleaved: A B C A B C ...
                if trial >= recipe.bench.repeats:
                    continue
                bar.set_postfix_str(f"{spec.name} {name} trial {trial + 1}/{recipe.bench.repeats}")
                if name in skip or _nothing_to_compare(plan, name, trial, skip):
                    bar.update()
                    continue
                if name != plan.baseline and plan.baseline in skip:
                    # No baseline here (pinning, empty_cache without CUDA): nothing to compare
                    # this variant with, so it is not measured either.
                    skip[name] = (f"n/a: no baseline to compare with ({plan.baseline}: "
                                  f"{skip[plan.baseline].removeprefix('n/a: ')})")
                    writer.append({"experiment": plan.experiment, "model": spec.name,
                                   "variant": name, "is_baseline": False, "trial": trial,
                                   "device": plan.device, "world_size": 1, "status": skip[name]})
                    bar.update()
                    continue
                record = measure_trial(plan, spec, name, recipe, trial, dataset)
                if record["status"].startswith("n/a"):
                    skip[name] = record["status"]
                writer.append(record)
                bar.update()
    bar.close()
    return writer


def _nothing_to_compare(plan: Plan, name: str, trial: int, skip: dict) -> bool:
    """After the first round, the baseline's repeats are spared when every other variant is n/a."""
    others = [v for v in plan.variants if v != plan.baseline]
    return trial > 0 and name == plan.baseline and bool(others) and all(v in skip for v in others)


def run(cfg: DictConfig, experiment: str | None, progress: bool = True,
        overrides: list[str] | None = None) -> Path:
    """The whole job for one config: validate, measure, summarise, report. Returns the run dir.

    A suite (`tips`) measures each member experiment into the same trials.csv; `overrides` are
    the command line's, handed on to every member.
    """
    from speedbench import suite
    from speedbench.config import build_plan
    from speedbench.report.render import console_table, write_report

    # Every plan is built, and so validated, before anything is written.
    if suite.is_suite(cfg):
        plans = suite.member_plans(cfg, experiment or "suite", overrides or [])
    else:
        plans = [build_plan(cfg, experiment)]
    name = experiment or plans[0].experiment
    run_dir = results.new_run_dir(cfg.out_dir, name, cfg.run_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if suite.is_suite(cfg):
        resolved["claims"] = suite.combined_claims(plans)
        (run_dir / "members").mkdir()
        for plan in plans:  # each member's own resolved config, to repeat it alone
            (run_dir / "members" / f"{plan.experiment}.yaml").write_text(
                OmegaConf.to_yaml(plan.config, resolve=True))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    results.write_json(env.collect(plans[0].device), run_dir / "env.json")
    started = time.perf_counter()
    writer = results.TrialWriter(run_dir / "trials.csv")
    for plan in plans:
        execute(plan, run_dir, progress, writer)
    summary = stats.summarise(writer.frame())
    results.write_summary(summary, run_dir)
    write_report(run_dir, cfg=resolved)
    print(console_table(summary))
    print(f"\n{len(writer.rows)} trials in {time.perf_counter() - started:.0f} s; "
          f"report: {run_dir / 'report.md'}")
    return run_dir
