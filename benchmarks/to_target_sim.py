"""Error rates and power of the time-to-target verdicts, simulated through
analysis.to_target.summarise, the function the command line runs on to_target.csv.

Each simulated run is a to_target.csv of the time_to_target experiment's shape: S paired seeds,
a baseline and 4 variants (a family of 4 comparisons). A seed's time to target is its steps to
target times its time per step. Two noises, fitted (--fit) to real to_target.csv files:

- pace: the sd of the log of a run's time per step, within a variant over its seeds (a run's
  own noise on a loaded or quiet machine, and the seeds' small differences in pace);
- steps: the sd over seeds of the log of a variant's steps to target over the baseline's, for
  variants whose numerics differ (bf16, a larger batch): they reach the target at other
  evaluations. Identical numerics take the same steps from the same seed (0).

A true effect multiplies a variant's time per step. Seeds differ in steps (sd of log steps
0.15) and pace, which pairing removes.

    python benchmarks/to_target_sim.py --fit RUN_DIR/to_target.csv [...]
    python benchmarks/to_target_sim.py --pace-sd 0.05 --steps-sd 0.1 --runs 2000

Prints a markdown table: per scenario and number of seeds, how often a run calls any variant
faster or slower (A/A: a false call at the family's level) and how often a true 1.3x is found.
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
VARIANTS = 4  # the time_to_target experiment: bf16, batch_x2, batch_x4, accumulate_x4


def _pooled(groups) -> float:
    """The pooled sd of the groups' values about their own means (NaN without two in any)."""
    resid, dof = 0.0, 0
    for values in groups:
        v = np.asarray(values, float)
        v = v[np.isfinite(v)]
        if len(v) > 1:
            resid += float(((v - v.mean()) ** 2).sum())
            dof += len(v) - 1
    return math.sqrt(resid / dof) if dof else math.nan


def fitted(paths: list[str]) -> tuple[float, float]:
    """(pace sd, steps sd) of the given to_target.csv files (the module's docstring)."""
    pace, steps = [], []
    for path in paths:
        runs = pd.read_csv(path)
        ok = runs[runs["status"] == "ok"].copy()
        ok["log_pace"] = np.log(ok["time_s"] / ok["steps"])
        for (_, _, _), g in ok.groupby(["experiment", "model", "variant"]):
            pace.append(g["log_pace"])
        for (_, _), g in ok.groupby(["experiment", "model"]):
            base = g[g["is_baseline"].astype(bool)].set_index("seed")["steps"]
            for _, v in g[~g["is_baseline"].astype(bool)].groupby("variant"):
                ratio = np.log(v.set_index("seed")["steps"] / base).dropna()
                if (ratio != 0).any():  # identical numerics: no steps noise to fit
                    steps.append(ratio)
    if not pace:
        raise SystemExit("--fit: no run that reached the target")
    steps_sd = _pooled(steps)
    return _pooled(pace), 0.0 if math.isnan(steps_sd) else steps_sd


def one_run(rng, seeds: int, effects: list[float], pace_sd: float,
            steps_sd: list[float]) -> pd.DataFrame:
    rows = []
    steps = 200 * rng.lognormal(0, STEPS_SD, seeds)
    pace = rng.lognormal(np.log(0.05), 0.05, seeds)
    for v, (effect, ssd) in enumerate(zip([1.0] + effects, [0.0] + steps_sd)):
        name = "base" if v == 0 else f"v{v}"
        own = np.round(steps * rng.lognormal(0, ssd, seeds)) if ssd else np.round(steps)
        for s in range(seeds):
            per_step = pace[s] / effect * rng.lognormal(0, pace_sd)
            t = own[s] * per_step
            rows.append({"experiment": "sim", "model": "m", "variant": name,
                         "is_baseline": v == 0, "seed": s, "status": "ok", "time_s": t,
                         "cold_s": t, "one_time_s": 0.0, "steps": own[s],
                         "step_ms": 1000 * per_step, "final_loss": 1.0, "target_loss": 1.0,
                         "entropy_floor": math.nan, "target_source": "sim"})
    return pd.DataFrame(rows)


def rates(seeds: int, effects: list[float], pace_sd: float, steps_sd: list[float], runs: int,
          seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    any_call = found = 0
    for _ in range(runs):
        verdicts = to_target.summarise(one_run(rng, seeds, effects, pace_sd, steps_sd))
        verdicts = verdicts.set_index("variant")
        calls = verdicts["verdict"].isin([intervals.FASTER, intervals.SLOWER])
        any_call += bool(calls.any())
        found += verdicts.loc["v1", "verdict"] == intervals.FASTER
    return {"any call": any_call / runs, "v1 found faster": found / runs}


SCENARIOS = (  # name, effects, whether the variants' numerics differ (steps noise)
    ("A/A", [1.0] * VARIANTS, False),
    ("one 1.3x, same numerics", [1.3] + [1.0] * (VARIANTS - 1), False),
    ("one 1.3x, other numerics", [1.3] + [1.0] * (VARIANTS - 1), True),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="*", default=[], help="to_target.csv files")
    ap.add_argument("--pace-sd", type=float, default=None, help="sd of log time per step")
    ap.add_argument("--steps-sd", type=float, default=None, help="sd of log steps ratio")
    ap.add_argument("--seeds", type=int, nargs="*", default=[3, 5, 8])
    ap.add_argument("--runs", type=int, default=2000)
    args = ap.parse_args()
    pace_sd, steps_sd = fitted(args.fit) if args.fit else (0.03, 0.1)
    pace_sd = args.pace_sd if args.pace_sd is not None else pace_sd
    steps_sd = args.steps_sd if args.steps_sd is not None else steps_sd
    print(f"noise: sd of a run's log time per step {pace_sd:.4f}, of a variant's log steps "
          f"ratio {steps_sd:.4f}" + (f" (fitted to {', '.join(args.fit)})" if args.fit else "")
          + "\n")
    print("| scenario | seeds | variants | runs | any faster/slower call | true 1.3x found |")
    print("|---|---|---|---|---|---|")
    for name, effects, other in SCENARIOS:
        for seeds in args.seeds:
            r = rates(seeds, effects, pace_sd, [steps_sd if other else 0.0] * VARIANTS,
                      args.runs)
            found = "-" if name == "A/A" else f"{r['v1 found faster']:.1%}"
            print(f"| {name} | {seeds} | {VARIANTS} + baseline | {args.runs} | "
                  f"{r['any call']:.1%} | {found} |")


if __name__ == "__main__":
    main()
