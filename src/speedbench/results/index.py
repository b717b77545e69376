"""The local index of runs: one SQLite file (`runs.sqlite`) in the results folder (out_dir), a
row per run written at the run's end: when, its label, the experiment, its models, the machine
class, torch and CUDA, a summary of its verdicts, its folder. `speedbench runs [FOLDER]` lists
them (list_runs, filtered by `select`), `speedbench runs label RUN LABEL` labels one, and the
report tool takes a label for a folder (`find`).

The index is a convenience, never the record: the run directories are. A run's label lives in
its folder (label.txt, else config.yaml's `label`), so an index rebuilt keeps it. The index is
rewritten whole into a temp file and renamed over the old one (a reader never sees half a
file), a run whose folder was moved or deleted by hand is listed as missing (not an error),
and an index that cannot be read is rebuilt from the run directories under the folder, said in
one line.
"""
from __future__ import annotations

import csv
import datetime as dt
import fnmatch
import json
import os
import sqlite3
import tempfile
from collections import Counter
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import yaml

from speedbench import errors
from speedbench.results import atomic

FILE = "runs.sqlite"
LABEL_FILE = "label.txt"  # the label `speedbench runs label` gave, over config.yaml's
LABEL_MOST = 60  # characters
DEPTH = 3  # run directories are found at most this deep under the folder (experiment/stamp)
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp's files are 0600, the index gets the usual mode


@dataclass(frozen=True)
class Card:
    """One run as the index holds it ("" where unknown)."""

    date: str  # when its trials were last written (ISO, to the second)
    label: str  # the user's name for it
    experiment: str  # its experiments, comma-separated
    models: str  # its models, comma-separated
    machine: str  # e.g. "cpu: AMD EPYC, 2 cores", "cuda: NVIDIA H100 x8"
    torch: str  # torch's version
    cuda: str  # the CUDA torch was built with
    verdicts: str  # e.g. "faster 2, inconclusive 1"; "no summary" where it wrote none
    path: str  # its folder, absolute


COLUMNS = ", ".join(f"{f.name} TEXT" for f in fields(Card)).replace(
    "path TEXT", "path TEXT PRIMARY KEY")


def label_problem(text) -> Optional[str]:
    """Why `text` cannot be a run's label (None where it can): 1 to LABEL_MOST printable
    characters, no '/' (a label stands where a folder could), not starting with '-' (an
    option)."""
    if not isinstance(text, str) or not text.strip():
        return "empty"
    if len(text) > LABEL_MOST:
        return f"{len(text)} characters, over {LABEL_MOST}"
    if not text.isprintable() or "/" in text or text.startswith("-") or text != text.strip():
        return ("it holds a '/', a control character or spaces around it, or starts with '-'")
    return None


LABEL_RULE = (f"1 to {LABEL_MOST} printable characters, without '/' or a leading '-' "
              "(e.g. torch2.5-a100)")


def user_label(run_dir: Path) -> str:
    """The run's label: label.txt's (`speedbench runs label`), else config.yaml's `label`
    (`label=...` on the command line); "" where none or not a usable label."""
    for text in (_label_file(Path(run_dir) / LABEL_FILE), _config_label(Path(run_dir))):
        if text is not None and label_problem(text) is None:
            return text
    return ""


def _label_file(path: Path) -> Optional[str]:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.read(LABEL_MOST + 2).strip()
    except OSError:
        return None


def _config_label(run_dir: Path) -> Optional[str]:
    """config.yaml's top-level `label:` line, read alone (the file may be large)."""
    try:
        with (run_dir / "config.yaml").open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("label:"):
                    value = yaml.safe_load(line[len("label:"):][:LABEL_MOST * 4])
                    # (label=2026 comes back a number)
                    return None if value is None or isinstance(value, bool) else str(value)
    except (OSError, yaml.YAMLError):
        pass
    return None


def write_label(run_dir: Path, label: str) -> None:
    """The run's label set in its folder (label.txt, written atomically)."""
    atomic.write_text(Path(run_dir) / LABEL_FILE, label + "\n")


def card(run_dir: Path) -> Card:
    """The index's row for a run directory, from its trials.csv, summary.csv, env.json and
    label."""
    run_dir = Path(run_dir).resolve()
    experiments, models = _column_values(run_dir / "trials.csv", ("experiment", "model"))
    verdicts = _verdicts(run_dir / "summary.csv")
    made = dt.datetime.fromtimestamp((run_dir / "trials.csv").stat().st_mtime) \
        if (run_dir / "trials.csv").exists() else dt.datetime.now()
    machine, torch, cuda = _machine(_env(run_dir / "env.json"))
    return Card(made.isoformat(timespec="seconds"), user_label(run_dir), ", ".join(experiments),
                ", ".join(models), machine, torch, cuda, verdicts, str(run_dir))


