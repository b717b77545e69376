"""The run directory: records → CSV, JSON and YAML files, each written whole or appended
atomically (atomic.py, through which the studies append their own tables too), and loading runs
back (runs.py)."""
from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from speedbench.results import atomic
from speedbench.errors import ConfigError, signals_held
from speedbench.results.runs import load_trials  # noqa: F401  (the one trials.csv loader)
from speedbench.results.schema import (CAPACITY_COLUMNS, FINDING_COLUMNS, FORMAT_VERSION,
                                       PHASE_COLUMNS, RECIPE_COLUMNS, STEP_COLUMNS, SUMMARY_COLUMNS,
                                       TRIAL_COLUMNS, trial_columns)  # noqa: F401

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None


class OutputError(ConfigError):
    """The run's files cannot be written (no permission, a full disk): one line naming the
    place, exit status 2, like a bad setting of out_dir."""


def new_run_dir(out_dir: str, experiment: str, explicit: Optional[str] = None,
                tag: str = "") -> Path:
    """`<out_dir>/<experiment>/<timestamp>`, made unique; or the explicit path given, which
    must be new or an empty folder: a run never writes over files it did not make. The path
    returned is absolute, so that a model's os.chdir() cannot move the run's files.

    The folder comes locked for this process's run (`release_run_dir` ends that): a second
    run given the same run_dir is refused even when it comes between the mkdir and the first
    file, and the report tool refuses to rebuild a report while its run is still going."""
    if explicit:  # an absolute path: the model's code may change the working directory
        return _claim(Path(os.path.abspath(explicit)), explicit)
    path = fresh_dir(Path(os.path.abspath(out_dir)) / experiment, tag=tag)
    _lock(path)
    return path


def fresh_dir(base: Path, key: str = "out_dir", tag: str = "", stamp: str = "") -> Path:
    """`<base>/<timestamp><tag>`, or `...-1`, `-2`, ... : a new folder, made with a mkdir that
    fails if it exists, so that two processes started in the same second never share one (`tag`:
    a sweep job's `_job<N>`, which says which of a sweep's folders is which; `stamp`: the time
    already taken, Hydra's for a sweep's folder)."""
    stamp = (stamp or dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")) + tag
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            _mkdir(path, key)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"could not make a fresh folder under {base}")


def _claim(path: Path, given: str) -> Path:
    """The explicit run_dir, made or taken empty, and locked; then checked empty again, since
    another run may have taken it between the first check and the lock."""
    if path.exists() or path.is_symlink():
        if (path / "trials.csv").exists():
            raise FileExistsError(f"run_dir: '{given}' already holds a run; choose another")
        if not path.is_dir() or path.is_symlink() or any(path.iterdir()):
            raise FileExistsError(f"run_dir: '{given}' exists and is not an empty folder; "
                                  "choose a new one (nothing was written)")
    try:
        _mkdir(path, "run_dir")
    except FileExistsError:
        pass  # an empty folder given (or one just made by another run): the lock decides
    if not _lock(path) or any(path.iterdir()):
        release_run_dir(path)
        raise FileExistsError(f"run_dir: '{given}' already holds a run; choose another")
    return path


_LOCKS: dict[Path, int] = {}  # run directory -> the descriptor holding its lock


