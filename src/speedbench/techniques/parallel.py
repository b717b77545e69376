"""Data parallelism: none, nn.DataParallel (one process, all GPUs), DDP (one process a device) or
FSDP2 (`fully_shard`: parameters, gradients and optimizer state sharded over the processes).

This module wraps the model and says how many processes a trial needs; joining the process
group is speedbench.distributed's job and launching torchrun is speedbench.measure.launch's.
"""
from __future__ import annotations

import contextlib
from typing import Literal, Optional

import torch
import torch.nn as nn

from speedbench import distributed
from speedbench.techniques.base import ActsOn, ConfigError, Context, Field, Finding, Technique

CPU_DEFAULT_NPROC = 2  # DDP on a CPU: enough processes to exercise the machinery
TIP = ("use DistributedDataParallel, one process per GPU (torchrun): DataParallel scatters, "
       "replicates and gathers from one Python process every step")


DISTRIBUTED = ("ddp", "fsdp")  # one process per device, launched through torchrun
DDP_OPTIONS = "ddp_options"  # ctx.extra: DDP constructor arguments other techniques set
FSDP_OPTIONS = "fsdp_options"  # ctx.extra: fully_shard arguments for the blocks (not the root)


def effective(recipe, dist_env) -> str:
    """Under torchrun every variant runs as DDP over its ranks (FSDP variants as FSDP)."""
    if dist_env is not None:
        return "fsdp" if recipe.parallel == "fsdp" else "ddp"
    return recipe.parallel


def launch_nproc(recipe, device: str) -> int:
    """Processes speedbench launches for a ddp trial: `nproc`, else all GPUs, else 2 CPU ranks."""
    if recipe.nproc is not None:
        return recipe.nproc
    if device.startswith("cuda"):
        return torch.cuda.device_count()
    return min(CPU_DEFAULT_NPROC, distributed.device_count("cpu"))


def wrap(model: nn.Module, parallel: str, device: torch.device,
         ddp_options: Optional[dict] = None, fsdp_options: Optional[dict] = None) -> nn.Module:
    """The model as `parallel` says: DDP (one rank, one device; `ddp_options` passed on),
    FSDP2 (`fsdp_options` passed to each block's fully_shard), DataParallel (all GPUs), or
    bare. DDP broadcasts rank 0's weights at construction, so every rank starts equal."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None, **(ddp_options or {}))
    if parallel == "fsdp":
        return shard(model, fsdp_options)
    if parallel == "dp" and device.type == "cuda":
        first = device.index or 0  # replicas on every GPU; inputs and outputs on this one
        ids = [first] + [i for i in range(torch.cuda.device_count()) if i != first]
        return nn.DataParallel(model, device_ids=ids)
    return model


def _blocks(module: nn.Module):
    """The units FSDP shards one by one: each member with parameters of an nn.Sequential or
    nn.ModuleList (ResNet's residual blocks, the transformer's blocks, the VAE's layers), not
    looking inside a unit; the rest stays with the root."""
    for child in module.children():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and \
                any(True for _ in child.parameters()):
            yield child
        else:
            yield from _blocks(child)


def shard(model: nn.Module, block_options: Optional[dict] = None) -> nn.Module:
    """FSDP2: fully_shard each block (with `block_options`), then the root with FSDP2's own
    defaults (torch.distributed.fsdp, torch >= 2.6)."""
    from torch.distributed.fsdp import fully_shard

    for block in list(_blocks(model)):
        fully_shard(block, **(block_options or {}))
    return fully_shard(model)


def data_parallel(model: nn.Module, parallel: str) -> Optional[str]:
    """How DataParallel shows itself: the model's wrapper (a user's model may wrap itself), or
    `parallel=dp`; None when it is not in use."""
    if isinstance(model, nn.DataParallel):
        gpus = len(model.device_ids or [])
        return f"torch.nn.DataParallel over {gpus} GPU(s)" if gpus else \
            "torch.nn.DataParallel (no GPU here, so it only calls the module)"
    return "parallel=dp" if parallel == "dp" else None


@contextlib.contextmanager
def counting_synced_forwards(model: nn.Module):
    """Under DDP, counts forwards that will all-reduce their gradients (outside no_sync());
    yields a one-element list, or None when the model is not DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        yield None
        return
    count = [0]

    def before_forward(module, args):
        count[0] += bool(module.require_backward_grad_sync)

    handle = model.register_forward_pre_hook(before_forward)
    try:
        yield count
    finally:
        handle.remove()


