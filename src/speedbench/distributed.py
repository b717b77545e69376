"""Data parallelism's runtime: torchrun's environment, the process group, each rank's shard,
the ranks stepping together, and one record for the job.

A variant runs as DDP in one of two ways:
- the user starts speedbench under torchrun (`torchrun --nproc_per_node=N -m speedbench ...`):
  every rank runs the whole experiment, each variant as DDP over the N ranks, and rank 0 alone
  writes the run directory (the ranks' clocks may disagree on its timestamp);
- a variant sets `parallel=ddp` in a plain `python -m speedbench` run: speedbench.measure.launch starts
  each of its trials under torchrun.
Wrapping the model (DDP, DataParallel) is the parallel technique's (techniques/parallel.py).

Under DDP every rank must take the same number of steps, or the ranks left behind wait in an
all-reduce forever: warm-up steps are agreed one by one (untimed), the timed window's length
once, from the warm-up's pace. A rank that fails raises, so torchrun stops the job; the process
group's timeout (`dist_timeout_s`) bounds any wait on a peer that is gone.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from speedbench import errors
from speedbench.errors import ConfigError
from speedbench.results import schema

@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in a torchrun job (from the variables torchrun sets)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    run_id: str  # TORCHELASTIC_RUN_ID: the same on every rank of one job


class DistEnvError(ConfigError):
    """torchrun's variables in this process's environment do not make a job it can join (a
    leftover RANK in a cluster shell, a peer that never came): one line, nothing written."""


LEFTOVER = ("unset RANK and WORLD_SIZE if they are leftovers of another job (a cluster shell), "
            "or start speedbench through torchrun")


def _int_var(environ: Mapping[str, str], name: str, default: Optional[str] = None) -> int:
    text = environ.get(name, default)
    try:
        return int(str(text).strip())
    except ValueError:
        raise DistEnvError(f"{name}={str(text)[:40]!r} is not an integer (torchrun's variables "
                           f"make this process a rank): {LEFTOVER}") from None


def from_environ(environ: Mapping[str, str] = os.environ) -> Optional[DistEnv]:
    """The torchrun job this process is a rank of, or None when it runs on its own.
    DistEnvError when the variables do not make a job (not integers, a rank outside the
    world)."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
    local_rank = _int_var(environ, "LOCAL_RANK", environ["RANK"])
    local_world = _int_var(environ, "LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])
    if not (world >= 1 and 0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise DistEnvError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local_rank}, "
                           f"LOCAL_WORLD_SIZE={local_world} make no torchrun job (0 <= rank < "
                           f"world size): {LEFTOVER}")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=local_world, run_id=environ.get("TORCHELASTIC_RUN_ID", "none"))


def join(env: Optional[DistEnv], device: torch.device, timeout_s: float) -> None:
    """The process group joined before anything is written (nothing without torchrun): a job
    whose rendezvous variables are missing, or whose peers do not all come within
    dist_timeout_s, is refused in one line (DistEnvError), with no run directory left."""
    if env is None:
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise DistEnvError(f"RANK={env.rank} and WORLD_SIZE={env.world_size} are set but "
                           f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                           f"not: {LEFTOVER}")
    try:
        init_process_group(env, device, timeout_s)
    except Exception as exc:  # a peer that never came, an address that does not answer
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise DistEnvError(
            f"could not join torchrun's job as rank {env.rank} of {env.world_size} at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within dist_timeout_s="
            f"{timeout_s:g} s ({type(exc).__name__}: {text}); nothing was written: start every "
            f"rank, or {LEFTOVER}") from None


def launcher(env: Optional[DistEnv], parent: Optional[list[str]] = None) -> list[str]:
    """The words that start this run again as it was started, for the commands speedbench
    prints: `speedbench` on its own; under torchrun the launcher and its options as given
    (the parent process's command line, `parent` in tests), through `-m speedbench`, else
    `torchrun --nproc_per_node=N [--nnodes=M] -m speedbench` from the job's variables."""
    if env is None:
        return ["speedbench"] + _sweep_launcher_words()
    if parent is None:
        try:
            import psutil

            parent = psutil.Process(os.getppid()).cmdline()
        except Exception:  # gone, or not ours to read
            parent = []
    words = _launcher_words(parent)
    if words:
        return _in_slurm_job(words)
    nodes = env.world_size // max(1, env.local_world_size)
    return (["torchrun", f"--nproc_per_node={env.local_world_size}"]
            + ([f"--nnodes={nodes}"] if nodes > 1 else []) + ["-m", "speedbench"])


