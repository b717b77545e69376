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

from speedbench import capacity, diagnosis, distributed, env, knobs, profile, results, scaling, stats
from speedbench.config import ModelSpec, Plan, micro_batch
from speedbench.data import build_dataset, build_loader
from speedbench.flops import FlopsBook
from speedbench.timing import PeakRss, PhaseClock, device_peak_mb, release_host_memory, \
    reset_device_peak, timed_steps, warm_up
from speedbench.train import Trainer, build_model


def dataset_length(plan: Plan, spec: ModelSpec, world_size: int = 1) -> int:
    """Enough samples that no trial crosses an epoch end (unless data.samples says otherwise),
    on every one of `world_size` ranks."""
    need = 0
    for r in plan.variants.values():
        if r.data.samples:
            return r.data.samples
        batch = micro_batch(r, spec) * distributed.replicas(
            r.parallel, torch.device(plan.device))
        warmup = max(r.bench.warmup, r.bench.warmup_max) if r.bench.steady_tol else r.bench.warmup
        steps = warmup + r.bench.steps + profile.extra_steps(r) + 2
        need = max(need, steps * batch * r.accumulate * world_size)
    return need


def measure_trial(plan: Plan, spec: ModelSpec, variant: str, recipe: DictConfig, trial: int,
                  dataset, dist_env: distributed.DistEnv | None = None,
                  run_dir: Path | None = None) -> dict:
    """One trial of one (model, variant): a record for trials.csv, whatever happens.

    Under torchrun (`dist_env`) it runs as DDP on every rank and returns the ranks' combined
    record; a fault on a rank is raised, not recorded, so that torchrun stops the whole job.
    With `profile` on, profile windows follow the timed one; trial 0 writes the profiler's
    files under run_dir/profile/<model>/<variant>/.
    """
    parallel = distributed.effective_parallel(recipe, dist_env)
    device = distributed.rank_device(plan.device, dist_env)
    batch = micro_batch(recipe, spec)
    replicas = distributed.replicas(parallel, device)  # GPUs one DataParallel process splits over
    world = dist_env.world_size if dist_env else 1
    record = {
        "experiment": plan.experiment, "model": spec.name, "variant": variant,
        "is_baseline": variant == plan.baseline, "trial": trial, "device": str(device),
        "world_size": world, "devices": world * replicas, "parallel": parallel,
        "batch_size": batch, "accumulate": recipe.accumulate,
        "precision": recipe.precision, "num_workers": recipe.data.num_workers,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "torch_threads": torch.get_num_threads(),
    }
    if parallel == "ddp" and dist_env is None:  # speedbench launches torchrun for this trial
        nproc = distributed.launch_nproc(recipe, plan.device)
        return {**record, "world_size": nproc, "devices": nproc,
                **distributed.launch_trial(plan, spec, variant, recipe, trial)}
    trainer = None
    try:
        with knobs.restored_global_state():
            release_host_memory()
            reset_device_peak(device)
            with PeakRss() as rss:
                model = build_model(spec, recipe.bench.seed)
                # the Trainer applies the knob; here we only ask whether it can act
                reason = knobs.not_applicable(recipe, device, knobs.makes_per_step_tensors(model))
                if reason:
                    return {**record, "status": reason}
                seed = recipe.bench.seed
                loader = build_loader(dataset, batch * replicas, recipe.data, seed=seed,
                                      sampler=distributed.sampler(dataset, dist_env, seed))
                clock = PhaseClock(device)
                model = distributed.wrap(model.to(device), parallel, device)
                trainer = Trainer(spec, recipe, device, loader, clock=clock, model=model)
                budget, b = recipe.bench.max_trial_s, recipe.bench
                if dist_env is None:
                    warm, steady = warm_up(trainer.step, device, b.warmup, max(b.warmup, b.warmup_max),
                                           b.steady_tol, budget_s=budget and budget / 4)
                    window = b.steps
                else:  # the ranks must agree on every step count, or one waits forever
                    warm_s, warm = distributed.warm_up(trainer.step, b.warmup, device,
                                                       budget and budget / 4)
                    window = distributed.agree_steps(b.steps, warm_s, warm,
                                                     budget and budget * 3 / 4, device)
                    budget, steady = None, None
                clock.reset()
                trainer.meter.reset()
                elapsed, steps = timed_steps(trainer.step, window, device,
                                             budget_s=budget and budget * 3 / 4)
                loss = trainer.meter.mean()
            dev_peak = device_peak_mb(device)
            if recipe.profile != "off":
                out = run_dir / "profile" / spec.name / variant if run_dir and trial == 0 else None
                record.update(profile.profile_trial(trainer, recipe, device, steps, out))
        samples = steps * batch * replicas * recipe.accumulate
        record.update({
            "status": "ok" if math.isfinite(loss) else "diverged",
            "samples_per_s": samples / elapsed, "step_ms": 1000 * elapsed / steps,
            "data_wait_frac": clock.totals["data"] / elapsed,
            "peak_mem_mb": dev_peak if dev_peak is not None else rss.main_mb - rss.start_mb,
            "host_rss_mb": rss.total_mb, "host_rss_main_mb": rss.main_mb,
            "final_loss": loss, "steps": steps, "warmup_steps": warm, "warmup_steady": steady,
            "elapsed_s": elapsed, "host_reads": trainer.meter.host_reads, "samples": samples,
        })
        if dist_env is not None:
            record = distributed.gather_record(record, dist_env)
    except torch.OutOfMemoryError:
        if dist_env is not None:
            raise
        record["status"] = "oom"
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
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def execute(plan: Plan, run_dir: Path | None, progress: bool = True,
            dist_env: distributed.DistEnv | None = None,
            writer: results.TrialWriter | None = None) -> results.TrialWriter | None:
    """Every trial of the plan, rows appended to trials.csv as they end (to `writer`'s, when a
    suite gathers several plans in one file). Under torchrun every rank runs every trial; rank 0
    alone (the one given a run_dir) writes."""
    if writer is None and run_dir:
        writer = results.TrialWriter(run_dir / "trials.csv")
    world = dist_env.world_size if dist_env else 1
    repeats = max(r.bench.repeats for r in plan.variants.values())
    total = sum(min(r.bench.repeats, repeats) for r in plan.variants.values()) * len(plan.models)
    bar = tqdm(total=total, desc=plan.experiment, unit="trial", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and distributed.is_main(dist_env)))
    book = FlopsBook(torch.device(plan.device))
    for spec in plan.models:
        bar.set_postfix_str(f"{spec.name}: making data")
        first = next(iter(plan.variants.values()))
        dataset = build_dataset(spec.dataset, dataset_length(plan, spec, world), first.data.path,
                                seed=first.bench.seed)
        skip: dict[str, str] = {}  # variants found n/a: no need to try them again
        rows: list[dict] = []  # this model's records, for the adaptive rule
        started, trial = time.perf_counter(), 0
        # `repeats` rounds; then, with bench.target_ci (the baseline's), more while CIs are wide.
        # Not under torchrun: every rank would have to take the same decision.
        while trial < repeats or (dist_env is None and stats.wants_more_rounds(
                rows, first.bench, trial, time.perf_counter() - started)):
            if trial >= repeats:
                bar.total += len(plan.variants)
            for name, recipe in plan.variants.items():  # interleaved: A B C A B C ...
                if repeats > trial >= recipe.bench.repeats:
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
                    if writer:
                        writer.append({"experiment": plan.experiment, "model": spec.name,
                                       "variant": name, "is_baseline": False, "trial": trial,
                                       "device": plan.device, "world_size": world,
                                       "status": skip[name]})
                    bar.update()
                    continue
                try:
                    record = measure_trial(plan, spec, name, recipe, trial, dataset, dist_env,
                                           run_dir)
                except Exception as exc:  # under torchrun: a failed rank fails the job
                    if dist_env is None:
                        raise
                    status = distributed.report_failure(
                        exc, dist_env, f"model {spec.name}, variant {name}, trial {trial}")
                    if writer:
                        writer.append({"experiment": plan.experiment, "model": spec.name,
                                       "variant": name, "is_baseline": name == plan.baseline,
                                       "trial": trial, "world_size": world, "status": status})
                    raise
                if record["status"] == "ok" and writer:
                    book.annotate(record, book.step(spec, recipe, dataset, record["batch_size"]))
                if record["status"].startswith("n/a"):
                    skip[name] = record["status"]
                if writer:
                    writer.append(record)
                rows.append(record)
                bar.update()
            trial += 1
        if trial > repeats:
            bar.write(f"{spec.name}: {trial} rounds (bench.target_ci={first.bench.target_ci}); "
                      + stats.halfwidth_note(rows))
        baseline = plan.variants[plan.baseline]
        if baseline.bench.find_largest_batch and run_dir:
            bar.set_postfix_str(f"{spec.name}: largest batch that fits")
            capacity.append(run_dir / "capacity.csv", _largest_batch(plan, spec, dataset, dist_env))
    bar.close()
    return writer


