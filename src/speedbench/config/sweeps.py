"""Variants whose values depend on the machine, generated when the config is resolved.

An experiment file cannot hard-code "4 x GPUs" or "all CPUs": this module turns such settings
into variants through OmegaConf resolvers (registered by `config.register_schema`):

    variants: ${speedbench.worker_variants:[0, 1, 2, 4, 8, 4xGPU, CPUs]}
    baseline: w0

gives one variant `w<N>` per distinct worker count, capped by the CPU count, each with
persistent workers. `${speedbench.workers_variant:4xGPU}` names the variant a rule picks.
"""
from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf

# Symbolic worker counts an experiment may list next to plain integers.
RULES = {
    "4xGPU": lambda: 4 * torch.cuda.device_count(),  # the articles' rule of thumb
    "CPUs": lambda: cpu_count(),  # "the more CPU cores you have, the higher the number"
}


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


def register_resolvers() -> None:
    for name, fn in (("speedbench.worker_variants", worker_variants),
                     ("speedbench.workers_variant", workers_variant)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
