"""Data parallelism: torchrun's environment, the process group, DDP and DataParallel wrapping,
and launching torchrun from inside speedbench.

A variant runs as DDP in one of two ways:
- the user starts speedbench under torchrun (`torchrun --nproc_per_node=N -m speedbench ...`):
  every rank runs the whole experiment, each variant as DDP over the N ranks, and rank 0 alone
  writes the run directory (the ranks' clocks may disagree on its timestamp: DESIGN pitfall 2);
- a variant sets `parallel=ddp` in a plain `python -m speedbench` run: each of its trials is
  launched as `python -m torch.distributed.run --standalone -m speedbench.distributed JOB_DIR`
  (`main` below is the worker), and rank 0's record comes back as a JSON file. One launch per
  trial keeps the variants interleaved; the launch itself is outside the timed window.

Under DDP every rank must take the same number of steps, or the ranks left behind wait in an
all-reduce forever: warm-up steps are agreed one by one (untimed), the timed window's length
once, from the warm-up's pace. A rank that fails raises, so torchrun stops the job; the process
group's timeout (`dist_timeout_s`) bounds any wait on a peer that is gone.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from speedbench.errors import ConfigError
from speedbench.timing import timed_steps

CPU_DEFAULT_NPROC = 2  # DDP on a CPU: enough processes to exercise the machinery


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in a torchrun job (from the variables torchrun sets)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    run_id: str  # TORCHELASTIC_RUN_ID: the same on every rank of one job


def from_environ(environ: Mapping[str, str] = os.environ) -> Optional[DistEnv]:
    """The torchrun job this process is a rank of, or None when it runs on its own."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    world = int(environ["WORLD_SIZE"])
    return DistEnv(rank=int(environ["RANK"]), world_size=world,
                   local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
                   local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
                   run_id=environ.get("TORCHELASTIC_RUN_ID", "none"))


def is_main(env: Optional[DistEnv]) -> bool:
    """Rank 0, or a process on its own: the one that writes."""
    return env is None or env.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, env: Optional[DistEnv]) -> torch.device:
    """Each rank drives its own GPU, cuda:LOCAL_RANK; CPU ranks share the CPU."""
    if env is not None and device.startswith("cuda"):
        return torch.device("cuda", env.local_rank)
    return torch.device(device)


def effective_parallel(recipe, env: Optional[DistEnv]) -> str:
    """Under torchrun every variant runs as DDP over its ranks."""
    return "ddp" if env is not None else recipe.parallel


def replicas(parallel: str, device: torch.device) -> int:
    """Devices one process drives: all visible GPUs under DataParallel, else one."""
    if parallel == "dp" and device.type == "cuda":
        return max(1, torch.cuda.device_count())
    return 1