def _largest_batch(plan: Plan, spec: ModelSpec, dataset, dist_env) -> dict:
    recipe = plan.variants[plan.baseline]
    if dist_env is not None:  # every rank would search its own device, and time it differently
        return {"experiment": plan.experiment, "model": spec.name, "variant": plan.baseline,
                "precision": recipe.precision,
                "status": "n/a: the largest batch that fits is searched without torchrun"}
    return capacity.probe(plan.experiment, spec, plan.baseline, recipe, torch.device(plan.device),
                          dataset)


def _nothing_to_compare(plan: Plan, name: str, trial: int, skip: dict) -> bool:
    """After the first round, the baseline's repeats are spared when every other variant is n/a."""
    others = [v for v in plan.variants if v != plan.baseline]
    return trial > 0 and name == plan.baseline and bool(others) and all(v in skip for v in others)


def run(cfg: DictConfig, experiment: str | None, progress: bool = True,
        overrides: list[str] | None = None) -> Path | None:
    """The whole job for one config: validate, measure, summarise, report. Returns the run dir
    (None on the ranks other than 0 under torchrun: they measure, rank 0 writes).

    A suite (`tips`) measures each member experiment into the same trials.csv; `overrides` are
    the command line's, handed on to every member.
    """
    from speedbench import recipe, suite
    from speedbench.config import build_plan
    from speedbench.report.render import console_table, write_report

    # Every plan is built, and so validated, before anything is written.
    if suite.is_suite(cfg):
        plans = suite.member_plans(cfg, experiment or "suite", overrides or [])
    else:
        plans = [build_plan(cfg, experiment)]
    dist_env = distributed.from_environ()
    groups = recipe.check(cfg, plans[0], dist_env) if recipe.is_recipe(cfg) else None
    device = distributed.rank_device(plans[0].device, dist_env)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if suite.is_suite(cfg):
        resolved["claims"] = suite.combined_claims(plans)
    run_dir = None
    if distributed.is_main(dist_env):
        run_dir = results.new_run_dir(cfg.out_dir, experiment or plans[0].experiment, cfg.run_dir)
        if suite.is_suite(cfg):
            (run_dir / "members").mkdir()
            for plan in plans:  # each member's own resolved config, to repeat it alone
                (run_dir / "members" / f"{plan.experiment}.yaml").write_text(
                    OmegaConf.to_yaml(plan.config, resolve=True))
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        machine = env.collect(plans[0].device)
        machine["distributed"] = distributed.describe(dist_env, device)
        results.write_json(machine, run_dir / "env.json")
    started = time.perf_counter()
    distributed.init_process_group(dist_env, device, cfg.dist_timeout_s)
    distributed.outlive_peer_failure(dist_env)
    writer = results.TrialWriter(run_dir / "trials.csv") if run_dir else None
    for plan in plans:
        if groups is not None:  # +experiment=recipe: the search runs the plans (recipe.py)
            recipe.execute(cfg, plan, groups, run_dir, writer, progress, execute,
                           recipe.cannot_act_for(cfg, dist_env))
            continue
        execute(plan, run_dir, progress, dist_env, writer)
    if writer is None:
        return None
    frame = writer.frame()
    summary = scaling.add_efficiency(stats.summarise(frame), frame)
    results.write_summary(summary, run_dir)
    profiled = diagnosis.write_tables(run_dir, writer.rows)  # phases.csv, findings.csv
    if profiled and cfg.recipe.check_findings:  # each suggested knob measured (recipe.py)
        recipe.check_findings(plans, run_dir, writer, progress, execute)
        frame = writer.frame()
        summary = scaling.add_efficiency(stats.summarise(frame), frame)
        results.write_summary(summary, run_dir)
    write_report(run_dir, cfg=resolved)
    print(console_table(summary))
    for line in stats.spread_warnings(summary):
        print(line)
    if profiled:
        from speedbench.report.profile_section import console_text
        print("\n" + console_text(run_dir))
    print(f"\n{len(writer.rows)} trials in {time.perf_counter() - started:.0f} s; "
          f"report: {run_dir / 'report.md'}")
    from speedbench.report import recommend
    print("\n" + "\n".join(recommend.console_lines(summary, run_dir)))
    print(f"report: {(run_dir / 'report.html').resolve()}")
    return run_dir
