"""Launching torchrun from inside speedbench, for a trial that needs several processes.

A variant with `parallel=ddp` in a plain `python -m speedbench` run has each of its trials
launched as `python -m torch.distributed.run --standalone -m speedbench.measure.launch JOB_DIR` (`main`
below is each rank's entry point), and rank 0's record comes back as a file (a pickle). One
launch per trial keeps the variants interleaved; the launch itself is outside the timed window.
The quality probe and the forecasts' profile of such a variant are launched alike
(launch_call: a named function run on every rank).
The run's clock holds a launched trial as it holds one in this process: its ranks get the
deadline (their warm-up and window stop at it between steps) and the launch is killed
BUDGET_GRACE_S past it, whatever it is doing (starting, meeting its peers, a step, a hang).

A trial that needs environment variables set at start-up (LD_PRELOAD for another malloc) but
one process is not launched here: it runs as an arm of this interpreter with those variables
(studies/arms.variant_arm), the A/B's worker process.
"""
from __future__ import annotations

import ctypes
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from speedbench.measure.data import build_dataset
from speedbench.distributed import (DistEnv, blame, exit_cleanly, failure_status, from_environ,
                                    init_process_group, is_main, rank_device, report_failure)
from speedbench.measure.budget import Budget
from speedbench.measure.flops import FlopsBook
from speedbench.measure.trial import BUDGET_GRACE_S, dataset_length, header, measure_trial
from speedbench.results import schema


def launch_timeout_s(recipe) -> Optional[float]:
    """Wall time allowed to a launched trial: start-up and rendezvous (dist_timeout_s), then a
    warm-up and a window each capped by max_trial_s. None without a cap."""
    if recipe.bench.max_trial_s is None:
        return None
    return recipe.dist_timeout_s + 2 * recipe.bench.max_trial_s


def launch_limit(recipe, budget: Optional[Budget]) -> tuple[Optional[float], bool]:
    """(the seconds a launched trial started now may take, whether the run's budget sets
    them): launch_timeout_s, or the budget's seconds left and BUDGET_GRACE_S where that is
    less (None: neither limits it)."""
    own = launch_timeout_s(recipe)
    left = None if budget is None else budget.limit(None)
    if left is None or (own is not None and own <= left + BUDGET_GRACE_S):
        return own, False
    return left + BUDGET_GRACE_S, True


def launch_trial(plan, spec, variant: str, recipe, trial: int, nproc: int,
                 position: int = 0, book: Optional[FlopsBook] = None,
                 env: Optional[dict] = None, budget: Optional[Budget] = None) -> dict:
    """One trial over `nproc` processes started through torchrun, each started with `env` on
    top of ours: rank 0's combined record (its peak from `book`, which the parent holds), or
    one whose status says which rank failed and why. `budget`: the run's clock; the ranks'
    warm-up and window stop at its deadline, and the launch is killed BUDGET_GRACE_S past it
    (status `not measured: ...`)."""
    record = header(plan, spec, variant, recipe, trial, position=position)
    record.update({"world_size": nproc, "devices": nproc})
    started = time.perf_counter()
    record.update(launch_call(plan, spec, variant, recipe, nproc, trial_on_rank,
                              {"trial": trial, "position": position}, env, budget))
    record["launch_s"] = time.perf_counter() - started  # where a launch's time goes
    return book.annotate(record) if book is not None else record


def launch_call(plan, spec, variant: str, recipe, nproc: int, work: Callable[..., dict],
                args: dict, env: Optional[dict] = None, budget: Optional[Budget] = None
                ) -> dict:
    """`work(plan, spec, variant, recipe, dataset, dist_env, budget, **args)` on each of
    `nproc` ranks started through torchrun (a module-level function: the ranks import it by
    name), each started with `env` on top of ours: rank 0's result, or {"status": which rank
    failed and why, or that the run's budget ran out}. The ranks get `budget`'s deadline."""
    return _launched(plan, spec, variant, recipe, nproc, env or {}, budget, work, args)


def trial_on_rank(plan, spec, variant: str, recipe, dataset, dist_env, budget,
                  trial: int, position: int) -> dict:
    """A launched trial's work on one rank: its record (the ranks' combined one)."""
    return measure_trial(plan, spec, variant, recipe, trial, dataset, dist_env=dist_env,
                         position=position, budget=budget)


