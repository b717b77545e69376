"""The conductor: plans -> measure -> analyse -> write -> report.

`run` validates every plan before anything is written, opens the run directory, measures the
plans (speedbench.studies.study; the recipe search runs its own plans, speedbench.search),
summarises the trials (speedbench.analysis), writes summary.csv and the diagnosis tables, and
prints the report's lines.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import sys
import textwrap
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from speedbench import distributed, errors, results, techniques
from speedbench.analysis import intervals
from speedbench.analysis import to_target as target_stats
from speedbench.analysis.summary import summary_of
from speedbench.config import ConfigError, Plan, build_plan, suite
from speedbench.measure import diagnosis, env, isolation
from speedbench.studies import arms, to_target
from speedbench.measure.budget import Budget, run_start, startup_s
from speedbench.measure.flops import FlopsBook
from speedbench.measure.timing import settled_heap
from speedbench.studies.orders import plan_order_seed
from speedbench.studies.study import measure_plan, planned_comparisons
from speedbench.measure.trial import check_data
from speedbench.report import method
from speedbench.results import atomic, planned, schema
from speedbench.results import index as run_index
from speedbench.results.runs import load_quality, load_to_target
from speedbench.search import check_findings, driver


def run(cfg: DictConfig, experiment: str | None, progress: bool = True,
        overrides: list[str] | None = None) -> Path | None:
    """The whole job for one config: validate, measure, summarise, report. Returns the run dir
    (None on the ranks other than 0 under torchrun: they measure, rank 0 writes).

    A suite (`tips`) measures each member experiment into the same trials.csv; `overrides` are
    the command line's, handed on to every member.
    """
    plans = _plans(cfg, experiment, overrides)  # every plan validated before anything is written
    arm_facts = check_arms(cfg, plans, distributed.from_environ())  # each arm can run a trial
    isolation.clear_notes()  # a sweep's jobs each say their own models' changes
    dist_env = distributed.from_environ()
    groups = driver.check(cfg, plans[0], dist_env) if driver.is_recipe(cfg) else None
    for plan in plans:  # the data too, before the run directory exists
        for spec in plan.models:
            check_data(plan, spec, dist_env.world_size if dist_env else 1)
    if distributed.is_main(dist_env):
        for line in dict.fromkeys(note for plan in plans for note in plan.notes):
            print(textwrap.fill(f"speedbench: {line}", width=100), file=sys.stderr)
        for line in forecast_notes(cfg, dist_env):
            print(textwrap.fill(f"speedbench: note: {line}", width=100,
                                subsequent_indent="  "), file=sys.stderr)
    device = distributed.rank_device(plans[0].device, dist_env)
    threads_before = torch.get_num_threads()
    threads = fit_threads(OmegaConf.select(cfg, "bench.threads"), dist_env,
                          device.type)  # said up front
    distributed.join(dist_env, device, cfg.dist_timeout_s)  # torchrun's peers, before any file
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if suite.is_suite(cfg):
        resolved["claims"] = suite.combined_claims(plans)
    run_dir = _open_run_dir(cfg, experiment, plans, resolved, dist_env, device, threads,
                            arm_facts) if distributed.is_main(dist_env) else None
    try:
        with settled_heap(), techniques.logs_into(run_dir):  # tools' own output: off the console
            return _conduct(cfg, plans, groups, run_dir, resolved, dist_env, device, progress,
                            experiment, overrides)
    except KeyboardInterrupt as exc:
        exc.run_dir = run_dir  # the interrupt's line names this run's folder, no other
        raise
    except Exception as exc:
        stop = errors.stopping()
        if stop is not None:  # a signal's stop raised inside an import (matplotlib's backend,
            stop.run_dir = run_dir  # loaded by the report) comes back as an ImportError
            raise stop from None
        # a full disk while a table of the run is written (quality.csv, capacity.csv, ...):
        if not isinstance(exc, OSError) or not _in(exc.filename, run_dir):  # one line, like
            raise                                                     # trials.csv's
        raise results.write_failed(exc, run_dir) from None
    finally:
        torch.set_num_threads(threads_before)  # the next job of a sweep starts as this one did
        if run_dir is not None:
            results.release_run_dir(run_dir)


def forecast_notes(cfg: DictConfig, dist_env) -> list[str]:
    """The options that act on forecasts, asked for where none is made (bench.explain=false,
    torchrun): each a line saying it is off, rather than nothing done without a word."""
    off = "bench.explain=false" if not cfg.bench.explain else \
        "bench.mode=quick makes none" if cfg.bench.mode == "quick" else ""  # (plan.QUICK)
    why = off or ("the forecasts are not made under torchrun" if dist_env is not None else "")
    notes = []
    if why and cfg.bench.skip_by_forecast:
        notes.append(f"bench.skip_by_forecast needs the forecasts of bench.explain ({why}): "
                     "every variant is measured")
    if off and driver.is_recipe(cfg) and cfg.recipe.forecasts:
        notes.append(f"recipe.forecasts needs bench.explain ({off}): every option is screened")
    return notes


def _in(filename, run_dir: Path | None) -> bool:
    """Whether a failed OSError's file is one of the run directory's."""
    if not filename or run_dir is None:
        return False
    try:
        return Path(os.path.abspath(os.fsdecode(filename))).is_relative_to(run_dir)
    except (TypeError, ValueError):
        return False


def _conduct(cfg: DictConfig, plans: list[Plan], groups, run_dir: Path | None, resolved: dict,
             dist_env, device, progress: bool, experiment: str | None,
             overrides: list[str] | None) -> Path | None:
    """Measure every plan into run_dir's trials.csv, then analyse, write and report. Each
    plan's phases draw on its one clock (bench.time_budget_s): the rounds (or the recipe
    search), time to target, and the findings' checks."""
    started = run_start()  # a command's first run: from the process's start
    distributed.init_process_group(dist_env, device, cfg.dist_timeout_s)
    distributed.outlive_peer_failure(dist_env)
    writer = results.TrialWriter(run_dir / "trials.csv", techniques.column_names()) \
        if run_dir else None
    book = FlopsBook(device, cfg.bench.peak_s)
    # adaptive rounds judge CIs at the run's family (a suite's)
    family = sum(planned_comparisons(p) for p in plans) if groups is None else None
    checks = driver.check_share(cfg) > 0 and run_dir is not None  # a profiled run checks
    levels = {}  # (experiment, model) -> the CI level a recipe search used there
    budget = None
    for i, plan in enumerate(plans):
        # one clock for the experiment: every phase draws on what is left of its budget
        budget = Budget.of_run(plan.config.bench.time_budget_s,
                               start=started if i == 0 else math.nan)
        phases = budget.part(1 - CHECKS_TIME_SHARE) if checks else budget  # the rest: checks
        # how soon each variant trains (a recipe search checks its final recipe itself)
        target = plan.config.target.enabled and run_dir is not None and groups is None
        if groups is not None:  # +experiment=recipe: the search runs the plans
            levels.update(driver.levels(driver.execute(cfg, plan, groups, run_dir, writer,
                                                       progress, book, phases)))
        else:
            measure_plan(plan, run_dir, progress, dist_env, writer, book=book,
                         comparisons=family,
                         budget=phases.part(1 - TARGET_SHARE) if target else phases)
        if target:
            to_target.measure(plan, run_dir, writer.rows, progress, plan_order_seed(plan),
                              phases)
    if writer is None:
        return None
    planned.mark_ended(run_dir)
    writing = time.perf_counter()
    summary, profiled, load = _analyse_and_write(cfg, plans, run_dir, writer, resolved,
                                                 levels, progress, book, budget)
    fixed_s = {"Python's start-up and the imports": startup_s(),
               "the tables and the report": time.perf_counter() - writing}
    _report(summary, run_dir, writer, experiment, overrides, groups is None, profiled,
            (time.perf_counter() - started, fixed_s), load, cfg.bench.noise_threshold,
            max(int(p.variants[p.baseline].bench.repeats) for p in plans),
            distributed.launcher(dist_env), _budget_s(plans),
            # a recipe search names its own key (recipe.budget_s) in its not-decided line
            cfg.bench.time_budget_s if groups is None else None)
    index_run(Path(os.path.abspath(cfg.out_dir)), run_dir)
    return run_dir


