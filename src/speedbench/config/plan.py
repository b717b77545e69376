"""A composed config, validated and expanded into a `Plan`: the models to train and, per
variant, the fully merged recipe. Nothing trains before `build_plan` has accepted every variant
of every model, including the checks that depend on how speedbench was started (`check_plan`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from speedbench import distributed, techniques
from speedbench.config.arms import Arm, cross, parse_arms
from speedbench.config.keys import check_known_keys
from speedbench.config.models import (ModelSpec, check_choice, check_dataset_sizes,
                                      check_path_fits, config_dirs, first_line, inline_name,
                                      is_inline, model_entries, own_data, resolve_model)
from speedbench.config.schema import DEVICES, SCALES, Schema, SpeedbenchConfig
from speedbench.errors import ConfigError
from speedbench.results import index as run_index

# Keys a variant may not change: they define the experiment, not a recipe.
NOT_PER_VARIANT = ("model", "models", "variants", "arms", "baseline", "claims", "experiment", "out_dir",
                   "suite", "recipe", "target", "label")
# bench.mode=quick: one round of fixed windows, no quality probe (so no early stop), no interval
QUICK = {"repeats": 1, "target_ci": None, "steady_tol": None, "quality_steps": 0,
         "quality_seeds": 1, "too_slow_factor": None, "explain": False}


@dataclass
class Plan:
    experiment: str
    device: str  # resolved: cpu, cuda:0, mps
    scale: str  # resolved: small or full
    models: list[ModelSpec]
    variants: dict[str, DictConfig]  # name -> merged recipe, baseline first
    baseline: str
    config: DictConfig = MISSING
    # with `arms` (config/arms.py): each variant's environment, and the variant each is
    # compared with ('' or absent: the baseline)
    arms: dict[str, Arm] = field(default_factory=dict)
    references: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # said once before the run (loop_settings)


def resolve_device(name: str) -> str:
    """`auto` → the accelerator if present, else CPU. Unavailable devices are a config error."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if name == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m:
        if not torch.cuda.is_available():
            raise ConfigError(f"device: '{name}' asked for, but CUDA is not available here; "
                              "allowed here: auto, cpu")
        index = int(m.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device: '{name}' asked for, but only {torch.cuda.device_count()} "
                              f"CUDA device(s) are visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return f"cuda:{index}"
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError("device: 'mps' asked for, but MPS is not available here; "
                              "allowed here: auto, cpu")
        return "mps"
    raise ConfigError(f"device: '{name}' is not a device; allowed: {', '.join(DEVICES)}")


def resolve_scale(scale: str, device: str) -> str:
    check_choice("scale", scale, SCALES)
    if scale == "auto":
        # GPU-sized work only on CUDA; CPUs and laptop MPS get the small defaults.
        return "full" if device.startswith("cuda") else "small"
    return scale


def check_declared(node: Any, cls: type = SpeedbenchConfig, where: str = "") -> None:
    """Every run key's declared choices and range, walking the schema's dataclasses: one loop
    and one message for every run key (the techniques' keys: their Fields, in
    techniques.validate)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = node.get(f.name) if isinstance(node, DictConfig) else None
        if dataclasses.is_dataclass(hints[f.name]):
            check_declared(value, hints[f.name], f"{where}{f.name}.")
        elif f.metadata.get("choices"):
            check_choice(where + f.name, value, f.metadata["choices"])
        elif "bounds" in f.metadata:
            f.metadata["bounds"].check(where + f.name, value)


def run_level_keys(cls: type = SpeedbenchConfig, prefix: str = "") -> list[str]:
    """The dotted keys declared `per_variant=False`: the run reads them once."""
    hints, keys = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += run_level_keys(hints[f.name], f"{prefix}{f.name}.")
        elif not f.metadata.get("per_variant", True):
            keys.append(prefix + f.name)
    return keys


RUN_LEVEL_KEYS = run_level_keys()


def check_recipe(recipe: DictConfig, where: str = "") -> None:
    """Range and choice checks for one recipe (the types were checked by OmegaConf): every
    technique's keys (from their Fields), every run key's declared bounds, then the rules that
    join keys or look outside the config."""
    techniques.validate(recipe, where)
    check_declared(recipe, where=where)
    if recipe.data.path is not None and not _exists(recipe.data.path):
        raise ConfigError(f"{where}data.path: '{recipe.data.path}' does not exist; give an "
                          "ImageFolder directory (image models) or a text file (token models)")


def _exists(path: str) -> bool:
    from pathlib import Path

    return Path(path).expanduser().exists()


def merge_variant(base: DictConfig, name: str, overrides: Any) -> DictConfig:
    """The base recipe with one variant's overrides (nested or dotted keys) applied, type-checked."""
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, (dict, DictConfig)):
        raise ConfigError(f"variants.{name}: must be a mapping of recipe keys to values, "
                          f"got {overrides!r}")
    recipe = base.copy()
    items = OmegaConf.to_container(overrides) if isinstance(overrides, DictConfig) else overrides
    for key, value in items.items():
        if key.split(".")[0] in NOT_PER_VARIANT:
            raise ConfigError(f"variants.{name}.{key}: a variant cannot change '{key}'; "
                              f"it may set recipe keys such as precision, accumulate, data.*")
        run_level = [k for k in RUN_LEVEL_KEYS if _sets(key, value, k)]
        if run_level:
            raise ConfigError(f"variants.{name}.{run_level[0]}: a variant cannot change it; "
                              f"it is the run's (set {run_level[0]} for the whole run)")
        try:
            OmegaConf.update(recipe, key, value, merge=True, force_add=False)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"variants.{name}.{key}: {first_line(exc)}") from None
    return recipe


