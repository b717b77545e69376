"""The technique registry: every speed-up technique speedbench knows, in application order.

To add a technique: write one module here with a `Technique` subclass (see base.py and
docs/adding-a-technique.md), add an instance to `_ALL` below, write its experiment YAML and its
EFFECTS entry in tests/test_techniques.py, and regenerate the docs (python -m
speedbench.config.docs). tests/test_registry.py fails for a module left out of `_ALL`.
The schema, validation, the trial, the Trainer, trials.csv and diagnosis pick it up from here.

The helpers below apply every technique's hook in `REGISTRY` order: `_ALL`'s, sorted so that
each technique comes after the ones its `after` names.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from speedbench.results.schema import FORECAST_STEPS

from speedbench.techniques import (accumulation, empty_cache, loader, parallel, precision, sync,
                                   tensor_creation)
from speedbench.techniques import (attention, checkpointing, compile, cudnn_benchmark,
                                   matmul_precision, memory_format, optimizer)
from speedbench.techniques import allocator, batch_scale, ddp_tuning, openmp, threads
from speedbench.techniques import conv_bias, debug_apis, eval_mode, onednn_precision, zero_grad
from speedbench.techniques import chunked_ce, expandable_segments, packing
from speedbench.techniques import comm_hook, fsdp_reshard
from speedbench.techniques import cuda_graphs, flex_attention, float8, fused_ce, offload
from speedbench.techniques.base import (GLOBAL_FLAGS, LOG_DIR_ENV, Bound, ConfigError, Context,
                                        Field, Finding, Technique, get_key, global_snapshot,
                                        joined_preload, restored_global_state,
                                        starting_from)

# Registration order; it also breaks ties where no `after` relation decides.
_ALL: list[Technique] = [
    precision.Precision(),
    accumulation.Accumulation(),
    batch_scale.BatchScale(),  # after accumulation: it scales the micro-batch that leaves
    loader.Loader(),
    packing.Packing(),
    tensor_creation.TensorCreation(),
    sync.Sync(),
    empty_cache.EmptyCache(),
    conv_bias.ConvBias(),  # on the bare model, before channels_last and checkpointing
    memory_format.MemoryFormat(),
    checkpointing.Checkpointing(),
    attention.Attention(),
    chunked_ce.ChunkedCE(),
    fused_ce.FusedCE(),
    flex_attention.FlexAttention(),
    float8.Float8(),
    offload.Offload(),
    cuda_graphs.CudaGraphs(),
    matmul_precision.MatmulPrecision(),
    cudnn_benchmark.CudnnBenchmark(),
    optimizer.Optimizer(),
    threads.Threads(),
    allocator.Allocator(),
    expandable_segments.ExpandableSegments(),
    openmp.OpenMP(),
    ddp_tuning.DdpTuning(),
    fsdp_reshard.FsdpReshard(),
    zero_grad.ZeroGrad(),
    eval_mode.EvalMode(),
    debug_apis.DebugApis(),
    onednn_precision.OnednnPrecision(),
    parallel.Parallel(),
    comm_hook.CommHook(),  # registers on parallel's DDP module, before compile wraps it
    compile.Compile(),
]


def in_order(techs: list[Technique]) -> list[Technique]:
    """`techs` sorted so that each comes after those its `after` names: a stable topological
    sort (of the techniques ready to go, the first in `techs` goes first). Raises ValueError
    on an unknown name or a cycle."""
    names = {t.name for t in techs}
    for t in techs:
        unknown = sorted(set(t.after) - names)
        if unknown:
            raise ValueError(f"{t.name}.after names no technique: {', '.join(unknown)}")
    done: set[str] = set()
    out, pending = [], list(techs)
    while pending:
        ready = next((t for t in pending if done.issuperset(t.after)), None)
        if ready is None:
            raise ValueError("the techniques' `after` relations form a cycle among: "
                             + ", ".join(t.name for t in pending))
        pending.remove(ready)
        out.append(ready)
        done.add(ready.name)
    return out


REGISTRY: list[Technique] = in_order(_ALL)

__all__ = ["REGISTRY", "Technique", "Field", "Context", "Finding", "ConfigError", "GLOBAL_FLAGS",
           "global_snapshot", "restored_global_state", "in_order", "by_name", "fields",
           "resolvers", "validate", "normalise", "check_plan", "not_applicable", "processes",
           "global_state", "micro_batching", "replicas", "loader_options", "prepare_model",
           "copy_options", "step_context", "grad_scaler", "loss_meter", "optimizer_options",
           "after_step_hooks", "matmul_dtype", "capacity_overrides", "columns", "column_names",
           "profile_counters", "diagnose", "metadata", "environment", "zero_grad_options",
           "forward_only", "one_time_steps", "Bound", "changed", "bound"]


def by_name(name: str) -> Technique:
    for t in REGISTRY:
        if t.name == name:
            return t
    raise KeyError(f"no technique named {name!r}; known: {', '.join(t.name for t in REGISTRY)}")


def fields() -> list[Field]:
    """Every recipe key the techniques own, in registry order."""
    return [f for t in REGISTRY for f in t.fields]


# --- config --------------------------------------------------------------------------------------
def resolvers() -> dict:
    """Every technique's OmegaConf resolvers, by name."""
    return {name: fn for t in REGISTRY for name, fn in t.resolvers().items()}


