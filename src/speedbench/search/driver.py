"""`+experiment=recipe`: the recipe search (selection.py) run through speedbench's own trials.

Per model: the candidate groups of `recipe.candidates` are checked up front (every option is a
valid recipe, or the run stops before training with one line naming the key); the naive recipe
is restricted to what can act here; then every search step is one ordinary speedbench plan
(experiment `recipe-step<N>`, baseline `current`, the step's options as variants) measured by
study.measure_plan in shuffled, paired rounds, its rows appended to trials.csv like any
experiment's;
the closing measurement is the plan `recipe` (baseline `naive`, each prefix of the stack and
each leave-one-out recipe). Results: recipe.csv (waterfall, ablation, every step's
comparisons, the options set aside), recipe.yaml (the final recipe per model, as overrides).
"""
from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf

from speedbench import results
from speedbench.analysis import intervals
from speedbench.analysis import quality as quality_stats
from speedbench.analysis import to_target as target_stats
from speedbench.studies import costs, to_target
from speedbench.measure.budget import Budget
from speedbench.studies.orders import fresh_order_seed
from speedbench.studies.study import Request, measure_plan, na_variants
from speedbench.results.runs import load_quality
from speedbench.results.schema import OK
from speedbench.search import forecasts
from speedbench.search import selection
from speedbench.config import (ConfigError, ModelSpec, Plan, build_plan, config_flags,
                               inline_name)

CLOSING = "recipe"
# The least time a search measurement gets once the search decided to start it, whatever its
# clock has left: on a short or busy budget a pilot's data, probe and one trial take seconds.
MIN_MEASUREMENT_S = 5.0


def is_recipe(cfg: DictConfig) -> bool:
    return bool(OmegaConf.select(cfg, "recipe.candidates"))


# --- config -> candidate groups ------------------------------------------------------------------
def parse_groups(cfg: DictConfig) -> list[selection.Group]:
    """`recipe.candidates` as search groups: {group: {naive: {...}, options: {name: {...}},
    trades_memory: bool}}. Raises ConfigError naming the key."""
    raw = OmegaConf.to_container(cfg.recipe.candidates, resolve=True)
    groups = []
    for name, spec in raw.items():
        where = f"recipe.candidates.{name}"
        if not isinstance(spec, dict) or not isinstance(spec.get("options"), dict) \
                or not spec["options"]:
            raise ConfigError(f"{where}: must be a mapping with `options` (name -> recipe "
                              "overrides), optional `naive` overrides and `trades_memory`")
        unknown = set(spec) - {"naive", "options", "trades_memory"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown key; known keys: naive, "
                              "options, trades_memory")
        options = []
        for opt, overrides in spec["options"].items():
            if not isinstance(overrides, dict) or not overrides:
                raise ConfigError(f"{where}.options.{opt}: must be a non-empty mapping of recipe "
                                  "keys to values")
            options.append(selection.Option(name, str(opt), flat(overrides)))
        groups.append(selection.Group(name, options, naive=flat(spec.get("naive") or {}),
                                   trades_memory=bool(spec.get("trades_memory", False))))
    return groups


def flat(mapping: dict, prefix: str = "") -> dict:
    """{'data': {'num_workers': 2}} -> {'data.num_workers': 2}; dotted keys kept."""
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def step_plan(cfg: DictConfig, spec_entry: Any, recipes: dict[str, dict], baseline: str,
              experiment: str) -> Plan:
    """An ordinary plan for one model whose variants are `recipes` (validated by build_plan)."""
    step = cfg.copy()
    OmegaConf.set_struct(step, False)
    step.variants = {label: dict(overrides) for label, overrides in recipes.items()}
    step.baseline = baseline
    step.model = spec_entry
    step.recipe.candidates = {}
    OmegaConf.set_struct(step, True)
    return build_plan(step, experiment)