def _flocked(path: Path, mode: int) -> Optional[int]:
    """A descriptor of folder `path` holding a non-blocking flock in `mode`; None when another
    process holds a conflicting lock (OSError when the folder cannot be opened)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _lock(path: Path) -> bool:
    """An exclusive lock on the folder for this process's run; False when another holds it.
    The kernel drops it when the process ends, however it ends: no stale lock file."""
    if fcntl is None:  # no flock (Windows): the atomic mkdir still keeps runs apart
        return True
    try:
        fd = _flocked(path, fcntl.LOCK_EX)
    except OSError:
        return False
    if fd is None:
        return False
    _LOCKS[Path(path)] = fd
    return True


def release_run_dir(path: Path) -> None:
    """The run in `path` is over (its report written, or stopped): its folder unlocked, for
    every copy of the descriptor too (a process the model's code forked holds one: closing
    ours alone would leave the run 'still going' while that process lives)."""
    fd = _LOCKS.pop(Path(path), None)
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def open_run_dirs() -> list[Path]:
    """The run directories this process holds (one, while a run goes)."""
    return list(_LOCKS)


def _forget_locks_in_child() -> None:
    """In a process forked from a run (a DataLoader worker, the model's own helper): its copies
    of the run directory's lock are closed, not unlocked (the run still holds it), so that the
    lock ends with the run, not with the last process forked from it."""
    for fd in _LOCKS.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


def run_in_progress(path: Path) -> bool:
    """Whether a run is still going in `path` (its process holds the folder's lock)."""
    if fcntl is None:
        return False
    try:
        fd = _flocked(path, fcntl.LOCK_SH)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


def file_name(name: str) -> str:
    """A name (a model's, a variant's) as one file name inside the run directory: names are
    data, never paths. Separators, `..`, NUL and anything but ASCII letters, digits and `_.+=-`
    are replaced, at most 80 characters; a name that had to change gets a short hash of itself,
    so that two names never share a file."""
    safe = re.sub(r"[^A-Za-z0-9_.+=-]", "_", str(name)).lstrip(".")
    if safe == name and 0 < len(safe) <= 80:
        return safe
    digest = hashlib.sha256(str(name).encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{safe[:60] or 'x'}-{digest}"


def _mkdir(path: Path, key: str, exist_ok: bool = False) -> None:
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if not exist_ok:
            raise
        raise OutputError(f"{key}: cannot make the folder '{path}': a file is in the way") from None
    except OSError as exc:
        raise OutputError(f"{key}: cannot make the folder '{path}' ({exc.strerror or exc})") \
            from None


def write_failed(exc: OSError, run_dir: Optional[Path]) -> OutputError:
    """One line for a write that failed mid-run (a full disk): what failed and what was kept."""
    where = f" {exc.filename}" if exc.filename else " the run's files"
    kept = f"; the run in {run_dir} is incomplete (no report)" if run_dir else ""
    error = OutputError(f"out_dir: cannot write{where} ({exc.strerror or exc}){kept}")
    error.run_dir = run_dir  # (the run had started: its line follows the progress bar's)
    return error


class TrialWriter:
    """Appends one row per trial to trials.csv as soon as the trial ends (survives a crash)."""

    def __init__(self, path: Path, extra_columns: Iterable[str] = ()):
        """`extra_columns`: what the techniques add (techniques.column_names())."""
        self.path = path
        self.columns = trial_columns(extra_columns)
        self.rows: list[dict] = []
        try:  # the header whole or no file: never a 0-byte trials.csv
            atomic.write_text(path, _csv_line(self.columns, None))
        except OSError as exc:
            raise write_failed(exc, path.parent) from None

    def append(self, record: dict) -> None:
        """The trial's row, and its timed steps' times into steps.csv (beside trials.csv)."""
        steps = self.path.parent / "steps.csv"
        # a full disk: no half row, the rows before it stay; a signal: the row and its steps,
        # its KeyboardInterrupt raised once both are written
        with signals_held():
            try:
                if record.get("step_s"):
                    if not steps.exists():
                        atomic.write_text(steps, _csv_line(STEP_COLUMNS, None))
                    atomic.append_text(steps, "".join(
                        _csv_line(STEP_COLUMNS, {**record, "step": i, "step_ms": 1000 * t})
                        for i, t in enumerate(record["step_s"])))
                atomic.append_text(self.path, _csv_line(self.columns, record))
            except OSError as exc:
                raise write_failed(exc, self.path.parent) from None
            self.rows.append(record)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.columns)


def write_summary(summary: pd.DataFrame, run_dir: Path) -> Path:
    cols = [c for c in SUMMARY_COLUMNS if c in summary.columns]
    cols += [c for c in summary.columns if c not in cols]
    path = run_dir / "summary.csv"
    atomic.write_csv(summary[cols], path)
    return path


def write_json(data: dict, path: Path) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_env(env: dict, run_dir: Path) -> None:
    """env.json: the machine and software, stamped with the run directory's format version."""
    write_json({"format_version": FORMAT_VERSION, **env}, Path(run_dir) / "env.json")


def update_json(path: Path, **entries) -> None:
    """Entries added to a JSON file (env.json's end-of-run figures), the file replaced whole."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    write_json({**data, **entries}, path)


def write_diagnosis(run_dir: Path, phases: list[dict], findings: list[dict]) -> None:
    """phases.csv and findings.csv (the profiled trials' step phases and what they suggest),
    replaced together."""
    run_dir = Path(run_dir)
    atomic.write_files({
        run_dir / "phases.csv": _csv(pd.DataFrame(phases, columns=PHASE_COLUMNS)),
        run_dir / "findings.csv": _csv(pd.DataFrame(findings, columns=FINDING_COLUMNS))})


def load_findings(run_dir: Path) -> Optional[pd.DataFrame]:
    """findings.csv as written, for the findings check; None when the run has none."""
    path = Path(run_dir) / "findings.csv"
    return pd.read_csv(path) if path.is_file() else None


def write_findings(findings: pd.DataFrame, run_dir: Path) -> None:
    atomic.write_csv(findings, Path(run_dir) / "findings.csv")


def write_recipe(run_dir: Path, rows: list[dict], recipe_yaml: str) -> None:
    """recipe.csv (the search's tables) and recipe.yaml (the recipe found), replaced together."""
    run_dir = Path(run_dir)
    atomic.write_files({run_dir / "recipe.csv": _csv(pd.DataFrame(rows, columns=RECIPE_COLUMNS)),
                        run_dir / "recipe.yaml": recipe_yaml.encode("utf-8")})


def append_capacity(path: Path, row: dict) -> None:
    """One row appended to capacity.csv, whole or not at all (made with its header if new)."""
    path = Path(path)
    if not path.exists():
        atomic.write_text(path, _csv_line(CAPACITY_COLUMNS, None))
    atomic.append_text(path, _csv_line(CAPACITY_COLUMNS, row))


def _csv(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode("utf-8")


def _csv_line(columns: list[str], row: Optional[dict]) -> str:
    """One CSV line: `row`'s values in `columns` order (others ignored), or the header."""
    line = io.StringIO()
    if row is None:
        csv.writer(line).writerow(columns)
    else:
        csv.DictWriter(line, columns, extrasaction="ignore").writerow(row)
    return line.getvalue()