def _sets(key: str, value: Any, dotted: str) -> bool:
    """Whether the override `key: value` (nested mappings or dotted keys) sets `dotted`."""
    if key == dotted:
        return True
    if not dotted.startswith(key + ".") or not isinstance(value, (dict, DictConfig)):
        return False
    rest = dotted[len(key) + 1:]
    return any(_sets(k, v, rest) for k, v in value.items())


def check_target(cfg: DictConfig) -> None:
    """What the `target` group's declared bounds cannot say (check_declared has the rest)."""
    t = cfg.target
    if t.loss is not None and not math.isfinite(t.loss):
        raise ConfigError(f"target.loss: {t.loss} is out of range; it must be a finite loss, or "
                          "null for the automatic target")


# The entry points (models/loops.py) whose model config carries a loop's own flags: the loop's
# kind for Technique.from_loop and the key that holds them.
LOOP_ENTRIES = {"speedbench.models.loops.lightning": ("lightning", "trainer"),
                "speedbench.models.loops.hf_trainer": ("hf", "args")}


def loop_settings(models: list[ModelSpec]) -> dict[str, Any]:
    """The run's settings the models' own loops ask for (a Lightning Trainer's flags, Hugging
    Face TrainingArguments: precision, accumulation, the optimizer's implementation through
    the techniques, TrainingArguments' learning_rate as lr), read from their configs; a value
    that has no counterpart, or two models asking for different ones, is a ConfigError."""
    found: dict[str, Any] = {}
    for spec in models:
        target = str(spec.target.get("_target_"))
        if target not in LOOP_ENTRIES or not spec.target.get(LOOP_ENTRIES[target][1]):
            continue
        loop, key = LOOP_ENTRIES[target]
        flags = spec.target[key]
        flags = OmegaConf.to_container(flags) if isinstance(flags, DictConfig) else dict(flags)
        try:
            settings = techniques.from_loop(loop, flags)
        except ValueError as exc:
            raise ConfigError(f"model {spec.name}: {key}.{exc}") from None
        if loop == "hf" and flags.get("learning_rate") is not None:
            settings["lr"] = float(flags["learning_rate"])
        for name, value in settings.items():
            if found.get(name, value) != value:
                raise ConfigError(f"model: two models' loops ask for {name}={found[name]} and "
                                  f"{name}={value}; run them apart")
            found[name] = value
    return found


def apply_loop_settings(base: DictConfig, settings: dict[str, Any]) -> list[str]:
    """`settings` set in `base` where the run leaves them at their defaults (a key given on
    the command line wins, and a variant's own setting wins over both); the line saying so."""
    schema = OmegaConf.structured(Schema)  # with the techniques' keys and defaults
    applied = []
    for name, value in settings.items():
        if OmegaConf.select(base, name) == OmegaConf.select(schema, name):
            OmegaConf.update(base, name, value, merge=False)
            applied.append(f"{name}={value}")
    if not applied:
        return []
    return [f"the model's own loop asks for {' '.join(applied)}: set for every variant (a "
            "variant's own setting wins, as one given on the command line does)"]