def _sweep_launcher_words() -> list[str]:
    """Inside a SLURM job of a `-m hydra/launcher=slurm...` sweep (submitit sets
    SUBMITIT_FOLDER in the job): `-m` and the sweep's launcher overrides, so that the printed
    command submits again rather than running on the login node; [] elsewhere."""
    if not os.environ.get("SUBMITIT_FOLDER"):
        return []
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.hydra)
    except Exception:  # no Hydra run here (a test, the report tool)
        return []
    words = [o for o in given if o.startswith(("hydra/launcher=", "hydra.launcher."))]
    return ["-m", *words] if words else []


def _in_slurm_job(words: list[str]) -> list[str]:
    """torchrun's words inside a SLURM job (`srun torchrun ...`): as `srun torchrun ...`, and
    without this job's `--rdzv_id` (a finished job's id; pasted in another job's script,
    torchrun's default id serves); unchanged outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return words
    kept: list[str] = []
    for i, w in enumerate(words):
        if w == f"--rdzv_id={job}" or (w == job and words[i - 1:i] == ["--rdzv_id"]) or \
                (w == "--rdzv_id" and words[i + 1:i + 2] == [job]):
            continue
        kept.append(w)
    return ["srun", *kept]


def _launcher_words(cmdline: list[str]) -> list[str]:
    """torchrun's words in its command line, from the launcher through the entry that runs
    speedbench (`-m speedbench`, or a `speedbench` script); [] when none is found."""
    names = [os.path.basename(w) for w in cmdline]
    if "torchrun" in names:
        start, head = names.index("torchrun") + 1, ["torchrun"]
    elif "torch.distributed.run" in cmdline:
        start = cmdline.index("torch.distributed.run") + 1
        head = ["python", "-m", "torch.distributed.run"]
    else:
        return []
    for i in range(start, len(cmdline)):
        if cmdline[i] == "-m" and cmdline[i + 1:i + 2] == ["speedbench"]:
            return head + cmdline[start:i] + ["-m", "speedbench"]
        if names[i] == "speedbench":  # torchrun --no-python speedbench
            return head + cmdline[start:i] + ["speedbench"]
    return []


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


# --- what this machine offers (config.check_plan asks, before anything trains) ----------------
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


# --- the process group ------------------------------------------------------------------------
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
    """Let the writing rank record a peer's failure before torchrun stops it, and stop at once
    when the SIGTERM is a stop.

    When a rank fails, torchrun sends SIGTERM to the others at once (about 0.1 s later), often
    before rank 0 has reached the collective where it would see that failure and write its row.
    So where a peer failed (peer_failed), rank 0 takes SIGTERM as notice, not as the end: it
    carries on into that collective, which fails fast once the peer is gone, writes the row and
    exits; a timer ends it after TERM_GRACE_S in any case, and a second SIGTERM ends it at once.
    Where no peer failed, the SIGTERM is a stop (a user's `kill` of this worker, a cluster's
    stop of the job): it is taken by the handler that was there before, as Ctrl-C is.
    """
    if env is None or not is_main(env) or threading.current_thread() is not threading.main_thread():
        return
    before = signal.getsignal(signal.SIGTERM)
    before = getattr(before, "taken_from", before)  # a sweep's next job: the command's own

    def on_term(signum, frame):
        if _termed:  # a second SIGTERM: at once
            os._exit(128 + signum)
        if not peer_failed(env):
            _stopped_alone[:] = [signum]
            signal.signal(signal.SIGTERM, before)  # a second one: the stop's own handling
            return _stop(before, signum, frame)
        _termed.append(signum)
        timer = threading.Timer(TERM_GRACE_S, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    on_term.taken_from = before
    signal.signal(signal.SIGTERM, on_term)


def _stop(handler, signum: int, frame) -> None:
    """A stop signal taken as the handler before outlive_peer_failure's would (the command's:
    interrupted, what was kept, the signal's exit status), or as a Terminated stop."""
    if callable(handler):
        handler(signum, frame)
        return
    say_stopped(signum)
    raise errors.ask_to_stop(errors.Terminated(signum))