# --- validation (called by config.build_plan, before anything trains) -----------------------------
def device_count(device_type: str) -> int:
    """How many devices of this type one node offers to processes: GPUs, or usable CPU cores."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cannot_launch(device_type: str) -> Optional[str]:
    """Why speedbench cannot launch DDP processes for this device type, or None when it can."""
    if not dist.is_available():
        return "this PyTorch build has no torch.distributed"
    if device_type == "cuda" and not dist.is_nccl_available():
        return "this PyTorch build has no NCCL backend for CUDA"
    if device_type == "cpu" and not dist.is_gloo_available():
        return "this PyTorch build has no gloo backend for the CPU"
    if device_type not in ("cuda", "cpu"):
        return f"DDP has no process-group backend for '{device_type}' (only cuda and cpu)"
    return None


def launch_nproc(recipe, device: str) -> int:
    """Processes speedbench launches for a ddp trial: `nproc`, else all GPUs, else 2 CPU ranks."""
    if recipe.nproc is not None:
        return recipe.nproc
    if device.startswith("cuda"):
        return torch.cuda.device_count()
    return min(CPU_DEFAULT_NPROC, device_count("cpu"))


def check_plan(plan, env: Optional[DistEnv]) -> None:
    """Checks that depend on how speedbench was started. Raises ConfigError."""
    kind = plan.device.split(":")[0]
    have = device_count(kind)
    noun = "CUDA devices" if kind == "cuda" else "CPU cores"
    if env is not None:
        reason = cannot_launch(kind)
        if reason:
            raise ConfigError(f"device: '{plan.device}' cannot run under torchrun: {reason}")
        if env.local_world_size > have:
            raise ConfigError(f"torchrun started {env.local_world_size} processes on this node "
                              f"but it has {have} {noun}; use --nproc_per_node={have} or fewer")
    for name, recipe in plan.variants.items():
        key = "parallel" if name == "default" else f"variants.{name}.parallel"
        if env is not None and recipe.parallel == "dp":
            raise ConfigError(f"{key}: 'dp' cannot run under torchrun (DataParallel is one process "
                              "driving all GPUs; under torchrun every variant already runs as DDP "
                              "over the ranks); use parallel=none or ddp, or run without torchrun")
        if env is None and recipe.parallel == "ddp":
            reason = cannot_launch(kind)
            if reason:
                raise ConfigError(f"{key}: 'ddp' needs a launcher and speedbench cannot launch one "
                                  f"here: {reason}; run speedbench under torchrun, or use "
                                  "parallel=none")
            n = launch_nproc(recipe, plan.device)
            where = "nproc" if name == "default" else f"variants.{name}.nproc"
            if n > have:
                raise ConfigError(f"{where}: {n} processes asked for, but this machine has {have} "
                                  f"{noun}; choose 1..{have}")


# --- the process group and the model -------------------------------------------------------
_failed = False  # set when a rank's trial failed: its process group is then left alone at exit
_joined = False  # set when this process joined a process group (see exit_cleanly)


def init_process_group(env: Optional[DistEnv], device: torch.device, timeout_s: float) -> None:
    """Join the torchrun job's process group (nothing when not under torchrun), once per process:
    a Hydra multirun calls run() once per job, and a group made again after being destroyed does
    not reliably find its peers. It is destroyed when the process exits cleanly."""
    if env is None or dist.is_initialized():
        return
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL binds to this rank's GPU
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), **kwargs)
    global _joined
    _joined = True
    atexit.register(_destroy_process_group)


TERM_GRACE_S = 20  # under torchrun's 30 s between its SIGTERM and its SIGKILL


def outlive_peer_failure(env: Optional[DistEnv]) -> None:
    """Let the writing rank record a peer's failure before torchrun stops it.

    When a rank fails, torchrun sends SIGTERM to the others at once (about 0.1 s later), often
    before rank 0 has reached the collective where it would see that failure and write its row.
    So rank 0 takes SIGTERM as notice, not as the end: it carries on into that collective, which
    fails fast once the peer is gone, writes the row and exits; a timer ends it after
    TERM_GRACE_S in any case, and a second SIGTERM ends it at once.
    """
    if env is None or not is_main(env) or threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        timer = threading.Timer(TERM_GRACE_S, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_term)


def exit_cleanly() -> None:
    """End a rank whose work is done and written: leave the process group with the other ranks,
    flush, and exit 0 without the interpreter's finalization. (Nothing when this process never
    joined a group.) With gloo, torch's C++ teardown during finalization aborts now and then
    ("terminate called without an active exception", SIGABRT or SIGSEGV, about one exit in
    seven on a loaded 2-core machine, after destroy_process_group had returned), and torchrun
    would then report a job that finished and wrote everything as failed."""
    if not _joined:
        return
    _destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _destroy_process_group() -> None:
    # After a failure the peers may be gone, and the process is ending anyway.
    if dist.is_initialized() and not _failed:
        # No rank may tear its connections down while a peer still talks to it: gloo's
        # background threads abort the process when a peer's socket closes under them.
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """The model as `parallel` says: DDP (one rank, one device), DataParallel (all GPUs), or bare.
    DDP broadcasts rank 0's weights at construction, so every rank starts equal."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)
    if parallel == "dp" and device.type == "cuda":
        first = device.index or 0  # replicas on every GPU; inputs and outputs on this one
        ids = [first] + [i for i in range(torch.cuda.device_count()) if i != first]
        return nn.DataParallel(model, device_ids=ids)
    return model


def sampler(dataset, env: Optional[DistEnv], seed: int):
    """Each rank reads its own shard: DistributedSampler (shuffled, seeded); None on its own."""
    if env is None:
        return None
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                              seed=seed, drop_last=True)


