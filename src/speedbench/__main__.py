"""`python -m speedbench +experiment=NAME [overrides]` (or the `speedbench` script): Hydra composes
the config, run() does the rest.

Before Hydra sees the command line, its overrides are checked against speedbench's schema, so that
a typo gets "unknown key bench.repets; did you mean bench.repeats?" (exit status 2) rather than
Hydra's advice to add it with `+`. Ctrl-C ends with one line saying what was kept (exit 130).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


from speedbench import errors  # no dependencies: ready before the signals are taken
from speedbench.errors import Terminated

STOPPING = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
# Stop signals within this many seconds of the first are one stop (Ctrl-C pressed twice, a
# service manager's second SIGTERM): ignored, so that they cannot cut the cleanup short. One
# later than that ends the process at once (_stop_now).
CLEANUP_S = 1.0


class StopSignals:
    """The stop signals' handler. The first signal raises KeyboardInterrupt (Terminated for
    SIGTERM and SIGHUP): the run cleans up on its way out (launched processes killed, temp files
    removed) and says what it kept. A later one, CLEANUP_S after it, means the first did not
    stop the run: the model's code caught it (a bare `except:` in a retry loop) or the cleanup
    is stuck; then `stop_now` ends the process. Its clock and its ending are arguments, so that
    a test hands its own rather than patching this module."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 stop_now: Callable[[int], None] | None = None, importing: bool = True):
        self.clock = clock
        self.stop_now = stop_now  # None: _stop_now
        # while speedbench's imports run, a stop is recorded, not raised: an exception raised
        # inside an import can leave a module half-made (numpy without `subtract`)
        self.importing = importing
        self.first: list[float] = []  # when the first stop signal came (`clock`)

    def __call__(self, signum, frame) -> None:
        now = self.clock()
        if self.first:
            if now - self.first[0] >= CLEANUP_S:
                end = self.stop_now or _stop_now
                errors.when_free(lambda: end(signum))  # (after a file being written)
            return
        self.first.append(now)
        stop = errors.ask_to_stop(KeyboardInterrupt() if signum == signal.SIGINT
                                  else Terminated(signum))
        dist = sys.modules.get("speedbench.distributed")
        if dist is not None:  # a torchrun rank: the others learn it was a stop, not a failure
            dist.say_stopped(signum)
        if not self.importing:  # raised once the imports end, and after a file being written
            errors.when_free(_raiser(stop))


STOPS = StopSignals()  # the command's


def _raiser(stop: KeyboardInterrupt):
    def raise_it():
        raise stop
    return raise_it


def _stop_now(signum: int) -> None:
    """The run did not stop at the first signal: end the process now, with what a stop leaves
    (the launched trial's processes killed and its temp folder removed, one line on what was
    kept). Every file of the run is written whole or not at all (results/atomic.py holds the
    signals while it writes), so none is left half-written."""
    try:
        launch = sys.modules.get("speedbench.measure.launch")
        if launch is not None:
            launch.abandon()
        results = sys.modules.get("speedbench.results")
        dirs = results.open_run_dirs() if results is not None else []
        if os.environ.get("RANK", "0") == "0":
            line = interrupted_line(dirs[0] if dirs else None)
            print("\n" + line.replace("interrupted", "interrupted at a second signal (the first "
                                       "did not stop the run)", 1), file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)


def _quiet_lost_stop(unraisable) -> None:
    # Python prints "Exception ignored in ..." with a traceback when a signal's exception lands
    # in a finalizer; errors.stop_if_asked raises that stop again, so the user sees one line.
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _exit_status(exc: KeyboardInterrupt) -> int:
    return 128 + exc.signum if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _take_signals() -> None:
    for sig in STOPPING:  # an ignored one stays ignored (nohup's SIGHUP)
        if signal.getsignal(sig) not in (signal.SIG_IGN, STOPS):
            signal.signal(sig, STOPS)


def _before_the_run(exc: KeyboardInterrupt) -> None:
    print("\nspeedbench: interrupted before the run started; nothing was written",
          file=sys.stderr)
    sys.exit(_exit_status(exc))


if __name__ == "__main__":
    _take_signals()  # before the slow imports below (torch): a signal there gets one line too

try:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from speedbench.config import ConfigError, config_dir, config_flags, register_schema
    from speedbench.config.keys import (deletes_schema, did_you_mean, is_known, schema_keys,
                                        schema_node)

    register_schema()
    STOPS.importing = False
    errors.stop_if_asked()
except KeyboardInterrupt as exc:
    _before_the_run(exc)


def experiment_names(args: list[str] | None = None) -> list[str]:
    """The experiments Hydra can load: the package's, and those in `--config-dir` and
    `hydra.searchpath` folders of the command line `args` (a user's own experiment files)."""
    folders = [Path(config_dir())] + _user_config_dirs(args or [])
    return sorted({p.stem for d in folders for p in (d / "experiment").glob("*.yaml")})


def _without_package(name: str | None, args: list[str]) -> Path | None:
    """A user's experiment file `name` that lacks Hydra's `# @package _global_` line (Hydra
    would load it under `experiment:` and fail with a conversion error)."""
    for folder in _user_config_dirs(args):
        path = folder / "experiment" / f"{name}.yaml"
        try:
            head = path.read_text(encoding="utf-8", errors="replace")[:2000]
        except OSError:
            continue
        return None if "@package _global_" in head else path
    return None


def _user_config_dirs(args: list[str]) -> list[Path]:
    """Config folders the command line adds: --config-dir/-cd, and hydra.searchpath's file://
    (or plain) paths; pkg:// entries are packages, not folders, and are left to Hydra."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = get_args_parser().parse_args(args)
        overrides = OverridesParser.create().parse_overrides(parsed.overrides)
    except (Exception, SystemExit):
        return []
    folders = [parsed.config_dir] if parsed.config_dir else []
    for o in overrides:
        if o.key_or_group == "hydra.searchpath":
            value = o.value()
            folders += [str(v) for v in (value if isinstance(value, list) else [value])]
    return [Path(f[len("file://"):] if f.startswith("file://") else f).expanduser()
            for f in folders if not str(f).startswith("pkg://")]


def command_line_problem(args: list[str]) -> str | None:
    """One line naming the first override speedbench cannot take, or None (Hydra's own
    grammar errors are left to Hydra)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = get_args_parser().parse_args(args).overrides
        parsed = OverridesParser.create().parse_overrides(overrides)
    except (Exception, SystemExit):
        return None
    schema = None  # loaded once: ConfigStore.load deep-copies the whole schema
    for o in parsed:
        key = o.key_or_group
        if key == "hydra/launcher" and not _submitit_installed() and any(
                word in str(o.value()) for word in ("slurm", "submitit")):
            return (f"hydra/launcher={o.value()} needs Hydra's submitit launcher plugin: "
                    f"pip install hydra-submitit-launcher")
        if o.is_delete() and not key.startswith("hydra") and "/" not in key:
            schema = schema_node() if schema is None else schema
            if key == "experiment" or deletes_schema(key, schema):
                return (f"~{key}: speedbench's keys cannot be deleted (each has a default in "
                        f"its schema); set a value instead, e.g. {key}=...")
        if key.startswith("hydra") or "/" in key or o.package is not None or o.is_delete():
            continue
        if key == "experiment":
            value = o.value() if isinstance(o.value(), str) else None
            names = experiment_names(args)
            if not (o.is_add() or o.is_force_add()):
                return (f"experiment={value or '...'}: write +experiment={value or 'NAME'} (with "
                        f"'+': an experiment is added to the base config); experiments: "
                        + ", ".join(names))
            if value is not None and value not in names:
                return (f"unknown experiment {value}{did_you_mean(value, names)} "
                        f"(experiments: {', '.join(names)})")
            unpackaged = _without_package(value, args)
            if unpackaged:
                return (f"experiment {value}: {unpackaged} does not start with `# @package "
                        f"_global_`, which an experiment file needs (its keys are the run's, "
                        f"as in {Path(config_dir()) / 'experiment' / 'amp.yaml'})")
            continue
        schema = schema_node() if schema is None else schema
        if not is_known(key, schema):
            keys = schema_keys(schema)
            hint = did_you_mean(key, keys) or (
                "; known keys: " + ", ".join(k for k in keys if "." not in k))
            return f"unknown key {key}{hint}"
    return None


