"""Diagnosis that closes the loop: a finding's suggested knob is measured before it is
recommended.

For every finding of findings.csv that suggests a knob: the variant as it ran vs the same with
the knob set, side by side in paired rounds (experiment `check-<experiment>`, profile off), the
suggestion's effect with a CI Bonferroni-adjusted over the run's checks. The finding gets a
`check` column: "measured 0.82x [0.75, 0.90] here, not recommended".
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml
from omegaconf import OmegaConf

from speedbench import results
from speedbench.analysis import intervals
from speedbench.analysis.numbers import ratio_text
from speedbench.config import ConfigError, Plan
from speedbench.studies import costs
from speedbench.measure.budget import Budget
from speedbench.studies.study import Request, measure_plan
from speedbench.results.schema import OK
from speedbench.search import driver, selection

CHECK_BUDGET_S = 60.0  # per finding checked, at most: the rounds beyond bench.repeats stop there
VERDICT_TEXT = {intervals.FASTER: "recommended", intervals.SLOWER: "slower here, not recommended",
                intervals.EQUIVALENT: "no difference here, not recommended"}


def parse_knob(knob: str) -> dict:
    """'data.num_workers=2 data.persistent_workers=true' -> overrides (YAML-typed values)."""
    out = {}
    for part in str(knob).split():
        if "=" in part:
            key, value = part.split("=", 1)
            out[key] = yaml.safe_load(value)
    return out


def _todo(findings: pd.DataFrame) -> pd.DataFrame:
    """The findings that suggest a knob to measure."""
    return findings[findings["knob"].fillna("-").astype(str).str.contains("=")]


def _level(todo: pd.DataFrame, alpha: float = intervals.CHECK_SHARE) -> float:
    """Bonferroni over the knobs to check, counted before any is measured, within `alpha`."""
    keys = set(zip(todo["experiment"], todo["model"], todo["variant"], todo["knob"]))
    return intervals.comparison_level(len(keys), alpha)


def levels(run_dir: Path, trials: pd.DataFrame) -> dict[tuple[str, str], float]:
    """(check experiment, model) -> the level its check used: summary.csv states the same
    intervals (summary.summarise's `levels`)."""
    findings = results.load_findings(run_dir)
    if findings is None or "experiment" not in trials:
        return {}
    level = _level(_todo(findings))
    checked = trials[trials["experiment"].astype(str).str.startswith("check-")]
    return {pair: level for pair in zip(checked["experiment"], checked["model"])}


def check(plans: list[Plan], run_dir: Path, writer, progress: bool, book=None,
          budget: Optional[Budget] = None, alpha: float = intervals.CHECK_SHARE
          ) -> Optional[pd.DataFrame]:
    """Measure every suggested knob of findings.csv and write the verdicts into its `check`
    column; the findings, or None when the run has no findings.csv. Each check takes its share
    of what `budget` (the run's clock) has left when it starts, CHECK_BUDGET_S at most; one
    that cannot fit two rounds there is not checked, and says so."""
    findings = results.load_findings(run_dir)
    if findings is None:
        return None
    todo = _todo(findings)
    if todo.empty:
        return findings
    by_experiment = {p.experiment: p for p in plans}
    pairs, status = {}, {}
    budget = budget or Budget(None)
    keys = list(dict.fromkeys(zip(todo["experiment"], todo["model"], todo["variant"],
                                  todo["knob"])))
    for i, key in enumerate(keys):
        share = budget.part(1 / (len(keys) - i))
        got = _measure(by_experiment.get(key[0]), *key[1:], run_dir, writer, progress, book,
                       share)
        if isinstance(got, str):
            status[key] = got
        else:
            pairs[key] = got
    threshold = float(OmegaConf.select(plans[0].config, "bench.noise_threshold", default=0.02))
    level = _level(todo, alpha)
    for key, (s, lo, hi, verdict) in selection.compare_at(pairs, level, threshold).items():
        effect = ratio_text(s, lo, hi)
        status[key] = (f"measured {effect} here, "
                       + VERDICT_TEXT.get(verdict, "not settled by this check"))
    findings["check"] = [
        status.get((r.experiment, r.model, r.variant, r.knob), "-") for r in findings.itertuples()]
    results.write_findings(findings, run_dir)
    return findings


def _measure(plan: Optional[Plan], model: str, variant: str, knob: str, run_dir: Path, writer,
             progress: bool, book, budget: Budget):
    """(suggested, as run) throughputs per round, or why the suggestion was not measured."""
    spec = next((m for m in plan.models if m.name == model), None) if plan else None
    if spec is None or variant not in (plan.config.variants or {"default": {}}):
        return "not checked: its plan is unknown"
    node = (plan.config.variants or {}).get(variant)  # an empty variant is falsy: {}
    raw = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) \
        else dict(node or {})
    ran = {**driver.flat(raw), "profile": "off"}  # unprofiled
    need = 4 * _trial_seconds(writer.rows, plan.experiment, model, variant)  # 2 rounds of 2
    if budget.left() <= need:  # nothing left, or less than two rounds
        return (f"not checked: the run's bench.time_budget_s had {budget.left():.0f} s left "
                f"for it, about {need:.0f} s needed")
    recipes = {"as run": ran, "suggested": {**ran, **parse_knob(knob)}}
    if progress:
        print(f"checking the finding's suggestion {knob} on {model}/{variant}",
              file=sys.stderr, flush=True)
    try:
        step = driver.step_plan(plan.config, driver.model_entry(plan.config, spec), recipes,
                                "as run", f"check-{plan.experiment}")
    except ConfigError as exc:
        return f"not checked: {exc}"
    step.models = [m for m in step.models if m.name == model]
    start = len(writer.rows)
    # a check is a verdict on a finding, several per experiment under one name: no explanation
    measure_plan(step, run_dir, progress, None, writer, book=book, budget=budget,
                 request=Request(explain=False, budget_s=CHECK_BUDGET_S))
    arms = driver.arms_from_rows(writer.rows[start:], list(recipes))
    bad = next((a for a in (arms["suggested"], arms["as run"]) if a.status != OK), None)
    if bad is not None:
        return f"not measured here ({bad.status})"
    return selection.rounds_of(arms["suggested"], arms["as run"])


def _trial_seconds(rows: list[dict], experiment: str, model: str, variant: str) -> float:
    """Median seconds of the variant's ok trials in the run (0 where none)."""
    ok = [r for r in rows if (r.get("experiment"), r.get("model"), r.get("variant"))
          == (experiment, model, variant) and r.get("status") == OK]
    got = costs.observed_trial_seconds(*([r.get(c, math.nan) for r in ok]
                                         for c in ("elapsed_s", "steps", "warmup_steps")))
    return got if math.isfinite(got) else 0.0
