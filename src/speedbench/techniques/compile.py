"""torch.compile: TorchDynamo captures the model's graph, Inductor generates fused kernels.

How the trial sees compilation (warm-up is never timed, so compilation stays out of the window;
a compiled trial is not time-capped, as the cap would also cut its warm-up short):
the model is compiled in `prepare_model`, but the first `eager_steps(recipe)` optimizer steps
run eagerly (`torch.compiler.set_stance("force_eager")`) and are timed, synchronised, as the
eager reference; the next step compiles (forward and backward) and is timed too; the steps after
it are the compiled ones. From these the trial records
- compile_s: the compiling step's time minus a compiled step's (median of the later steps);
- compile_breakeven_steps: compile_s / (eager step - compiled step), the optimizer steps a run
  must last before compiling pays for itself (inf when the compiled step is not faster);
- recompiles (frames Dynamo compiled after the first compiled step), graph_breaks, and
  compile_cache (hit / miss / partial: whether Inductor's on-disk FX-graph cache served it).
Dynamo's in-process caches are reset for every trial, so each trial pays its compilation; the
on-disk cache is kept, as a user re-running a script keeps it (`compile_cache` says which).
The step times after the switch are host-clock times between optimizer steps (on CUDA not
synchronised, so as not to touch the timed window): the break-even is an estimate there.

`compile_scope=blocks` is regional compilation: each repeated block (a transformer's layers, a
ResNet's residual blocks: repeated_blocks) compiled in place with `nn.Module.compile`, the
rest eager; the blocks share one class, so Dynamo compiles the code once and reuses it (cold
compile time falls; the glue between blocks is not fused). `compile_autograd` compiles the
backward pass at run time as well (compiled autograd, the whole backward graph in one capture,
hooks included), through torch._dynamo.compiled_autograd._enable around the trial (the API the
compiled-autograd tutorial's flag sets up inside a compiled function); its captures are
counted (`compiled_autograd_captures`) beside the recompiles.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Literal, Optional

import torch

from speedbench.techniques.base import (ActsOn, ANY, Bound, Context, Field, Technique, amdahl,
                                        global_flag, log_path, percent, times)

MODES = ("off", "default", "max-autotune", "reduce-overhead")
BACKEND = "inductor"  # torch.compile's backend (tests use aot_eager: same capture, no codegen)
AUTOTUNE_LOG = "autotune.log"  # max-autotune's kernel-timing tables, in the run directory
EAGER_STEPS = 2  # eager reference steps before the compiling one (fewer if warm-up is shorter)
OBSERVED = ("compile_s", "compile_eager_step_ms", "compile_step_ms", "compile_breakeven_steps",
            "recompiles", "graph_breaks", "compile_cache", "compiled_autograd_captures")
SCOPES = ("model", "blocks")


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of a ModuleList or Sequential that repeat one class and hold modules of
    their own (a transformer's layers, a ResNet's residual blocks): what regional compilation
    compiles."""
    found = []
    for parent in model.modules():
        if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = list(parent.children())
            kinds = Counter(type(k) for k in kids)
            found += [k for k in kids if kinds[type(k)] >= 2 and next(k.children(), None)]
    return found


def eager_steps(recipe) -> int:
    """Eager steps before compiling: the compiling step must fall inside the warm-up."""
    return max(0, min(EAGER_STEPS, recipe.bench.warmup - 1))


def _stance() -> str:
    """Dynamo's current stance (set_stance's first argument)."""
    if "torch._dynamo" not in sys.modules:  # nothing can have set one; importing it is slow
        return "default"
    try:
        from torch._dynamo.eval_frame import _stance as current

        return current.stance
    except (ImportError, AttributeError):  # private: if it moves, assume the default
        return "default"


def _set_stance(stance: str) -> None:
    if "torch._dynamo" in sys.modules or stance != "default":  # else it is the default already
        torch.compiler.set_stance(stance)


global_flag("compiler.stance", _stance, _set_stance)


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["ok"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"],
            "captures": counters["compiled_autograd"]["captures"]}


