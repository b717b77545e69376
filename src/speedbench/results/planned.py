"""planned.json: what a run set out to measure, and whether it got to the end of measuring.

The run writes it when it opens its directory (every (experiment, model, variant) of its
plans, `ended` null) and stamps `ended` once every plan is measured. A run that stops on the
way (a signal, the watchdog ending the process, a crash) leaves `ended` null, so the report
rebuilt from its trials says that it did not finish and lists what was never measured. A run
directory without the file (an older version's) is taken as it is.
"""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Optional

import pandas as pd

from speedbench.results import atomic

FILE = "planned.json"


def write(run_dir: Path, pairs: list[tuple[str, str, str]], search: bool = False) -> None:
    """The run's (experiment, model, variant) triples; `search`: a recipe search, whose
    trials are its own steps rather than the plan's variants."""
    rows = [{"experiment": e, "model": m, "variant": v} for e, m, v in pairs]
    atomic.write_text(Path(run_dir) / FILE, json.dumps(
        {"planned": rows, "search": search, "ended": None}, indent=2) + "\n")


def mark_ended(run_dir: Path) -> None:
    """Every plan measured: the time it ended."""
    path = Path(run_dir) / FILE
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        data["ended"] = dt.datetime.now().isoformat(timespec="seconds")
        atomic.write_text(path, json.dumps(data, indent=2) + "\n")


def unfinished(run_dir: Path, trials: pd.DataFrame) -> Optional[list[str]]:
    """None for a run that got to the end of measuring (or has no readable planned.json);
    else the `model/variant` pairs (with their experiment in a suite) it never measured, no
    row in `trials`: empty when every pair had one before it stopped."""
    try:
        data = json.loads((Path(run_dir) / FILE).read_text(encoding="utf-8"))
        if data.get("ended") is not None:
            return None
        planned = [(str(r["experiment"]), str(r["model"]), str(r["variant"]))
                   for r in data.get("planned", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None  # (a hand-edited file nested past Python's limit: unreadable too)
    if data.get("search"):
        return []
    done = set(zip(*(trials[c].astype(str) for c in ("experiment", "model", "variant")))) \
        if len(trials) else set()
    suite = len({e for e, _, _ in planned}) > 1
    return [f"{e}: {m}/{v}" if suite else f"{m}/{v}" for e, m, v in planned
            if (e, m, v) not in done]