# --- stepping together ---------------------------------------------------------------------
def _agree(value: float, device: torch.device, op) -> float:
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def warm_up(step: Callable[[], None], max_steps: int, device: torch.device,
            budget_s: Optional[float]) -> tuple[float, int]:
    """Untimed warm-up steps, stopping on every rank as soon as one rank is over the budget
    (one small all-reduce per step: harmless here, as nothing is being timed)."""
    return timed_steps(step, max_steps, device, budget_s,
                       agree=lambda over: bool(_agree(over, device, dist.ReduceOp.MAX)))


def agree_steps(wanted: int, warm_s: float, warm_steps: int, budget_s: Optional[float],
                device: torch.device) -> int:
    """Timed steps for every rank: the most that fit the window's budget at the warm-up's pace
    on the slowest rank (at least one), and never more than `wanted`."""
    n = wanted
    if budget_s is not None and warm_steps:
        n = max(1, min(wanted, int(budget_s / (warm_s / warm_steps))))
    n = int(_agree(n, device, dist.ReduceOp.MIN))
    dist.barrier()  # the ranks start the window together
    return n


def gather_record(record: dict, env: DistEnv) -> dict:
    """Every rank's record gathered (all_gather_object); the combined one returned on all ranks."""
    records: list = [None] * env.world_size
    dist.all_gather_object(records, record)
    return combine(records)


def combine(records: list[dict]) -> dict:
    """One row for the job: global throughput is all ranks' samples over the slowest rank's
    window; memory is the largest rank's; the loss is the ranks' mean."""
    first = records[0]
    slowest = max(r["elapsed_s"] for r in records)
    statuses = [r["status"] for r in records if r["status"] != "ok"]
    return {
        **first,
        "status": statuses[0] if statuses else "ok",
        "samples_per_s": sum(r["samples"] for r in records) / slowest,
        "step_ms": 1000 * slowest / first["steps"],
        "elapsed_s": slowest,
        "data_wait_frac": sum(r["data_wait_frac"] for r in records) / len(records),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in records),
        "host_rss_mb": max(r["host_rss_mb"] for r in records),
        "host_rss_main_mb": max(r["host_rss_main_mb"] for r in records),
        "final_loss": sum(r["final_loss"] for r in records) / len(records),
        "samples": sum(r["samples"] for r in records),
        "rank_step_ms": ";".join(f"{r['step_ms']:.2f}" for r in records),
    }


