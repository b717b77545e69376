"""Records → DataFrames → CSV files in one run directory, and loading runs back."""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from speedbench.results import atomic
from speedbench.errors import ConfigError
from speedbench.results.schema import SUMMARY_COLUMNS, TRIAL_COLUMNS, trial_columns  # noqa: F401


class OutputError(ConfigError):
    """The run's files cannot be written (no permission, a full disk): one line naming the
    place, exit status 2, like a bad setting of out_dir."""


def new_run_dir(out_dir: str, experiment: str, explicit: Optional[str] = None) -> Path:
    """`<out_dir>/<experiment>/<timestamp>`, made unique; or the explicit path given, which
    must be new or an empty folder: a run never writes over files it did not make."""
    if explicit:
        path = Path(explicit)
        if path.exists() or path.is_symlink():
            if (path / "trials.csv").exists():
                raise FileExistsError(f"run_dir: '{explicit}' already holds a run; choose another")
            if not path.is_dir() or path.is_symlink() or any(path.iterdir()):
                raise FileExistsError(f"run_dir: '{explicit}' exists and is not an empty folder; "
                                      "choose a new one (nothing was written)")
        _mkdir(path, "run_dir", exist_ok=True)
        return path
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    base = Path(out_dir) / experiment
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            _mkdir(path, "out_dir")
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not make a fresh run directory under {base}")


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
    return OutputError(f"out_dir: cannot write{where} ({exc.strerror or exc}){kept}")


class TrialWriter:
    """Appends one row per trial to trials.csv as soon as the trial ends (survives a crash)."""

    def __init__(self, path: Path, extra_columns: Iterable[str] = ()):
        """`extra_columns`: what the techniques add (techniques.column_names())."""
        self.path = path
        self.columns = trial_columns(extra_columns)
        self.rows: list[dict] = []
        line = io.StringIO()
        csv.writer(line).writerow(self.columns)
        try:  # the header whole or no file: never a 0-byte trials.csv
            atomic.write_text(path, line.getvalue())
        except OSError as exc:
            raise write_failed(exc, path.parent) from None

    def append(self, record: dict) -> None:
        line = io.StringIO()
        csv.DictWriter(line, self.columns, extrasaction="ignore").writerow(record)
        data = memoryview(line.getvalue().encode("utf-8"))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:  # a full disk: no half row; the rows before it stay
            os.ftruncate(fd, end)
            raise write_failed(exc, self.path.parent) from None
        finally:
            os.close(fd)
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


def load_trials(run_dir: Path) -> pd.DataFrame:
    df = pd.read_csv(Path(run_dir) / "trials.csv")
    if "is_baseline" in df:
        df["is_baseline"] = df["is_baseline"].astype(str).str.lower().isin(["true", "1"])
    return df
