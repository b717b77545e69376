"""The technique plug-in interface: one `Technique` subclass per module of this package.

A technique is everything speedbench knows about one speed-up knob: the recipe keys it owns
(typed, with defaults and choices), when it cannot act here (`n/a: <reason>`), how it acts (on
global state, the model, the loader, the batch copies, around the forward pass, on the optimizer,
after the step), the columns it adds to trials.csv, its diagnosis rule, a method card and the
code a user changes in their own loop to use it (its snippets).
Every hook has a no-op default, so a technique implements only what it needs.

Who calls what, in this order (each hook is called in registry order: see `Technique.after`):

  config              fields -> the Hydra schema; resolvers() -> OmegaConf's resolvers
  config.build_plan   validate(); check(); normalise(); check_plan()
  run (start)         metadata()         card, fields, columns, snippets -> techniques.json
  studies (prepare)   not_applicable()   asked once per model before the rounds; the first
                                         reason makes the variant's row `n/a: <reason>`
                      processes()        a number: the trial runs under torchrun (launch.py)
                      environment()      variables a fresh process must start with: the trial
                                         runs in one of its own (an arm: studies/arms.py), or
                                         under torchrun with them (launch.py)
  measure.session     global_state()     entered for the whole trial, restored on exit
  (applied(): trial,  not_applicable()   asked again, of the trial's own fresh model
  quality probe,      micro_batching()   micro-batch size and micro-batches per optimizer step
  capacity probe)     replicas()         devices one process drives (the loader's batch)
                      loader_options()   DataLoader kwargs
                      prepare_model()    the model, once, on its device; `parallel` wraps it
                                         after the techniques that change the bare model
  measure.capacity    capacity_overrides()  keys reset while the largest batch is searched
  measure.flops       matmul_dtype()     the dtype the step's matmuls run in (the FLOP peak)
  measure.quality     one_time_steps()   steps of a fresh model with one-time costs (compile)
  Trainer (per step)  copy_options()     kwargs of tensor.to(device, ...) for every batch
                      step_context()     entered around each forward pass
                      forward_only()     True: each step is an evaluation pass (model.eval(),
                                         forward and loss only, no backward, no optimizer step)
                      grad_scaler(), loss_meter(), optimizer_options(), zero_grad_options():
                                         once, at construction
                      after_step()       after each optimizer step
  trial (record)      columns()          the technique's columns of the trials.csv row
  profile window      profile_counters() entered around a profiled trial's phase window
  diagnosis           diagnose()         findings from a profiled trial (profile != off)
  measure.explain     bound()            the most a variant could gain, from the baseline's
                                         profile (before the rounds): the forecast

Config typing: a choice is declared as `typing.Literal[...]` on its Field. OmegaConf's
structured configs support Enum but not Literal, and Enum values would reach trials.csv and the
saved config.yaml as Enum objects; so the schema gives OmegaConf the Literal's base type (str)
and `validate()` checks membership from the Literal itself, with the project's one-line message
("precision: 'fp8' is not allowed; choose one of fp32, fp16, bf16"). Types (int, bool, float,
Optional) are checked by OmegaConf; the range (`Bounds`) by `validate()`.

This module imports only torch, the standard library and speedbench.errors.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch


from speedbench.analysis.numbers import ratio_text
from speedbench.errors import ConfigError  # noqa: F401  (re-exported for technique modules)


# A `snippets` value that stands for any value but the key's default.
ANY = "*"


# --- typed recipe keys -----------------------------------------------------------------------------
_ORDER = (("low", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
          ("lt", "<", lambda v, b: v < b), ("high", "at most", lambda v, b: v <= b))


def _number(x: Any) -> str:
    """1000000.0 -> 1,000,000; 0.5 -> 0.5."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Bounds:
    """A numeric key's allowed range: low <= v, gt < v, v < lt, v <= high (None: no bound).
    NaN fails every bound (each comparison with it is False), inf every upper one. `note` says
    what a value means ("0.05 = 5 %"); `null` what null does where the key is Optional ("to
    turn it off"). One range vocabulary, one check and one message for the run's keys
    (config.setting) and the techniques' (Field)."""

    low: Any = None
    gt: Any = None
    lt: Any = None
    high: Any = None
    note: str = ""
    null: str = ""

    def holds(self, value: Any) -> bool:
        return all(ok(value, getattr(self, name)) for name, _, ok in _ORDER
                   if getattr(self, name) is not None)

    def check(self, key: str, value: Any) -> None:
        """Raise ConfigError, one line naming the key and the range, for a number outside it."""
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or self.holds(value):
            return
        raise ConfigError(f"{key}: {value} is out of range; it must be "
                          f"{self.text(isinstance(value, int))}")

    def text(self, integer: bool) -> str:
        """`an integer >= 1 and at most 10,000`, `> 0 and < 1 (0.05 = 5 %), or null to ...`."""
        parts = self._parts()
        if not integer and self.high is not None:
            parts[-1] = f"finite and {parts[-1]}"
        text = ("an integer " if integer and parts else "") + " and ".join(parts)
        return text + (f" ({self.note})" if self.note else "") + \
            (f", or null {self.null}" if self.null else "")

    def short(self) -> str:
        """The range as the docs' values column shows it: `>= 1, at most 10,000`."""
        return ", ".join(self._parts())

    def _parts(self) -> list[str]:
        return [f"{word} {_number(getattr(self, name))}" for name, word, _ in _ORDER
                if getattr(self, name) is not None]

    def bad_values(self) -> list:
        """Values `check` must reject, one per bound."""
        bad = [None if self.low is None else self.low - 1, self.gt, self.lt,
               None if self.high is None else self.high + 1]
        return [b for b in bad if b is not None]


