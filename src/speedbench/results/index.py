"""The local index of runs: one SQLite file (`runs.sqlite`) in the results folder (out_dir), a
row per run written at the run's end: when, the experiment, its models, a summary of its
verdicts, its folder. `speedbench runs [FOLDER]` lists them (list_runs).

The index is a convenience, never the record: the run directories are. So it is rewritten
whole into a temp file and renamed over the old one (a reader never sees half a file), a run
whose folder was moved or deleted by hand is listed as missing (not an error), and an index
that cannot be read is rebuilt from the run directories under the folder, said in one line.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import sqlite3
import tempfile
from collections import Counter
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

from speedbench import errors

FILE = "runs.sqlite"
COLUMNS = "date TEXT, experiment TEXT, models TEXT, verdicts TEXT, path TEXT PRIMARY KEY"
DEPTH = 3  # run directories are found at most this deep under the folder (experiment/stamp)
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp's files are 0600, the index gets the usual mode


@dataclass(frozen=True)
class Card:
    """One run as the index holds it."""

    date: str  # when its folder was made (ISO, to the second)
    experiment: str  # its experiments, comma-separated
    models: str  # its models, comma-separated
    verdicts: str  # e.g. "faster 2, inconclusive 1"; "no summary" where it wrote none
    path: str  # its folder, absolute


def card(run_dir: Path) -> Card:
    """The index's row for a run directory, from its trials.csv and summary.csv."""
    run_dir = Path(run_dir).resolve()
    experiments, models = _column_values(run_dir / "trials.csv", ("experiment", "model"))
    verdicts = _verdicts(run_dir / "summary.csv")
    made = dt.datetime.fromtimestamp((run_dir / "trials.csv").stat().st_mtime) \
        if (run_dir / "trials.csv").exists() else dt.datetime.now()
    return Card(made.isoformat(timespec="seconds"), ", ".join(experiments), ", ".join(models),
                verdicts, str(run_dir))


def _column_values(path: Path, names: tuple[str, ...]) -> list[list[str]]:
    """The distinct values, in order, of each named column of a CSV file ([] where absent)."""
    seen: list[dict[str, None]] = [{} for _ in names]
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as f:
            for row in csv.DictReader(f):
                for values, name in zip(seen, names):
                    if row.get(name):
                        values[row[name][:100]] = None
    except OSError:
        pass
    return [list(v) for v in seen]


def _verdicts(summary: Path) -> str:
    """`faster 2, inconclusive 1`: the verdicts of the non-baseline rows, counted."""
    try:
        with summary.open(newline="", encoding="utf-8", errors="replace") as f:
            rows = [r for r in csv.DictReader(f)
                    if str(r.get("is_baseline", "")).strip().lower() not in ("true", "1")]
    except OSError:
        return "no summary"
    counted = Counter(str(r.get("verdict") or "-").split(":")[0][:40] for r in rows)
    return ", ".join(f"{v} {n}" for v, n in counted.most_common()) or "no comparison"


def record(folder: Path, run_dir: Path) -> None:
    """The run added to (or replaced in) the folder's index, which is rewritten whole and
    renamed into place. OSError where the folder cannot take it."""
    folder = Path(folder)
    cards = {c.path: c for c in read_index(folder / FILE) or []}
    new = card(run_dir)
    cards[new.path] = new
    _write(folder / FILE, sorted(cards.values(), key=lambda c: (c.date, c.path)))


def read_index(path: Path) -> Optional[list[Card]]:
    """The index's rows; [] without an index; None where it cannot be read (corrupt)."""
    if not path.exists():
        return []
    db = None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        got = db.execute("SELECT date, experiment, models, verdicts, path FROM runs "
                         "ORDER BY date, path").fetchall()
        return [Card(*map(str, row)) for row in got]
    except sqlite3.Error:
        return None
    finally:
        if db is not None:
            db.close()


def _write(path: Path, cards: list[Card]) -> None:
    """The index made anew in a temp file beside it, then renamed over it; a stop signal waits
    for the rename (errors.signals_held), so no temp file is left behind."""
    with errors.signals_held():
        _replace(path, cards)


def _replace(path: Path, cards: list[Card]) -> None:
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)
    os.close(fd)
    try:
        db = sqlite3.connect(temp)
        with db:
            db.execute(f"CREATE TABLE runs ({COLUMNS})")
            db.executemany(f"INSERT INTO runs VALUES ({', '.join('?' * len(fields(Card)))})",
                           [astuple(c) for c in cards])
        db.close()
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def run_dirs(folder: Path) -> list[Path]:
    """The run directories under `folder` (a trials.csv at most DEPTH levels down)."""
    found = []
    for depth in range(1, DEPTH + 1):
        found += [p.parent for p in Path(folder).glob("/".join(["*"] * depth) + "/trials.csv")]
    return sorted(found)


def list_runs(folder: Path, say: Callable[[str], None] = print) -> list[Card]:
    """The folder's runs as its index holds them, with the run directories under it that it
    lacks (two runs that ended together each rewrote it: the later one's rows win); an index
    that cannot be read is rebuilt from the run directories, said in one line."""
    folder = Path(folder)
    cards = read_index(folder / FILE)
    dirs = run_dirs(folder)
    if cards is None:
        say(f"speedbench runs: {folder / FILE} could not be read; rebuilt from the "
            f"{len(dirs)} run directories under {folder}")
        cards = []
    known = {c.path for c in cards}
    lacking = [card(d) for d in dirs if str(d.resolve()) not in known]
    if lacking or not (folder / FILE).exists() and dirs:
        cards = sorted(cards + lacking, key=lambda c: (c.date, c.path))
        _write(folder / FILE, cards)
    return cards


def lines(cards: list[Card]) -> list[str]:
    """The listing: a line per run, its folder marked `(missing)` where it is gone."""
    out = []
    for c in cards:
        gone = "" if Path(c.path).is_dir() else " (missing: moved or deleted)"
        out.append(f"{c.date.replace('T', ' ')}  {c.experiment or '-'}  {c.models or '-'}  "
                   f"{c.verdicts}  {c.path}{gone}")
    return out
