"""`speedbench runs`: the index of an out_dir's runs (results/index.py) listed and filtered, and
`speedbench runs label RUN LABEL` to name a run. Bad input is one line naming the option and
what it takes, exit status 2."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from speedbench.results import index

EXIT_USAGE = 2
USAGE = ("usage: speedbench runs [FOLDER] [--experiment GLOB] [--model GLOB] [--label GLOB] "
         "[--since DATE] [--until DATE] | speedbench runs label RUN LABEL [--in FOLDER]")


class Usage(Exception):
    """A command line the parser refused: its one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise Usage(message)


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _error(text: str) -> None:
    print(f"speedbench: error: runs: {text}", file=sys.stderr)


def main(args: list[str]) -> int:
    """The command's exit status."""
    try:
        if args[:1] == ["label"]:
            return _label(_label_args(args[1:]))
        return _list(_list_parser().parse_args(args))
    except Usage as exc:
        _error(f"{exc} ({USAGE})")
        return EXIT_USAGE


def _list_parser() -> _Parser:
    p = _Parser(prog="speedbench runs", add_help=False)
    p.add_argument("folder", nargs="?", default="results")
    for name in ("experiment", "model", "label"):
        p.add_argument(f"--{name}", default=None)
    p.add_argument("--since", default=None)
    p.add_argument("--until", default=None)
    return p


def _label_args(args: list[str]) -> argparse.Namespace:
    """RUN LABEL [--in FOLDER], read by hand: a label may start with '-' only to be refused
    as a label (label_problem), not taken for an option."""
    folder = "results"
    if "--in" in args[:-1]:
        at = args.index("--in")
        folder, args = args[at + 1], args[:at] + args[at + 2:]
    if len(args) != 2:
        raise Usage(f"label takes a run and a label, {len(args)} given")
    return argparse.Namespace(run=args[0], label=args[1], folder=folder)


def _folder(text: str) -> Optional[Path]:
    folder = Path(text)
    if not folder.is_dir():
        _error(f"{folder} is not a folder (give the out_dir your runs went to)")
        return None
    return folder


def _list(args: argparse.Namespace) -> int:
    """The runs of the folder's index that match the filters, a line each."""
    folder = _folder(args.folder)
    if folder is None:
        return EXIT_USAGE
    try:
        cards = index.list_runs(folder, say=_say)
    except OSError as exc:  # the rebuilt index could not be written
        _error(f"{exc.strerror or exc} ({exc.filename or folder})")
        return 1
    try:
        shown = index.select(cards, args.experiment, args.model, args.label, args.since,
                             args.until)
    except ValueError as exc:
        _error(str(exc))
        return EXIT_USAGE
    for line in index.lines(shown, folder):
        print(line)
    if not cards:
        _say(f"speedbench runs: no run in {folder}")
    elif not shown:
        _say(f"speedbench runs: none of the {len(cards)} runs in {folder} matches")
    return 0


def _label(args: argparse.Namespace) -> int:
    """The run (a folder, a label, a folder's name) given the label."""
    problem = index.label_problem(args.label)
    if problem:
        _error(f"label {args.label!r}: {problem}; a label is {index.LABEL_RULE}")
        return EXIT_USAGE
    try:
        run_dir = index.find(Path(args.folder), args.run, say=_say)
    except index.RunNotFound as exc:
        _error(str(exc))
        return EXIT_USAGE
    if not (run_dir / "trials.csv").is_file():
        _error(f"{run_dir}: not a run directory (no trials.csv)")
        return EXIT_USAGE
    try:
        index.relabel(Path(args.folder), run_dir, args.label)
    except OSError as exc:
        _error(f"{exc.strerror or exc} ({exc.filename or run_dir})")
        return 1
    print(f"speedbench runs: {run_dir} is labelled {args.label}")
    return 0