def peer_failed(env: DistEnv) -> bool:
    """Whether a SIGTERM to this rank is torchrun's notice of a peer's failure: a rank left its
    failure in the job's store (report_failure), or one of this node's ranks is gone. With ranks
    on other nodes, whose processes cannot be seen from here, it is taken as notice too.
    Otherwise every peer is alive and none failed: the signal was a stop."""
    if env.world_size > env.local_world_size:
        return True
    failed: list[bool] = []

    def ask():  # bounded: a store that does not answer within 1 s is not waited for
        failed.append(bool(_failed_keys(env)))

    asker = threading.Thread(target=ask, name="speedbench-peers", daemon=True)
    asker.start()
    asker.join(1.0)
    return failed != [False] or _local_peers_alive() < env.local_world_size - 1


def _local_peers_alive() -> int:
    """This node's other ranks still running: the launcher's children that run this rank's
    command line (torchrun starts every local rank so), zombies not counted; -1 when the
    processes cannot be read."""
    try:
        import psutil

        me = psutil.Process()
        command = me.cmdline()
        alive = 0
        for peer in psutil.Process(me.ppid()).children():
            try:
                if peer.pid != me.pid and peer.cmdline() == command \
                        and peer.status() != psutil.STATUS_ZOMBIE:
                    alive += 1
            except psutil.Error:  # it ended as it was read
                continue
        return alive
    except Exception:  # no psutil, or the launcher is not ours to read
        return -1


def stopped_alone() -> Optional[int]:
    """The signal that stopped this rank without any peer's failure (outlive_peer_failure):
    one aimed at this worker (or at the whole job); None when there was none."""
    return _stopped_alone[0] if _stopped_alone else None


def leave_now(code: int, joined: bool = False) -> None:
    """End a rank that joined a process group (or `joined`) now, with `code`, without the
    barrier at exit or torch's teardown: after a stop or a failure the peers may be gone, and
    the barrier would wait for them (dist_timeout_s) and then print a traceback. Nothing when
    this process never joined one."""
    if not (_joined or joined):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STOP_KEY = "speedbench/stop/"  # + rank: that rank was told to stop (a signal), not failed


def say_stopped(signum: int) -> None:
    """This rank was told to stop (torchrun forwards the user's signal to every rank): it says
    so in the job's store, so that rank 0 records an interrupted run rather than blaming it as
    a rank that died; the process group is not waited for at exit. Bounded: a store that does
    not answer within 1 s is not waited for."""
    global _failed
    if not _joined:
        return
    _failed = True  # leave at exit without the barrier (peers are stopping too)

    def tell():
        try:
            dist.distributed_c10d._get_default_store().set(
                f"{STOP_KEY}{dist.get_rank()}", str(signum))
        except Exception:
            pass

    teller = threading.Thread(target=tell, name="speedbench-stop", daemon=True)
    teller.start()
    teller.join(1.0)


def peers_stopped(env: DistEnv, wait_s: float = 2.0) -> Optional[int]:
    """The signal every other rank of the job was told to stop by, when each of them said so
    (say_stopped): a user's stop forwarded by torchrun, not a failure. None when one of them
    did not: it died or failed (a few seconds are given to the others once one has said it)."""
    others = [r for r in range(env.world_size) if r != env.rank]
    try:
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + wait_s
        while True:
            said = [r for r in others if store.check([f"{STOP_KEY}{r}"])]
            if not others or not said or len(said) == len(others) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not others or len(said) < len(others):
            return None
        return int(store.get(f"{STOP_KEY}{others[0]}").decode())
    except Exception:  # no process group or store
        return None


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