def validate(recipe: Any, where: str = "") -> None:
    for t in REGISTRY:
        t.validate(recipe, where)


def normalise(recipe: Any) -> None:
    for t in REGISTRY:
        t.normalise(recipe)


def check_plan(plan: Any, dist_env: Any) -> None:
    for t in REGISTRY:
        t.check_plan(plan, dist_env)


# --- one trial -------------------------------------------------------------------------------------
def from_loop(loop: str, flags: dict) -> dict:
    """The settings a training loop's own flags ask for, technique by technique
    (Technique.from_loop): loop "lightning" (a Trainer's flags) or "hf" (TrainingArguments').
    ValueError naming the flag where one cannot be mapped."""
    settings: dict = {}
    for t in REGISTRY:
        settings.update(t.from_loop(loop, flags))
    return settings


def not_applicable(recipe: Any, ctx: Context) -> Optional[str]:
    """The first technique's reason why this recipe cannot be measured here, or None."""
    for t in REGISTRY:
        reason = t.not_applicable(recipe, ctx)
        if reason:
            return reason
    return None


def processes(recipe: Any, ctx: Context) -> Optional[int]:
    """Processes to launch for this trial (torchrun), or None to run it in this process."""
    for t in REGISTRY:
        n = t.processes(recipe, ctx)
        if n is not None:
            return n
    return None


def launched(recipe: Any, ctx: Context) -> bool:
    """Whether this recipe's trials run in processes of their own (torchrun, or a fresh one)."""
    return bool(processes(recipe, ctx) or environment(recipe, ctx))


def environment(recipe: Any, ctx: Context, over: dict | None = None) -> dict:
    """Variables the trial's process must start with; non-empty: a fresh process (an arm).
    `over`: the variables of the A/B arm it starts in (its LD_PRELOAD is the one the
    techniques' libraries join; None: ours)."""
    env: dict = {}
    preloads = []  # e.g. jemalloc's and Intel's OpenMP: both, and neither one's rival
    with starting_from((over or {}).get("LD_PRELOAD")):
        for t in REGISTRY:
            own = t.environment(recipe, ctx)
            if "LD_PRELOAD" in own:
                preloads.append(own["LD_PRELOAD"])
            env.update(own)
        if len(preloads) > 1:
            env["LD_PRELOAD"] = joined_preload(preloads)
    return env


@contextlib.contextmanager
def global_state(recipe: Any, ctx: Context):
    """Every technique's global settings for one trial; every registered flag restored after."""
    with restored_global_state(), contextlib.ExitStack() as stack:
        for t in REGISTRY:
            stack.enter_context(t.global_state(recipe, ctx))
        yield


