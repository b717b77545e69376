"""`python -m speedbench.report RUN_DIR [RUN_DIR ...] [--out DIR]`: rebuild or compare reports.

One run directory: rebuild its report.md/report.html/plots (in place, or in --out).
Several: a comparison report (the first run is the reference) in --out, by default
results/compare/<timestamp>/.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from speedbench.results.runs import ReportError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speedbench.report",
        description="Rebuild the report of one speedbench run, or compare several runs "
                    "(the first is the reference).")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories (each with trials.csv)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the report (one run: default its own directory; "
                             "several: default results/compare/<timestamp>)")
    args = parser.parse_args(argv)
    from speedbench.report.compare import compare_runs
    from speedbench.report.render import write_report

    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"speedbench.report: error: --out {args.out} is a file, not a directory",
              file=sys.stderr)
        return 2
    try:
        if len(args.run_dirs) == 1:
            md = write_report(args.run_dirs[0], out_dir=args.out)
        else:
            stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
            out = args.out or Path("results", "compare", stamp)
            md = compare_runs(args.run_dirs, out)
    except ReportError as exc:
        print(f"speedbench.report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a read-only folder: the old report files are kept
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"speedbench.report: error: could not write the report: {exc.strerror or exc}"
              f"{where}; report.md and report.html were left as they were", file=sys.stderr)
        return 1
    print(f"report: {md.with_suffix('.html')} (and {md.name} beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