def check(cfg: DictConfig, plan: Plan, dist_env) -> list[selection.Group]:
    """Everything the search could run is a valid recipe: the naive one and every option on top
    of it (interactions between options are merged key by key and checked as they come).
    Raises ConfigError before anything trains."""
    if dist_env is not None:
        raise ConfigError("recipe: run the recipe search without torchrun; it launches torchrun "
                          "itself for the candidates that need several processes")
    groups = parse_groups(cfg)
    for key in ("skip", "also_skip"):
        unknown = [name for name in cfg.recipe[key] if name not in {g.name for g in groups}]
        if unknown:
            raise ConfigError(f"recipe.{key}: '{unknown[0]}' is not a candidate group; choose "
                              "from " + ", ".join(g.name for g in groups))
    naive = {k: v for g in groups for k, v in g.naive.items()}
    recipes = {"naive": naive}
    for g in groups:
        for o in g.options:
            recipes[f"{g.name}.{o.name}"] = {**naive, **o.overrides}
    try:
        step_plan(cfg, model_entry(cfg, plan.models[0]), recipes, "naive", CLOSING)
    except ConfigError as exc:
        raise ConfigError(f"recipe.candidates: {exc}") from None
    return groups


def model_entry(cfg: DictConfig, spec: ModelSpec) -> Any:
    """The `model` entry that names this spec (a reference name or a `_target_` mapping)."""
    entry = cfg.model
    if entry is None:
        return spec.name
    entries = list(entry) if OmegaConf.is_list(entry) else [entry]
    for e in entries:
        if (isinstance(e, str) and spec.name in _registry_names(cfg, e)) or (
                not isinstance(e, str) and spec.name == inline_name(e)):
            return e if isinstance(e, str) else OmegaConf.to_container(e)
    return spec.name


def _registry_names(cfg: DictConfig, key: str) -> set[str]:
    """The names a model given by its config key may have in the tables: the key, and its
    `model_name` (as given, or for a scale), which the tables use where there is one."""
    node = (cfg.get("models") or {}).get(key)
    if node is None:
        return {key}
    names = {key, node.get("model_name")}
    names |= {(node.get(s) or {}).get("model_name") for s in ("small", "full")}
    return {str(n) for n in names if n}


# --- the measurer: a search step as an ordinary plan ----------------------------------------------
def experiment_name(step: str) -> str:
    """trials.csv's experiment for a search measurement: "step 2" -> recipe-step2 (the
    screen), "step 2 confirm" -> recipe-step2-confirm, "pilot" -> recipe-pilot, "closing" ->
    recipe."""
    if step == "closing":
        return CLOSING
    return "recipe-" + step.replace("step ", "step").replace(" ", "-")


class TrialMeasurer:
    """selection.Measurer over study.measure_plan: each search step one request, on the
    search's clock; rows go to the run's trials.csv as they end."""

    def __init__(self, cfg: DictConfig, spec: ModelSpec, run_dir: Path, writer, progress: bool,
                 book, budget: Budget, instruments=None):
        self.cfg, self.spec, self.run_dir, self.writer = cfg, spec, run_dir, writer
        self.progress, self.book, self.budget = progress, book, budget
        self.instruments = instruments  # None: the command line's (study.INSTRUMENTS)

    def __call__(self, recipes: dict[str, dict], *, step: str,
                 time_left_s: Optional[float], rounds: Optional[int] = None,
                 ) -> dict[str, selection.Arm]:
        baseline = next(iter(recipes))
        plan = step_plan(self.cfg, model_entry(self.cfg, self.spec), recipes, baseline,
                         experiment_name(step))
        plan.models = [next(m for m in plan.models if m.name == self.spec.name)]
        start = len(self.writer.rows)
        measure_plan(plan, self.run_dir, self.progress, None, self.writer, book=self.book,
                     budget=self.budget, instruments=self.instruments,
                     request=step_request(self.cfg, step, time_left_s, rounds))
        arms = arms_from_rows(self.writer.rows[start:], list(recipes))
        judged = quality_stats.summarise(_quality_rows(self.run_dir, plan.experiment),
                                         self.cfg.bench.quality_tolerance)
        for r in judged.itertuples():
            if r.variant in arms:
                arms[r.variant].quality = r.quality_verdict
                arms[r.variant].quality_note = (
                    f"learning lost {r.learning_lost:+.0%} "
                    f"[{r.learning_lost_lo:+.0%}, {r.learning_lost_hi:+.0%}]")
        return arms


