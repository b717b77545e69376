"""`hydra/launcher=slurm`: Hydra's submitit launcher, with what a sweep owes its user.

The plugin's own launcher waits on each job's pickled return value, which a speedbench job
always gives (its failure is written to the job's outcome.txt, not raised), so a sweep of
failed jobs ended in silence with exit status 0; a cancelled job ended the wait in a traceback;
Ctrl-C left the jobs running unsaid; a refusal by sbatch was a 40-line traceback. Here, in the
submitting process: one job per sweep point named after its experiment and model, a refusal in
one line naming the setting to change, Ctrl-C cancels the jobs and says so, and each job's
outcome (ok, failed with its reason, cancelled, timed out) is read back from its outcome.txt and
SLURM's state for __main__ to print (`finished`), the exit status counting those that did not
succeed. Imported only where the launcher is selected (the plugin must be installed).
"""
from __future__ import annotations

import contextlib
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from speedbench.results.schema import OK  # a job that succeeded

FAILED, CANCELLED, TIMED_OUT = "failed", "cancelled", "timed out"
POLL_S = 2.0  # how often the submitting process asks SLURM about its jobs


@dataclass(frozen=True)
class JobOutcome:
    num: int  # the sweep's job number (its folder under the sweep directory)
    slurm_id: str
    kind: str  # OK, FAILED, CANCELLED or TIMED_OUT
    said: str  # its kind, then the job's outcome.txt, or SLURM's state where it wrote none


# The last sweep's outcomes and its folder, for __main__ to say (the launcher runs inside
# Hydra, which keeps only the jobs' return values).
finished: dict = {"outcomes": [], "dir": None}


class SweepLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        say(f"speedbench: sweep of {len(job_overrides)} SLURM job"
            f"{'s' * (len(job_overrides) > 1)}; each job's outcome.txt and log will be in "
            f"{sweep_dir}")
        executor = self._executor()
        jobs: list = []
        try:
            for num, overrides in enumerate(job_overrides, start=initial_job_idx):
                executor.update_parameters(name=job_name(list(overrides), self.config))
                # submitit prints a refusing sbatch's stderr, then raises it: said once, below
                with contextlib.redirect_stderr(io.StringIO()):
                    jobs.append((num, executor.submit(
                        self, list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}",
                        Singleton.get_state())))
                print(f"  job {num}: SLURM job {jobs[-1][1].job_id}"
                      + _varying(list(overrides), job_overrides), file=sys.stderr, flush=True)
            _wait([job for _, job in jobs])
        except KeyboardInterrupt as stop:
            _cancel_and_say(jobs, sweep_dir, stop)
        except Exception as exc:  # sbatch refused a job: its reason, not submitit's traceback
            from submitit.core.utils import FailedJobError
            if not isinstance(exc, FailedJobError):
                raise
            _cancel([job for _, job in jobs])
            say(f"speedbench: error: {refusal_line(str(exc))}")
            raise SystemExit(2) from None
        finished.update(dir=sweep_dir, outcomes=[
            read_outcome(num, job.job_id, _outcome_text(self._job_dir(sweep_dir, num)),
                         _state(job))
            for num, job in jobs])
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=None) for _ in jobs]

    def _job_dir(self, sweep_dir: Path, num: int) -> Path:
        """Job `num`'s folder of the sweep (hydra.sweep.subdir, the job number by default)."""
        try:
            config = self.config.copy()
            with open_dict(config):
                config.hydra.job.num = num
            return sweep_dir / str(config.hydra.sweep.subdir)
        except Exception:  # noqa: BLE001 (a subdir of the job's own config keys)
            return sweep_dir / str(num)

    def _executor(self) -> Any:
        """The plugin's executor, built as its launch() builds it."""
        import submitit

        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init["slurm_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
            if k not in ("submitit_folder", "max_num_timeout")})
        return executor


def job_name(overrides: list[str], config) -> str:
    """`speedbench-<experiment>-<model>` for squeue and sacct: the job's overrides, else the
    primary config's choice."""
    def value(key: str, default: str) -> str:
        for o in overrides:
            name, _, val = o.lstrip("+~").partition("=")
            if name == key and val:
                return val
        return default

    choices = config.hydra.runtime.choices if "runtime" in config.hydra else {}
    experiment = value("experiment", str(choices.get("experiment") or "run"))
    model = value("model", str(OmegaConf.select(config, "model", default="") or ""))
    return "-".join(p for p in ("speedbench", experiment, model) if p)


