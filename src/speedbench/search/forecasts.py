"""The recipe search's forecasts (selection.Forecast): before each screen, the current recipe's
profiled steps (measure/explain.py, untimed) and each option's bound on top of it
(Technique.bound, Amdahl); an option whose bound lies under 1 + min_gain is not screened in
that step, with the reason.

Profiled afresh at every step, not once on the naive recipe: a saving of so many milliseconds
is a larger share of the shorter step the search has reached (once debug_apis=off or bf16 is
in, data wait that was 0.4 % of the naive step may be 4 % of the current one), so a bound
from an earlier, longer step would understate what an option can gain now.

What it costs and what it spares are both kept (`profiled_s`, `spared_s`) and said in one
note after the search, so the trade is measured, not assumed."""
from __future__ import annotations

import time
from typing import Optional

from omegaconf import DictConfig

from speedbench import techniques
from speedbench.config import ModelSpec
from speedbench.measure import explain, watchdog
from speedbench.measure.budget import Budget
from speedbench.studies import costs, explain_phases
from speedbench.measure.data import build_dataset
from speedbench.measure.trial import context, dataset_length
from speedbench.search import selection

PROFILE_SHARE = 0.1  # of the search's time left, at most, for one step's profiled steps


class Forecaster:
    """One model's forecasts over its search (`selection.search(..., forecast=...)`).
    `step_plan(cfg, entry, recipes, baseline, name)` builds a plan (driver.step_plan);
    `book` is the run's flops.FlopsBook (matmul peaks, measured once per dtype) or None."""

    def __init__(self, cfg: DictConfig, spec: ModelSpec, book, min_gain: float,
                 step_plan, entry):
        self.cfg, self.spec, self.book, self.min_gain = cfg, spec, book, min_gain
        self.step_plan, self.entry = step_plan, entry
        self.dataset = None  # made once, on the first forecast
        self.profiled_s = 0.0  # seconds the profiles took
        self.spared_s = 0.0  # seconds of screening the set-aside options would have taken
        self.set_aside = 0  # option screens set aside, over all steps
        self.failed = ""  # why the forecasts stopped (a profile failed), else ""

    def _plan(self, overrides: dict):
        plan = self.step_plan(self.cfg, self.entry, {"r": dict(overrides)}, "r",
                              "recipe-forecast")
        plan.models = [m for m in plan.models if m.name == self.spec.name]
        return plan, plan.variants["r"]

    def __call__(self, current: dict, options: list[selection.Option], *,
                 time_left_s: Optional[float]) -> dict[str, str]:
        if self.failed or (time_left_s is not None and time_left_s <= 0):
            return {}
        started = time.perf_counter()
        try:
            return self._aside(current, options, time_left_s)
        except explain.OutOfTime:
            return {}  # no room for a profile in this step: every option is screened
        except (Exception, watchdog.StepOverrun) as exc:  # the search goes on without them
            self.failed = f"profiling the current recipe failed ({exc})"[:200]
            return {}
        finally:
            self.profiled_s += time.perf_counter() - started

    def _aside(self, current: dict, options: list[selection.Option],
               time_left_s: Optional[float]) -> dict[str, str]:
        plan, base = self._plan(current)
        recipes = {o.label: self._plan({**current, **o.overrides})[1] for o in options}
        peaks = {}
        if self.book is not None:  # once per run and dtype, as the trials' (flops.FlopsBook)
            self.book.measure_peaks(["fp32", *(techniques.matmul_dtype(r)
                                               for r in recipes.values())],
                                    None if time_left_s is None else Budget(time_left_s))
            peaks = self.book.bound_inputs()
        model = plan.models[0]
        if self.dataset is None:
            self.dataset = build_dataset(model.dataset, dataset_length(plan, model),
                                         base.data.path, seed=base.bench.seed)
        limit = 10 * (base.bench.max_trial_s or 6.0)
        if time_left_s is not None:
            limit = min(limit, PROFILE_SHARE * time_left_s)
        if techniques.processes(base, context(plan)):  # DDP, FSDP: over its processes
            profile = explain_phases.profile_over_processes(
                plan, model, "r", explain.FORECAST_STEPS, Budget(limit))
            if isinstance(profile, str):
                raise RuntimeError(profile)
        else:
            profile = explain.profile_recipe(model, base, context(plan), self.dataset,
                                             explain.FORECAST_STEPS, limit)
        screen_s = self.cfg.recipe.screen_rounds * costs.trial_seconds(
            profile.step_ms / 1000, base.bench)
        aside = set_aside(recipes, base, profile, peaks, self.min_gain)
        self.spared_s += screen_s * len(aside)
        self.set_aside += len(aside)
        return aside

    def note(self) -> str:
        """What the forecasts cost and spared, for the search's notes."""
        if self.failed:
            return f"no forecasts after a point: {self.failed}"
        return (f"forecasts: {self.set_aside} option screens set aside, about "
                f"{self.spared_s:.0f} s of screening spared; the profiles took "
                f"{self.profiled_s:.0f} s")


def set_aside(recipes: dict, base, profile, peaks: dict, min_gain: float) -> dict[str, str]:
    """label -> why, for the options (`recipes`: label -> recipe) whose forecast on the current
    recipe's profile (`base`, `profile`) is a bound under 1 + `min_gain` (techniques.forecast:
    the shares' upper limits, enough profiled steps); the rest are screened."""
    aside = {}
    for label, recipe in recipes.items():
        bound = techniques.forecast(recipe, base, profile, peaks)[1]
        why = bound.under(min_gain) if isinstance(bound, techniques.Bound) else ""
        if why:
            aside[label] = f"{why} (on the current recipe's {profile.step_ms:.3g} ms step)"
    return aside