def step_request(cfg: DictConfig, step: str, time_left_s: Optional[float],
                 rounds: Optional[int]) -> Request:
    """What a search step measures: a screen exactly `rounds` rounds; a screen ranks on speed
    alone, so its probes need only the two steps that tell a hopeless option (a confirmation's
    full probes judge the held-out loss, the closing one reports it); the closing measurement
    alone is explained; each at most recipe.step_budget_s, or half the search's time left."""
    screening = step != "closing" and not step.endswith("confirm")
    cap = cfg.recipe.step_budget_s
    if time_left_s is not None:  # adaptive rounds may not outrun the search's budget
        cap = max(MIN_MEASUREMENT_S, time_left_s / 2 if cap is None else min(cap, time_left_s / 2))
    # a measurement the search decided to start runs its first trials: MIN_MEASUREMENT_S at
    # least, even where the search's clock is spent (a pilot on a very short budget)
    return Request(rounds=rounds, probes="screen" if screening else "full",
                   explain=step == "closing", budget_s=cap, min_s=MIN_MEASUREMENT_S)


def _quality_rows(run_dir: Path, experiment: str) -> pd.DataFrame:
    """quality.csv's rows of one measurement (none where it wrote none)."""
    rows = load_quality(run_dir)
    return pd.DataFrame() if rows is None else rows[rows["experiment"] == experiment]


def arms_from_rows(rows: list[dict], labels: list[str]) -> dict[str, selection.Arm]:
    """trials.csv rows of one plan -> per variant: status and throughput per round."""
    frame = pd.DataFrame(rows)
    key = "round" if "round" in frame and frame["round"].notna().any() else "trial"
    arms = {}
    for label in labels:
        g = frame[frame["variant"] == label] if len(frame) else frame
        if g.empty:
            arms[label] = selection.Arm("error: not measured")
            continue
        ok = g[g["status"] == OK]
        if ok.empty:
            arms[label] = selection.Arm(str(g["status"].iloc[0]))
            continue
        rounds = int(pd.to_numeric(frame[key], errors="coerce").max()) + 1
        mem = pd.to_numeric(ok.get("peak_mem_mb", pd.Series(dtype=float)), errors="coerce")
        arms[label] = selection.Arm(OK, _per_round(ok, key, "samples_per_s", rounds),
                                    _per_round(ok, key, "others_cpu_share", rounds, max),
                                    float(mem.median()) if len(mem) else math.nan,
                                    trial_seconds(ok))
    return arms


def _per_round(ok: pd.DataFrame, key: str, column: str, rounds: int,
               pick=lambda values: values[-1]) -> list[float]:
    """`column` of the ok rows as one value per round (`pick` of the round's values; NaN
    where the round has none or the column is missing)."""
    values: dict[int, list[float]] = {}
    if column in ok:
        for r, v in zip(pd.to_numeric(ok[key], errors="coerce"),
                        pd.to_numeric(ok[column], errors="coerce")):
            if math.isfinite(r) and math.isfinite(v):
                values.setdefault(int(r), []).append(float(v))
    return [pick(values[r]) if r in values else math.nan for r in range(rounds)]


def trial_seconds(ok: pd.DataFrame) -> float:
    """Median seconds of a trial, warm-up included (costs.observed_trial_seconds)."""
    need = ("elapsed_s", "steps", "warmup_steps")
    if not all(c in ok for c in need):
        return math.nan
    return costs.observed_trial_seconds(*(pd.to_numeric(ok[c], errors="coerce") for c in need))


