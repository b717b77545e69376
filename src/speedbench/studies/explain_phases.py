"""The two explain phases of a model's study (bench.explain; explain.py profiles and splits):
the forecasts before the rounds, the paired profile after them, and the seconds kept back from
the rounds for it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from speedbench import techniques
from speedbench.analysis.numbers import ratio_text
from speedbench.measure import explain, launch
from speedbench.studies import costs
from speedbench.measure.budget import Budget
from speedbench.measure.trial import context
from speedbench.results import atomic, schema

# The most of a model's share left after its probes that the forecasts may take: past it, a
# short budget skips them (and the paired profile) and says so.
SHORT_SHARE = 0.25  # as explain.RESERVE_SHARE, the most the paired profile may keep back


@dataclass
class ForecastResult:
    """The forecasts: the explainer that holds the baseline's profile (None where none was
    taken), variant -> (technique, Bound or why none), and the variants bench.skip_by_forecast
    leaves out (variant -> status)."""

    explainer: Optional[explain.Explainer] = None
    forecasts: dict[str, tuple] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)


def forecasts(mc, prepared, status: dict[str, str], probe_steps: dict, budget: Budget
              ) -> ForecastResult:
    """bench.explain: the baseline's profiled steps, untimed, and each variant's forecast from
    them (explain.py); a variant the probes stopped still gets its forecast: it says what it
    could have been."""
    base, settings = mc.plan.baseline, mc.settings
    if not settings.explain or base in status:
        return ForecastResult()
    ctx = context(mc.plan, mc.dist_env)
    if base in prepared.launched and not techniques.processes(mc.plan.variants[base], ctx):
        return ForecastResult(forecasts=launched_baseline(mc, status))
    steps = costs.step_seconds(probe_steps, [])
    cost = explain.seconds(steps.get(base, math.nan), explain.FORECAST_STEPS,
                           mc.plan.variants[base])
    if math.isfinite(cost) and cost > SHORT_SHARE * budget.left():
        # a short budget drops the optional stages first: the forecasts, and with them the
        # paired profile
        mc.say(f"{mc.spec.name}: no forecasts or explanation: they would take about "
               f"{cost:.0f} s of the {budget.left():.0f} s left of this model's share "
               "(a larger bench.time_budget_s runs them)")
        return ForecastResult()
    mc.doing(f"{mc.spec.name}: forecasts")
    explainer = explain.Explainer(mc.plan, mc.spec, ctx, prepared.dataset, mc.run_dir,
                                  mc.book.bound_inputs(), partial(launched_profile, mc))
    na = {n: s for n, s in status.items() if schema.parse_status(s).kind == schema.NA}
    said_by = explainer.forecast(budget, steps.get(base, math.nan), na)
    said = [f"{n} {'at most ' if b.sound else ''}{ratio_text(b.speedup, spec='.3g')}"
            f"{'' if b.sound else ' (not a bound)'}" for n, (_, b) in said_by.items()
            if isinstance(b, techniques.Bound)]
    if said:  # before any round: what each could gain at best
        mc.say(f"{mc.spec.name}: forecasts: {', '.join(said)}")
    out = ForecastResult(explainer, said_by)
    if settings.skip_by_forecast:
        out.status = skip_by_forecast(mc, said_by, status, steps)
    return out


def launched_profile(mc, name: str, steps: int, budget: Budget) -> explain.Breakdown | str:
    """A variant's profile over the processes its trials run over (torchrun), launched as
    they are (profile_over_processes)."""
    return profile_over_processes(mc.plan, mc.spec, name, steps, budget, mc.dist_env)


def profile_over_processes(plan, spec, name: str, steps: int, budget: Budget,
                           dist_env=None) -> explain.Breakdown | str:
    """`steps` profiled steps of a recipe over the processes its trials run over (torchrun),
    launched as they are (explain.profile_on_rank on each rank): rank 0's profile, or the
    status saying why there is none (the launch stopped at the deadline, a rank's failure)."""
    recipe, ctx = plan.variants[name], context(plan, dist_env)
    got = launch.launch_call(plan, spec, name, recipe, techniques.processes(recipe, ctx),
                             explain.profile_on_rank, {"steps": steps},
                             techniques.environment(recipe, ctx), budget)
    if "profile" in got:
        return got["profile"] if got["profile"].steps else schema.format_status(
            schema.NOT_MEASURED, "no profiled step fitted in the run's bench.time_budget_s")
    status = schema.parse_status(got["status"])
    return schema.format_status(status.kind or schema.ERROR,
                                f"profiling its processes: {status.reason}")


def launched_baseline(mc, status: dict[str, str]) -> dict:
    """No forecast where the baseline runs in a fresh process of its own (an arm: start-up
    variables): the forecasts are read off the baseline's steps profiled in this process, and
    those would be another recipe's. Each variant's forecast.csv row says so (the report's
    forecast table), and the console once; variant -> ("", why). (A baseline over several
    processes is profiled over as many: launched_profile.)"""
    base = mc.plan.baseline
    why = schema.na(f"no forecast: the baseline ({base}) runs in a process of its own, and "
                    "the forecasts are read off the baseline's steps profiled in this process")
    said = {n: ("", why) for n in mc.plan.variants if n != base and n not in status}
    if said:
        mc.say(f"{mc.spec.name}: {why}")
    if mc.run_dir is not None and said:
        head = {"experiment": mc.plan.experiment, "model": mc.spec.name, "is_baseline": False}
        atomic.append_rows(mc.run_dir / "forecast.csv", schema.FORECAST_COLUMNS,
                           [{**head, "variant": n, "technique": "", "status": why}
                            for n in said])
    return said


def skip_by_forecast(mc, said_by: dict, status: dict[str, str], steps: dict[str, float]
                     ) -> dict[str, str]:
    """bench.skip_by_forecast: a variant that cannot gain the noise threshold here (its
    forecast, an upper bound: Bound.under, never one that is not a bound) is not measured; the
    rounds it would have had are spared."""
    threshold, skipped, spared = mc.settings.noise_threshold, {}, []
    for name, (_, bound) in said_by.items():
        why = bound.under(threshold) if isinstance(bound, techniques.Bound) else ""
        if name in status or not why:
            continue
        skipped[name] = schema.format_status(
            schema.NOT_MEASURED, f"by its forecast: {why} (bench.skip_by_forecast=false "
            "measures it)")
        step_s = steps.get(name, steps.get(mc.plan.baseline, math.nan))
        trial_s = costs.trial_seconds(step_s, mc.plan.variants[name].bench)
        spared.append(f"{name} (about {mc.settings.repeats * trial_s:.0f} s of rounds)")
    if spared:
        mc.say(f"{mc.spec.name}: not measured, by their forecasts: " + ", ".join(spared))
    return skipped


def reserve_for(mc, prepared, status: dict[str, str], step_s: dict[str, float],
                budget: Budget) -> float:
    """The seconds the paired profile will need after the rounds, kept back from them."""
    others = [n for n in mc.plan.variants if n != mc.plan.baseline and n not in status
              and n not in prepared.launched]
    return explain.reserve_s(mc.plan, others, step_s, budget.left())


def paired_profile(mc, explainer: explain.Explainer, prepared, rows: list[dict],
                   step_s: dict[str, float], budget: Budget) -> None:
    """After the rounds, the paired profile of the baseline and of every variant measured in
    this process (explain.py), on what the rounds left of `budget`."""
    base = mc.plan.baseline
    ok = {r["variant"] for r in rows if r.get("status") == schema.OK}
    if base not in ok:
        return
    measured = [n for n in mc.plan.variants if n != base and n in ok
                and n not in prepared.launched]
    mc.doing(f"{mc.spec.name}: explaining")
    explainer.paired(budget, measured, step_s)
