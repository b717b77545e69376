"""`python -m speedbench.report RUN_DIR [RUN_DIR ...]`: rebuild the report of finished runs."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speedbench.report.render import write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speedbench.report",
                                     description="Rebuild report.md/report.html of speedbench runs.")
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (with trials.csv)")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not (run_dir / "trials.csv").exists():
            print(f"speedbench.report: error: {run_dir} has no trials.csv; is it a run directory?",
                  file=sys.stderr)
            return 2
        print(write_report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