@dataclass(frozen=True)
class Field:
    """One recipe key a technique owns.

    key: flat (`precision`) or grouped (`data.num_workers`; the group must exist in the schema).
    type: int, float, bool, str, Optional[...] or Literal[...] (choices, validated here).
    low, gt, lt, high: its range (Bounds); None passes every bound.
    doc: one line, shown in the generated docs and `--help`.
    column: its trials.csv column; "" (the default): the key with `.` -> `_`
    (`optimizer.impl` -> `optimizer_impl`); None: not recorded.
    """

    key: str
    type: Any
    default: Any
    doc: str = ""
    low: Optional[int] = None
    column: Optional[str] = ""
    gt: Any = None
    lt: Any = None
    high: Any = None

    @property
    def column_name(self) -> Optional[str]:
        if self.column is None:
            return None
        return self.column or self.key.replace(".", "_")

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.low, self.gt, self.lt, self.high)

    @property
    def choices(self) -> Optional[tuple]:
        t = _strip_optional(self.type)
        return typing.get_args(t) if typing.get_origin(t) is typing.Literal else None

    @property
    def schema_type(self) -> Any:
        """The type OmegaConf is given: a Literal becomes its values' type (str)."""
        t, optional = _strip_optional(self.type), _is_optional(self.type)
        if typing.get_origin(t) is typing.Literal:
            t = type(typing.get_args(t)[0])
        return Optional[t] if optional else t

    def validate(self, value: Any, where: str = "") -> None:
        """Raise ConfigError (one line naming the key and what is allowed) for a bad value."""
        key = where + self.key
        if value is None:
            if _is_optional(self.type):
                return
            raise ConfigError(f"{key}: null is not allowed")
        choices = self.choices
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: '{value}' is not allowed; choose one of "
                              f"{', '.join(str(c) for c in choices)}")
        self.bounds.check(key, value)

    def bad_values(self) -> list:
        """Values `validate` must reject (the generic registry tests use them)."""
        return (["not-a-choice"] if self.choices is not None else []) + self.bounds.bad_values()


def _is_optional(t: Any) -> bool:
    return typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)


def _strip_optional(t: Any) -> Any:
    if _is_optional(t):
        rest = [a for a in typing.get_args(t) if a is not type(None)]
        return rest[0]
    return t


