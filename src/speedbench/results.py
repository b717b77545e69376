"""Records → DataFrames → CSV files in one run directory, and loading runs back."""
from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from speedbench.schema import SUMMARY_COLUMNS, TRIAL_COLUMNS, trial_columns  # noqa: F401


def new_run_dir(out_dir: str, experiment: str, explicit: Optional[str] = None) -> Path:
    """`<out_dir>/<experiment>/<timestamp>`, made unique; or the explicit path given."""
    if explicit:
        path = Path(explicit)
        if (path / "trials.csv").exists():
            raise FileExistsError(f"run_dir: '{explicit}' already holds a run; choose another")
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    base = Path(out_dir) / experiment
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not make a fresh run directory under {base}")


class TrialWriter:
    """Appends one row per trial to trials.csv as soon as the trial ends (survives a crash)."""

    def __init__(self, path: Path, extra_columns: Iterable[str] = ()):
        """`extra_columns`: what the techniques add (techniques.column_names())."""
        self.path = path
        self.columns = trial_columns(extra_columns)
        self.rows: list[dict] = []
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(self.columns)

    def append(self, record: dict) -> None:
        self.rows.append(record)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(record)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.columns)


def write_summary(summary: pd.DataFrame, run_dir: Path) -> Path:
    cols = [c for c in SUMMARY_COLUMNS if c in summary.columns]
    cols += [c for c in summary.columns if c not in cols]
    path = run_dir / "summary.csv"
    summary[cols].to_csv(path, index=False)
    return path


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def load_trials(run_dir: Path) -> pd.DataFrame:
    df = pd.read_csv(Path(run_dir) / "trials.csv")
    if "is_baseline" in df:
        df["is_baseline"] = df["is_baseline"].astype(str).str.lower().isin(["true", "1"])
    return df