_termed: list[int] = []  # rank 0's SIGTERM, taken as notice (outlive_peer_failure)
_stopped_alone: list[int] = []  # rank 0's SIGTERM, taken as a stop (outlive_peer_failure)


def _destroy_process_group() -> None:
    # After a failure or a stop the peers may be gone, and the process is ending anyway.
    if dist.is_initialized() and not _failed and errors.stopping() is None:
        # No rank may tear its connections down while a peer still talks to it: gloo's
        # background threads abort the process when a peer's socket closes under them.
        dist.barrier()
        dist.destroy_process_group()


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


def same_on_every_rank(value: int, env: Optional[DistEnv]) -> int:
    """Rank 0's `value` on every rank (as is without torchrun)."""
    if env is None or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank as soon as one rank says so (one small all-reduce)."""
    return bool(_agree(flag, device, dist.ReduceOp.MAX))


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
    window; memory (a tensor peak, or on the CPU a process's RSS growth, each its own column)
    and the stall are the largest rank's; the loss is the ranks' mean; the FLOPs of a step are
    all ranks' (each rank counted its own micro-batches), so that the job's FLOP/s is compared
    with the whole machine's peak (FlopsBook.annotate)."""
    first = records[0]
    slowest = max(r["elapsed_s"] for r in records)
    statuses = [r["status"] for r in records if r["status"] != schema.OK]
    return {
        **first,
        "status": statuses[0] if statuses else schema.OK,
        "samples_per_s": sum(r["samples"] for r in records) / slowest,
        "step_ms": 1000 * slowest / first["steps"],
        "elapsed_s": slowest,
        "data_wait_frac": sum(r["data_wait_frac"] for r in records) / len(records),
        "peak_mem_mb": _largest(r.get("peak_mem_mb") for r in records),
        "rss_growth_mb": _largest(r.get("rss_growth_mb") for r in records),
        "flops_per_step": sum(r.get("flops_per_step", math.nan) for r in records),
        "host_rss_mb": max(r["host_rss_mb"] for r in records),
        "host_rss_main_mb": max(r["host_rss_main_mb"] for r in records),
        "final_loss": sum(r["final_loss"] for r in records) / len(records),
        "samples": sum(r["samples"] for r in records),
        "rank_step_ms": ";".join(f"{r['step_ms']:.2f}" for r in records),
        "stall_ms": max(r.get("stall_ms", 0.0) for r in records),  # one rank's stalls the job
        "step_s": _slowest_steps([r.get("step_s") for r in records]),
    }


def _largest(values) -> float:
    """The largest of the ranks' values that were measured (NaN where none was)."""
    got = [float(v) for v in values if v is not None and v == v]
    return max(got) if got else math.nan


def _slowest_steps(per_rank: list) -> Optional[list[float]]:
    """The job's step times: each step the slowest rank's (the ranks meet at every step's
    gradient all-reduce); None unless every rank timed the same steps."""
    if not per_rank or any(not s for s in per_rank) or len({len(s) for s in per_rank}) != 1:
        return None
    return [max(step) for step in zip(*per_rank)]


# How the CPU allocator (and Python) say they ran out of memory.
CPU_OOM = re.compile(r"can't allocate memory|DefaultCPUAllocator|Cannot allocate memory")