def index_run(folder: Path, run_dir: Path) -> None:
    """The run added to its results folder's index (results/index.py) where it is in that
    folder; an index that cannot be written is said in one line, the run is not failed."""
    if not run_dir.resolve().is_relative_to(folder.resolve()):
        return  # an explicit run_dir elsewhere: no out_dir is made for an index
    try:
        run_index.record(folder, run_dir)
    except (OSError, sqlite3.Error) as exc:
        print(f"speedbench: note: the index of runs {folder / run_index.FILE} was not updated "
              f"({exc}); `speedbench runs {folder}` rebuilds it", file=sys.stderr)


def _budget_s(plans: list[Plan]) -> float | None:
    """The run's whole bench.time_budget_s (each experiment's, added), None without one."""
    got = [p.config.bench.time_budget_s for p in plans]
    return None if any(b is None for b in got) else float(sum(got))


OVERRUN_SLACK_S, OVERRUN_SHARE = 10.0, 0.05  # what the console lets pass before saying so


def overrun_line(took_s: float, budget_s: float | None,
                 fixed_s: dict[str, float] | None = None) -> str | None:
    """The line saying the run took longer than bench.time_budget_s by more than the slack
    (max(OVERRUN_SHARE of it, OVERRUN_SLACK_S)), else None. `fixed_s`: what no budget can
    shorten (start-up, the report), in seconds, named in the line where it took a second."""
    if budget_s is None or took_s <= budget_s + max(OVERRUN_SHARE * budget_s, OVERRUN_SLACK_S):
        return None
    spent = "; ".join(f"{name} took {s:.0f} s" for name, s in (fixed_s or {}).items()
                      if s is not None and s >= 1)
    return (f"speedbench: the run took {took_s:.0f} s, {took_s - budget_s:.0f} s over its "
            f"bench.time_budget_s of {budget_s:g} s (its start-up, data, probes and trials "
            "are held to the clock; a step, a data set or the machine's load ran past it"
            + (f"; {spent})" if spent else ")"))


