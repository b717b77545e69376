"""The DataLoader's knobs: worker processes, pinned memory, asynchronous copies.

An experiment cannot hard-code "4 x GPUs" or "all CPUs" workers: the loader's resolvers (Hydra
resolvers, registered by the config) turn such settings into variants when it is resolved:

    variants: ${speedbench.worker_variants:[0, 1, 2, 4, 8, 4xGPU, CPUs]}
    baseline: w0

gives one variant `w<N>` per distinct worker count, capped by the CPU count, each with
persistent workers. `${speedbench.workers_variant:4xGPU}` names the variant a rule picks.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from speedbench.techniques.base import (ActsOn, ANY, Bound, Context, Field, Finding, Technique,
                                        amdahl, percent, times)

DATA_WAIT_SHARE = 0.10  # of the step spent waiting for the next batch
H2D_SHARE = 0.02  # of the step spent copying the batch from pageable memory
TIPS = {
    "workers": "load batches in DataLoader worker processes, so the next batch is decoded while "
               "the model trains",
    "cpu_bound": "the workers already use every CPU: make decoding and augmentation cheaper, "
                 "pre-decode the data, or decode on the GPU",
    "pinning": "pin the DataLoader's memory and copy with non_blocking=True: pinned copies are "
               "faster and overlap with compute",
}
# Symbolic worker counts an experiment may list next to plain integers.
RULES = {
    "4xGPU": lambda: 4 * torch.cuda.device_count(),  # the articles' rule of thumb
    "CPUs": lambda: cpu_count(),  # "the more CPU cores you have, the higher the number"
}
WORKERS = """\
loader = torch.utils.data.DataLoader(
    dataset, batch_size=batch_size, shuffle=True,
    num_workers={value}, persistent_workers=True)  # workers survive the epoch's end"""


class Loader(Technique):
    name = "loader"
    card = """\
**What**: `data.num_workers` loads batches in worker processes (`persistent_workers` keeps
them across epochs, `prefetch_factor` batches ahead per worker); `data.pin_memory` puts batches
in page-locked memory and `data.non_blocking` copies them to the GPU asynchronously.
**Helps**: when the loop waits for data (decoding, augmentation); pinning + non_blocking when
host-to-device copies take a visible share of the step (CUDA only).
**Costs**: each worker is a process with its own memory; too many workers compete with the
training process for CPUs."""
    fields = (
        Field("data.num_workers", int, 0, "DataLoader worker processes (0: load in the loop)",
              low=0, column="num_workers"),
        Field("data.pin_memory", bool, False, "page-locked batches (CUDA)", column="pin_memory"),
        Field("data.non_blocking", bool, False, "asynchronous host-to-device copies (CUDA)",
              column="non_blocking"),
        Field("data.persistent_workers", bool, False, "keep workers across epochs",
              column="persistent_workers"),
        Field("data.prefetch_factor", Optional[int], None, "batches loaded ahead per worker",
              low=1, column="prefetch_factor"),
    )
    example = {"data.num_workers": 1}
    acts_on = ActsOn()  # one worker process
    host_sweep = {"column": "num_workers", "title": "DataLoader workers"}
    snippets = {
        "data.num_workers": {
            1: ("1 DataLoader worker", WORKERS.replace("{value}", "1")),
            ANY: ("{value} DataLoader workers", WORKERS),
        },
        "data.pin_memory": {True: ("pinned host memory", """\
loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, pin_memory=True)""")},
        "data.non_blocking": {True: ("asynchronous host-to-device copies (with pinned memory)", """\
x = x.to(device, non_blocking=True)
y = y.to(device, non_blocking=True)""")},
    }

    def resolvers(self) -> dict[str, Callable]:
        return {"speedbench.worker_variants": worker_variants,
                "speedbench.workers_variant": workers_variant}

    def normalise(self, recipe) -> None:
        """DataLoader refuses prefetch_factor/persistent_workers without workers: drop them."""
        if recipe.data.num_workers == 0:
            recipe.data.persistent_workers = False
            recipe.data.prefetch_factor = None

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        if recipe.data.pin_memory and not ctx.cuda:
            return "n/a: pin_memory needs CUDA (no pinned host-to-device copy without it)"
        if recipe.data.non_blocking and not ctx.cuda:
            return "n/a: non_blocking needs CUDA (copies to the CPU are synchronous)"
        return None

    def loader_options(self, opts: dict, recipe, ctx: Context) -> dict:
        d = recipe.data
        opts = {**opts, "num_workers": d.num_workers, "pin_memory": d.pin_memory}
        if d.num_workers > 0:
            opts["persistent_workers"] = d.persistent_workers
            if d.prefetch_factor is not None:
                opts["prefetch_factor"] = d.prefetch_factor
        return opts

    def copy_options(self, opts: dict, recipe, ctx: Context) -> dict:
        return {**opts, "non_blocking": recipe.data.non_blocking}

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        """More workers can at most hide the whole data wait."""
        if recipe.data.num_workers <= baseline.data.num_workers:
            return None
        share = profile.share("data")
        gain = amdahl(share)
        return Bound(gain, share, f"data wait is {percent(share)} of the step: workers cannot "
                                  f"gain more than {times(gain)}")

    def diagnose(self, tp) -> list[Finding]:
        found = []
        if tp.share("data") >= DATA_WAIT_SHARE:
            workers = tp.settings.get("num_workers", 0)
            figure = (f"the loop waits for data {100 * tp.share('data'):.0f}% of the step "
                      f"({tp.ms('data'):.1f} of {tp.step_ms:.1f} ms), "
                      f"data.num_workers={workers}")
            if workers < tp.cpus:
                more = min(tp.cpus, 4) if workers == 0 else min(tp.cpus, 2 * workers)
                found.append(Finding("data wait share high", figure, TIPS["workers"],
                                     f"data.num_workers={more} data.persistent_workers=true"))
            else:
                found.append(Finding("data wait share high", f"{figure} on {tp.cpus} CPUs",
                                     TIPS["cpu_bound"], "-"))
        if tp.device == "cuda" and tp.batch_pinned is False and tp.share("h2d") >= H2D_SHARE:
            found.append(Finding("pageable host-to-device copies",
                                 f"copying {tp.batch_mb:.1f} MB per step from pageable memory "
                                 f"takes {100 * tp.share('h2d'):.0f}% of the step "
                                 f"({tp.ms('h2d'):.2f} ms)",
                                 TIPS["pinning"], "data.pin_memory=true data.non_blocking=true"))
        return found


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, which containers and SLURM narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_count(entry) -> int:
    """One entry of a worker list (an integer or a rule name), capped by the CPU count."""
    if isinstance(entry, str):
        if entry not in RULES:
            raise ValueError(f"'{entry}' is not a worker count; use an integer or one of "
                             f"{', '.join(RULES)}")
        n = RULES[entry]()
    else:
        n = int(entry)
    return max(0, min(n, cpu_count()))


def worker_counts(entries) -> list[int]:
    """The distinct worker counts the entries give on this machine, in ascending order."""
    return sorted({worker_count(e) for e in entries})


def workers_variant(entry) -> str:
    return f"w{worker_count(entry)}"


def worker_variants(entries) -> dict:
    """{`w<N>`: recipe overrides} for each distinct worker count on this machine."""
    return {f"w{n}": {"data.num_workers": n, "data.persistent_workers": n > 0}
            for n in worker_counts(entries)}
