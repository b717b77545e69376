"""Loading a run directory back for a report: tolerant of interrupted runs and other versions.

A run is usable when its trials.csv holds the contract columns a report needs (REQUIRED).
Other contract columns may be missing (an older speedbench): they are filled with NaN and
listed in `Run.notes`, so the report says what it left out instead of failing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml

from speedbench import results, stats
from speedbench.schema import FINDING_COLUMNS as FINDINGS_COLUMNS
from speedbench.schema import PHASE_COLUMNS as PHASES_COLUMNS

# Without these a run cannot be summarised, plotted or compared at all.
REQUIRED = ("experiment", "model", "variant", "is_baseline", "status", "samples_per_s")
# The rest of the trials.csv contract (DESIGN.md section 2) plus what stats.summarise reads.
OPTIONAL_NUMERIC = ("trial", "world_size", "step_ms", "data_wait_frac", "peak_mem_mb",
                    "final_loss", "host_rss_mb")
SUMMARY_CONTRACT = ("experiment", "model", "variant", "is_baseline", "status", "samples_per_s",
                    "speedup", "speedup_lo", "speedup_hi", "verdict")
CAPACITY_COLUMNS = ("experiment", "model", "variant", "precision", "status", "largest_batch",
                    "first_oom")
KEYS = ["experiment", "model", "variant"]


class ReportError(Exception):
    """A run directory the report cannot use; the message says why (printed as one line)."""


@dataclass
class Run:
    path: Path
    trials: pd.DataFrame
    summary: pd.DataFrame
    env: dict
    cfg: dict
    phases: Optional[pd.DataFrame] = None
    findings: Optional[pd.DataFrame] = None
    capacity: Optional[pd.DataFrame] = None  # capacity.csv: the largest batch that fits
    notes: list[str] = field(default_factory=list)  # what is missing, recomputed, left out
    missing: list[str] = field(default_factory=list)  # contract columns absent from trials.csv
    label: str = ""

    @property
    def experiments(self) -> list[str]:
        return list(dict.fromkeys(self.trials["experiment"]))


def _bool(col: pd.Series) -> pd.Series:
    return col.astype(str).str.strip().str.lower().isin(["true", "1", "yes"])


def _read_csv(path: Path) -> pd.DataFrame:
    try:  # only empty cells are missing: pandas would read a verdict "n/a" as NaN
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        raise ReportError(f"{path} is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise ReportError(f"{path} is not a readable CSV file ({reason})") from None


def _optional_table(path: Path, columns: tuple[str, ...],
                    notes: list[str]) -> Optional[pd.DataFrame]:
    """phases.csv / findings.csv when present and well formed; a note otherwise."""
    if not path.exists():
        return None
    try:
        df = _read_csv(path)
    except ReportError as exc:
        notes.append(f"{path.name} left out: {exc}")
        return None
    lacking = [c for c in columns if c not in df.columns]
    if lacking:
        notes.append(f"{path.name} left out: it lacks the columns {', '.join(lacking)}")
        return None
    for c in KEYS:
        df[c] = df[c].astype(str)
    return df


def _summary(path: Path, trials: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """summary.csv as the run wrote it, or recomputed from the trials when absent or unusable."""
    file = path / "summary.csv"
    reason = None
    if not file.exists():
        reason = ("no summary.csv (the run was interrupted or is still going): "
                  f"summary recomputed from the {len(trials)} trials written")
    else:
        summary = _read_csv(file)
        lacking = [c for c in SUMMARY_CONTRACT if c not in summary.columns]
        if lacking:
            reason = f"summary.csv lacks {', '.join(lacking)}: summary recomputed from trials.csv"
        else:
            for c in KEYS:
                summary[c] = summary[c].astype(str)
            summary["is_baseline"] = _bool(summary["is_baseline"])
            have = set(map(tuple, summary[KEYS].to_numpy()))
            if have != set(map(tuple, trials[KEYS].drop_duplicates().to_numpy())):
                reason = "summary.csv does not match trials.csv: summary recomputed from trials.csv"
    if reason:
        notes.append(reason)
        summary = stats.summarise(trials)
    for c in ("peak_mem_mb", "final_loss", "mem_ratio", "mem_ratio_lo", "mem_ratio_hi", "cv"):
        if c not in summary.columns:
            summary[c] = math.nan
    return summary


def load_run(path, cfg: Optional[dict] = None) -> Run:
    """Everything a report needs from one run directory; ReportError when it is unusable."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path} does not exist")
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory")
    if not (path / "trials.csv").exists():
        raise ReportError(f"{path} has no trials.csv; is it a speedbench run directory?")
    trials = _read_csv(path / "trials.csv")
    lacking = [c for c in REQUIRED if c not in trials.columns]
    if lacking:
        raise ReportError(f"{path / 'trials.csv'} lacks the contract columns {', '.join(lacking)}; "
                          "cannot report on it")
    if trials.empty:
        raise ReportError(f"{path / 'trials.csv'} holds no trials yet")
    notes: list[str] = []
    missing = [c for c in results.TRIAL_COLUMNS[:13] if c not in trials.columns]
    if missing:
        notes.append(f"trials.csv lacks {', '.join(missing)} (another speedbench version?): "
                     "what needs them is left out")
    for c in OPTIONAL_NUMERIC:
        if c not in trials.columns:
            trials[c] = math.nan
    if "device" not in trials.columns:
        trials["device"] = "unknown"
    for c in KEYS:
        trials[c] = trials[c].astype(str)
    trials["is_baseline"] = _bool(trials["is_baseline"])
    trials["status"] = trials["status"].fillna("error: no status").astype(str)
    trials["samples_per_s"] = pd.to_numeric(trials["samples_per_s"], errors="coerce")

    env = {}
    if (path / "env.json").exists():
        try:
            env = json.loads((path / "env.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            notes.append("env.json is not valid JSON: environment unknown")
    else:
        notes.append("no env.json: environment unknown")
    if cfg is None:
        cfg = {}
        if (path / "config.yaml").exists():
            try:
                cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
            except yaml.YAMLError:
                notes.append("config.yaml is not valid YAML: claims and settings unknown")
    return Run(path=path, trials=trials, summary=_summary(path, trials, notes), env=env,
               cfg=cfg if isinstance(cfg, dict) else {},
               phases=_optional_table(path / "phases.csv", PHASES_COLUMNS, notes),
               findings=_optional_table(path / "findings.csv", FINDINGS_COLUMNS, notes),
               capacity=_optional_table(path / "capacity.csv", CAPACITY_COLUMNS, notes),
               notes=notes, missing=missing, label=path.name)


def label_runs(runs: list[Run]) -> None:
    """Short, distinct labels: the directory name, with parents added until they differ."""
    depth = 1
    while depth < 6:
        labels = ["/".join(r.path.resolve().parts[-depth:]) for r in runs]
        if len(set(labels)) == len(labels):
            break
        depth += 1
    for i, (run, label) in enumerate(zip(runs, labels)):
        run.label = label if labels.count(label) == 1 else f"{label} #{i + 1}"