ENV_MOST = 20 * 2 ** 20  # bytes: an env.json larger than a run writes is not read


def _env(path: Path) -> dict:
    """env.json's entries; {} where absent, too large or not a JSON object."""
    try:
        if path.stat().st_size > ENV_MOST:
            return {}
        env = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return {}
    return env if isinstance(env, dict) else {}


def _machine(env: dict) -> tuple[str, str, str]:
    """(machine class, torch version, CUDA version) from env.json; "" where not recorded."""
    def text(value) -> str:
        return str(value)[:60] if isinstance(value, (str, int, float)) else ""

    device, name = text(env.get("device")), text(env.get("device_name"))
    if device.startswith("cuda") and isinstance(env.get("cuda_device_count"), int) \
            and env["cuda_device_count"] > 1:
        name = f"{name} x{env['cuda_device_count']}"
    elif device == "cpu" and isinstance(env.get("cpu_count"), int):
        name = f"{name}, {env['cpu_count']} cores"
    versions = env.get("versions") if isinstance(env.get("versions"), dict) else {}
    machine = f"{device.split(':')[0]}: {name}" if device and name else device or name
    return machine, text(versions.get("torch")), text(env.get("torch_cuda_version"))


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
    got = _read(path)
    return None if got is None else got[0]


def _read(path: Path) -> Optional[tuple[list[Card], bool]]:
    """The index's rows and whether it holds every column a Card has (an index written by an
    earlier speedbench lacks some: "" there); None where it cannot be read."""
    if not path.exists():
        return [], True
    db = None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        have = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
        names = [f.name for f in fields(Card)]
        if "path" not in have:
            return None
        got = db.execute(f"SELECT {', '.join(n for n in names if n in have)} FROM runs "
                         "ORDER BY date, path").fetchall()
        cards = []
        for row in got:
            values = dict(zip([n for n in names if n in have], row))
            cards.append(Card(**{n: str(values.get(n) or "") for n in names}))
        return cards, have.issuperset(names)
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
    lacks (two runs that ended together each rewrote it: the later one's rows win); a run
    moved by hand within the folder is followed, said in one line; an index that cannot be
    read is rebuilt from the run directories, said in one line."""
    folder = Path(folder)
    got = _read(folder / FILE)
    dirs = run_dirs(folder)
    if got is None:
        say(f"speedbench runs: {folder / FILE} could not be read; rebuilt from the "
            f"{len(dirs)} run directories under {folder}")
    cards, current = got or ([], True)
    if not current:  # an earlier speedbench's index: its rows read afresh from their folders
        cards = [card(Path(c.path)) if Path(c.path).is_dir() else c for c in cards]
    known = {c.path for c in cards}
    lacking = [card(d) for d in dirs if str(d.resolve()) not in known]
    cards = _follow_moves(cards, lacking, say)
    if lacking or not current or not (folder / FILE).exists() and dirs:
        cards = sorted(cards + lacking, key=lambda c: (c.date, c.path))
        _write(folder / FILE, cards)
    return cards


def _identity(c: Card) -> tuple:
    """What a run keeps when its folder is moved (`mv` keeps trials.csv's time)."""
    return c.date, c.label, c.experiment, c.models, c.machine, c.verdicts


def _follow_moves(cards: list[Card], found: list[Card], say: Callable[[str], None]) -> list[Card]:
    """`cards` without the rows whose folder is gone and that are one of `found` (the same
    run, moved by hand within the folder), each move said."""
    new = Counter(_identity(c) for c in found)
    kept = []
    for c in cards:
        if not Path(c.path).is_dir() and new[_identity(c)] == 1:
            there = next(f.path for f in found if _identity(f) == _identity(c))
            say(f"speedbench runs: {c.path} was moved to {there}; the index follows it")
            continue
        kept.append(c)
    return kept


def _when(text: str, key: str, end: bool) -> dt.datetime:
    """A date (2026-12-05: its start, or with `end` its end) or a date and time."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a date; give YYYY-MM-DD or "
                         "YYYY-MM-DDTHH:MM") from None
    if end and len(text.strip()) <= 10:  # a whole day
        when += dt.timedelta(days=1) - dt.timedelta(microseconds=1)
    return when.replace(tzinfo=None)


def _matches(pattern: Optional[str], text: str) -> bool:
    """Whether one of the comma-separated `text`'s items matches the glob `pattern` (any
    case); no pattern matches all."""
    if pattern is None:
        return True
    return any(fnmatch.fnmatchcase(item.strip().lower(), pattern.lower())
               for item in (text.split(",") if text else [""]))


def select(cards: list[Card], experiment: Optional[str] = None, model: Optional[str] = None,
           label: Optional[str] = None, since: Optional[str] = None,
           until: Optional[str] = None) -> list[Card]:
    """The runs that match every filter given: experiment, model and label as globs (`bert*`),
    since and until as dates (inclusive). ValueError naming the filter for a bad date."""
    low = _when(since, "--since", end=False) if since else dt.datetime.min
    high = _when(until, "--until", end=True) if until else dt.datetime.max
    out = []
    for c in cards:
        try:
            made = dt.datetime.fromisoformat(c.date)
        except ValueError:
            made = None
        if made is None and (since or until) or made is not None and not low <= made <= high:
            continue
        if _matches(experiment, c.experiment) and _matches(model, c.models) and (
                label is None or fnmatch.fnmatchcase(c.label.lower(), label.lower())):
            out.append(c)
    return out


class RunNotFound(LookupError):
    """A run named on the command line that is neither a run directory nor in the index."""


def find(folder: Path, name: str, say: Callable[[str], None] = print) -> Path:
    """The run directory `name` stands for: a folder (given as such), else the run of the
    folder's index with that label (or that folder name, e.g. 2026-12-05_10-00-00).
    RunNotFound, in one line, where none, several, or one that was moved or deleted."""
    given = Path(name)
    try:
        folder_given = given.is_dir() or os.sep in name
    except OSError:  # a name the system cannot look up (too long): the caller says so
        folder_given = True
    if folder_given:  # a folder (one that is not there: the caller says)
        return given
    if not Path(folder).is_dir():
        raise RunNotFound(f"{name}: not a run directory, and {folder} is not a results folder "
                          "whose index could name it (give the out_dir your runs went to)")
    cards = list_runs(Path(folder), say=say)
    hits = [c for c in cards if c.label == name] or [
        c for c in cards if Path(c.path).name == name]
    if not hits:
        labels = sorted({c.label for c in cards if c.label})
        known = (f" (its labels: {', '.join(labels[:8])}{' ...' if len(labels) > 8 else ''})"
                 if labels else " (its runs have no label)")
        raise RunNotFound(f"{name}: not a run directory, nor a run of {Path(folder) / FILE}"
                          f"{known}")
    if len(hits) > 1:
        raise RunNotFound(f"{name} names {len(hits)} runs of {Path(folder) / FILE} ("
                          f"{', '.join(c.path for c in hits[:3])}{' ...' if len(hits) > 3 else ''})"
                          "; give the run's folder, or label one anew (speedbench runs label)")
    if not Path(hits[0].path).is_dir():
        raise RunNotFound(f"{name}: its run {hits[0].path} was moved or deleted (`speedbench "
                          f"runs {folder}` lists it as missing); give its folder where it is now")
    return Path(hits[0].path)


def relabel(folder: Path, run_dir: Path, label: str) -> None:
    """`label` given to the run (its label.txt) and to its row of the folder's index."""
    write_label(run_dir, label)
    run_dir = Path(run_dir).resolve()
    holders = [Path(folder).resolve()] + [p for p in run_dir.parents[:DEPTH] if (p / FILE).exists()]
    for holder in holders:  # the given folder's index, else the one the run lies in
        if run_dir.is_relative_to(holder) and holder.is_dir():
            record(holder, run_dir)
            return


def lines(cards: list[Card], folder: Optional[Path] = None, width: int = 100) -> list[str]:
    """The listing: a line per run (when, label, experiments, models, verdicts, its folder
    under `folder`), marked `(missing)` where the folder is gone, each cut to `width`; a line
    `-- machine · torch · CUDA` above each run whose machine or versions differ from the run
    above."""
    out, above = [], None
    base = Path(folder).resolve() if folder is not None else None
    for c in cards:
        setup = (c.machine, c.torch, c.cuda)
        if setup != above and any(setup):
            out.append(_cut(f"-- {c.machine or 'machine unknown'} · torch {c.torch or '?'}"
                            f" · CUDA {c.cuda or '-'}", width))
        above = setup
        where = Path(c.path)
        shown = str(where.relative_to(base)) if base and where.is_relative_to(base) else c.path
        gone = "" if where.is_dir() else " (missing: moved or deleted)"
        head = (f"{c.date.replace('T', ' ')[:16]}  {c.label or '-'}  {c.experiment or '-'}  "
                f"{c.models or '-'}  {c.verdicts}  ")
        tail = shown + gone
        room = max(width - len(head), 24)
        if len(tail) > room:  # the folder's end (its name) and the mark are what tell it apart
            tail = "…" + tail[len(tail) - room + 1:]
        out.append(_cut(head, width - len(tail)) + tail)
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(width - 3, 1)] + "…  "
