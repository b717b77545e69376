"""A/A through the CLI: 7 identical fp32 variants of a real model, as a user would run them.

    python benchmarks/aa_cli.py                      # transformer, default settings
    python benchmarks/aa_cli.py --model resnet -- bench.time_budget_s=60

Prints each comparison's verdict, speed-up CI and loss Δ, the number of faster/slower calls
(there should be none: the run's family-wise error rate is 5 %), and the wall time. Runs this
checkout's code (src/ first on the path).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 600.0  # bench.time_budget_s's default
VARIANTS = "+variants={a:{},b:{},c:{},d:{},e:{},f:{},g:{}}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("overrides", nargs="*", help="more speedbench overrides (after --)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "speedbench", f"model={a.model}", VARIANTS,
                               "baseline=a", f"out_dir={out}", *a.overrides], env=env, cwd=out,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stderr[-3000:])
            return proc.returncode
        summary = pd.read_csv(next(Path(out).rglob("summary.csv")))
    rows = summary[~summary["is_baseline"]]
    for r in rows.itertuples():
        print(f"{r.variant}: {r.verdict:12s} {r.speedup:.3f}x [{r.speedup_lo:.3f}, "
              f"{r.speedup_hi:.3f}] (+-{r.ci_halfwidth:.1%}, {r.rounds} rounds), "
              f"loss Δ {r.loss_delta:+.6f}")
    # a call of any kind: faster, slower, and the far-slower stop ("slower (stopped early)")
    calls = rows["verdict"].astype(str).str.startswith(("faster", "slower")).sum()
    budget = next((float(o.split("=", 1)[1]) for o in a.overrides
                   if o.startswith("bench.time_budget_s=")), DEFAULT_BUDGET_S)
    limit = budget + max(0.05 * budget, 10.0)
    print(f"{len(rows)} comparisons at level {rows['ci_level'].iloc[0]:.4f}; faster/slower "
          f"calls, stops included: {calls}; verdicts: "
          f"{rows['verdict'].astype(str).value_counts().to_dict()}; max |loss Δ|: "
          f"{rows['loss_delta'].abs().max():.6f}; wall time {wall:.0f} s of budget {budget:g} s "
          f"({'kept' if wall <= limit else 'OVERRAN'}: limit {limit:.0f} s); load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