def micro_batching(batch: int, recipe: Any) -> tuple[int, int]:
    """(samples per micro-batch, micro-batches per optimizer step) for a batch of `batch`."""
    micro, k = batch, 1
    for t in REGISTRY:
        got = t.micro_batching(micro, recipe)
        if got is not None:
            micro, k_t = got
            k *= k_t
    return micro, k


def replicas(recipe: Any, ctx: Context) -> int:
    n = 1
    for t in REGISTRY:
        n *= t.replicas(recipe, ctx)
    return n


def loader_options(recipe: Any, ctx: Context) -> dict:
    opts: dict = {}
    for t in REGISTRY:
        opts = t.loader_options(opts, recipe, ctx)
    return opts


def prepare_model(model: Any, recipe: Any, ctx: Context) -> Any:
    for t in REGISTRY:
        model = t.prepare_model(model, recipe, ctx)
    return model


def copy_options(recipe: Any, ctx: Context) -> dict:
    opts: dict = {}
    for t in REGISTRY:
        opts = t.copy_options(opts, recipe, ctx)
    return opts


@contextlib.contextmanager
def step_context(recipe: Any, ctx: Context):
    with contextlib.ExitStack() as stack:
        for t in REGISTRY:
            stack.enter_context(t.step_context(recipe, ctx))
        yield


def step_contexts(recipe: Any, ctx: Context) -> list[Technique]:
    """The techniques whose step_context is not a no-op (the Trainer skips the others)."""
    return [t for t in REGISTRY if type(t).step_context is not Technique.step_context]


def grad_scaler(recipe: Any, ctx: Context) -> Any:
    for t in REGISTRY:
        scaler = t.grad_scaler(recipe, ctx)
        if scaler is not None:
            return scaler
    return None


def loss_meter(recipe: Any, ctx: Context) -> Any:
    for t in REGISTRY:
        meter = t.loss_meter(recipe, ctx)
        if meter is not None:
            return meter
    return sync.LossMeter("deferred", 10, ctx.device)


def optimizer_options(recipe: Any, ctx: Context) -> dict:
    opts: dict = {}
    for t in REGISTRY:
        opts = t.optimizer_options(opts, recipe, ctx)
    return opts


def zero_grad_options(recipe: Any, ctx: Context) -> dict:
    """Keyword arguments of optimizer.zero_grad(); PyTorch's default frees the gradients."""
    opts: dict = {"set_to_none": True}
    for t in REGISTRY:
        opts = t.zero_grad_options(opts, recipe, ctx)
    return opts


def one_time_steps(recipe: Any) -> int:
    """Steps of a fresh model that carry one-time costs besides the first (the most any
    technique declares)."""
    return max(t.one_time_steps(recipe) for t in REGISTRY)


def forward_only(recipe: Any) -> bool:
    """Whether a step of this recipe is an evaluation pass (forward and loss only)."""
    return any(t.forward_only(recipe) for t in REGISTRY)


def after_step_hooks() -> list[Technique]:
    """The techniques with an after_step (the Trainer calls only these, every step)."""
    return [t for t in REGISTRY if type(t).after_step is not Technique.after_step]


def matmul_dtype(recipe: Any) -> str:
    """The dtype of the model's matrix products: the first technique's that decides, else fp32."""
    for t in REGISTRY:
        dtype = t.matmul_dtype(recipe)
        if dtype is not None:
            return dtype
    return "fp32"


def capacity_overrides(recipe: Any) -> dict:
    """Every technique's recipe keys for the largest-batch search."""
    out: dict = {}
    for t in REGISTRY:
        out.update(t.capacity_overrides(recipe))
    return out


# --- records -----------------------------------------------------------------------------------------
def column_names() -> list[str]:
    """Every column the techniques add to trials.csv, in registry order, without repeats."""
    out: list[str] = []
    for t in REGISTRY:
        out += [c for c in t.column_names if c not in out]
    return out


