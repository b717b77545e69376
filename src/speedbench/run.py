"""Orchestration: plan -> rounds of trials -> records -> results.

A *round* runs every variant of a model once, in an order shuffled per round: round r of a run
with seed s uses `np.random.default_rng((s, r))` (bench.seed of the baseline), independent
streams for every (seed, round) pair and the same order on every torchrun rank. trials.csv
records `round` and `position` (the trial's place in its round, 0 first); `trial` equals
`round` for older readers. After `bench.repeats` rounds, more follow while a speed-up CI is
wider than `bench.target_ci` (stats.wants_more_rounds), within the model's time budget.

One trial (build -> warm up -> time -> record) is speedbench.measure.trial's; a trial that needs
several processes is launched through torchrun by speedbench.measure.launch.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from speedbench.results import atomic, schema
from speedbench.measure import capacity, diagnosis, env, launch, quality
from speedbench import distributed, results, techniques
from speedbench.analysis import scaling, stats
from speedbench.config import ModelSpec, Plan
from speedbench.measure.data import build_dataset
from speedbench.measure.flops import FlopsBook
from speedbench.measure.trial import (check_data, context, dataset_length, header,  # noqa: F401
                                      measure_trial)
from speedbench.measure.train import build_model


def round_order(names: list[str], seed: int, round_: int) -> list[str]:
    """The variants in the order round `round_` runs them: shuffled from (seed, round)."""
    rng = np.random.default_rng((seed, round_))
    return [names[i] for i in rng.permutation(len(names))]


def not_applicable(plan: Plan, spec: ModelSpec, dist_env: distributed.DistEnv | None) -> dict:
    """variant -> why it cannot be measured here (n/a), for the variants that cannot. Asked
    once before the first round, so that the rounds can be shuffled and a variant without a
    baseline is known from the start. (Each trial asks again, of its own fresh model.)"""
    ctx = context(plan, dist_env)
    try:
        ctx.model = build_model(spec, plan.variants[plan.baseline].bench.seed)
    except Exception:  # each trial builds it again and records why it cannot be built
        return {}
    skip = {}
    for name, recipe in plan.variants.items():
        with techniques.global_state(recipe, ctx):
            reason = techniques.not_applicable(recipe, ctx)
        if reason:
            skip[name] = reason
    return skip


def execute(plan: Plan, run_dir: Path | None, progress: bool = True,
            dist_env: distributed.DistEnv | None = None,
            writer: results.TrialWriter | None = None,
            book: FlopsBook | None = None) -> results.TrialWriter | None:
    """Every trial of the plan, rows appended to trials.csv as they end (to `writer`'s, when a
    suite gathers several plans in one file). Under torchrun every rank runs every trial; rank 0
    alone (the one given a run_dir) writes. `book` holds the run's FLOP counts and peaks
    (shared by a suite's plans: the peaks are measured once per run)."""
    if writer is None and run_dir:
        writer = results.TrialWriter(run_dir / "trials.csv", techniques.column_names())
    world = dist_env.world_size if dist_env else 1
    repeats = max(r.bench.repeats for r in plan.variants.values())
    total = sum(min(r.bench.repeats, repeats) for r in plan.variants.values()) * len(plan.models)
    # ETA from the mean time per trial so far (smoothing=0): a variant's trials can take 20x
    # another's, and tqdm's default moving average then swings from minutes to many.
    bar = tqdm(total=total, desc=plan.experiment, unit="trial", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and distributed.is_main(dist_env)), smoothing=0)
    book = book or FlopsBook(torch.device(plan.device))
    if writer:  # the matmul peaks: once per run and precision, before any trial
        bar.set_postfix_str("matmul peak")
        book.measure_peaks(r.precision for r in plan.variants.values())
    ctx = context(plan, dist_env)
    names = list(plan.variants)
    for spec in plan.models:
        bar.set_postfix_str(f"{spec.name}: making data")
        first = plan.variants[plan.baseline]
        dataset = build_dataset(spec.dataset, dataset_length(plan, spec, world), first.data.path,
                                seed=first.bench.seed)
        # Variants found n/a (asked once, before the first round): they get one row, in round 0.
        skip: dict[str, str] = not_applicable(plan, spec, dist_env)
        if plan.baseline in skip:
            # No baseline here (pinning, empty_cache without CUDA): nothing to compare the other
            # variants with, so they are not measured either.
            why = schema.reason_of(skip[plan.baseline])
            for name in names:
                skip.setdefault(name, schema.na(f"no baseline to compare with "
                                                f"({plan.baseline}: {why})"))
        # Quality at equal work, once per variant, before the first round; a hopeless variant
        # is stopped on its first step there and joins `skip` (quality.py).
        probes = _quality_probes(plan, spec, dataset, ctx, skip, bar) if dist_env is None else {}
        rows: list[dict] = []  # this model's records, for the adaptive rule
        started, round_ = time.perf_counter(), 0
        # `repeats` rounds; then, with bench.target_ci (the baseline's), more while CIs are wide.
        # Not under torchrun: every rank would have to take the same decision.
        while round_ < repeats or (dist_env is None and stats.wants_more_rounds(
                rows, first.bench, round_, time.perf_counter() - started)):
            if round_ >= repeats:
                bar.total += len(plan.variants)
            for position, name in enumerate(round_order(names, first.bench.seed, round_)):
                recipe = plan.variants[name]
                if repeats > round_ >= recipe.bench.repeats:
                    continue
                # past the minimum, rounds go on while a CI is wide: no fixed total to show
                of = f"/{repeats}" if round_ < repeats else " (extra: a CI is still wide)"
                bar.set_postfix_str(f"{spec.name} {name} round {round_ + 1}{of}")
                if name in skip:
                    if round_ == 0 and writer:
                        writer.append({**header(plan, spec, name, recipe, round_, dist_env),
                                       **probes.get(name, {}), "position": position,
                                       "status": skip[name]})
                    bar.update()
                    continue
                if _nothing_to_compare(plan, name, round_, skip):
                    bar.update()
                    continue
                try:
                    nproc = techniques.processes(recipe, ctx)
                    if nproc:  # the trial runs in processes of its own, launched via torchrun
                        record = {**header(plan, spec, name, recipe, round_, dist_env),
                                  "world_size": nproc, "devices": nproc,
                                  **launch.launch_trial(plan, spec, name, recipe, round_, nproc)}
                    else:
                        record = measure_trial(plan, spec, name, recipe, round_, dataset,
                                               dist_env, run_dir)
                except Exception as exc:  # under torchrun: a failed rank fails the job
                    if dist_env is None:
                        raise
                    status = distributed.report_failure(
                        exc, dist_env, f"model {spec.name}, variant {name}, trial {round_}")
                    if writer:
                        writer.append({**header(plan, spec, name, recipe, round_, dist_env),
                                       "position": position, "status": status})
                    raise
                record.update({"round": round_, "position": position})
                if name in probes and record["status"] == schema.OK:
                    record.update(probes[name])  # final_loss: the quality probe's
                if record["status"] == schema.OK and writer:
                    book.annotate(record, book.step(spec, recipe, dataset, record["batch_size"]))
                if schema.is_na(record["status"]):
                    skip[name] = record["status"]
                if writer:
                    writer.append(record)
                rows.append(record)
                bar.update()
            round_ += 1
        if round_ > repeats:
            bar.write(f"{spec.name}: {round_} rounds (bench.target_ci={first.bench.target_ci}); "
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
                "status": schema.na("the largest batch that fits is searched without torchrun")}
    return capacity.probe(plan.experiment, spec, plan.baseline, recipe, torch.device(plan.device),
                          dataset)


