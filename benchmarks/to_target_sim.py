"""Error rates of the time-to-target verdicts, simulated through analysis.to_target.summarise,
the function the command line runs on to_target.csv.

Each simulated run is a to_target.csv: S paired seeds, a baseline and k variants. A seed's time
to target is its steps to target times its time per step. Identical variants take the same
steps from the same seed (the same numerics, measured: they reach the target at the same
evaluation), so between them only the time per step varies; its per-run noise (sd of the log of
a run's time per step, around the seed's) is fitted to real runs: every pair of variants of a
to_target.csv given with --fit whose recipes are identical. A true effect multiplies a
variant's time per step. Seeds differ in steps (sd of log steps 0.15) and pace, which pairing
removes.

    python benchmarks/to_target_sim.py --fit results/reference/to_target_aa/to_target.csv
    python benchmarks/to_target_sim.py --sd 0.03 --runs 4000

Prints a markdown table: per scenario, how often a run calls any variant faster or slower
(A/A: a false call at the run's family level) and how often a true effect is found.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speedbench.analysis import intervals  # noqa: E402
from speedbench.analysis import to_target  # noqa: E402

STEPS_SD = 0.15  # between seeds: removed by pairing, kept for realism


def fitted_sd(paths: list[str]) -> float:
    """sd of one run's log time per step around its seed's mean, over the identical variants
    of the given to_target.csv files (every variant of an A/A run)."""
    resid = []
    for path in paths:
        runs = pd.read_csv(path)
        ok = runs[runs["status"] == "ok"].copy()
        ok["log_step"] = np.log(ok["time_s"] / ok["steps"])
        for _, seed in ok.groupby(["model", "seed"]):
            n = len(seed)
            if n > 1:  # deviations from a mean of n lose one degree of freedom: rescaled
                dev = seed["log_step"] - seed["log_step"].mean()
                resid += list(dev * math.sqrt(n / (n - 1)))
    if len(resid) < 3:
        raise SystemExit("--fit: fewer than 3 paired runs of identical variants found")
    return float(np.std(resid, ddof=0))


def one_run(rng, seeds: int, effects: list[float], sd: float) -> pd.DataFrame:
    rows = []
    steps = np.round(200 * rng.lognormal(0, STEPS_SD, seeds))
    pace = rng.lognormal(np.log(0.05), 0.05, seeds)
    for v, effect in enumerate([1.0] + effects):
        name = "base" if v == 0 else f"v{v}"
        for s in range(seeds):
            per_step = pace[s] / effect * rng.lognormal(0, sd)
            t = steps[s] * per_step
            rows.append({"experiment": "sim", "model": "m", "variant": name,
                         "is_baseline": v == 0, "seed": s, "status": "ok", "time_s": t,
                         "cold_s": t, "one_time_s": 0.0, "steps": steps[s],
                         "step_ms": 1000 * per_step, "final_loss": 1.0, "target_loss": 1.0,
                         "entropy_floor": math.nan, "target_source": "sim"})
    return pd.DataFrame(rows)


def rates(seeds: int, effects: list[float], sd: float, runs: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    any_call = found = 0
    for _ in range(runs):
        verdicts = to_target.summarise(one_run(rng, seeds, effects, sd)).set_index("variant")
        calls = verdicts["verdict"].isin([intervals.FASTER, intervals.SLOWER])
        any_call += bool(calls.any())
        found += verdicts.loc["v1", "verdict"] == intervals.FASTER
    return {"any call": any_call / runs, "v1 found faster": found / runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="*", default=[], help="to_target.csv files of A/A runs")
    ap.add_argument("--sd", type=float, default=None, help="noise sd (log time per step)")
    ap.add_argument("--runs", type=int, default=2000)
    args = ap.parse_args()
    sd = args.sd if args.sd is not None else fitted_sd(args.fit) if args.fit else 0.03
    print(f"noise: sd of a run's log time per step = {sd:.4f}"
          + (f" (fitted to {', '.join(args.fit)})" if args.fit else "") + "\n")
    print("| scenario | seeds | variants | runs | any faster/slower call | true effect found |")
    print("|---|---|---|---|---|---|")
    for seeds in (3, 5):
        for name, effects in (("A/A", [1.0] * 4), ("one 1.3x", [1.3, 1, 1, 1]),
                              ("one 2x", [2.0, 1, 1, 1])):
            r = rates(seeds, effects, sd, args.runs)
            found = "-" if name == "A/A" else f"{r['v1 found faster']:.1%}"
            print(f"| {name} | {seeds} | 4 + baseline | {args.runs} | {r['any call']:.1%} | "
                  f"{found} |")


if __name__ == "__main__":
    main()