# --- the whole search for one plan ------------------------------------------------------------------
def execute(cfg: DictConfig, plan: Plan, groups: list[selection.Group], run_dir: Path, writer,
            progress: bool, book, budget: Budget, instruments=None
            ) -> dict[str, selection.SearchResult]:
    """The search for every model of the plan; recipe.csv and recipe.yaml written as each model
    ends. `book` (flops.FlopsBook) holds the run's matmul peaks, for the forecasts; `budget` is
    the run's clock: each model's search takes its share of what is left when it starts, at
    most recipe.budget_s. `instruments`: what trains (study.Instruments; None: the command
    line's)."""
    found, entries = {}, {}
    min_gain = cfg.recipe.min_gain
    if min_gain is None:
        min_gain = OmegaConf.select(cfg, "bench.noise_threshold", default=0.02)
    skipped = [g for g in groups if g.name in {*cfg.recipe.skip, *cfg.recipe.also_skip}]
    # the run's family-wise error, fixed before anything runs: the findings' share (when a
    # profiled run will check them) aside, the rest split evenly over the models searched
    alpha = (intervals.FAMILY_LEVEL - check_share(cfg)) / len(plan.models)
    cannot_act = cannot_act_for(cfg)
    for k, spec in enumerate(plan.models):
        naive, kept, notes = selection.restrict_naive(groups, cannot_act(spec))
        kept = [g for g in kept if g not in skipped]
        if skipped:
            notes.append("not candidates (recipe.skip, recipe.also_skip): "
                         + ", ".join(g.name for g in skipped)
                         + "; their naive setting stays")

        def say(msg: str, model: str = spec.name) -> None:
            if progress:
                print(f"recipe {model}: {msg}", file=sys.stderr, flush=True)

        forecaster = None
        if cfg.recipe.forecasts and cfg.bench.explain:
            forecaster = forecasts.Forecaster(cfg, spec, book, min_gain, step_plan,
                                              model_entry(cfg, spec))
        # the model's search: its share of what is left of the run, recipe.budget_s at most
        own = budget.part(1 / (len(plan.models) - k)).cap(cfg.recipe.budget_s)
        measurer = TrialMeasurer(cfg, spec, run_dir, writer, progress, book, own, instruments)
        result = selection.search(kept, naive, measurer, budget=own,
                                  max_memory_mb=cfg.recipe.max_memory_mb, alpha=alpha,
                                  min_gain=min_gain, screen_rounds=cfg.recipe.screen_rounds,
                                  confirm_top=cfg.recipe.confirm_top,
                                  min_rounds=int(cfg.bench.repeats), progress=say,
                                  forecast=forecaster)
        result.notes[:0] = notes
        if forecaster is not None:
            result.notes.append(forecaster.note())
        say(f"done in {result.elapsed_s:.0f} s: {result.undecided or result.stopped}")
        found[spec.name] = result
        entries[spec.name] = model_entry(cfg, spec)
        if cfg.target.enabled and result.chosen:  # does the final recipe train sooner?
            say("time to target: the final recipe against naive")
            check = step_plan(cfg, entries[spec.name], {"naive": dict(result.naive),
                                                        "final": dict(result.final)},
                              "naive", target_stats.RECIPE_CHECK)
            to_target.measure(check, run_dir, [], progress, fresh_order_seed(), own)
        write_outputs(run_dir, found, entries)
    return found


def check_share(cfg: DictConfig) -> float:
    """The share of the run's family-wise error kept for the findings' checks: set before the
    search when the run profiles and checks what it finds (intervals.CHECK_SHARE), else 0."""
    profiled = OmegaConf.select(cfg, "profile", default="off") != "off"
    return intervals.CHECK_SHARE if profiled and cfg.recipe.check_findings else 0.0


def levels(found: dict[str, selection.SearchResult]) -> dict[tuple[str, str], float]:
    """(experiment, model) -> the CI level the search used in that measurement: summary.csv
    states the same intervals (summary.summarise's `levels`)."""
    return {(experiment_name(step), model): level for model, r in found.items()
            for step, level in r.levels.items()}


def result_rows(model: str, r: selection.SearchResult) -> list[dict]:
    """One SearchResult as recipe.csv rows (tables: waterfall, ablation, step (the screens),
    confirm (the confirmations), excluded, chosen, stopped, note)."""
    rows = []
    for i, w in enumerate(r.waterfall):
        rows.append({"model": model, "table": "waterfall", "step": i, **{
            k: w.get(k, math.nan) for k in ("label", "option", "speedup", "lo", "hi", "verdict",
                                            "step_gain", "step_lo", "step_hi")}})
    for a in r.ablation:
        rows.append({"model": model, "table": "ablation", "label": f"without {a['option']}",
                     "option": a["option"], "group": a["group"], "speedup": a["marginal"],
                     "lo": a["lo"], "hi": a["hi"], "verdict": a["verdict"],
                     "step_gain": a["step_gain"], "overrides": _yaml_inline(a["overrides"])})
    for s in r.steps:
        for c in s.comparisons.values():  # the screen: ranks
            rows.append({"model": model, "table": "step", "step": s.index, "label": c.label,
                         "option": c.label, "speedup": c.speedup, "lo": c.lo, "hi": c.hi,
                         "verdict": c.verdict, "rounds": c.rounds, "status": OK})
        for c in s.confirmations.values():  # the fresh measurement: decides
            failed = not math.isfinite(c.speedup)
            rows.append({"model": model, "table": "confirm", "step": s.index, "label": c.label,
                         "option": c.label, "speedup": c.speedup, "lo": c.lo, "hi": c.hi,
                         "verdict": ("chosen" if c.label == s.chosen else
                                     "" if failed else c.verdict),
                         "rounds": c.rounds, "status": c.verdict if failed else OK})
    for label, status in r.excluded.items():
        rows.append({"model": model, "table": "excluded", "label": label, "option": label,
                     "status": status})
    for o in r.chosen:
        rows.append({"model": model, "table": "chosen", "label": o.label, "option": o.label,
                     "group": o.group, "overrides": _yaml_inline(dict(o.overrides))})
    rows.append({"model": model, "table": "stopped", "label": r.stopped,
                 "speedup": r.elapsed_s})
    if r.undecided:
        rows.append({"model": model, "table": "undecided", "label": r.undecided})
    for note in r.notes:
        rows.append({"model": model, "table": "note", "label": note})
    return rows