# With time to target (target.enabled), the share of an experiment's budget that trains the
# variants to the target; the speed rounds take the rest first.
TARGET_SHARE = 0.6
# A profiled run that checks its findings (recipe.check_findings) keeps this share of its
# budget for the checks, which run after the report's tables are written.
CHECKS_TIME_SHARE = 0.25


def _plans(cfg: DictConfig, experiment: str | None, overrides: list[str] | None) -> list[Plan]:
    if suite.is_suite(cfg):
        return suite.member_plans(cfg, experiment or "suite", overrides or [])
    return [build_plan(cfg, experiment)]


def fit_threads(setting, dist_env, device_type: str = "cpu") -> dict:
    """bench.threads for this run, decided once before anything is measured: torch's threads
    set where bench.threads asks, or, by default, where they do not fit the machine (the
    cores other processes keep busy, env.threads_plan; else, on the CPU, a matrix product that
    fewer threads run faster, env.threads_by_rates), with one line that says so; env.json's
    record of it. Under torchrun the ranks' threads are the parallel technique's."""
    if dist_env is not None:
        return {}
    default = torch.get_num_threads()
    busy = env.others_busy_cores() if setting in (None, "auto") else None
    threads, said = env.threads_plan(setting, busy, default, env.cores())
    rates = None
    if setting is None and threads is None and device_type == "cpu" and default > 1:
        rates = env.matmul_rates(env.thread_counts(default))
        threads, said = env.threads_by_rates(rates, default)
    if said:
        print(said, file=sys.stderr)  # one line, before anything is measured
    if threads is not None:
        torch.set_num_threads(threads)
    return {"setting": setting, "others_busy_cores": busy, "torch_default": default,
            "matmul_rates": {n: round(r, 1) for n, r in rates.items()} if rates else None,
            "torch_threads": torch.get_num_threads()}