class Parallel(Technique):
    name = "parallel"
    # It wraps the model: after every technique that changes the bare model.
    after = ("tensor_creation", "memory_format", "checkpointing", "attention", "ddp_tuning",
             "fsdp_reshard", "float8", "flex_attention", "fused_ce", "cuda_graphs")
    card = """\
**What**: `dp` wraps the model in `nn.DataParallel` over every visible GPU (one process);
`ddp` runs one process per device under `DistributedDataParallel` (speedbench launches
torchrun for the trial, `nproc` processes; under torchrun every variant runs as DDP);
`fsdp` likewise with FSDP2's `fully_shard` per block instead of DDP (works with gloo on CPUs).
**Helps**: more devices, more samples per second; DDP scales better than DP, which scatters,
replicates and gathers from one Python process every step.
**Costs**: gradient all-reduce every optimizer step; process start-up; memory per process.
FSDP trades memory (a shard per rank) for an all-gather per block in forward and backward and
a reduce-scatter of its gradients."""
    fields = (
        Field("parallel", Literal["none", "dp", "ddp", "fsdp"], "none",
              "dp: DataParallel over all GPUs; ddp: one process per device; fsdp: FSDP2"),
        Field("nproc", Optional[int], None,
              "processes speedbench launches for ddp; null: all GPUs, 2 on a CPU", low=1,
              column=None),
    )
    example = {"parallel": "dp"}
    # DDP and FSDP on a CPU: tests/test_distributed.py
    acts_on = ActsOn(device="cuda", gpus=2, why="DataParallel needs two CUDA devices")
    snippets = {"parallel": {
        "ddp": ("DistributedDataParallel (launch with torchrun --nproc_per_node=N train.py)", """\
torch.distributed.init_process_group("nccl")     # "gloo" on CPUs
model = torch.nn.parallel.DistributedDataParallel(model.to(device))
sampler = torch.utils.data.DistributedSampler(dataset)
loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)"""),
        "fsdp": ("FSDP2: shard parameters, gradients and optimizer state over ranks", """\
from torch.distributed.fsdp import fully_shard
for block in model.blocks:
    fully_shard(block)
fully_shard(model)"""),
    }}

    def check_plan(self, plan, dist_env) -> None:
        kind = plan.device.split(":")[0]
        have = distributed.device_count(kind)
        noun = "CUDA devices" if kind == "cuda" else "CPU cores"
        for name, recipe in plan.variants.items():
            key = "parallel" if name == "default" else f"variants.{name}.parallel"
            if dist_env is not None and recipe.parallel == "dp":
                raise ConfigError(f"{key}: 'dp' cannot run under torchrun (DataParallel is one "
                                  "process driving all GPUs; under torchrun every variant already "
                                  "runs as DDP over the ranks); use parallel=none or ddp, or run "
                                  "without torchrun")
            if dist_env is None and recipe.parallel in DISTRIBUTED:
                reason = distributed.cannot_launch(kind)
                if reason:
                    raise ConfigError(f"{key}: '{recipe.parallel}' needs a launcher and speedbench "
                                      f"cannot launch one here: {reason}; run speedbench under "
                                      "torchrun, or use parallel=none")
                n = launch_nproc(recipe, plan.device)
                where = "nproc" if name == "default" else f"variants.{name}.nproc"
                if n > have:
                    raise ConfigError(f"{where}: {n} processes asked for, but this machine has "
                                      f"{have} {noun}; choose 1..{have}")

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        gpus = torch.cuda.device_count() if ctx.cuda else 0
        if effective(recipe, ctx.dist_env) == "dp" and gpus < 2:
            return f"n/a: DataParallel needs at least two CUDA devices (this run has {gpus})"
        return None

    def processes(self, recipe, ctx: Context) -> Optional[int]:
        if ctx.dist_env is None and recipe.parallel in DISTRIBUTED:
            return launch_nproc(recipe, str(ctx.device))
        return None

    def replicas(self, recipe, ctx: Context) -> int:
        if effective(recipe, ctx.dist_env) == "dp" and ctx.cuda:
            return max(1, torch.cuda.device_count())
        return 1

    def prepare_model(self, model, recipe, ctx: Context):
        return wrap(model, effective(recipe, ctx.dist_env), ctx.device,
                    ctx.extra.get(DDP_OPTIONS), ctx.extra.get(FSDP_OPTIONS))

    def capacity_overrides(self, recipe) -> dict:
        return {"parallel": "none"}  # the largest batch is searched on one device

    def columns(self, recipe, ctx: Context) -> dict:
        return {"parallel": effective(recipe, ctx.dist_env)}

    @contextlib.contextmanager
    def profile_counters(self, trainer, ctx: Context):
        """DataParallel as the window saw it; under DDP, the forwards that all-reduce their
        gradients (accumulation's diagnosis reads them)."""
        counters = {}
        seen = data_parallel(trainer.model, effective(trainer.recipe, ctx.dist_env))
        if seen:
            counters["data_parallel"] = seen
        with counting_synced_forwards(trainer.model) as synced:
            yield counters
        if synced is not None:
            counters["synced_forwards"] = synced[0]

    def diagnose(self, tp) -> list[Finding]:
        seen = tp.counters.get("data_parallel")
        return [Finding("DataParallel in use", seen, TIP, "parallel=ddp")] if seen else []