def _yaml_inline(d: dict) -> str:
    return yaml.safe_dump(d, default_flow_style=True, sort_keys=False).strip()


def write_outputs(run_dir: Path, found: dict[str, selection.SearchResult],
                  entries: Optional[dict] = None) -> None:
    """recipe.csv and recipe.yaml, through the run directory's writer."""
    rows = [row for model, r in found.items() for row in result_rows(model, r)]
    results.write_recipe(run_dir, rows, recipe_yaml(found, entries or {}))


def recipe_yaml(found: dict[str, selection.SearchResult], entries: dict) -> str:
    """The final recipe per model as overrides speedbench accepts back, with the command
    (`entries`: each model's `model` entry as given)."""
    lines = ["# The best recipe found per model on this machine (speedbench +experiment=recipe).",
             "# Re-run one with its command: the run's own flags, its model, the recipe"]
    doc = {}
    for model, r in found.items():
        if r.undecided:  # no recipe to offer: the naive one is no answer
            doc[model] = {"decided": False, "reason": r.undecided}
            continue
        if not r.chosen:  # decided: nothing beat the naive recipe, which is no recipe to run
            doc[model] = {"decided": True, "chosen": [], "overrides": dict(r.final),
                          "reason": f"nothing was added: {r.stopped}; these are the naive "
                                    "settings the search started from"}
            continue
        last = r.waterfall[-1]
        args = [f"{k}={_cli(v)}" for k, v in r.final.items()]
        doc[model] = {
            "decided": True,
            "overrides": dict(r.final),
            "chosen": [o.label for o in r.chosen],
            "speedup_over_naive": _num(last.get("speedup")),  # measured; null if not measured
            "ci": [_num(last.get("lo")), _num(last.get("hi"))],
            "command": rerun_command(entries.get(model, model), args),
        }
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False)


def rerun_command(entry: Any, recipe_args: list[str]) -> str:
    """`speedbench` (under torchrun, its launcher: distributed.launcher) with this run's config
    flags and overrides (but the search's own and those the recipe sets), the model as given,
    then the recipe: a plain run of the final recipe."""
    from hydra.core.hydra_config import HydraConfig

    given: list[str] = []
    if HydraConfig.initialized():  # a command line (not a test calling run())
        set_here = {a.split("=", 1)[0] for a in recipe_args}
        given = config_flags(sys.argv[1:]) + [
            o for o in HydraConfig.get().overrides.task
            if o.lstrip("+~").split("=", 1)[0].split(".")[0] not in (
                "experiment", "recipe", "model", "variants", "baseline", "run_dir")
            and o.lstrip("+~").split("=", 1)[0] not in set_here]
    model = entry if isinstance(entry, str) else yaml.safe_dump(
        entry, default_flow_style=True, sort_keys=False, width=math.inf).strip()
    from speedbench import distributed

    # under torchrun the launcher as given, so that the command measures the same setup
    start = distributed.launcher(distributed.from_environ())
    return " ".join(shlex.quote(w) for w in [*start, *given, f"model={model}", *recipe_args])


def _cli(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _num(x) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, 4) if math.isfinite(x) else None


def cannot_act_for(cfg: DictConfig, dist_env=None):
    """spec -> (overrides -> 'n/a: ...' or None): whether a recipe can act on this model here,
    asked of a freshly built model (study.na_variants, as before a plan's first round)."""
    def for_spec(spec: ModelSpec):
        def cannot(overrides: dict) -> Optional[str]:
            plan = step_plan(cfg, model_entry(cfg, spec), {"probe": overrides}, "probe", "probe")
            plan.models = [m for m in plan.models if m.name == spec.name]
            return na_variants(plan, plan.models[0], dist_env).get("probe")
        return cannot
    return for_spec