def _quality_probes(plan: Plan, spec: ModelSpec, dataset, ctx, skip: dict, bar) -> dict:
    """variant -> its quality probe (quality.quality_probe), the baseline's first, so that its
    first-step time can tell a hopeless variant; a variant stopped as too slow joins `skip`.
    Variants launched through torchrun keep their timed window's loss."""
    baseline = plan.variants[plan.baseline]
    order = [plan.baseline] + [v for v in plan.variants if v != plan.baseline]
    probes: dict[str, dict] = {}
    base_first = base_second = None
    for name in order:
        recipe = plan.variants[name]
        if name in skip or techniques.processes(recipe, ctx):
            continue
        bar.set_postfix_str(f"{spec.name} {name}: quality probe")
        limit = limit2 = None
        # The first-step rule needs a trial budget: an experiment that sets none (compile,
        # whose first step is the compilation) has said that a slow first step is expected.
        if name != plan.baseline and base_first and recipe.bench.max_trial_s:
            limit = quality.first_step_limit(base_first, recipe.bench.max_trial_s)
        if name != plan.baseline and base_second:
            limit2 = quality.steady_step_limit(base_second)
        try:
            got = quality.quality_probe(spec, recipe, ctx, dataset,
                                        quality.probe_steps(spec, recipe, baseline, ctx),
                                        first_step_limit_s=limit, baseline_first_s=base_first,
                                        second_step_limit_s=limit2, baseline_second_s=base_second)
        except Exception:  # its trials will meet the fault and record it
            continue
        if name == plan.baseline:
            base_first = got["first_step_ms"] / 1000
            second = got.get("second_step_ms", math.nan) / 1000
            base_second = second if math.isfinite(second) else None
        if str(got.get("status", "")).startswith(schema.TOO_SLOW):
            skip[name] = got.pop("status")
        probes[name] = got
    return probes