def check_label(value) -> None:
    """label: null or a label `speedbench runs` and the report tool can take for the run."""
    problem = None if value is None else run_index.label_problem(str(value))
    if problem:
        raise ConfigError(f"label: {str(value)[:80]!r} is not allowed ({problem}); a label is "
                          f"{run_index.LABEL_RULE}")


def check_threads(value) -> None:
    """bench.threads: null, auto or a whole number of threads from 1."""
    if value is None or value == "auto" or (str(value).isdigit() and int(value) >= 1):
        return
    raise ConfigError(f"bench.threads: {value!r} is not allowed; choose auto, a whole number "
                      "from 1, or null (torch's default)")


def build_plan(cfg: DictConfig, experiment: Optional[str]) -> Plan:
    """Validate everything and expand the config into what will run. Raises ConfigError."""
    check_known_keys(cfg)
    check_threads(OmegaConf.select(cfg, "bench.threads"))
    device = resolve_device(cfg.device)
    scale = resolve_scale(cfg.scale, device)
    base = cfg.copy()
    check_recipe(base)
    check_target(cfg)
    check_label(cfg.label)

    entries = model_entries(cfg.model)
    models = []
    data = own_data(cfg)
    dirs = config_dirs()  # --config-dir's models/NAME.yaml needs no +models@models.NAME=NAME
    for raw in entries:
        name = inline_name(raw) if is_inline(raw) else raw
        models.append(resolve_model(name, raw, cfg.models, scale, cfg.batch_size, data, dirs))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError(f"model: {names} names a model twice (an inline model's name is its "
                          f"model_name, else its _target_'s last part)")
    notes = apply_loop_settings(base, loop_settings(models))

    raw_variants = cfg.variants or {"default": {}}
    baseline = cfg.baseline or next(iter(raw_variants))
    if baseline not in raw_variants:
        raise ConfigError(f"baseline: '{baseline}' is not a variant; choose one of "
                          f"{', '.join(raw_variants.keys())}")
    variants = {}
    for name in [baseline] + [v for v in raw_variants if v != baseline]:
        recipe = merge_variant(base, name, raw_variants[name])
        check_recipe(recipe, where=f"variants.{name}." if name != "default" else "")
        techniques.normalise(recipe)
        if cfg.bench.mode == "quick":
            recipe.bench.update(QUICK)
        variants[name] = recipe
    for spec in models:
        if cfg.data.path is not None:
            check_path_fits(spec, cfg.data.path)
    config = cfg
    if cfg.bench.mode == "quick":  # the run's own keys too: the studies read them from here
        config = cfg.copy()
        config.bench.update(QUICK)
    arms = parse_arms(OmegaConf.select(cfg, "arms"))
    crossed = cross(variants, baseline, arms) if arms else None
    plan = Plan(experiment=experiment or "default", device=device, scale=scale, models=models,
                variants=crossed.variants if arms else variants,
                baseline=crossed.baseline if arms else baseline, config=config,
                arms=crossed.arm_of if arms else {},
                references=crossed.reference if arms else {}, notes=notes)
    check_plan(plan, distributed.from_environ())
    return plan


def check_plan(plan: Plan, env: Optional[distributed.DistEnv]) -> None:
    """Checks against the whole plan and how speedbench was started (under torchrun: `env`),
    then every technique's own (techniques.check_plan). Raises ConfigError."""
    for spec in plan.models:
        check_dataset_sizes(spec)
    kind = plan.device.split(":")[0]
    if env is not None:
        reason = distributed.cannot_launch(kind)
        if reason:
            raise ConfigError(f"device: '{plan.device}' cannot run under torchrun: {reason}")
        have = distributed.device_count(kind)
        if env.local_world_size > have:
            noun = "CUDA devices" if kind == "cuda" else "CPU cores"
            raise ConfigError(f"torchrun started {env.local_world_size} processes on this node "
                              f"but it has {have} {noun}; use --nproc_per_node={have} or fewer")
    techniques.check_plan(plan, env)