def _command(job: Path, nproc: int) -> list[str]:
    """torchrun, through this module's --torchrun (see torchrun_main): it dies with us."""
    me = [sys.executable, "-m", "speedbench.measure.launch"]
    return me + [TORCHRUN, str(job), "--standalone", f"--nproc_per_node={nproc}",
                 f"--log-dir={job / 'logs'}",  # not a temp folder
                 "-m", "speedbench.measure.launch", str(job)]


def _launched(plan, spec, variant: str, recipe, nproc: int, extra_env: dict,
              budget: Optional[Budget], work: Callable[..., dict], args: dict) -> dict:
    """Rank 0's result as it comes back from torchrun, or a status saying what failed."""
    package_root = str(Path(__file__).resolve().parents[2])  # the speedbench the parent runs
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="speedbench-launch-") as tmp:
        job = Path(tmp)
        limit, by_budget = launch_limit(recipe, budget)
        # the deadline on the wall clock, which the ranks share with this process
        deadline = None if budget is None or budget.seconds is None \
            else time.time() + budget.left()
        (job / "job.pkl").write_bytes(pickle.dumps(
            {"plan": plan, "spec": spec, "variant": variant, "recipe": recipe, "work": work,
             "args": args, "intra_op": torch.get_num_threads(), "deadline": deadline}))
        cmd = _command(job, nproc)
        started = time.perf_counter()
        # A session of its own, so that a timeout kills torchrun and all its workers.
        proc = subprocess.Popen(cmd, env={**env, PARENT_PID: str(os.getpid())},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        LIVE[proc.pid] = job
        try:
            output, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            return {"status": _timed_out(limit, by_budget, nproc,
                                         time.perf_counter() - started)}
        finally:
            LIVE.pop(proc.pid, None)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if os.environ.get("SPEEDBENCH_DEBUG"):
            print(output, file=sys.stderr)
        result_file = job / RESULT
        if proc.returncode == 0 and result_file.exists():
            return pickle.loads(result_file.read_bytes())
        return {"status": _launch_failure(job, proc.returncode, output, nproc),
                "world_size": nproc}


def _timed_out(limit: float, by_budget: bool, nproc: int, took_s: float) -> str:
    """A launch killed at its limit: out of the run's time, or a trial that did not end."""
    if by_budget:
        return schema.format_status(
            schema.NOT_MEASURED, f"the run's bench.time_budget_s ran out in its launch over "
            f"{nproc} processes (torchrun), stopped after {took_s:.1f} s")
    return f"error: DDP trial over {nproc} processes did not end within {limit:.0f} s " \
        "(dist_timeout_s + 2 x bench.max_trial_s)"


def rank_budget(deadline: Optional[float]) -> Optional[Budget]:
    """A rank's share of the run's clock: the seconds to the parent's deadline (time.time(),
    the clock the processes share), None without one."""
    if deadline is None:
        return None
    now = time.time()
    return Budget(max(0.0, deadline - now), time.time, now)


RESULT = "result.pkl"  # rank 0's result, in the job folder

# the launched trial or arm worker running now: its process group -> its temp folder
LIVE: dict[int, Path] = {}


def abandon() -> None:
    """What a stop that cannot wait for the cleanup does (a second signal): the launched
    trial's processes killed and its job folder removed, at once."""
    for pid, job in list(LIVE.items()):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        shutil.rmtree(job, ignore_errors=True)


# Every process of a launched trial ends with the one that started it, however that ends
# (a timeout, Ctrl-C, SIGTERM, SIGKILL): speedbench -> torchrun -> ranks, each asks Linux for
# a signal when its parent dies (PR_SET_PDEATHSIG), since torchrun starts each rank in a session
# of its own, out of reach of a signal to torchrun's process group.
TORCHRUN = "--torchrun"
PARENT_PID, LAUNCHER_PID = "SPEEDBENCH_PARENT_PID", "SPEEDBENCH_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent_variable: str) -> None:
    """Get `sig` when the parent process (pid in the environment variable) ends; leave at once
    if it has already ended. Nothing where prctl does not exist (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    expected = os.environ.get(parent_variable)
    if expected and os.getppid() != int(expected):  # it ended before prctl took effect
        os._exit(1)


def torchrun_main(job: Path, args: list[str]) -> None:
    """torchrun for one launched trial. SIGTERM when speedbench ends: torchrun then stops its
    ranks; the job folder is removed here when speedbench is gone (else speedbench does it)."""
    parent = int(os.environ.get(PARENT_PID, "0"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # until torchrun's

    def remove_job_when_orphaned():  # first thing, whatever torchrun's shutdown does next
        while os.getppid() == parent:
            time.sleep(0.2)
        _remove(job)

    if parent:  # (launch_trial always sets it)
        threading.Thread(target=remove_job_when_orphaned, daemon=True).start()
    try:
        die_with_parent(signal.SIGTERM, PARENT_PID)
        os.environ[LAUNCHER_PID] = str(os.getpid())
        from torch.distributed.run import main as torchrun

        torchrun(args)
    except BaseException as exc:
        # A signal here is speedbench's death (PDEATHSIG). It comes when the thread that started
        # torchrun ends, while the rest of speedbench may still be exiting and getppid() still
        # names it: wait for it to be gone, so that the job folder is removed below.
        if type(exc).__name__ == "SignalException" or (
                isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM):
            deadline = time.monotonic() + 5
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        raise
    finally:
        if parent and os.getppid() != parent:
            _remove(job)


def _remove(job: Path, tries: int = 50) -> None:
    """Remove the job folder, again while the stopping ranks and torchrun's log writers still
    create files in it (one rmtree can then fail on a directory that is no longer empty)."""
    for _ in range(tries):
        shutil.rmtree(job, ignore_errors=True)
        if not job.exists():
            return
        time.sleep(0.1)


def _launch_failure(job: Path, returncode: int, output: str, nproc: int) -> str:
    """The first rank's failure as a row status: `error: rank R: Type: message`; when that is
    a timeout, the ranks that reported nothing are named as the ones that hung."""
    errors = []
    for path in job.glob("rank*.error.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass  # a rank killed while writing: the others' records still tell
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return blame(first["status"], first["rank"], {e["rank"] for e in errors}, nproc,
                     killed_ranks(output))
    lines = [ln.strip() for ln in output.splitlines()
             if re.match(r"^\s*\w+(Error|Exception)\b.*:", ln)]
    detail = lines[-1][:160] if lines else "no message (SPEEDBENCH_DEBUG=1 shows its output)"
    return f"error: torchrun exited with status {returncode}: {detail}"


def killed_ranks(output: str) -> dict:
    """rank -> the signal that ended it, from torchrun's failure summary (`rank : 1 ...`
    then `exitcode : -9`)."""
    found = {}
    for rank, code in re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*-(\d+)", output):
        try:
            found[int(rank)] = signal.Signals(int(code)).name
        except ValueError:
            found[int(rank)] = f"signal {code}"
    return found


def _write_rank_error(job: Path, env: DistEnv, exc: BaseException) -> None:
    # Written then renamed: torchrun may kill this rank at any moment once a peer has failed,
    # and the launcher must never read half a file.
    tmp = job / f".rank{env.rank}.error.json.tmp"
    tmp.write_text(json.dumps({"rank": env.rank, "time": time.time(),
                               "status": failure_status(exc), "traceback": traceback.format_exc()}))
    tmp.replace(job / f"rank{env.rank}.error.json")


def _worker(job: Path) -> None:
    """One rank of a launched trial or other work (run by torchrun)."""
    env = from_environ()
    if env is None:
        raise SystemExit("speedbench.measure.launch: run me through torchrun "
                         "(speedbench does this)")
    die_with_parent(signal.SIGKILL, LAUNCHER_PID)
    job_data = pickle.loads((job / "job.pkl").read_bytes())
    plan, spec, recipe = job_data["plan"], job_data["spec"], job_data["recipe"]
    device = rank_device(plan.device, env)
    try:
        init_process_group(env, device, recipe.dist_timeout_s)
        dataset = build_dataset(spec.dataset, dataset_length(plan, spec, env.world_size),
                                recipe.data.path, seed=recipe.bench.seed)
        result = job_data["work"](plan, spec, job_data["variant"], recipe, dataset, env,
                                  rank_budget(job_data["deadline"]), **job_data["args"])
    except BaseException as exc:
        _write_rank_error(job, env, exc)
        report_failure(exc, env, f"model {spec.name}, variant {job_data['variant']}")
        raise
    if is_main(env):
        (job / RESULT).write_bytes(pickle.dumps(result))
    exit_cleanly()


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    args = sys.argv[1:] if argv is None else argv
    if len(args) > 2 and args[0] == TORCHRUN:
        return torchrun_main(Path(args[1]), args[2:])
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m speedbench.measure.launch JOB_DIR "
                         "(run by speedbench)")
    record(_worker)(Path(args[0]))


if __name__ == "__main__":
    main()