class CompileRecord:
    """One trial's compile timeline: step times and Dynamo's counters, read at each step end."""

    def __init__(self, device: torch.device, eager: int):
        self.device, self.eager = device, eager
        self.start = _counters()
        self.first_frames: Optional[int] = None  # frames compiled by the compiling step
        self.times: list[float] = []
        self.last = time.perf_counter()

    def step_done(self) -> None:
        # Synchronise the eager and compiling steps only: they lie in the (untimed) warm-up.
        if len(self.times) <= self.eager and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        if len(self.times) == self.eager:
            torch.compiler.set_stance("default")  # the next step compiles
        elif len(self.times) == self.eager + 1:
            self.first_frames = _counters()["frames"] - self.start["frames"]

    def columns(self) -> dict:
        n = self.eager
        eager = self.times[n - 1] if n and len(self.times) >= n else math.nan
        later = self.times[n + 1:]
        compiled = statistics.median(later) if later else math.nan
        compile_s = max(0.0, self.times[n] - compiled) if later else math.nan
        saved = eager - compiled
        if math.isnan(saved) or math.isnan(compile_s):
            breakeven = math.nan
        else:
            breakeven = compile_s / saved if saved > 0 else math.inf
        now = _counters()
        hits = now["cache_hits"] - self.start["cache_hits"]
        misses = now["cache_misses"] - self.start["cache_misses"]
        cache = ("partial" if hits and misses else "hit" if hits else "miss" if misses
                 else "none")
        return {"compile_s": compile_s, "compile_eager_step_ms": 1000 * eager,
                "compile_step_ms": 1000 * compiled, "compile_breakeven_steps": breakeven,
                "recompiles": (now["frames"] - self.start["frames"] - self.first_frames
                               if self.first_frames is not None else math.nan),
                "graph_breaks": now["graph_breaks"] - self.start["graph_breaks"],
                "compile_cache": cache,
                "compiled_autograd_captures": now["captures"] - self.start["captures"]}


class Compile(Technique):
    name = "compile"
    after = ("parallel", "comm_hook")  # torch.compile wraps the hooked DDP module
    logs = {AUTOTUNE_LOG: "Inductor's AUTOTUNE tables"}  # kept short: a path follows
    card = """\
**What**: `torch.compile(model, mode=...)`: TorchDynamo captures the forward pass (and
AOTAutograd the backward) as graphs; Inductor fuses them into generated kernels (Triton on
GPUs, C++/OpenMP on CPUs). `default`; `max-autotune` (benchmarks kernel choices: longer
compile); `reduce-overhead` (also CUDA graphs, against launch overhead: CUDA only).
**Helps**: models bound by memory traffic and kernel launches (many small element-wise ops).
**Costs**: compile time before the first step (`compile_s`; `compile_breakeven_steps` says
when it pays back), recompilations on new shapes, memory for the compiler.
`compile_scope=blocks` (regional compilation) compiles each repeated block once, in place:
far shorter cold compiles, a little less fusion. `compile_autograd=true` (compiled autograd)
captures the whole backward graph at run time: more to fuse, more recompiles."""
    fields = (Field("compile", Literal[MODES], "off",
                    "torch.compile's mode; off: eager"),
              Field("compile_scope", Literal[SCOPES], "model",
                    "model: compile the whole model; blocks: each repeated block (regional)"),
              Field("compile_autograd", bool, False,
                    "compiled autograd: the backward pass compiled at run time too"))
    example = {"compile": "default"}
    acts_on = ActsOn()
    snippets = {"compile": {
        "default": ("torch.compile", """\
model = torch.compile(model)   # the first steps compile; time them out"""),
        ANY: ("torch.compile", """\
model = torch.compile(model, mode="{value}")   # the first steps compile; time them out"""),
    },
        "compile_scope": {"blocks": ("regional compilation: each repeated block", """\
for block in model.blocks:   # the repeated layers; the rest stays eager
    block.compile()          # one compile, reused by every block of the class""")},
        "compile_autograd": {True: ("compiled autograd (backward compiled at run time)", """\
torch._dynamo.config.compiled_autograd = True
@torch.compile
def train_step(model, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()          # traced and compiled too
    return loss""")}}
    extra_columns = OBSERVED


    # What a compiled graph can remove: element-wise work it fuses, the Python and framework
    # overhead between ops (matrix products, the data wait and the optimizer stay).
    FUSABLE = ("elementwise", "python", "other")

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        if recipe.compile == "off" or baseline.compile != "off":
            return None
        share = sum(profile.share(c) for c in self.FUSABLE)
        gain = amdahl(share)
        return Bound(gain, share, f"element-wise work and overhead are {percent(share)} of the "
                                  f"step: compile cannot gain more than {times(gain)}")

    def normalise(self, recipe) -> None:
        # The trial's time cap also cuts the warm-up short, which would push compilation into
        # the timed window: a compiled trial runs uncapped (its warm-up still ends at
        # bench.warmup_max steps).
        if recipe.compile != "off":
            recipe.bench.max_trial_s = None

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.compile == "reduce-overhead" and not ctx.cuda:
            return ("n/a: compile=reduce-overhead records CUDA graphs, which need CUDA "
                    f"(this run is on {ctx.device.type})")
        if recipe.compile != "off" and ctx.device.type == "mps":
            return "n/a: torch.compile's Inductor has no MPS training backend here"
        if recipe.compile == "off" and (recipe.compile_scope != "model"
                                        or recipe.compile_autograd):
            return "n/a: compile_scope and compile_autograd act with compile on (compile=off)"
        if recipe.compile_scope == "blocks" and ctx.model is not None \
                and not repeated_blocks(ctx.model):
            return ("n/a: compile_scope=blocks compiles repeated blocks (a ModuleList or "
                    "Sequential of one class); this model has none")
        return None

    def global_state(self, recipe, ctx: Context):
        if recipe.compile == "off":
            return contextlib.nullcontext()
        return _compile_trial(recipe, ctx)

    def one_time_steps(self, recipe) -> int:
        # the eager steps, the compiling one, and one more for a recompile or CUDA graph capture
        return 0 if recipe.compile == "off" else eager_steps(recipe) + 2

    def prepare_model(self, model, recipe, ctx: Context):
        if recipe.compile == "off":
            return model
        record = CompileRecord(ctx.device, eager_steps(recipe))
        ctx.extra["compile"] = record
        if record.eager:
            torch.compiler.set_stance("force_eager")  # the eager reference steps first
        mode = None if recipe.compile == "default" else recipe.compile
        if recipe.compile_scope == "blocks":
            for block in repeated_blocks(model):
                block.compile(backend=BACKEND, mode=mode)
            return model
        return torch.compile(model, backend=BACKEND, mode=mode)

    def after_step(self, recipe, ctx: Context) -> None:
        record = ctx.extra.get("compile")
        if record is not None:
            record.step_done()

    def columns(self, recipe, ctx: Context) -> dict:
        row = {**super().columns(recipe, ctx), **dict.fromkeys(OBSERVED, math.nan)}
        record = ctx.extra.get("compile")
        if record is not None and record.times:
            row.update(record.columns())
        return row