def _varying(overrides: list[str], every: Sequence[Sequence[str]]) -> str:
    """The job's overrides that tell it from the sweep's other jobs (within the console's
    width: the rest are the same for every job and on the command line)."""
    own = [o for o in filter_overrides(overrides) if not all(o in other for other in every)]
    text = " ".join(own)
    if not text:
        return ""
    return f": {text}" if len(text) <= 70 else f": {text[:67]}..."


def say(line: str) -> None:
    """A console line within 100 columns (continued indented; paths are not broken)."""
    import textwrap

    print("\n".join(textwrap.wrap(line, 100, subsequent_indent="  ", break_long_words=False,
                                  break_on_hyphens=False)), file=sys.stderr, flush=True)


def _wait(jobs: list) -> None:
    while not all(job.done() for job in jobs):
        time.sleep(POLL_S)


def _cancel(jobs: list) -> list[str]:
    """scancel each job not yet done; their ids."""
    cancelled = []
    for job in jobs:
        try:
            if not job.done():
                job.cancel(check=False)
                cancelled.append(str(job.job_id))
        except Exception:  # noqa: BLE001 (SLURM gone: nothing left to cancel)
            continue
    return cancelled


def _cancel_and_say(jobs: list, sweep_dir: Path, stop: KeyboardInterrupt) -> None:
    cancelled = _cancel([job for _, job in jobs])
    if cancelled:
        what = (f"cancelled the sweep's SLURM job{'s' * (len(cancelled) > 1)} still queued or "
                f"running ({', '.join(cancelled)}); a running job keeps its finished trials "
                f"and says so in its outcome.txt in {sweep_dir}")
    else:
        what = f"no SLURM job was still running; each job's outcome.txt is in {sweep_dir}"
    print(file=sys.stderr)
    say(f"speedbench: interrupted; {what}")
    raise SystemExit(128 + getattr(stop, "signum", 2))


def _state(job) -> str:
    try:
        return str(job.state)
    except Exception:  # noqa: BLE001 (sacct unanswered: the outcome file alone decides)
        return "UNKNOWN"


def _outcome_text(folder: Path) -> str | None:
    try:
        return (folder / "outcome.txt").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def read_outcome(num: int, slurm_id: str, text: str | None, state: str) -> JobOutcome:
    """One job's outcome from its outcome.txt (`text`, None if it wrote none) and SLURM's
    state of it (COMPLETED, CANCELLED by 0, TIMEOUT, FAILED, OUT_OF_MEMORY, ...); `said`
    starts with the kind: "ok: <run dir>", "failed (exit status 2): <its reason>",
    "cancelled: interrupted (SIGTERM ...): kept 3 finished trials in ...", ...."""
    if text and text.split(":")[0].strip() == OK:
        return JobOutcome(num, slurm_id, OK, text)
    timed_out = state.startswith("TIMEOUT")
    if text and text.startswith("interrupted"):
        kind = TIMED_OUT if timed_out or "time limit is near" in text else CANCELLED
        return JobOutcome(num, slurm_id, kind, f"{kind}: {text}")
    if text:
        return JobOutcome(num, slurm_id, FAILED, text if text.startswith(FAILED)
                          else f"{FAILED}: {text}")
    kind = TIMED_OUT if timed_out else CANCELLED if state.startswith("CANCELLED") else FAILED
    return JobOutcome(num, slurm_id, kind,
                      f"{kind}: the job wrote no outcome.txt (SLURM state {state}); its log is "
                      f"in the sweep's .submitit/{slurm_id}/ folder")


# sbatch's refusals, and the launcher setting that each one is about
_SETTINGS = (
    ("gres", "hydra.launcher.gpus_per_node=null (these nodes have no GPUs), or "
             "hydra/launcher=slurm_cpu"),
    ("Requested node configuration is not available",
     "hydra.launcher.cpus_per_task and hydra.launcher.mem_gb to what a node has "
     "(sinfo -o '%P %c %m %G'), or hydra/launcher=slurm_cpu"),
    ("partition", "hydra.launcher.partition (sinfo lists them)"),
    ("time limit", "hydra.launcher.timeout_min (minutes, within the partition's limit)"),
    ("account", "hydra.launcher.account=... (hydra.launcher.additional_parameters)"),
)


def refusal_line(message: str) -> str:
    """One line for a submission sbatch refused: sbatch's own error and the setting to change."""
    errors = [line.strip() for line in message.splitlines() if "error:" in line]
    said = errors[-1] if errors else (message.strip().splitlines() or ["(no message)"])[-1]
    said = said.split("error:", 1)[-1].strip() if "error:" in said else said
    change = next((s for word, s in _SETTINGS if word.lower() in said.lower()),
                  "the hydra.launcher.* settings (docs/distributed.md, SLURM)")
    return f"SLURM refused the sweep's job (sbatch: {said}); change {change}"
