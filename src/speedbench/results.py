"""Records → DataFrames → CSV files in one run directory, and loading runs back."""
from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path
from typing import Optional

import pandas as pd

# The contract columns (DESIGN.md section 2) come first; more follow.
TRIAL_COLUMNS = [
    "experiment", "model", "variant", "is_baseline", "trial", "status", "device", "world_size",
    "samples_per_s", "step_ms", "data_wait_frac", "peak_mem_mb", "final_loss",
    "host_rss_mb", "host_rss_main_mb", "steps", "warmup_steps", "batch_size", "accumulate",
    "precision", "num_workers", "elapsed_s", "host_reads", "omp_num_threads", "torch_threads",
    # profile != off (profile.py): the mode; step times in an unprofiled reference window, with
    # phase syncs, and under the mode's profiler; that profiler's overhead over the reference
    "profile", "reference_step_ms", "phase_step_ms", "profiled_step_ms", "profile_overhead",
    "parallel", "devices", "rank_step_ms",
    "warmup_steady", "flops_per_step", "achieved_tflops", "peak_tflops",
]
SUMMARY_COLUMNS = [
    "experiment", "model", "variant", "is_baseline", "status", "samples_per_s", "speedup",
    "speedup_lo", "speedup_hi", "verdict", "trials", "step_ms", "cv", "data_wait_frac",
    "peak_mem_mb", "mem_ratio", "host_rss_mb", "final_loss", "loss_delta",
    "spread", "unsteady", "flops_per_step", "achieved_tflops", "peak_tflops", "peak_fraction",
]


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

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(TRIAL_COLUMNS)

    def append(self, record: dict) -> None:
        self.rows.append(record)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, TRIAL_COLUMNS, extrasaction="ignore").writerow(record)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=TRIAL_COLUMNS)


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