@contextlib.contextmanager
def _compile_trial(recipe, ctx: Context):
    """Fresh Dynamo caches for the trial, so that it pays (and reports) its compilation;
    max-autotune's tables in the run's log, off the console."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with _compiled_autograd(recipe), autotune_tables_to(log_path(AUTOTUNE_LOG)):
            yield
    finally:
        torch._dynamo.reset()  # frees the compiled code (the record stays for `columns`)


class _StderrTo:
    """The `sys` module as Inductor's select_algorithm sees it, its stderr another stream."""

    def __init__(self, stream):
        self.stderr = stream

    def __getattr__(self, name):
        return getattr(sys, name)


@contextlib.contextmanager
def autotune_tables_to(path: Optional[Path]):
    """Inductor's max-autotune prints a table of kernel timings per autotuned operator
    ("AUTOTUNE mm(...)", the choices' times, "... AUTOTUNE benchmarking takes ...") with
    sys.stderr.write from torch/_inductor/select_algorithm.py, straight onto the console and
    through any progress bar: meanwhile that module's stderr is the file `path` (appended), and
    nothing else's. None (outside a run), or a torch without that module: as it is."""
    try:
        from torch._inductor import select_algorithm
    except Exception:  # an Inductor of another shape: its tables stay where it writes them
        select_algorithm = None
    if path is None or getattr(select_algorithm, "sys", None) is not sys:
        yield
        return
    with open(path, "a", encoding="utf-8") as log:
        select_algorithm.sys = _StderrTo(log)
        try:
            yield
        finally:
            select_algorithm.sys = sys


def _compiled_autograd(recipe):
    """Every backward pass of the trial compiled (compile_autograd), else nothing."""
    if not recipe.compile_autograd:
        return contextlib.nullcontext()
    from torch._dynamo import compiled_autograd

    mode = None if recipe.compile == "default" else recipe.compile
    return compiled_autograd._enable(torch.compile(backend=BACKEND, mode=mode))
