"""Intra-op threads per training process (torch.set_num_threads), crossed with the DataLoader's
workers and the number of training processes: CPU oversubscription, measured.

PyTorch's "Multiprocessing best practices" notes give each of M processes on N cores at most
floor(N/M) threads; the Performance Tuning Guide's "Utilize OpenMP" tip tunes OMP_NUM_THREADS.
A trial sets the count in each of its processes (torchrun's ranks included) before the model is
built, and records the count each process really ran with. Each DataLoader worker runs one
intra-op thread (PyTorch sets it so in every worker), so a process with T threads and W busy
workers keeps T + W threads busy.

The experiment's variants follow the machine (`${speedbench.thread_variants:}`): one process
with every core, one thread, workers and threads that fit the cores or exceed them, and DDP
ranks with floor(cores / ranks) threads each or all cores each.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from speedbench.techniques import loader
from speedbench.techniques.base import ANY, ActsOn, Context, Field, Technique

FAIR = 0  # `threads=0`: each process's share of the cores, its workers' threads left out
SET_THREADS = """\
import torch
torch.set_num_threads({value})   # first thing, before any other torch work
# or in the shell: OMP_NUM_THREADS={value} python train.py"""
FAIR_THREADS = """\
import math, os, torch
cores = len(os.sched_getaffinity(0))
processes = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's ranks on this machine
torch.set_num_threads(max(1, cores // processes - num_workers))  # num_workers: the DataLoader's"""


def fair_share(cores: int, processes: int, workers: int) -> int:
    """Threads per process so that every process's threads and workers fit in the cores:
    floor(cores / processes) less the process's DataLoader workers, at least 1."""
    return max(1, cores // max(1, processes) - workers)


class Threads(Technique):
    name = "threads"
    card = """\
**What**: `threads` sets the intra-op threads of every training process
(`torch.set_num_threads`, the count `OMP_NUM_THREADS` sets at start-up); `threads=0` gives each
process its share of the cores, floor(cores / processes) less its DataLoader workers (each
worker runs one intra-op thread).
**Helps**: threads that fit the cores: with DataLoader workers or several DDP ranks on one
machine, fewer threads per process than cores; with one process and no workers, all cores.
**Costs**: too many (oversubscription: more busy threads than cores) and the threads wait for
one another at every parallel region; too few and cores sit idle. The row records the threads
each process ran with, the processes, the busy threads and the cores."""
    fields = (
        Field("threads", Optional[int], None,
              "intra-op threads of each training process (torch.set_num_threads); 0: "
              "floor(cores / processes) less the workers; null: PyTorch's default", low=0),
    )
    extra_columns = ("threads_per_process", "train_processes", "busy_threads", "cpu_cores",
                     "oversubscribed")
    example = {"threads": 1}
    acts_on = ActsOn()  # one thread instead of PyTorch's default on a CPU
    snippets = {"threads": {
        FAIR: ("floor(cores / processes) threads per process, less its workers", FAIR_THREADS),
        ANY: ("{value} intra-op threads per process", SET_THREADS),
    }}

    def resolvers(self) -> dict[str, Callable]:
        return {"speedbench.thread_variants": thread_variants}

    @contextlib.contextmanager
    def global_state(self, recipe, ctx: Context):
        # the registry restores torch's thread count after the trial (base.GLOBAL_FLAGS)
        if recipe.threads is not None:
            torch.set_num_threads(self.count(recipe, ctx))
        yield

    def count(self, recipe, ctx: Context) -> int:
        """The threads this recipe gives each training process here."""
        if recipe.threads != FAIR:
            return recipe.threads
        return fair_share(loader.cpu_count(), processes(ctx), recipe.data.num_workers)

    def columns(self, recipe, ctx: Context) -> dict:
        row = super().columns(recipe, ctx)
        if ctx.trainer is None:  # observed during the trial only
            return {**row, **{c: math.nan for c in self.extra_columns}}
        per_process = torch.get_num_threads()  # inside the trial: the recipe's count applied
        procs, cores = processes(ctx), loader.cpu_count()
        busy = procs * (per_process + getattr(ctx.trainer.loader, "num_workers", 0))
        return {**row, "threads_per_process": per_process, "train_processes": procs,
                "busy_threads": busy, "cpu_cores": cores, "oversubscribed": busy > cores}


def processes(ctx: Context) -> int:
    """Training processes of the trial: torchrun's ranks, else this one."""
    return ctx.dist_env.world_size if ctx.dist_env is not None else 1


def thread_variants() -> dict:
    """The threads experiment's variants on this machine (C cores): one process with all
    cores or one thread; threads and workers that fit the cores (balanced) or C threads plus
    C workers (oversubscribed); DDP ranks with their fair share (threads=0) or C threads each."""
    cores = loader.cpu_count()
    workers = max(1, cores // 2)
    persistent = {"data.persistent_workers": True}
    return {
        "all_cores": {"threads": cores},
        "one_thread": {"threads": 1},
        "balanced": {"threads": FAIR, "data.num_workers": workers, **persistent},
        "oversubscribed": {"threads": cores, "data.num_workers": cores, **persistent},
        "ddp_balanced": {"parallel": "ddp", "threads": FAIR},
        "ddp_oversubscribed": {"parallel": "ddp", "threads": cores},
    }