def _in_plan_order(frame, plans: list[Plan]):
    """Trials sorted (stably) so that the summary lists each model's baseline first, then the
    variants in the experiment file's order: rounds run them shuffled."""
    rank = {(p.experiment, v): i for p in plans
            for i, v in enumerate(sorted(p.variants, key=lambda v: v != p.baseline))}
    keys = [rank.get((e, v), len(rank)) for e, v in zip(frame["experiment"], frame["variant"])]
    return frame.assign(_rank=keys).sort_values("_rank", kind="stable").drop(columns="_rank")


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
    from speedbench.search import check_findings
    from speedbench.search import driver as recipe
    from speedbench.config import suite
    from speedbench.config import build_plan
    from speedbench.report.render import console_lines, report_line, write_report

    # Every plan is built, and so validated, before anything is written.
    if suite.is_suite(cfg):
        plans = suite.member_plans(cfg, experiment or "suite", overrides or [])
    else:
        plans = [build_plan(cfg, experiment)]
    dist_env = distributed.from_environ()
    groups = recipe.check(cfg, plans[0], dist_env) if recipe.is_recipe(cfg) else None
    for plan in plans:  # the data too, before the run directory exists
        for spec in plan.models:
            check_data(plan, spec, dist_env.world_size if dist_env else 1)
    device = distributed.rank_device(plans[0].device, dist_env)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if suite.is_suite(cfg):
        resolved["claims"] = suite.combined_claims(plans)
    run_dir = None
    if distributed.is_main(dist_env):
        run_dir = results.new_run_dir(cfg.out_dir, experiment or plans[0].experiment, cfg.run_dir)
        try:
            if suite.is_suite(cfg):
                (run_dir / "members").mkdir()
                for plan in plans:  # each member's own resolved config, to repeat it alone
                    atomic.write_text(run_dir / "members" / f"{plan.experiment}.yaml",
                                      OmegaConf.to_yaml(plan.config, resolve=True))
            atomic.write_text(run_dir / "config.yaml", OmegaConf.to_yaml(resolved))
            machine = env.collect(plans[0].device)
            machine["distributed"] = distributed.describe(dist_env, device)
            results.write_env(machine, run_dir)
            results.write_json(techniques.metadata(), run_dir / "techniques.json")
        except OSError as exc:  # nothing measured yet: leave no folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
            raise results.write_failed(exc, None) from None
    started = time.perf_counter()
    distributed.init_process_group(dist_env, device, cfg.dist_timeout_s)
    distributed.outlive_peer_failure(dist_env)
    writer = results.TrialWriter(run_dir / "trials.csv", techniques.column_names()) \
        if run_dir else None
    book = FlopsBook(device)
    for plan in plans:
        if groups is not None:  # +experiment=recipe: the search runs the plans (recipe.py)
            recipe.execute(cfg, plan, groups, run_dir, writer, progress,
                           lambda *args: execute(*args, book=book),
                           recipe.cannot_act_for(cfg, not_applicable, dist_env))
            continue
        execute(plan, run_dir, progress, dist_env, writer, book)
    if writer is None:
        return None
    frame = _in_plan_order(writer.frame(), plans)
    summary = scaling.add_efficiency(
        stats.summarise(frame, per_experiment=groups is not None), frame)
    try:
        results.write_summary(summary, run_dir)
        profiled = diagnosis.write_tables(run_dir, writer.rows)  # phases.csv, findings.csv
        if profiled and cfg.recipe.check_findings:  # each suggested knob measured (search/check_findings.py)
            check_findings.check(plans, run_dir, writer, progress,
                                 lambda *args: execute(*args, book=book))
            frame = writer.frame()
            summary = scaling.add_efficiency(
                stats.summarise(frame, per_experiment=groups is not None), frame)
            results.write_summary(summary, run_dir)
        env.record_end(run_dir / "env.json")  # the load average at the end, beside the start's
        write_report(run_dir, cfg=resolved)
    except OSError as exc:  # a full disk: a run is complete with summary.csv and its report
        (run_dir / "summary.csv").unlink(missing_ok=True)
        raise results.write_failed(exc, run_dir) from None
    print("\n".join(console_lines(summary, experiment, overrides, table=groups is None)))
    if profiled:
        from speedbench.report.profile_section import console_text
        print("\n" + console_text(run_dir))
    from speedbench.report import recommend  # the report's first section, in a few lines
    print("\n" + "\n".join(recommend.console_lines(summary, run_dir)))
    print("\n" + report_line(run_dir, len(writer.rows), time.perf_counter() - started))
    failed = [r for r in writer.rows if schema.parse_status(r["status"]).failed]
    if failed and not any(schema.parse_status(r["status"]).ok for r in writer.rows):
        print(f"speedbench: no trial succeeded ({len(failed)} failed: see the status column)",
              file=sys.stderr)
        raise SystemExit(1)
    return run_dir
