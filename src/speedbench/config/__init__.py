"""Typed config schema (registered in Hydra's ConfigStore) and the checks types cannot express.

Data flow: Hydra composes a `Schema` (SpeedbenchConfig below plus every technique's keys, see
speedbench.techniques); `build_plan` validates it and expands it into a `Plan`: the models to
train and, per variant, the fully merged recipe. Nothing trains before `build_plan` has accepted
every variant of every model, including the checks that depend on how speedbench was started
(`check_plan`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from speedbench import distributed, techniques
from speedbench.errors import ConfigError
from speedbench.techniques.base import Bounds

SCALES = ("auto", "small", "full")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
DATASET_KINDS = ("images", "tokens", "tabular")
# dataset.task per kind; the first is the default (tokens with num_classes:
# sequence_classification; images and tabular with targets: regression)
TASKS = {"images": ("classification", "regression"),
         "tabular": ("classification", "regression"),
         "tokens": ("next_token", "sequence_classification", "token_classification",
                    "masked_lm")}
LOSSES = ("cross_entropy", "mse", "module")
# A model config's keys that are speedbench's, not the constructor's (`kwargs` holds the
# constructor's own, where one of them shares a name with these)
MODEL_KEYS = ("dataset", "loss", "inputs", "model_name", "batch_size")
# One-line models by name: the key -> its builder (models/by_name.py)
BY_NAME = {"timm": "speedbench.models.by_name.timm_model",
           "torchvision": "speedbench.models.by_name.torchvision_model",
           "hf": "speedbench.models.by_name.hf_model"}
PROFILES = ("off", "simple", "advanced", "pytorch")
REFERENCE_MODELS = ("resnet", "vae", "transformer")
# Keys a variant may not change: they define the experiment, not a recipe.
NOT_PER_VARIANT = ("model", "models", "variants", "baseline", "claims", "experiment", "out_dir",
                   "suite", "recipe", "target")


def setting(default: Any = None, doc: str = "", *, values: str = "", factory: Any = None,
            choices: tuple = (), per_variant: bool = True, **bounds: Any) -> Any:
    """A run key, declared once: its default and one-line doc (what the generated docs and
    `--help` show, speedbench.config.docs); its allowed values, as `choices` (checked) or as
    `values` text (`cuda:N`, checked where the key is resolved); its range (`bounds`: Bounds's
    low, gt, lt, high, note, null), which `check_declared` enforces with the techniques' own
    message; and whether a variant may set it (`per_variant=False`: the run reads it once, so
    a variant that sets it is refused)."""
    meta = {"doc": doc, "values": values or "|".join(choices), "choices": choices,
            "bounds": Bounds(**bounds), "per_variant": per_variant}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# Upper bounds of the size knobs: far above any useful run, low enough that a typo cannot ask
# for more memory than a machine has. Values handed to the OS: numpy's and torch's seeds take
# [0, 2^32) everywhere; subprocess and datetime overflow on an infinite or astronomically long
# timeout (11.6 days is far above any run).
STEPS_LIMIT, SEED_LIMIT, SECONDS_LIMIT = 1_000_000, 2 ** 32, 1_000_000.0
ORDER_SEED_LIMIT = 2 ** 63  # the rounds' orders: runs draw 63 bits (numpy takes any size)
SECONDS = {"gt": 0, "high": SECONDS_LIMIT}  # a time limit: positive, finite, at most 11.6 days
RUN_LEVEL = {"per_variant": False}
# bench.mode=quick: one round of fixed windows, no quality probe (so no early stop), no interval
QUICK = {"repeats": 1, "target_ci": None, "steady_tol": None, "quality_steps": 0,
         "quality_seeds": 1, "too_slow_factor": None, "explain": False}


@dataclass
class DataConfig:
    # The loader technique adds its keys here (num_workers, pin_memory, ...: see Schema).
    path: Optional[str] = setting(None, "real data: an ImageFolder directory (image models) or a "
                                        "text file (token models); null: synthetic data")
    samples: Optional[int] = setting(None, "size of the synthetic data set; null: sized so that no "
                                           "trial crosses an epoch end", low=1, high=10_000_000)
    # measure/own_data.py; a model's `dataset: {_target_: ...}` does the same for one model
    _target_: Optional[str] = setting(None, "your own data for every model: a callable "
                                            "(module.name) returning a map-style Dataset of "
                                            "(x, y) items or a DataLoader of one; speedbench "
                                            "loads it with its own DataLoader, so that the "
                                            "data.* knobs act; null: the model's dataset",
                                      per_variant=False)
    kwargs: dict[str, Any] = setting(doc="keyword arguments of data._target_ (on the command "
                                         "line: '+data.kwargs={n: 512}')",
                                     factory=dict, per_variant=False)


@dataclass
class BenchConfig:
    mode: str = setting("full", "full: probes, rounds and intervals; quick: a first look, one "
                                "round of fixed windows, no probes, no interval (verdict `no CI`)",
                        choices=("full", "quick"), per_variant=False)
    warmup: int = setting(3, "optimizer steps run before the timed window, at least "
                             "(0: no warm-up)", low=0, high=100_000)
    # Warm-up continues past `warmup` until the step time is steady: the last 3 step times lie
    # within `steady_tol` of their median (see timing.warm_up); at most max(warmup, warmup_max).
    warmup_max: int = setting(10, "warm-up steps at most, while the step time is not yet steady",
                              low=0, high=100_000)
    steady_tol: Optional[float] = setting(0.1, "steady: the last 3 warm-up steps within this of "
                                               "their median; null: exactly `warmup` steps",
                                          gt=0, null="to turn it off")
    steps: int = setting(10, "optimizer steps in the timed window", low=1, high=STEPS_LIMIT)
    # The paired, Bonferroni-adjusted CIs need about 5 rounds to call a 1.3x effect in most runs.
    repeats: int = setting(5, "rounds (every variant once, interleaved) before a verdict, and "
                              "the first look of adaptive rounds, and between two later looks "
                              "at least (up to 4 x where the budget fits more)", low=1,
                           high=10_000)
    # Adaptive rounds are group-sequential (adaptive.wants_more_rounds): 3 looks (up to 8 where
    # the budget fits more: intervals.planned_looks), each spending a share of the family-wise
    # error, the later ones spread over the model's budget (intervals.look_spacing).
    target_ci: Optional[float] = setting(0.03, "adaptive rounds: at a look, stop once every "
                                               "speed-up is decided or its CI's relative "
                                               "half-width is at most this; null: exactly "
                                               "`repeats`", gt=0, lt=1, **RUN_LEVEL,
                                          note="relative: 0.03 = +-3 %",
                                          null="to turn it off")
    noise_threshold: float = setting(0.05, "smallest speed-up that counts: faster/slower need the "
                                           "estimate beyond it, equivalent the whole CI within it",
                                      gt=0, lt=1, note="0.05 = 5 %")
    # The quality probe trains a fresh model from `seed` for this many optimizer steps of the
    # baseline (the same samples seen for every variant), untimed, once per (model, variant).
    quality_steps: int = setting(12, "optimizer steps of the quality probe whose loss is compared "
                                     "(0: no loss; the probe still times the steps "
                                     "too_slow_factor needs); a probe stops after 10 x "
                                     "max_trial_s (a hard cap, even mid-step), its loss then "
                                     "empty", low=0, high=10_000, **RUN_LEVEL)
    quality_seeds: int = setting(3, "paired seeds of the quality probe: each variant's held-out "
                                    "loss from each, compared with the baseline's in the same "
                                    "seed, with a CI (1: no CI, no verdict)", low=1, high=100,
                                **RUN_LEVEL)
    quality_tolerance: float = setting(0.05, "non-inferiority margin on the share of what the "
                                             "baseline learned (its step-0 held-out loss less "
                                             "its loss, nats) that a variant may lose: "
                                             "non-inferior when the upper end of the CI of "
                                             "that share is at most this, worse when the lower "
                                             "end is above it", gt=0, lt=1, **RUN_LEVEL,
                                        note="0.05 = 5 % of the baseline's learning")
    # measure/stopping.py: a one-sided test at the probe's 3rd and 6th steady steps, spending a
    # share of the family's error; a probe too slow for two rounds to fit is not measured.
    too_slow_factor: Optional[float] = setting(4.0, "stop a variant early, verdict \"slower "
                                                    "(stopped early)\", once its steady probe "
                                                    "steps against the baseline's put the upper "
                                                    "confidence bound of its speed-up below "
                                                    "1/this (a test of the run's family); "
                                                    "null: never", gt=1, **RUN_LEVEL,
                                               note="4 = four times slower",
                                               null="never to stop a variant early")
    time_budget_s: float = setting(600.0, "wall time of the whole experiment, which every "
                                          "phase draws on: the command's start-up (its first "
                                          "experiment), the matmul peaks, each model's data, "
                                          "quality probes (40 % of its share at most) and "
                                          "rounds, time to target, the report; steps stop at "
                                          "the deadline (a suite: each experiment its own)",
                                     **SECONDS, **RUN_LEVEL)
    # A very slow variant (fp16 on a CPU) then times fewer steps; trials.csv's `steps` says so.
    # measure/watchdog.py makes it a hard cap (trial.trial_limit_s).
    max_trial_s: Optional[float] = setting(6.0, "cap on one trial's wall time (a quarter warm-up, "
                                                "the rest timed), checked between steps; and a "
                                                "hard cap kept by a watchdog: past 2 x this (4 x "
                                                "when profiling) a step that has itself run this "
                                                "long is stopped mid-step, status `too slow: "
                                                "step exceeded ...`, and a process stuck outside "
                                                "Python max(30 s, this) later is ended (exit "
                                                "status 124); null: no cap", **SECONDS,
                                           null="for no cap")
    seed: int = setting(0, "seed of the models' weights and the data", low=0, lt=SEED_LIMIT)
    # The rounds' balanced order is drawn afresh per run; trials.csv's `order_seed` replays it.
    order_seed: Optional[int] = setting(None, "seed of the rounds' balanced random order; null: "
                                              "fresh entropy per run (recorded in trials.csv)",
                                         low=0, lt=ORDER_SEED_LIMIT, **RUN_LEVEL)
    find_largest_batch: bool = setting(False, "search the largest micro-batch that fits in "
                                              "device memory at the baseline's precision "
                                              "(CUDA; capacity.csv)", **RUN_LEVEL)
    largest_batch_s: float = setting(60.0, "time limit of that search, per model", **SECONDS,
                                     **RUN_LEVEL)
    peak_s: float = setting(1.5, "seconds the matmul peak (the denominator of % of peak) may take "
                                 "per dtype and layout, once per run; 0: not measured, "
                                 "peak_tflops empty", low=0, high=SECONDS_LIMIT, **RUN_LEVEL)
    # measure/explain.py: untimed profiled steps, never inside a timed window; each draws on the
    # run's time budget and is skipped, with the reason, when nothing is left of it.
    explain: bool = setting(True, "explained verdicts: after the rounds, a few untimed "
                                  "profiled steps of the baseline and of each variant split "
                                  "each step-time change by operator category (explain.csv); "
                                  "before them, each technique's forecast of the most it could "
                                  "gain, from one profiled baseline step (forecast.csv); "
                                  "false: neither", **RUN_LEVEL)
    skip_by_forecast: bool = setting(False, "a variant whose forecast (the most its technique "
                                            "could gain here, from the baseline's profiled "
                                            "steps) lies under bench.noise_threshold is not "
                                            "measured, with the reason and the time spared; "
                                            "needs bench.explain; the tips suite sets it",
                                     **RUN_LEVEL)


@dataclass
class OptimizerConfig:
    """The optimizer technique adds its key here (optimizer.impl: see Schema)."""


@dataclass
class SuiteConfig:
    # A suite (the `tips` experiment) runs experiments one after another into one run
    # directory and one report.
    experiments: list[str] = setting(doc="experiments this suite runs; \"*\": every file in "
                                         "configs/experiment/ that is not a suite; empty: no suite",
                                     factory=list)
    exclude: list[str] = setting(doc="experiments left out of \"*\"", factory=list)


@dataclass
class RecipeConfig:
    # `+experiment=recipe` (search/): each candidate group is {naive: overrides of the
    # articles' before-code, options: {name: overrides}, trades_memory: bool}.
    candidates: dict[str, Any] = setting(doc="the recipe search's candidate groups; empty: no "
                                             "search", factory=dict)
    budget_s: Optional[float] = setting(780.0, "the search's time budget per model; it stops "
                                               "cleanly when it is spent", **SECONDS,
                                        null="for no budget")
    step_budget_s: Optional[float] = setting(120.0, "the most one measurement of the search (a "
                                                    "screen, a confirmation, the closing) may "
                                                    "take; half the search's time left where "
                                                    "that is less", **SECONDS,
                                             null="for no cap but the search's")
    max_memory_mb: Optional[float] = setting(None, "memory limit: techniques that trade speed for "
                                                    "memory are candidates only under one", gt=0,
                                             null="for no limit")
    min_gain: Optional[float] = setting(None, "smallest gain the search adds; null: "
                                              "bench.noise_threshold", low=0, lt=1,
                                        note="0.05 = 5 %", null="for bench.noise_threshold")
    screen_rounds: int = setting(3, "paired rounds in which each step screens every option",
                                 low=1, high=10_000)
    confirm_top: int = setting(2, "the best options of a screen measured again, afresh, to "
                                  "decide", low=1, high=100)
    skip: list[str] = setting(doc="candidate groups left out of the search (the experiment's "
                                  "defaults; replacing the list lets them in)", factory=list)
    also_skip: list[str] = setting(doc="more candidate groups left out, on top of recipe.skip",
                                   factory=list)
    check_findings: bool = setting(True, "a profiled run measures each finding's suggested knob "
                                         "before the report recommends it")
    # search/forecasts.py: profiled afresh at every step (a bound from the naive step would
    # understate what an option can gain once the search has made the step shorter).
    forecasts: bool = setting(True, "before each screen, profile the current recipe (untimed) "
                                    "and set aside for that step every option whose forecast "
                                    "(Technique.bound) lies under recipe.min_gain, with the "
                                    "reason; needs bench.explain; false: screen every option")


@dataclass
class TargetConfig:
    # Time to target (measure/to_target.py): after the speed rounds, each variant trains from
    # `seeds` paired seeds until the held-out loss reaches the target, or a cap runs out.
    enabled: bool = setting(False, "after the speed rounds, train every variant to a target "
                                   "held-out loss and compare the wall times (to_target.csv)")
    # 5: with the transformer's run-to-run noise on a quiet CPU a true 1.3x is found in 97 % of
    # runs, 37 % with 3 (benchmarks/to_target_sim.py, benchmarks/README.md)
    seeds: int = setting(5, "paired seeds per variant (the same weights and data order for "
                            "every variant); the speed-up's CI comes from them", low=2, high=100)
    loss: Optional[float] = setting(None, "the target held-out loss; null: the data's entropy "
                                          "floor + margin (the synthetic tokens), else the worst "
                                          "baseline seed's loss after `steps` steps")
    margin: float = setting(0.15, "nats above the entropy floor that count as trained", gt=0,
                            note="nats")
    steps: int = setting(200, "baseline optimizer steps after which the baseline's seeds set the "
                              "target, where the data has no known floor", low=1,
                         high=STEPS_LIMIT)
    max_steps: int = setting(1000, "cap per run, in samples: this many of the baseline's "
                                   "optimizer steps; a variant not there by then missed",
                             low=1, high=STEPS_LIMIT)
    max_s: Optional[float] = setting(120.0, "cap per run on training time (s); null: none",
                                     **SECONDS, null="for no cap")
    eval_every: int = setting(10, "evaluate the held-out loss every this many baseline steps' "
                                  "worth of samples (untimed)", low=1, high=STEPS_LIMIT)
    eval_samples: int = setting(256, "held-out samples the loss is evaluated on", low=1,
                                high=10_000)


def check_target(cfg: DictConfig) -> None:
    """What the `target` group's declared bounds cannot say (check_declared has the rest)."""
    t = cfg.target
    if t.loss is not None and not math.isfinite(t.loss):
        raise ConfigError(f"target.loss: {t.loss} is out of range; it must be a finite loss, or "
                          "null for the automatic target")