def get_key(recipe: Any, key: str) -> Any:
    """recipe's value at a dotted key (`data.num_workers`), for a DictConfig, dict or object."""
    node = recipe
    for part in key.split("."):
        node = node[part] if isinstance(node, typing.Mapping) else getattr(node, part)
    return node


# --- what a trial knows when it asks a technique ----------------------------------------------------
@dataclass(frozen=True)
class ActsOn:
    """Where a technique's `example` changes a trial: the reference model and the device its
    generic test trains on (Composer's per-algorithm test settings, kept with the technique)."""
    model: str = "transformer"
    device: str = "cpu"  # "cuda": it cannot act on a CPU (`why` says why); its test needs CUDA
    gpus: int = 0  # CUDA devices it needs (device="cuda" implies at least 1)
    why: str = ""


@dataclass
class Context:
    """What a technique may look at besides the recipe.

    device: where this process trains. dist_env: the torchrun job (speedbench.distributed
    .DistEnv) or None. model: the freshly built model (before prepare_model), or None where there
    is none yet. trainer: the Trainer of the model once it is built (it sets itself), else None.
    extra: anything a technique keeps for the model it acts on (keys named after it).
    """

    device: torch.device
    dist_env: Any = None
    model: Any = None
    trainer: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Finding:
    """One diagnosis: the symptom seen, the figure that shows it, the tip, the knob to set."""

    symptom: str
    figure: str  # the measured figure that shows it
    tip: str
    knob: str  # what to set, `-` when the fix is in the user's own code


LOG_DIR_ENV = "SPEEDBENCH_LOG_DIR"  # the run directory, for Technique.logs (child processes too)


def log_path(name: str) -> Optional[Path]:
    """Where a technique's tool log `name` goes in this run (None outside a run)."""
    folder = os.environ.get(LOG_DIR_ENV)
    return Path(folder) / name if folder else None


@dataclass(frozen=True)
class Bound:
    """A forecast: the most a technique could speed a step up here, from the share of the
    baseline's step it can act on (Amdahl), and one line saying so. `sound`: whether it is an
    upper bound by construction; one that is not (precision's covers the matrix products only,
    while autocast also runs element-wise ops in 16 bits) is shown, and sets nothing aside."""

    speedup: float
    share: float  # of the baseline's profiled step
    why: str  # "data wait is 0.4 % of the step: workers cannot gain more than 1.004x"
    sound: bool = True

    def under(self, threshold: float) -> str:
        """Why the technique cannot gain 1 + `threshold` here, or "" where it might: the rule
        by which the recipe search and bench.skip_by_forecast set a variant aside; never for a
        forecast that is not a bound (`sound` false)."""
        if self.sound and self.speedup < 1 + threshold:
            return f"{self.why}, under the {threshold:.0%} noise threshold"
        return ""


def amdahl(share: float, gain: float = math.inf) -> float:
    """The whole step's speed-up when `share` of it runs `gain` times faster (inf: vanishes)."""
    share = min(max(share, 0.0), 1.0)
    saved = share * (1 - 1 / gain)
    return math.inf if saved >= 1 else 1 / (1 - saved)


def times(speedup: float) -> str:
    """1.004016 -> `1.004x`; inf -> `any factor`."""
    return "any factor" if math.isinf(speedup) else ratio_text(speedup, spec=".4g")


def percent(share: float) -> str:
    """0.004 -> `0.4 %`, 0.31 -> `31 %`."""
    return f"{100 * share:.2g} %" if share < 0.1 else f"{100 * share:.0f} %"


# --- global state: snapshot and restore ---------------------------------------------------------------
# name -> (read, write). Techniques that set other process-wide flags add theirs with
# `global_flag(...)` at import time; trials restore every one of them, and the registry tests
# check that a trial leaves them as it found them.
GLOBAL_FLAGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "torch_threads": (torch.get_num_threads, torch.set_num_threads),
    "cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                        lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    # The float32 matmul precision and matmul.allow_tf32 are two views of one setting: the
    # precision is read and restored first (the other order can leave torch's legacy and new
    # precision APIs disagreeing, and reading them then raises).
    "float32_matmul_precision": (torch.get_float32_matmul_precision,
                                 torch.set_float32_matmul_precision),
    "matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                          lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                         lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
}


