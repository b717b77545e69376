"""The typed config schema, registered in Hydra's ConfigStore: every run key declared once with
`setting()` (its default, doc, choices and range), the dataclasses that group them, and `Schema`,
SpeedbenchConfig plus every technique's keys (speedbench.techniques). Also where the Hydra
configs live (`config_dir`) and how a command line named them (`config_flags`).
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from speedbench import techniques
from speedbench.errors import ConfigError
from speedbench.results import fresh_dir
from speedbench.results.schema import FORECAST_STEPS
from speedbench.techniques.base import Bounds

SCALES = ("auto", "small", "full")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
PROFILES = ("off", "simple", "advanced", "pytorch")
REFERENCE_MODELS = ("resnet", "vae", "transformer")


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
    threads: Optional[str] = setting(None, "torch's threads for the whole run, decided once "
                                           "at the start: auto fits the cores other processes "
                                           "leave free; N sets N; null keeps torch's default "
                                           "where it fits, and else sets the count that fits "
                                           "(other processes' load, or fewer threads running "
                                           "a matrix product faster) and says so in one line",
                                     values="auto|N",
                                     per_variant=False)
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
    # studies/stopping.py: a one-sided test at the probe's 3rd and 6th steady steps, spending a
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
                                 "per dtype and layout, once per run, all of them within 5 % "
                                 "of bench.time_budget_s; 0: not measured, peak_tflops empty",
                            low=0, high=SECONDS_LIMIT, **RUN_LEVEL)
    # measure/explain.py: untimed profiled steps, never inside a timed window; each draws on the
    # run's time budget and is skipped, with the reason, when nothing is left of it.
    explain: bool = setting(True, "explained verdicts: after the rounds, a few untimed "
                                  "profiled steps of the baseline and of each variant split "
                                  "each step-time change by operator category (explain.csv); "
                                  "before them, each technique's forecast of the most it could "
                                  f"gain, from {FORECAST_STEPS} profiled baseline steps "
                                  "(forecast.csv); "
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
    # Time to target (studies/to_target.py): after the speed rounds, each variant trains from
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
    # config/arms.py, studies/arms.py: a paired A/B of Python environments (docs/outputs.md)
    arms: dict[str, Any] = setting(doc="Python environments to compare, paired in every round: "
                                       "name -> {python: interpreter path (this one where omitted), "
                                       "env: {NAME: value}}; every variant runs under every "
                                       "arm; {}: this process",
                                   values="{a: {python: PATH, env: {}}, b: ...}",
                                   factory=dict)
    claims: list[Any] = setting(doc="set by experiment files: the articles' claims this "
                                    "experiment checks", factory=list)
    suite: SuiteConfig = field(default_factory=SuiteConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    out_dir: str = setting("results", "where runs go")
    run_dir: Optional[str] = setting(None, "this run's directory; null: "
                                           "`<out_dir>/<experiment>/<timestamp>`")
    experiment: Optional[str] = setting(None, "filled from +experiment=NAME")
    label: Optional[str] = setting(None, "your name for this run: `speedbench runs` lists it "
                                         "and `python -m speedbench.report` takes it for the "
                                         "run's folder", values="TEXT")


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


# What torchrun sets in each of its workers besides TORCHELASTIC_RUN_ID: with them all, the run
# id names one job; without, it is a value left in the shell from another.
TORCHRUN_WORKER = ("TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK", "RANK", "WORLD_SIZE")


_SWEEPS: dict = {}  # (when, out_dir) -> the sweep folder this process made


def sweep_id(when: str, out_dir: str = "") -> str:
    """The name of a sweep's folder (`${speedbench.sweep_id:${now:...},${out_dir}}` in
    config.yaml): torchrun's run id in its workers (the same on every rank, whose clocks may
    differ), else `when`, the time, as a folder made new under out_dir's multirun/ (`when-1`
    where another sweep started in the same second has `when`): two sweeps started together,
    or from a shell with a stale TORCHELASTIC_RUN_ID, do not share (and overwrite) one folder.
    Made once per process: Hydra resolves the folder again for each job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and all(os.environ.get(k) for k in TORCHRUN_WORKER):
        return run_id
    if not out_dir:
        return when
    key = (when, os.path.abspath(out_dir))
    if key not in _SWEEPS:
        try:
            _SWEEPS[key] = fresh_dir(Path(key[1]) / "multirun", stamp=when).name
        except (OSError, ConfigError):  # out_dir unwritable: Hydra's mkdir then says so
            _SWEEPS[key] = when
    return _SWEEPS[key]


def register_schema() -> None:
    ConfigStore.instance().store(name="speedbench_schema", node=Schema)
    if not OmegaConf.has_resolver("speedbench.sweep_id"):
        OmegaConf.register_new_resolver("speedbench.sweep_id", sweep_id, use_cache=True)
    # the techniques' resolvers: machine-dependent variants, e.g. ${speedbench.worker_variants:...}
    for name, fn in techniques.resolvers().items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