def _sweep_tag() -> str:
    """`_job<N>` in a -m sweep: its jobs, started in the same second (SLURM runs them side by
    side), get run directories that say which job each is; "" in a single run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return f"_job{hc.job.num}" if hc.mode == RunMode.MULTIRUN else ""
    except Exception:  # no Hydra run (run() called from Python)
        return ""


def check_arms(cfg: DictConfig, plans: list[Plan], dist_env) -> dict:
    """An A/B's arms (config/arms.py), before anything is written: what they cannot be
    combined with, and each arm's interpreter asked to run a trial's imports (studies/arms.py;
    one line saying what to install where it cannot). arm -> its facts, for env.json."""
    if not any(p.arms for p in plans):
        return {}
    what = "torchrun" if dist_env is not None else "+experiment=recipe" \
        if driver.is_recipe(cfg) else "target.enabled=true" if cfg.target.enabled else None
    if what:
        raise ConfigError(f"arms: an A/B of environments cannot run with {what}; drop one")
    facts = {}
    for plan in plans:
        facts.update(arms.check(plan))
    return facts


def _open_run_dir(cfg: DictConfig, experiment: str | None, plans: list[Plan], resolved: dict,
                  dist_env, device, threads: dict | None = None,
                  arm_facts: dict | None = None) -> Path:
    """A new run directory with the config (each suite member's too) and env.json."""
    run_dir = results.new_run_dir(cfg.out_dir, experiment or plans[0].experiment, cfg.run_dir,
                                  tag=_sweep_tag())
    try:
        if suite.is_suite(cfg):
            (run_dir / "members").mkdir()
            for plan in plans:  # each member's own resolved config, to repeat it alone
                name = results.file_name(plan.experiment)
                atomic.write_text(run_dir / "members" / f"{name}.yaml",
                                  OmegaConf.to_yaml(plan.config, resolve=True))
        atomic.write_text(run_dir / "config.yaml", OmegaConf.to_yaml(resolved))
        # what it sets out to measure: a report rebuilt after a stop lists what it never did
        planned.write(run_dir, [(p.experiment, m.name, v) for p in plans for m in p.models
                                for v in p.variants], search=recipe_search(cfg))
        machine = env.collect(plans[0].device)
        machine["distributed"] = distributed.describe(dist_env, device)
        machine["bench_threads"] = threads or {}
        if arm_facts:  # each arm's software, side by side in the report's A/B section
            machine["arms"] = arm_facts
        results.write_env(machine, run_dir)
        results.write_json(techniques.metadata(), run_dir / "techniques.json")
    except OSError as exc:  # nothing measured yet: leave no folder behind
        _discard(run_dir)
        raise results.write_failed(exc, None) from None
    except KeyboardInterrupt:  # likewise: Ctrl-C before the first trial leaves nothing
        _discard(run_dir)
        raise
    return run_dir


def recipe_search(cfg: DictConfig) -> bool:
    return driver.is_recipe(cfg)


def _discard(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    results.release_run_dir(run_dir)


def _summary(writer: results.TrialWriter, plans: list[Plan], family: float, levels: dict,
             run_dir: Path, tolerance: float):
    """summary.csv's rows (summary_of, as a report rebuilt from trials.csv makes them), the
    trials in plan order."""
    frame = _in_plan_order(writer.frame(), plans)
    return summary_of(frame, load_quality(run_dir), tolerance, family, levels=levels)


def _analyse_and_write(cfg: DictConfig, plans: list[Plan], run_dir: Path, writer, resolved: dict,
                       levels: dict, progress: bool, book: FlopsBook, budget: Budget | None):
    """summary.csv, phases.csv and findings.csv, each suggested knob measured when asked (on
    what is left of `budget`, the last plan's clock), and the report. Returns the summary,
    whether any trial was profiled, and the machine's load."""
    from speedbench.report.render import write_report

    # the findings' checks get their own share of the run's error, set aside before any
    # interval is written: checking them never widens the run's intervals afterwards
    checks = cfg.recipe.check_findings and any(r.get("profile_data") is not None
                                               for r in writer.rows)
    family = intervals.FAMILY_LEVEL - (intervals.CHECK_SHARE if checks else 0.0)
    tolerance = plans[0].config.bench.quality_tolerance
    summary = _summary(writer, plans, family, levels, run_dir, tolerance)
    try:
        results.write_summary(summary, run_dir)
        profiled = diagnosis.write_tables(run_dir, writer.rows)  # phases.csv, findings.csv
        if profiled and checks:  # each suggested knob measured
            check_findings.check(plans, run_dir, writer, progress, book, budget)
            summary = _summary(writer, plans, family, {
                **levels, **check_findings.levels(run_dir, writer.frame())}, run_dir, tolerance)
            results.write_summary(summary, run_dir)
        runs = load_to_target(run_dir)
        if runs is not None:  # to_target_summary.csv: the time-to-target verdicts
            atomic.write_csv(target_stats.summarise(runs, cfg.bench.noise_threshold),
                             run_dir / "to_target_summary.csv", index=False)
        if isolation.notes():  # what the models' code changed in the process (put back)
            results.update_json(run_dir / "env.json", model_changes=isolation.notes())
        load = env.record_end(run_dir / "env.json")  # the load over the run, beside the start's
        write_report(run_dir, cfg=resolved)
    except OSError as exc:  # a full disk: a run is complete with summary.csv and its report
        (run_dir / "summary.csv").unlink(missing_ok=True)
        raise results.write_failed(exc, run_dir) from None
    return summary, profiled, load


def _report(summary, run_dir: Path, writer, experiment: str | None,
            overrides: list[str] | None, table: bool, profiled: bool,
            took: tuple[float, dict],
            load: dict, threshold: float = intervals.DEFAULT_THRESHOLD,
            repeats: int | None = None, program: list[str] | None = None,
            budget_s: float | None = None, advice_s: float | None = None) -> None:
    """The console's lines (a busy machine and stalled windows said first; `repeats`, the
    run's bench.repeats, and `program`, the words that started it (torchrun's too), for the
    command that measures a noisy run again); exit status 1 when no trial succeeded.
    `budget_s` is what the whole run had (a suite's members added), `advice_s` the
    bench.time_budget_s its one budget figure scales (recommend.more_budget), as the report's."""
    from speedbench.report import recommend  # the report's first section, in a few lines
    from speedbench.report.render import busy_note, console_lines, report_line

    # the threads the run set (env.json's bench_threads): the note asks for no fewer
    threads = json.loads((run_dir / "env.json").read_text()).get("bench_threads")
    busy = busy_note({"machine_load": load, "bench_threads": threads})
    if busy:
        print(textwrap.fill(busy, width=100) + "\n")
    for note in method.trial_notes(writer.frame()):  # stalled windows, trials others slowed
        print(textwrap.fill(note, width=100) + "\n")
    print("\n".join(console_lines(summary, experiment, overrides, table=table,
                                   repeats=repeats, program=program, budget_s=advice_s,
                                   busy=bool(isinstance(load, dict) and load.get("busy")))))
    from speedbench.report import ab_section
    for line in ab_section.console_lines(summary):  # an A/B of environments (arms)
        print(textwrap.fill(line, width=100, subsequent_indent="  "))
    if profiled:
        from speedbench.report.profile_section import console_text
        print("\n" + console_text(run_dir))
    from speedbench.report import explain_section
    why = explain_section.console_lines(run_dir, summary)
    if why:
        print("\n" + "\n".join(why))
    runs = load_to_target(run_dir)
    if runs is not None:
        from speedbench.report.to_target_section import console_lines as target_lines
        print("\n" + "\n".join(target_lines(runs, threshold)))
    print("\n" + "\n".join(recommend.console_lines(summary, run_dir, budget_s=advice_s)))
    for line in techniques.log_lines(run_dir):  # what a tool wrote aside, and where
        print(line)
    took_s, fixed_s = took  # the run's seconds, and those no budget shortens
    print("\n" + report_line(run_dir, sum(map(trained, writer.rows)), took_s))
    over = overrun_line(took_s, budget_s, fixed_s)
    if over:
        print(over, file=sys.stderr)
    failed = [r for r in writer.rows if schema.parse_status(r["status"]).failed]
    if failed and not any(schema.parse_status(r["status"]).ok for r in writer.rows):
        print(f"speedbench: no trial succeeded ({len(failed)} failed: see the status column)",
              file=sys.stderr)
        raise SystemExit(1)


def trained(row: dict) -> bool:
    """Whether a trials.csv row is a trial that ran (not the one row of a variant that was n/a,
    stopped by its probe or out of time before its first trial)."""
    kind = schema.parse_status(row.get("status")).kind
    return kind not in (schema.NA, schema.TOO_SLOW, schema.NOT_MEASURED) or \
        row.get("elapsed_s") is not None


def _in_plan_order(frame, plans: list[Plan]):
    """Trials sorted (stably) so that the summary lists the models in the config's order (their
    rounds run the cheapest first) and each model's baseline first, then the variants in the
    experiment file's order (rounds run them shuffled)."""
    rank = {(p.experiment, v): i for p in plans
            for i, v in enumerate(sorted(p.variants, key=lambda v: v != p.baseline))}
    models = {(p.experiment, m.name): (k, i) for k, p in enumerate(plans)
              for i, m in enumerate(p.models)}
    pairs = list(zip(frame["experiment"], frame["model"], frame["variant"]))
    return frame.assign(
        _model=[models.get((e, m), (len(plans), 0)) for e, m, _ in pairs],
        _rank=[rank.get((e, v), len(rank)) for e, _, v in pairs],
    ).sort_values(["_model", "_rank"], kind="stable").drop(columns=["_model", "_rank"])