def failure_status(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", text)[:160]  # gloo's `[/path/pair.cc:561] ` prefix
    return f"error: {type(exc).__name__}: {text}"


def with_rank(status: str, rank: int) -> str:
    """`error: X: msg` -> `error: rank R: X: msg`; `oom` -> `oom (rank R)`."""
    kind, sep, rest = status.partition(": ")
    return f"{kind}: rank {rank}: {rest}" if sep else f"{status} (rank {rank})"


FAILURE_KEY = "speedbench/failure/"


def report_failure(exc: BaseException, env: DistEnv, where: str) -> str:
    """A rank's trial failed: say so on stderr, leave the failure in the job's key-value store,
    and return the status for the row: the first failure of any rank, so that rank 0 records
    the root cause rather than the lost connection it saw. torchrun then stops the job."""
    global _failed
    _failed = True
    status = failure_status(exc)
    print(f"speedbench: rank {env.rank} of {env.world_size} failed in {where}: "
          f"{status.removeprefix('error: ')}", file=sys.stderr, flush=True)
    first = (time.time(), env.rank, status)
    try:
        # The store torchrun's agent serves to the ranks; it outlives a failed rank.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{FAILURE_KEY}{env.rank}", json.dumps([first[0], status]))
        for r in range(env.world_size):
            if store.check([f"{FAILURE_KEY}{r}"]):
                t, st = json.loads(store.get(f"{FAILURE_KEY}{r}"))
                first = min(first, (t, r, st))
    except Exception:  # no process group or store: this rank's own failure is the record
        pass
    return with_rank(first[2], first[1])


def describe(env: Optional[DistEnv], device: torch.device) -> dict:
    """For env.json: how this run was spread over processes."""
    if env is None:
        return {"world_size": 1}
    return {"world_size": env.world_size, "local_world_size": env.local_world_size,
            "nnodes": max(1, env.world_size // max(1, env.local_world_size)),
            "backend": backend_for(device), "run_id": env.run_id,
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT")}


# --- launching torchrun from inside speedbench ---------------------------------------------
def launch_timeout_s(recipe) -> Optional[float]:
    """Wall time allowed to a launched trial: start-up and rendezvous (dist_timeout_s), then a
    warm-up and a window each capped by max_trial_s. None without a cap."""
    if recipe.bench.max_trial_s is None:
        return None
    return recipe.dist_timeout_s + 2 * recipe.bench.max_trial_s


def launch_trial(plan, spec, variant: str, recipe, trial: int) -> dict:
    """One DDP trial over `nproc` processes started through torchrun; rank 0's combined record,
    or a record whose status says which rank failed and why."""
    nproc = launch_nproc(recipe, plan.device)
    package_root = str(Path(__file__).resolve().parents[1])  # the speedbench the parent runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="speedbench-ddp-") as tmp:
        job = Path(tmp)
        (job / "job.pkl").write_bytes(pickle.dumps(
            {"plan": plan, "spec": spec, "variant": variant, "recipe": recipe, "trial": trial}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "speedbench.distributed", str(job)]
        limit = launch_timeout_s(recipe)
        # A session of its own, so that a timeout kills torchrun and all its workers.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            return {"status": f"error: DDP trial over {nproc} processes did not end within "
                              f"{limit:.0f} s (dist_timeout_s + 2 x bench.max_trial_s)"}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if os.environ.get("SPEEDBENCH_DEBUG"):
            print(output, file=sys.stderr)
        record_file = job / "record.json"
        if proc.returncode == 0 and record_file.exists():
            return json.loads(record_file.read_text())
        return {"status": _launch_failure(job, proc.returncode, output), "world_size": nproc}


def _launch_failure(job: Path, returncode: int, output: str) -> str:
    """The first rank's failure as a row status: `error: rank R: Type: message`."""
    errors = []
    for path in job.glob("rank*.error.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass  # a rank killed while writing: the others' records still tell
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return with_rank(first["status"], first["rank"])
    lines = [ln.strip() for ln in output.splitlines()
             if re.match(r"^\s*\w+(Error|Exception)\b.*:", ln)]
    detail = lines[-1][:160] if lines else "no message (SPEEDBENCH_DEBUG=1 shows its output)"
    return f"error: torchrun exited with status {returncode}: {detail}"


def _write_rank_error(job: Path, env: DistEnv, exc: BaseException) -> None:
    # Written then renamed: torchrun may kill this rank at any moment once a peer has failed,
    # and the launcher must never read half a file.
    tmp = job / f".rank{env.rank}.error.json.tmp"
    tmp.write_text(json.dumps({"rank": env.rank, "time": time.time(),
                               "status": failure_status(exc), "traceback": traceback.format_exc()}))
    tmp.replace(job / f"rank{env.rank}.error.json")


def _worker(job: Path) -> None:
    """One rank of a launched DDP trial (run by torchrun)."""
    from speedbench.data import build_dataset
    from speedbench.run import dataset_length, measure_trial

    env = from_environ()
    if env is None:
        raise SystemExit("speedbench.distributed: run me through torchrun (speedbench does this)")
    job_data = pickle.loads((job / "job.pkl").read_bytes())
    plan, spec, recipe = job_data["plan"], job_data["spec"], job_data["recipe"]
    device = rank_device(plan.device, env)
    try:
        init_process_group(env, device, recipe.dist_timeout_s)
        dataset = build_dataset(spec.dataset, dataset_length(plan, spec, env.world_size),
                                recipe.data.path, seed=recipe.bench.seed)
        record = measure_trial(plan, spec, job_data["variant"], recipe, job_data["trial"],
                               dataset, dist_env=env)
    except BaseException as exc:
        _write_rank_error(job, env, exc)
        report_failure(exc, env, f"model {spec.name}, variant {job_data['variant']}")
        raise
    if is_main(env):
        (job / "record.json").write_text(json.dumps(record, default=float))
    exit_cleanly()


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m speedbench.distributed JOB_DIR (run by speedbench)")
    record(_worker)(Path(args[0]))


if __name__ == "__main__":
    main()