# the LD_PRELOAD a fresh process would start from where it is not ours: an A/B arm's own
# (techniques.environment(..., over=)); None: this process's
_STARTS_FROM: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "speedbench_preload_base", default=None)


def inherited_preload() -> list[str]:
    """The LD_PRELOAD entries (space- or colon-separated) the fresh process starts from: this
    process's, or its arm's where it sets one (starting_from)."""
    base = _STARTS_FROM.get()
    return (os.environ.get("LD_PRELOAD", "") if base is None else base).replace(":", " ").split()


@contextlib.contextmanager
def starting_from(preload: Optional[str]) -> Iterator[None]:
    """Within: the fresh process starts from LD_PRELOAD `preload` (None: ours), so that a
    technique's libraries join an arm's rather than replace them."""
    token = _STARTS_FROM.set(preload)
    try:
        yield
    finally:
        _STARTS_FROM.reset(token)


def preload_instead(library: Optional[str], drop: tuple[str, ...]) -> str:
    """LD_PRELOAD for a fresh process: `library` first, then the inherited entries less those
    naming a word of `drop` (the libraries `library` replaces), each once."""
    kept = [p for p in inherited_preload() if not any(word in p for word in drop)]
    return " ".join(dict.fromkeys(([library] if library else []) + kept))


def joined_preload(values: list[str]) -> str:
    """One LD_PRELOAD from several techniques' preload_instead values: every library one of
    them added, then the inherited entries that none of them dropped."""
    inherited, lists = inherited_preload(), [v.split() for v in values]
    added = [p for entries in lists for p in entries if p not in inherited]
    kept = [p for p in inherited if all(p in entries for entries in lists)]
    return " ".join(dict.fromkeys(added + kept))


def global_flag(name: str, read: Callable[[], Any], write: Callable[[Any], None]) -> None:
    GLOBAL_FLAGS[name] = (read, write)


def global_snapshot() -> dict:
    return {name: read() for name, (read, _) in GLOBAL_FLAGS.items()}


@contextlib.contextmanager
def restored_global_state() -> Iterator[None]:
    """Whatever happens inside, every registered global flag is put back on exit."""
    saved = global_snapshot()
    try:
        yield
    finally:
        for name, value in saved.items():  # in registration order, without reading first
            GLOBAL_FLAGS[name][1](value)


