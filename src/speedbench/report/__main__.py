"""`python -m speedbench.report RUN [RUN ...] [--out DIR] [--reference RUN] [--index FOLDER]`:
rebuild or compare reports. A RUN is a run directory, or a run's label (or its folder's name)
in the index of runs of --index's folder (results/index.py; default results).

One run: rebuild its report.md/report.html/plots (in place, or in --out).
Several: a comparison report in --out, by default results/compare/<timestamp>/, against a
reference run: --reference's, else the first run given that measured something (said).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from speedbench import errors, results
from speedbench.results import index
from speedbench.results.runs import ReportError, measured_something


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A signal, taken like Ctrl-C: the temp file being written is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


def _on_signal(signum, frame):
    for sig in STOPPING:  # one cleanup, not cut short by a second signal
        signal.signal(sig, signal.SIG_IGN)
    # recorded too: raised inside a module's import (matplotlib's backend, loaded on the first
    # figure) it comes back as "ImportError: initialization failed" with the stop as its cause
    errors.when_free(_raiser(errors.ask_to_stop(Stopped(signum))))  # after the file written


def _raiser(stop: KeyboardInterrupt):
    def raise_it():
        raise stop
    return raise_it


def _done() -> None:
    """The report is written: a signal now changes nothing (it would only turn a finished
    report's line into a traceback or a failed exit status)."""
    for sig in STOPPING:
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, signal.SIG_IGN)


def _out_dir(text: str) -> Path:
    """--out's folder; an empty one is refused (Path("") is the current folder, which would
    take the report's files without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a folder (. for the current one)")
    return Path(text)


def _line(text: str) -> None:
    print(text, flush=True)


def main(argv=None, write: Callable[[list[Path], Optional[Path]], Path] | None = None,
         say: Callable[[str], None] = _line) -> int:
    """The command: its exit status. `write` builds the reports (write_reports: a test hands
    its own), `say` prints the line naming them once they are written."""
    parser = argparse.ArgumentParser(
        prog="python -m speedbench.report",
        description="Rebuild the report of one speedbench run, or compare several runs "
                    "against a reference run.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN",
                        help="run directories (each with trials.csv), or runs' labels")
    parser.add_argument("--reference", default=None, metavar="RUN",
                        help="the run the others are compared with (default: the first run "
                             "given that measured something)")
    parser.add_argument("--index", type=Path, default=Path("results"), metavar="FOLDER",
                        help="the results folder (out_dir) whose index of runs names the "
                             "labels (default results)")
    parser.add_argument("--out", type=_out_dir, default=None,
                        help="where to write the report (one run: default its own directory; "
                             "several: default results/compare/<timestamp>)")
    args = parser.parse_args(argv)
    errors.clear_stop()  # a stop asked of an earlier call in this process is not this one's
    if argv is None:  # the command itself, not a call from Python
        for stream in (sys.stdout, sys.stderr):  # an ASCII-only terminal: '?', no traceback
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="replace")
        for sig in STOPPING:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(sig, _on_signal)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"speedbench.report: error: --out {args.out} is a file, not a directory",
              file=sys.stderr)
        return 2
    try:
        dirs, reference = _runs(args)
        md = (write or write_reports)(dirs, args.out)
        _done()
    except (ReportError, errors.ConfigError) as exc:  # (ConfigError: the default --out folder)
        print(f"speedbench.report: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of our output went away (`| head`): nothing to say
        return _pipe_closed()
    except OSError as exc:  # a full disk, a read-only folder: the old report files are kept
        name = str(exc.filename or "")
        where = f" ({name if len(name) <= 200 else name[:160] + '…'})" if name else ""
        print(f"speedbench.report: error: could not write the report: {exc.strerror or exc}"
              f"{where}; report.md and report.html were left as they were", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except Exception:  # a signal's stop that surfaced as another error (see _on_signal)
        if errors.stopping() is None:
            raise
        return _interrupted(errors.stopping())
    try:
        if reference:
            say(reference)
        say(f"report: {md.with_suffix('.html')} (and {md.name} beside it)")
    except BrokenPipeError:  # `| head -0`: the report is written all the same
        return _pipe_closed()
    return 0


def _runs(args: argparse.Namespace) -> tuple[list[Path], str]:
    """The run directories the command's RUNs name, the reference first where several, and
    the line that says which is the reference and why ("" for one run). ReportError where a
    RUN names no run."""
    def found(name: str) -> Path:
        try:
            return index.find(args.index, name, say=lambda line: None)
        except index.RunNotFound as exc:
            raise ReportError(str(exc)) from None

    dirs = [found(name) for name in args.run_dirs]
    if args.reference is not None:
        ref = found(args.reference)
        same = [d for d in dirs if _same(d, ref)]
        rest = [d for d in dirs if not _same(d, ref)]
        return [same[0] if same else ref] + rest, f"reference: {args.reference} (--reference)"
    if len(dirs) == 1:
        return dirs, ""
    measured = [d for d in dirs if measured_something(d)]
    if not measured or measured[0] is dirs[0]:
        why = "the first run given" + ("; none of them measured anything" if not measured else "")
        return dirs, f"reference: {_shown(dirs[0])} ({why}; another: --reference RUN)"
    skipped = ", ".join(_shown(d) for d in dirs[:dirs.index(measured[0])])
    return [measured[0]] + [d for d in dirs if d is not measured[0]], (
        f"reference: {_shown(measured[0])}, the first run given that measured something "
        f"({skipped} measured nothing; another: --reference RUN)")


def _shown(run_dir: Path) -> str:
    """A run as the comparison names it: its label, else its folder's name."""
    return index.user_label(run_dir) or run_dir.name


def _interrupted(exc: KeyboardInterrupt) -> int:
    print("\nspeedbench.report: interrupted; no file was left half-written (run it again "
          "for the whole report)", file=sys.stderr)
    return 128 + (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)


def _pipe_closed() -> int:
    """stdout's reader went away: point stdout at /dev/null so that Python's own flush at exit
    prints no second traceback; exit as a program the pipe's SIGPIPE ended does."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + signal.SIGPIPE


def write_reports(run_dirs: list[Path], out: Path | None) -> Path:
    """One run's report rebuilt (in place or in `out`), or several runs compared (in `out`):
    report.md's path."""
    from speedbench.report.compare import compare_runs
    from speedbench.report.render import write_report

    if out is not None and (out / "trials.csv").exists() and not (
            len(run_dirs) == 1 and _same(out, run_dirs[0])):  # its report would be replaced
        raise ReportError(f"--out {out} holds a run of its own (trials.csv); its report is not "
                          "replaced: choose another folder")
    if len(run_dirs) == 1:
        if results.run_in_progress(run_dirs[0]):  # its own report would replace this one
            raise ReportError(f"{run_dirs[0]}: its run is still going; rebuild the report "
                              "when it has ended")
        return write_report(run_dirs[0], out_dir=out)
    return compare_runs(run_dirs, out)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