def _submitit_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:  # no Hydra plugin at all
        return False


def _quiet_libraries() -> None:
    """Hydra's job logging prints INFO to stdout: keep library chatter (matplotlib's font cache
    "generated new fontManager") out of the console."""
    for name in ("matplotlib", "PIL"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)


def interrupted_line(run_dir: Path | None, by: str = "") -> str:
    """What Ctrl-C left behind in this run's own directory (None: it had not made one); `by`
    says what stopped it where that is not the user's stop of the whole command."""
    head = f"speedbench: interrupted{f' by {by}' if by else ''}"
    if run_dir is None or not run_dir.is_dir():
        return f"{head}; nothing was written"
    run_dir = run_dir.resolve()
    trials = run_dir / "trials.csv"
    rows = max(0, trials.read_bytes().count(b"\n") - 1) if trials.is_file() else 0
    if not rows:
        return f"{head}; no trial had finished (the run's config is in {run_dir})"
    kept = f"{rows} finished trial{'s' * (rows != 1)}"
    if (run_dir / "summary.csv").is_file():  # stopped while the report was being written
        return (f"{head}; kept {kept} and summary.csv in {run_dir} (no report: "
                f"python -m speedbench.report {run_dir} builds it)")
    return (f"{head}; kept {kept} in {run_dir} (no summary: "
            f"python -m speedbench.report {run_dir} builds one from them)")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    _quiet_libraries()
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        _sweep_job(cfg)
    else:
        _job(cfg)


# A Hydra sweep (`-m`): each job's outcome, so that one refused or failed job is said in that
# job and the sweep goes on; the sweep's exit status is the number of jobs that failed.
_SWEEP: dict = {"jobs": 0, "failed": [], "dir": None}


def _sweep_job(cfg: DictConfig) -> None:
    """One job of a sweep: its refusal or failure said, written to the job's own folder of the
    sweep (outcome.txt) and counted; a signal still stops the whole sweep."""
    hc = HydraConfig.get()
    _SWEEP["jobs"] += 1
    _SWEEP["dir"] = Path(hc.sweep.dir)
    from speedbench.results.schema import OK

    in_slurm = _in_submitit_job()
    try:
        run_dir, code = _job(cfg), 0
        outcome = f"{OK}: {run_dir}" if run_dir else OK
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 1
        if code >= 128 and not in_slurm:  # interrupted: the sweep stops with this job
            raise
        why = _LAST_ERROR[0] if _LAST_ERROR else "no trial succeeded (see its trials.csv)"
        outcome = _interrupted_outcome(code) if code >= 128 else \
            f"failed (exit status {code}): {why}"
    except Exception as exc:  # a fault of speedbench's own: its traceback, then the next job
        import traceback

        traceback.print_exc()
        code, outcome = 1, f"failed: {type(exc).__name__}: {exc}"
    if code:
        _SWEEP["failed"].append(hc.job.num)
    try:
        folder = Path(hc.runtime.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "outcome.txt").write_text(outcome.strip() + "\n", encoding="utf-8")
    except OSError:
        pass  # (an unwritable out_dir: its refusal was said on the console)


def _in_submitit_job() -> bool:
    """Whether this sweep job runs inside a SLURM job of the submitit launcher (set by submitit
    in the job's process). There submitit's handlers ignore SIGTERM (scancel, preemption, the
    time limit's end) and take SIGUSR2 (the time limit near, `--signal=USR2@...`): speedbench's
    own handling takes both back, so that the job stops as at Ctrl-C and keeps what it
    measured."""
    if not os.environ.get("SUBMITIT_FOLDER"):
        return False
    errors.clear_stop()
    STOPS.first.clear()
    for sig in STOPPING + tuple(getattr(signal, n) for n in ("SIGUSR2",) if hasattr(signal, n)):
        signal.signal(sig, STOPS)
    return True


def _interrupted_outcome(code: int) -> str:
    """A SLURM job's outcome.txt line after a stop: which signal, and what was kept."""
    why = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM: scancel, preemption or the end "
           "of SLURM's time limit", getattr(signal, "SIGUSR2", -1): "SIGUSR2: SLURM's time "
           "limit is near"}.get(code - 128, f"signal {code - 128}")
    kept = _LAST_ERROR[0].removeprefix("speedbench: interrupted") if _LAST_ERROR else ""
    return f"interrupted ({why}){kept or '; nothing was written'}"