# --- the interface --------------------------------------------------------------------------------------
class Technique:
    """Base class: every hook is a no-op. Subclass, set the class attributes, override hooks."""

    name: ClassVar[str] = ""
    # Names of the techniques whose hooks must run before this one's (torchtitan's run_after):
    # the registry is sorted so that they do.
    after: ClassVar[tuple[str, ...]] = ()
    # Method card: what it does, when it helps, what it costs (markdown, a few lines).
    card: ClassVar[str] = ""
    fields: ClassVar[tuple[Field, ...]] = ()
    # A small non-default setting of this technique's keys that makes it act (the generic
    # registry tests train one trial with it): e.g. {"precision": "bf16"}.
    example: ClassVar[dict] = {}
    # Where the example acts, for the generic test (required: the test fails without it).
    acts_on: ClassVar[Optional[ActsOn]] = None
    # What to change in a user's own loop when a recipe sets a key (the report shows it):
    # {key: {value: (title, code)}}. ANY stands for any other value than the key's default;
    # "{value}" in a title or code is replaced by the value.
    snippets: ClassVar[dict[str, dict[Any, tuple[str, str]]]] = {}
    # trials.csv columns after the fields' own: figures observed in a trial (`columns` fills them).
    extra_columns: ClassVar[tuple[str, ...]] = ()
    # Files a tool the technique drives writes its own output to, in the run directory
    # (LOG_DIR_ENV names it in a run), rather than on the console: {file name: what it holds}.
    # The run names each one that has content in one line at its end (techniques.log_lines).
    logs: ClassVar[dict[str, str]] = {}

    @property
    def column_names(self) -> tuple[str, ...]:
        """The trials.csv columns this technique adds: its fields', then `extra_columns`."""
        own = tuple(f.column_name for f in self.fields if f.column_name is not None)
        return own + self.extra_columns
    # A report view of throughput, data wait and host memory against one of this technique's
    # columns, for a setting whose cost shows on the host: {"column": ..., "title": ...}.
    host_sweep: ClassVar[dict] = {}

    # -- config ---------------------------------------------------------------------------------
    def resolvers(self) -> dict[str, Callable]:
        """OmegaConf resolvers an experiment file may use (`${name:args}`), by name."""
        return {}

    def validate(self, recipe: Any, where: str = "") -> None:
        """Types' rules (choices, bounds) of every field, then `check`."""
        for f in self.fields:
            f.validate(get_key(recipe, f.key), where)
        self.check(recipe, where)

    def check(self, recipe: Any, where: str = "") -> None:
        """Rules the field types cannot express. Raise ConfigError."""

    def normalise(self, recipe: Any) -> None:
        """Adjust a validated recipe in place (e.g. drop options that need workers)."""

    def check_plan(self, plan: Any, dist_env: Any) -> None:
        """Checks against the whole plan (models, device, how speedbench was started)."""

    # -- when it cannot act -----------------------------------------------------------------------
    def from_loop(self, loop: str, flags: dict) -> dict:
        """This technique's settings that a training loop's own flags ask for: `loop`
        "lightning" (a Lightning Trainer's flags) or "hf" (Hugging Face TrainingArguments');
        {} where none. ValueError, naming the flag and what it takes, for a value it cannot
        map."""
        return {}

    def not_applicable(self, recipe: Any, ctx: Context) -> Optional[str]:
        """'n/a: <reason>' when this recipe asks for something this technique cannot do here.
        A key left at its plain-PyTorch default must never make a recipe n/a."""
        return None

    # -- how it acts -------------------------------------------------------------------------------
    def global_state(self, recipe: Any, ctx: Context) -> contextlib.AbstractContextManager:
        """Set process-wide flags for the trial; restore them on exit."""
        return contextlib.nullcontext()

    def micro_batching(self, batch: int, recipe: Any) -> Optional[tuple[int, int]]:
        """(samples per micro-batch, micro-batches per optimizer step), or None: (batch, 1)."""
        return None

    def processes(self, recipe: Any, ctx: Context) -> Optional[int]:
        """Processes speedbench must launch (torchrun) to run this trial, or None to run it
        in this process."""
        return None

    def environment(self, recipe: Any, ctx: Context) -> dict[str, str]:
        """Environment variables the trial's process must start with (LD_PRELOAD: they act
        only at start-up). Non-empty: the trial and its probe run in a fresh process of their
        own (an arm of this interpreter: studies/arms.py), or, when it needs several,
        torchrun's ranks get them."""
        return {}

    def replicas(self, recipe: Any, ctx: Context) -> int:
        """Devices one process drives for this recipe (DataParallel: all GPUs); 1 otherwise."""
        return 1

    def loader_options(self, opts: dict, recipe: Any, ctx: Context) -> dict:
        """DataLoader keyword arguments."""
        return opts

    def prepare_model(self, model: Any, recipe: Any, ctx: Context) -> Any:
        """The model, changed or wrapped; called once, after it is on its device."""
        return model

    def copy_options(self, opts: dict, recipe: Any, ctx: Context) -> dict:
        """Keyword arguments of `tensor.to(device, ...)` for each batch."""
        return opts

    def step_context(self, recipe: Any, ctx: Context) -> contextlib.AbstractContextManager:
        """Entered around every forward pass (the loss included)."""
        return contextlib.nullcontext()

    def grad_scaler(self, recipe: Any, ctx: Context) -> Any:
        """A torch.amp.GradScaler when the loss must be scaled, else None."""
        return None

    def loss_meter(self, recipe: Any, ctx: Context) -> Any:
        """An object with add(loss), mean(), reset() and host_reads that keeps the running loss,
        or None (the Trainer then uses the sync technique's default)."""
        return None

    def optimizer_options(self, opts: dict, recipe: Any, ctx: Context) -> dict:
        """Keyword arguments of the optimizer (e.g. foreach / fused, or lr: it replaces the
        recipe's)."""
        return opts

    def zero_grad_options(self, opts: dict, recipe: Any, ctx: Context) -> dict:
        """Keyword arguments of `optimizer.zero_grad` after each step (set_to_none)."""
        return opts

    def one_time_steps(self, recipe: Any) -> int:
        """The first optimizer steps of a fresh model that carry this technique's one-time
        costs (compilation, autotuning) beyond the first step's usual ones: the probe's
        too-slow test and its budget check leave them out."""
        return 0

    def forward_only(self, recipe: Any) -> bool:
        """True when this recipe times an evaluation pass instead of a training step: the
        Trainer puts the model in eval mode and runs forward and loss only, under the
        techniques' step contexts (no backward, no optimizer step, no after-step hooks)."""
        return False

    def after_step(self, recipe: Any, ctx: Context) -> None:
        """Run after every optimizer step (timed, in the `other` phase)."""

    # -- what the measurement asks of it ---------------------------------------------------------
    def matmul_dtype(self, recipe: Any) -> Optional[str]:
        """The dtype the model's matrix products run in ("fp32", "fp16" or "bf16") when this
        technique decides it, else None; FLOP rates are compared with that dtype's peak."""
        return None

    def capacity_overrides(self, recipe: Any) -> dict:
        """Recipe keys to set while searching the largest micro-batch that fits (one
        micro-batch per step, on one device), e.g. {"accumulate": 1}."""
        return {}

    # -- what it records ---------------------------------------------------------------------------
    def columns(self, recipe: Any, ctx: Context) -> dict:
        """This technique's columns of a trials.csv row (also for n/a rows): its settings, and
        what it observed (ctx.trainer is the Trainer once the trial has run).
        By default each recorded field's value; override to add `extra_columns`."""
        return {f.column_name: get_key(recipe, f.key) for f in self.fields
                if f.column_name is not None}

    def profile_counters(self, trainer: Any, ctx: Context) -> contextlib.AbstractContextManager:
        """Entered around a profiled trial's phase window; yields a dict this technique fills
        with what it saw there, under keys of its own (e.g. {"empty_cache_calls": 3}). They
        reach `diagnose` as `tp.counters`, pooled over trials: numbers add up, anything else
        keeps the first trial's value."""
        return contextlib.nullcontext({})

    def diagnose(self, tp: Any) -> list[Finding]:
        """Findings from a pooled profile (diagnosis.TrialProfile); a clean recipe gives none."""
        return []

    def bound(self, recipe: Any, baseline: Any, profile: Any, peaks: dict
              ) -> Optional[Bound | str]:
        """The forecast for a variant (`recipe`) that changes this technique's keys from the
        baseline's: the most it could gain, from the baseline's profiled step (`profile`:
        `share(category)`, category one of schema.EXPLAIN_CATEGORIES) and the run's measured
        matmul peaks (`peaks`: kind -> TFLOP/s, NaN where not measured; `ratios`: 16-bit kind
        -> flops.PeakRatio from alternated windows). None: no forecast; a string: none, and
        why (`n/a: ...`)."""
        return None

    # -- what the run writes down about it ----------------------------------------------------
    def metadata(self) -> dict:
        """Plain data (JSON) about this technique: the run's techniques.json, which the report
        reads for the snippets, the settings columns and the views a technique asks for."""
        defaults = {f.key: f.default for f in self.fields}
        return {
            "name": self.name, "card": self.card,
            "fields": [{"key": f.key, "doc": f.doc, "default": f.default,
                        "choices": list(f.choices) if f.choices else None,
                        "column": f.column_name} for f in self.fields],
            "columns": list(self.column_names),
            "snippets": [{"key": key, "value": value, "default": defaults[key],
                          "title": title, "code": code}
                         for key, by_value in self.snippets.items()
                         for value, (title, code) in by_value.items()],
            "host_sweep": dict(self.host_sweep),
        }

    def __repr__(self) -> str:
        return f"<technique {self.name}>"