def failure_status(exc: BaseException) -> str:
    """`oom`, or `error: Type: first line of the message` followed by what caused it (an
    instantiation error says which constructor failed, its cause says why)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or CPU_OOM.search(str(exc)):
        return schema.OOM
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", text)  # gloo's `[/path/pair.cc:561] ` prefix
        text = re.sub(r"[\x00-\x1f\x7f]", " ", text)  # a NUL or a control character: a space
        parts.append(f"{type(exc).__name__}: {text.rstrip(':')}"[:160])
        exc = exc.__cause__
    return schema.format_status(schema.ERROR, "; caused by ".join(parts))


def with_rank(status: str, rank: int) -> str:
    """`error: X: msg` -> `error: rank R: X: msg`; `oom` -> `oom (rank R)`."""
    st = schema.parse_status(status)
    reason = f"rank {rank}: {st.reason}" if st.reason else f"rank {rank}"
    return schema.format_status(st.kind, reason)


# How a rank sees a peer that died (SIGKILL, the OOM killer, a segfault): its socket closes.
LOST_PEER = re.compile(r"connection (reset|closed)|broken pipe|peer closed|end of file",
                       re.IGNORECASE)


def blame(status: str, rank: int, reported: set, world_size: int,
          deaths: Optional[dict] = None) -> str:
    """The row status for a failed job whose first failure was `status` on `rank`. The ranks
    that reported nothing are the cause when that failure is a timeout (they hung: the others
    only waited) or a lost connection (they died: the others only lost them); `deaths` (rank ->
    signal name, from torchrun's summary) says how a rank died when that is known."""
    silent = sorted(set(range(world_size)) - set(reported))
    seen = f"rank {rank}: {schema.reason_of(status)}"
    if silent and re.search(r"timed? ?out", status, re.IGNORECASE):
        ranks = ", ".join(map(str, silent))
        return schema.format_status(schema.ERROR, f"rank {ranks} hung: no answer within "
                                    f"dist_timeout_s ({seen})")
    if silent and LOST_PEER.search(status):
        died = "; ".join(f"rank {r} died: {(deaths or {}).get(r, 'its connection was lost')}"
                         for r in silent)
        return schema.format_status(schema.ERROR, f"{died} ({seen})")
    return with_rank(status, rank)


def clear_failure() -> None:
    """Forget an earlier command's failed trial (a process that runs several: the CLI called
    in-process, a sweep's jobs)."""
    global _failed
    _failed = False


def failed() -> bool:
    """Whether a trial of this rank failed (report_failure has said so in one line)."""
    return _failed


FAILURE_KEY = "speedbench/failure/"


def report_failure(exc: BaseException, env: DistEnv, where: str) -> str:
    """A rank's trial failed: say so on stderr, leave the failure in the job's key-value store,
    and return the status for the row: the first failure of any rank, so that rank 0 records
    the root cause rather than the lost connection it saw. torchrun then stops the job."""
    global _failed
    _failed = True
    errors.stop_if_asked()  # this rank was told to stop: not a failure of the job
    stopped = None if any(_failed_keys(env)) else peers_stopped(env)
    if stopped is not None:  # every other rank was told to stop: the user stopped the job
        raise errors.ask_to_stop(KeyboardInterrupt() if stopped == signal.SIGINT
                                 else errors.Terminated(stopped))
    status = failure_status(exc)
    print(f"speedbench: rank {env.rank} of {env.world_size} failed in {where}: "
          f"{schema.reason_of(status) or status}", file=sys.stderr, flush=True)
    first, reported = (time.time(), env.rank, status), {env.rank}
    try:
        # The store torchrun's agent serves to the ranks; it outlives a failed rank.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{FAILURE_KEY}{env.rank}", json.dumps([first[0], status]))
        for r in range(env.world_size):
            if store.check([f"{FAILURE_KEY}{r}"]):
                t, st = json.loads(store.get(f"{FAILURE_KEY}{r}"))
                first, reported = min(first, (t, r, st)), reported | {r}
        # a rank torchrun stopped because of the failure said so: it is not blamed for it
        told = {r for r in range(env.world_size) if store.check([f"{STOP_KEY}{r}"])}
    except Exception:  # no process group or store: this rank's own failure is the record
        return with_rank(status, env.rank)
    return blame(first[2], first[1], reported | told, env.world_size)


def _failed_keys(env: DistEnv) -> list[int]:
    """The ranks that left a failure in the job's store (report_failure)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return [r for r in range(env.world_size) if store.check([f"{FAILURE_KEY}{r}"])]
    except Exception:
        return []


def describe(env: Optional[DistEnv], device: torch.device) -> dict:
    """For env.json: how this run was spread over processes."""
    if env is None:
        return {"world_size": 1}
    return {"world_size": env.world_size, "local_world_size": env.local_world_size,
            "nnodes": max(1, env.world_size // max(1, env.local_world_size)),
            "backend": backend_for(device), "run_id": env.run_id,
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT")}