def columns(recipe: Any, ctx: Context) -> dict:
    row: dict = {}
    for t in REGISTRY:
        row.update(t.columns(recipe, ctx))
    return row


@contextlib.contextmanager
def profile_counters(trainer: Any, ctx: Context):
    """Every technique's counters around a profile window: yields one dict, filled with all
    of them once the block has run."""
    counters: dict = {}
    with contextlib.ExitStack() as stack:
        parts = [stack.enter_context(t.profile_counters(trainer, ctx)) for t in REGISTRY]
        yield counters
    for part in parts:
        counters.update(part)


def diagnose(tp: Any) -> list[Finding]:
    return [f for t in REGISTRY for f in t.diagnose(tp)]


def changed(recipe: Any, baseline: Any) -> list[Technique]:
    """The techniques whose keys the recipe sets otherwise than the baseline does."""
    return [t for t in REGISTRY
            if any(get_key(recipe, f.key) != get_key(baseline, f.key) for f in t.fields)]


def bound(recipe: Any, baseline: Any, profile: Any, peaks: dict) -> tuple[str, Any]:
    """(technique, its Bound) for a variant that changes one technique; (names, why there is
    none) otherwise: a forecast combines no two techniques (Amdahl's bounds do not multiply)."""
    techs = changed(recipe, baseline)
    names = ", ".join(t.name for t in techs)
    if not techs:
        return "", "n/a: the variant changes no technique's key"
    if len(techs) > 1:
        return names, f"n/a: the variant changes several techniques ({names})"
    got = techs[0].bound(recipe, baseline, profile, peaks)
    return names, got if got is not None else f"n/a: {names} declares no bound"


@contextlib.contextmanager
def logs_into(run_dir: Optional[Path]):
    """The techniques' tool logs (Technique.logs) go to `run_dir` meanwhile (LOG_DIR_ENV: the
    trials' child processes see it too); None: where they would go otherwise."""
    before = os.environ.get(LOG_DIR_ENV)
    if run_dir is not None:
        os.environ[LOG_DIR_ENV] = str(run_dir)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOG_DIR_ENV, None)
        else:
            os.environ[LOG_DIR_ENV] = before


def log_lines(run_dir: Path) -> list[str]:
    """One line per technique's tool log with content in `run_dir`: what it holds, where."""
    return [f"{what}: {run_dir / name}" for t in REGISTRY for name, what in t.logs.items()
            if (run_dir / name).is_file() and (run_dir / name).stat().st_size]


def forecast(recipe: Any, baseline: Any, profile: Any, peaks: dict) -> tuple[str, Any]:
    """The forecast the runs and the recipe search act on: `bound` from the profile's upper
    shares (analysis.explain.Breakdown.upper: the profiler's cost and the spread of the
    profiled steps counted for the technique), its reason saying how many steps it rests on.
    From fewer than FORECAST_STEPS profiled steps it is the point forecast, and where a load
    slowed the unprofiled steps (Breakdown.unsteady: the profiler's cost cannot be told) it is
    shown: either is no bound (`sound` false) and sets nothing aside."""
    n = len(profile.steps)
    if n < FORECAST_STEPS:
        names, got = bound(recipe, baseline, profile, peaks)
        if isinstance(got, Bound):
            got = replace(got, sound=False, why=f"{got.why} (from {n} profiled step"
                          f"{'s' if n != 1 else ''}: no bound, {FORECAST_STEPS} make one)")
        return names, got
    upper = profile.upper()
    names, got = bound(recipe, baseline, upper, peaks)
    if isinstance(got, Bound):
        got = replace(got, why=f"{got.why} (the share's one-sided {upper.level:.0%} upper "
                               f"limit over {n} profiled steps)")
        if got.sound and upper.unsteady:
            got = replace(got, sound=False, why=f"{got.why}: no bound, {upper.unsteady}")
    return names, got


def metadata() -> dict:
    """Every technique's metadata, in registry order: what the run writes to techniques.json."""
    return {"techniques": [t.metadata() for t in REGISTRY]}