def _sweep_end() -> int:
    """After a sweep: one line saying how many of its jobs failed; the exit status is that
    number (at most 100)."""
    jobs, failed = _SWEEP["jobs"], _SWEEP["failed"]
    slurm = sys.modules.get("speedbench.slurm")  # the jobs ran as SLURM jobs: their outcomes
    if not jobs and slurm is not None and slurm.finished["outcomes"]:
        return _slurm_sweep_end(slurm.finished["outcomes"], slurm.finished["dir"])
    if not jobs:
        return 0
    where = f"; each job's outcome.txt is in {_SWEEP['dir']}" if _SWEEP["dir"] else ""
    if failed:
        print(f"speedbench: sweep: {len(failed)} of {jobs} jobs failed "
              f"(job {', '.join(map(str, failed))}){where}", file=sys.stderr)
    else:
        print(f"speedbench: sweep: all {jobs} jobs ended well{where}", file=sys.stderr)
    return min(len(failed), 100)


def _slurm_sweep_end(outcomes: list, sweep_dir: Path) -> int:
    """A SLURM sweep's end, in the submitting process: each job's outcome, one line each
    (wrapped within the console's 100 columns), then the sweep's line as _sweep_end says it;
    the exit status is the number of jobs that did not succeed (at most 100)."""
    from speedbench.results.schema import OK
    from speedbench.slurm import say

    for o in outcomes:
        say(f"speedbench: job {o.num} (SLURM job {o.slurm_id}): {o.said}")
    bad = [o for o in outcomes if o.kind != OK]
    where = f"; each job's outcome.txt is in {sweep_dir}"
    if bad:
        kinds = ", ".join(f"job {o.num} {o.kind}" for o in bad)
        say(f"speedbench: sweep: {len(bad)} of {len(outcomes)} jobs did not succeed "
            f"({kinds}){where}")
    else:
        say(f"speedbench: sweep: all {len(outcomes)} jobs ended well{where}")
    return min(len(bad), 100)


_LAST_ERROR: list[str] = []  # the last job's one-line error, for its outcome.txt