@dataclass
class SpeedbenchConfig:
    device: str = setting("auto", "where to train; auto: CUDA, then MPS, else the CPU",
                          values="|".join(DEVICES))
    scale: str = setting("auto", "model and batch sizes; auto: full on CUDA, else small",
                         values="|".join(SCALES))
    # (A list default could not be overridden with a `_target_` mapping on the command line.)
    model: Any = setting(None, "a model name from `models`, a list of them, or a config with "
                               "`_target_`; null: the three reference models",
                         values="|".join(REFERENCE_MODELS) + "|[a,b]|{_target_: ...}")
    models: dict[str, Any] = setting(doc="the models by name (configs/models/)", factory=dict)
    batch_size: Optional[int] = setting(None, "samples per micro-batch per process; null: the "
                                              "model's, per scale", low=1, high=65_536)
    lr: float = setting(1e-3, "AdamW's learning rate", gt=0)
    # Profiling runs in extra windows after the timed one, so throughput stays unprofiled.
    profile: str = setting("off", "simple: phase table; advanced: + cProfile per phase; pytorch: "
                                  "+ torch.profiler trace", choices=PROFILES)
    dist_timeout_s: float = setting(300.0, "a rank waiting this long on its peers fails the run, "
                                           "no hang", **SECONDS)
    # The techniques' keys (precision, accumulate, sync, parallel, data.num_workers, ...) are
    # declared in their modules under speedbench/techniques/ and added by `Schema` below.
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    variants: dict[str, Any] = setting(doc="set by experiment files: variant name -> overrides of "
                                           "the recipe", factory=dict)
    baseline: Optional[str] = setting(None, "the variant the others are compared with; null: the "
                                            "first")
    claims: list[Any] = setting(doc="set by experiment files: the articles' claims this "
                                    "experiment checks", factory=list)
    suite: SuiteConfig = field(default_factory=SuiteConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    out_dir: str = setting("results", "where runs go")
    run_dir: Optional[str] = setting(None, "this run's directory; null: "
                                           "`<out_dir>/<experiment>/<timestamp>`")
    experiment: Optional[str] = setting(None, "filled from +experiment=NAME")


def config_dir() -> str:
    """The Hydra configs: inside the package when installed from a wheel, else the checkout's
    top-level configs/ (editable install or PYTHONPATH=src)."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]  # the speedbench package
    for candidate in (here / "configs", here.parents[1] / "configs"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"speedbench's configs/ were not found next to {here}")


def config_flags(args: list[str]) -> list[str]:
    """Where the configs came from, as given (`--config-dir=conf`, `hydra.searchpath=[...]`):
    the commands speedbench prints put them back, so that they repeat the run."""
    from hydra._internal.utils import get_args_parser

    try:
        parsed = get_args_parser().parse_args(args)
    except (Exception, SystemExit):
        return []
    flags = [f"--{flag.replace('_', '-')}={getattr(parsed, flag)}"
             for flag in ("config_path", "config_dir", "config_name") if getattr(parsed, flag)]
    return flags + [o for o in parsed.overrides if o.startswith("hydra.searchpath=")]


def _with_fields(base: type, name: str, fields: list, prefix: str = "") -> type:
    """`base` extended by the technique fields under `prefix`: a dataclass OmegaConf validates.
    A grouped key (`data.num_workers`) extends the group's own dataclass the same way. Every
    class made is a global of this module, under its name, so that recipes pickle."""
    hints = typing.get_type_hints(base)
    own = [f for f in fields if "." not in f.key[len(prefix):]]
    spec: list = [(f.key[len(prefix):], f.schema_type, field(default=f.default)) for f in own]
    groups = dict.fromkeys(f.key[len(prefix):].split(".")[0] for f in fields if f not in own)
    for group in groups:
        if group not in hints:
            raise TypeError(f"technique key group '{prefix}{group}' is not in the schema")
        inner = _with_fields(hints[group], f"{name}_{group}",
                             [f for f in fields if f.key.startswith(f"{prefix}{group}.")],
                             prefix=f"{prefix}{group}.")
        spec.append((group, inner, field(default_factory=inner)))
    cls = dataclasses.make_dataclass(name, spec, bases=(base,))
    cls.__module__, cls.__qualname__ = __name__, name
    globals()[name] = cls
    return cls


# The full schema: SpeedbenchConfig plus every technique's keys (Schema_data: DataConfig plus
# the loader's). Hydra's `speedbench_schema` is this class.
Schema = _with_fields(SpeedbenchConfig, "Schema", techniques.fields())


def register_schema() -> None:
    ConfigStore.instance().store(name="speedbench_schema", node=Schema)
    # the techniques' resolvers: machine-dependent variants, e.g. ${speedbench.worker_variants:...}
    for name, fn in techniques.resolvers().items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


@dataclass
class ModelSpec:
    """One model to train: how to build it and the data it eats, resolved for one scale."""

    name: str
    target: dict  # `_target_` plus constructor kwargs, for hydra.utils.instantiate
    dataset: dict  # kind, image_size/num_classes or seq_len/vocab_size
    loss: str
    batch_size: int
    inputs: Optional[list] = None  # forward's keyword names for x (and y): model(**batch)


@dataclass
class Plan:
    experiment: str
    device: str  # resolved: cpu, cuda:0, mps
    scale: str  # resolved: small or full
    models: list[ModelSpec]
    variants: dict[str, DictConfig]  # name -> merged recipe, baseline first
    baseline: str
    config: DictConfig = MISSING


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
    _choice("scale", scale, SCALES)
    if scale == "auto":
        # GPU-sized work only on CUDA; CPUs and laptop MPS get the small defaults.
        return "full" if device.startswith("cuda") else "small"
    return scale


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: '{value}' is not allowed; choose one of "
                          f"{', '.join(map(str, allowed))}")


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
            _choice(where + f.name, value, f.metadata["choices"])
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
            raise ConfigError(f"variants.{name}.{key}: {_first_line(exc)}") from None
    return recipe


def _sets(key: str, value: Any, dotted: str) -> bool:
    """Whether the override `key: value` (nested mappings or dotted keys) sets `dotted`."""
    if key == dotted:
        return True
    if not dotted.startswith(key + ".") or not isinstance(value, (dict, DictConfig)):
        return False
    rest = dotted[len(key) + 1:]
    return any(_sets(k, v, rest) for k, v in value.items())


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


def resolve_model(name: str, raw: Any, registry: DictConfig, scale: str,
                  batch_size: Optional[int], data: Optional[dict] = None) -> ModelSpec:
    """Turn a model name or a model config into a ModelSpec for one scale.

    A model config holds `_target_` (or a model by name: `timm`, `torchvision`, `hf`) and the
    constructor's kwargs, plus speedbench's keys (MODEL_KEYS): `dataset` (what data it eats;
    `data`, the run's data._target_, replaces it), `loss` (`cross_entropy` on logits, `mse`,
    or `module` when forward(x, y) returns the loss), `inputs` (forward's keyword names for x
    and y), `model_name`, `batch_size`; `kwargs` (the constructor's own, where a name is also
    one of speedbench's keys), and `small:`/`full:` blocks merged on top per scale.
    """
    name, node = _model_node(name, raw, registry)
    node = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    per_scale = {s: node.pop(s, None) for s in ("small", "full")}
    if per_scale[scale] is not None:
        node = OmegaConf.merge(node, per_scale[scale])
    try:
        spec = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"model {name}: {_first_line(exc)}") from None
    own = spec.pop("dataset", None)
    dataset = check_dataset(str(spec.get("model_name") or name), data or own or {})
    spec = by_name(name, spec, dataset)
    given = [k for k in MODEL_KEYS if k in spec]
    loss = spec.pop("loss", "mse" if dataset.get("task") == "regression" else "cross_entropy")
    default_batch = spec.pop("batch_size", 32)
    name = str(spec.pop("model_name", None) or name)
    inputs = _inputs(name, spec.pop("inputs", None), loss)
    _choice(f"model {name}: loss", loss, LOSSES)
    target = check_importable(name, spec["_target_"])
    spec = constructor_args(name, spec, target, given)
    return ModelSpec(name=name, target=spec, dataset=dataset, loss=loss,
                     batch_size=batch_size or default_batch, inputs=inputs)


def _model_node(name: str, raw: Any, registry: DictConfig) -> tuple[str, Any]:
    """(name, config node) of a model given by its name in `models`, or inline."""
    if isinstance(raw, str):
        if raw not in registry:
            raise ConfigError(f"model: '{raw}' is not a known model; choose from "
                              f"{', '.join(registry.keys())}, a list of them, or a config with "
                              "_target_ (or timm, torchvision, hf)")
        return raw, registry[raw]
    if is_inline(raw):
        return name, OmegaConf.create(raw) if isinstance(raw, dict) else raw
    raise ConfigError(f"model: {raw!r} is neither a model name ({', '.join(registry.keys())}) "
                      "nor a config with _target_ (or timm, torchvision, hf)")


def is_inline(raw: Any) -> bool:
    """Whether a `model` entry is a model config (a mapping with _target_ or a model by name)."""
    return isinstance(raw, (dict, DictConfig)) and any(k in raw for k in ("_target_", *BY_NAME))


NEEDS = {"images": ("image_size",), "tokens": ("seq_len", "vocab_size"),
         "tabular": ("features",)}
TASK_NEEDS = {"regression": ("targets",), "next_token": (), "masked_lm": ()}


def check_dataset(name: str, dataset: Any) -> dict:
    """A model's `dataset`, checked, with its `task` filled in: a kind (DATASET_KINDS), a task
    of that kind (TASKS) and the sizes both need; or a user's own (`_target_`), as it is."""
    if not isinstance(dataset, dict):
        raise ConfigError(f"model {name}: dataset: {dataset!r}; give a mapping: {{kind: "
                          f"images|tokens|tabular, ...}} or {{_target_: module.Dataset, ...}}")
    if "_target_" in dataset:
        return dataset
    kind = dataset.get("kind")
    _choice(f"model {name}: dataset.kind", kind, DATASET_KINDS)
    default = "regression" if "targets" in dataset and kind != "tokens" else TASKS[kind][0]
    if kind == "tokens" and "num_classes" in dataset:
        default = "sequence_classification"
    task = dataset.get("task") or default
    _choice(f"model {name}: dataset.task", task, TASKS[kind])
    for key in NEEDS[kind] + TASK_NEEDS.get(task, ("num_classes",)):
        value = dataset.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"model {name}: dataset.{key}: {value!r}; {kind} for task {task} "
                              f"needs {key}, a positive integer (it needs "
                              f"{', '.join(NEEDS[kind] + TASK_NEEDS.get(task, ('num_classes',)))})")
    if kind == "images":
        _choice(f"model {name}: dataset.channels", dataset.get("channels", 3), (1, 3))
    return {**dataset, "task": task}


def by_name(name: str, spec: dict, dataset: dict) -> dict:
    """A model by name (`timm: resnet18`, `torchvision: mobilenet_v3_small`, `hf:
    BertForSequenceClassification`) as the `_target_` of its builder (models/by_name.py), the
    name given positionally; what its dataset says filled in where not given: num_classes
    (and timm's in_chans) for pictures, the Hugging Face config's vocab_size and num_labels
    and forward's `inputs`."""
    keys = [k for k in BY_NAME if k in spec]
    if not keys:
        return spec
    if len(keys) > 1 or "_target_" in spec:
        raise ConfigError(f"model {name}: give one of _target_, {', '.join(BY_NAME)}; it has "
                          f"{', '.join(k for k in ('_target_', *BY_NAME) if k in spec)}")
    key = keys[0]
    model = spec.pop(key)
    if not isinstance(model, str):
        raise ConfigError(f"model {name}: {key}: {model!r}; give the model's name, e.g. "
                          f"{key}: {BY_NAME_EXAMPLE[key]}")
    out = {"_target_": BY_NAME[key], "_args_": [model], **spec}
    task, kind = dataset.get("task"), dataset.get("kind")
    classes = dataset.get("targets") if task == "regression" else dataset.get("num_classes")
    if key == "hf":
        config = dict(out.get("config") or {})
        if kind == "tokens":
            config.setdefault("vocab_size", dataset["vocab_size"])
        if classes and task not in ("next_token", "masked_lm"):
            config.setdefault("num_labels", classes)
        out["config"] = config
        out.setdefault("inputs", ["pixel_values"] if kind == "images" else ["input_ids"])
    elif kind in ("images", "tabular") and classes:
        out.setdefault("num_classes", classes)
        if key == "timm" and kind == "images":
            out.setdefault("in_chans", dataset.get("channels", 3))
    return out


BY_NAME_EXAMPLE = {"timm": "resnet18", "torchvision": "mobilenet_v3_small",
                   "hf": "BertForSequenceClassification"}
MODEL_KEY_MEANING = {"dataset": "the data it eats", "loss": "how its loss is taken",
                     "inputs": "forward's keyword names", "model_name": "its name in the tables",
                     "batch_size": "samples per micro-batch"}


def constructor_args(name: str, spec: dict, target: Any, given: list[str]) -> dict:
    """The `_target_`'s arguments: the model config's other keys and `kwargs`. A key of
    speedbench's (MODEL_KEYS) that is also a keyword of the target is refused unless `kwargs`
    is given (the target's then go there): no reserved key swallows a user's argument."""
    kwargs = spec.pop("kwargs", None)
    where = spec["_target_"]
    if kwargs is None:
        clash = [k for k in given if k in keyword_names(target)]
        if clash:
            key = clash[0]
            raise ConfigError(f"model {name}: {key} is speedbench's key ({MODEL_KEY_MEANING[key]}) "
                              f"and also an argument of {where}; give {where}'s under kwargs: "
                              f"{{{key}: ...}}, speedbench's beside it")
        return spec
    if not isinstance(kwargs, dict):
        raise ConfigError(f"model {name}: kwargs: {kwargs!r}; give a mapping of {where}'s "
                          "keyword arguments")
    twice = [k for k in kwargs if k in spec]
    if twice:
        raise ConfigError(f"model {name}: {twice[0]} is given twice, in kwargs and beside it; "
                          "keep one")
    return {**spec, **kwargs}


def keyword_names(target: Any) -> set[str]:
    """The names a callable takes as keywords (none where its signature cannot be read)."""
    import inspect

    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _inputs(name: str, inputs: Any, loss: str) -> Optional[list]:
    """`inputs`: the keyword names forward takes x (and, with loss: module, y) under."""
    if inputs is None:
        return None
    want = 2 if loss == "module" else 1
    if not (isinstance(inputs, list) and len(inputs) == want
            and all(isinstance(n, str) for n in inputs)):
        example = "[input_ids, labels]" if want == 2 else "[pixel_values]"
        raise ConfigError(f"model {name}: inputs: {inputs!r}; with loss: {loss} give {want} "
                          f"keyword name{'s' * (want > 1)} of forward, e.g. inputs: {example}")
    return inputs


def check_importable(name: str, target: str) -> Any:
    """Import a `_target_`'s module now, so that a missing one stops the run before any trial;
    returns the callable it names."""
    import importlib

    parts = str(target).split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:
            if exc.name != module or i == 1:
                raise ConfigError(f"model {name}: _target_ {target}: no module named "
                                  f"'{exc.name}'{_import_fix(exc.name)}") from None
        except Exception as exc:
            raise ConfigError(f"model {name}: _target_ {target}: importing {module} failed: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
    else:
        raise ConfigError(f"model {name}: _target_ {target}: give module.callable, "
                          f"e.g. mynet.build")
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            raise ConfigError(f"model {name}: _target_ {target}: {obj.__name__} has no {attr}")
        obj = getattr(obj, attr)
    return obj


def _import_fix(module: str) -> str:
    from pathlib import Path

    top = module.split(".")[0]
    if Path(f"{top}.py").is_file() or Path(top).is_dir():
        return ""
    return (f" (run speedbench from the folder that holds {top}.py, or add that folder to "
            f"PYTHONPATH; an installed package: pip install it)")


def inline_name(raw: Any) -> str:
    """An inline model's name: its `model_name`, else its name (`timm: resnet18`), else the
    last part of its `_target_`."""
    named = [raw[k] for k in BY_NAME if k in raw]
    return str(raw.get("model_name") or (named[0] if named else "")
               or str(raw.get("_target_")).rsplit(".", 1)[-1])


def _model_entries(model: Any) -> list:
    if model is None:
        return list(REFERENCE_MODELS)
    if isinstance(model, (list, ListConfig)):
        entries = list(model)
        if not entries:
            raise ConfigError("model: the list is empty; name at least one of "
                              + ", ".join(REFERENCE_MODELS))
        return entries
    return [model]


# Free-form nodes: their keys are names (models, variants) or claim fields, not schema keys.
FREE_FORM = ("model", "models", "variants", "claims", "recipe.candidates", "data.kwargs")


def check_known_keys(cfg: DictConfig, schema: Optional[DictConfig] = None, prefix: str = "") -> None:
    """Reject keys the schema does not know, including ones added with `+key=value`."""
    schema = schema if schema is not None else OmegaConf.structured(Schema)
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema:
            allowed = ", ".join(str(k) for k in schema.keys())
            raise ConfigError(f"{full}: unknown key; known keys{' under ' + prefix[:-1] if prefix else ''}: "
                              f"{allowed}")
        if full in FREE_FORM:
            continue
        node, spec = cfg._get_node(key), schema._get_node(key)
        if isinstance(node, DictConfig) and isinstance(spec, DictConfig):
            check_known_keys(node, spec, prefix=f"{full}.")


def build_plan(cfg: DictConfig, experiment: Optional[str]) -> Plan:
    """Validate everything and expand the config into what will run. Raises ConfigError."""
    check_known_keys(cfg)
    device = resolve_device(cfg.device)
    scale = resolve_scale(cfg.scale, device)
    base = cfg.copy()
    check_recipe(base)
    check_target(cfg)

    entries = _model_entries(cfg.model)
    models = []
    data = own_data(cfg)
    for raw in entries:
        name = inline_name(raw) if is_inline(raw) else raw
        models.append(resolve_model(name, raw, cfg.models, scale, cfg.batch_size, data))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError(f"model: {names} names a model twice (an inline model's name is its "
                          f"model_name, else its _target_'s last part)")

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
            _check_path_fits(spec, cfg.data.path)
    plan = Plan(experiment=experiment or "default", device=device, scale=scale, models=models,
                variants=variants, baseline=baseline, config=cfg)
    check_plan(plan, distributed.from_environ())
    return plan


# A synthetic data set's sizes: each a positive integer where the model's dataset gives it
# (vocab_size=0 would fail while the data is made, after the run directory exists).
DATASET_SIZES = ("image_size", "num_classes", "seq_len", "vocab_size")


def check_dataset_sizes(spec: "ModelSpec") -> None:
    for key in DATASET_SIZES:
        if key in spec.dataset:
            value = spec.dataset[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"model {spec.name}: dataset.{key}: {value!r} is out of "
                                  f"range; it must be an integer >= 1")


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


def micro_batch(recipe, spec: ModelSpec) -> int:
    """Samples per micro-batch (the techniques may cut the batch, e.g. accumulation's split)."""
    return techniques.micro_batching(recipe.batch_size or spec.batch_size, recipe)[0]


def own_data(cfg: DictConfig) -> Optional[dict]:
    """The run's data._target_ and its kwargs, as a model's `dataset`; None without one."""
    if cfg.data._target_ is None:
        if cfg.data.kwargs:
            raise ConfigError("data.kwargs: given without data._target_; name the callable "
                              "they are for (data._target_=module.name)")
        return None
    return {"_target_": cfg.data._target_, **OmegaConf.to_container(cfg.data.kwargs)}


def _check_path_fits(spec: ModelSpec, path: str) -> None:
    from pathlib import Path

    p = Path(path).expanduser()
    kind = spec.dataset.get("kind")
    if kind not in ("images", "tokens"):
        what = "its own data set (_target_)" if kind is None else f"{kind} data, made up"
        raise ConfigError(f"data.path: model {spec.name} eats {what}; data.path takes an "
                          "ImageFolder directory (images) or a text file (tokens)")
    want_dir = kind == "images"
    if want_dir != p.is_dir():
        need = "an ImageFolder directory" if want_dir else "a text file"
        raise ConfigError(f"data.path: model {spec.name} eats {spec.dataset['kind']}, so data.path "
                          f"must be {need}; '{path}' is not")