def _job(cfg: DictConfig):
    """One run: its run directory; a refusal, an interrupt or a failed run ends in SystemExit
    with the exit status, after one line."""
    from speedbench.run import run

    experiment = HydraConfig.get().runtime.choices.get("experiment")
    _LAST_ERROR.clear()
    try:
        return run(cfg, experiment,
                   overrides=config_flags(sys.argv[1:]) + list(HydraConfig.get().overrides.task))
    except (ConfigError, FileExistsError) as exc:
        from speedbench.distributed import DistEnvError

        _LAST_ERROR.append(str(exc))
        # under torchrun every rank fails alike: say it once (torchrun's variables themselves
        # may be what is wrong: then every process says it)
        if os.environ.get("RANK", "0") == "0" or isinstance(exc, DistEnvError):
            # mid-run (a full disk): on a line of its own, after the progress bar's
            print("\n" * bool(getattr(exc, "run_dir", None)) + f"speedbench: error: {exc}",
                  file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except BrokenPipeError:  # `speedbench ... | head`: the reader of the output went away
        sys.exit(_pipe_closed())
    except Exception:
        from speedbench import distributed

        if not distributed.failed():
            raise
        # A rank's failed trial, already said in one line and written as a row: no traceback,
        # and no interpreter teardown with a broken process group (see exit_cleanly).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except KeyboardInterrupt as exc:
        line = interrupted_line(getattr(exc, "run_dir", None), _stopped_by())
        _LAST_ERROR.append(line)
        if os.environ.get("RANK", "0") == "0":
            print("\n" + line, file=sys.stderr)
        sys.exit(_exit_status(exc))


def _stopped_by() -> str:
    """'SIGTERM to rank 0' where a signal stopped torchrun's rank 0 with no peer's failure (a
    `kill` of that worker: torchrun then ends the other ranks and names rank 0's exit status in
    its summary); '' for a stop of the whole command."""
    dist = sys.modules.get("speedbench.distributed")
    signum = dist.stopped_alone() if dist is not None else None
    return f"{signal.Signals(signum).name} to rank 0" if signum else ""


def _pipe_closed() -> int:
    """stdout or stderr was a pipe whose reader ended: one line where it can still be said, the
    streams pointed at /dev/null (no second error as Python flushes them at exit); returns the
    exit status of a program that SIGPIPE ended."""
    try:
        print("speedbench: the output pipe was closed (its reader ended); stopped",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass
    return 128 + signal.SIGPIPE


def import_from_here() -> None:
    """The user's own modules (`_target_: mynet.build`) import from the current directory, as
    under `python -m`, for the console command too."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def console_never_fails() -> None:
    """Print what the terminal cannot show as '?' (an ASCII-only locale and a variant named
    in another script), never end a finished run in a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def main() -> None:
    from speedbench import errors
    errors.clear_stop()
    STOPS.first.clear()
    if "speedbench.distributed" in sys.modules:  # an earlier command of this process
        sys.modules["speedbench.distributed"].clear_failure()
    _take_signals()
    console_never_fails()
    import_from_here()
    _SWEEP.update(jobs=0, failed=[], dir=None)
    if "speedbench.slurm" in sys.modules:  # an earlier SLURM sweep of this process
        sys.modules["speedbench.slurm"].finished.update(outcomes=[], dir=None)
    if sys.argv[1:2] == ["runs"]:  # the index of past runs: no config, no Hydra
        sys.exit(runs_command(sys.argv[2:]))
    try:
        problem = command_line_problem(sys.argv[1:])
        if problem:
            print(f"speedbench: error: {problem}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        _hydra_main()
    except KeyboardInterrupt as exc:  # before the run started (composing the config)
        _before_the_run(exc)
    failed = _sweep_end()
    if failed:
        sys.exit(failed)


def runs_command(args: list[str]) -> int:
    """`speedbench runs ...` (results/runs_cli.py): the index of past runs; the exit status."""
    from speedbench.results import runs_cli

    return runs_cli.main(args)


def cli() -> None:
    """The command (`speedbench`, `python -m speedbench`): main(), then leave, even when model
    code left threads running that would keep Python waiting for them forever."""
    sys.unraisablehook = _quiet_lost_stop  # the process's own: not for main() run in-process
    from speedbench.measure import budget
    budget.count_from_process_start()  # bench.time_budget_s bounds the process's wall time
    try:
        main()
        code = 0
    except SystemExit as end:
        if not isinstance(end.code, (int, type(None))):
            raise
        code = end.code or 0
    try:  # what is left in stdout's buffer, while a closed pipe can still be said in one line
        sys.stdout.flush()
    except BrokenPipeError:
        code = _pipe_closed()
    from speedbench import distributed

    try:
        if code == 0:
            distributed.exit_cleanly()  # under torchrun: leave without torch's teardown
        distributed.leave_now(code)  # a rank that stopped or failed: its peers may be gone
    except KeyboardInterrupt:  # a stop as the job ends: its work is done and written
        distributed.leave_now(code, joined=True)
    _leave(code)


LIBRARY_POOLS = ("ThreadPoolExecutor-",)  # concurrent.futures' worker names


def _leave(code: int) -> None:
    """Exit with `code` once the run's files are written and its lines said: atexit's handlers
    run (a library's clean-up, temporary folders), then the process ends without the
    interpreter's finalization, which freed every module and tensor for 5-6 s after the last
    line on a loaded 2-core machine, outside any budget, and would wait forever for threads the
    model's code left running (those are said)."""
    import atexit
    import threading

    alive = [t.name for t in threading.enumerate()
             if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    # a library's worker pool (torch.compile's, say) is not news to the user; other threads,
    # the model's own, are said
    left = [name for name in alive if not name.startswith(LIBRARY_POOLS)]
    if left:
        print(f"speedbench: {len(left)} thread(s) the run started are still running "
              f"({', '.join(left[:3])}: the model's code or a library it used); exiting "
              "without waiting for them", file=sys.stderr)
    for sig in STOPPING:  # a stop now finds the work done: its default handler would kill
        signal.signal(sig, signal.SIG_IGN)  # the process (-15) with its line already said
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a pipe closed meanwhile: nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    cli()
