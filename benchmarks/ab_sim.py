"""The paired A/B of environments (config/arms.py) against two separate runs compared with
`python -m speedbench.report RUN_A RUN_B`, simulated with noise fitted to a real A/B run.

From an A/B run's trials.csv (both arms' baseline rows, paired by round) a two-way fit of log
throughput (round + arm) gives the per-trial sd (the residual) and the sd of the round effect
(the machine's drift from round to round, which pairing removes). Then, for a true ratio of
B over A:

- paired: `rounds` rounds of both arms, a round effect shared by the two trials of a round;
  the verdict is analysis.summary.summarise's (the run's own rule: the paired t interval on
  the log ratios and intervals.classify, one comparison);
- separate runs: `rounds` trials of A on one day and of B on another, each day with its own
  level (a draw of the round effect's sd times `day_factor`) and its rounds' drift; the
  verdict is report/compare.py's (intervals.welch_ratio_ci and intervals.verdict, one
  comparison) and, for reference, the bootstrap of medians it replaced.

    python benchmarks/ab_sim.py RUN_DIR [--runs 1000] [--rounds 5] [--day-factor 1]
    python benchmarks/ab_sim.py RUN_DIR --trial-sd 0.083 --round-sd 0.050   # a quiet machine
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.analysis.summary import summarise
from speedbench.results.schema import TRIAL_COLUMNS


def fitted_noise(trials: pd.DataFrame) -> tuple[float, float]:
    """(per-trial sd, round-effect sd) of log throughput, from the arms' baseline rows."""
    rows = trials[(trials["status"] == "ok") & (trials["reference"].fillna("") == "")]
    y = np.log(rows.pivot_table(index="round", columns="variant", values="samples_per_s"))
    y = y.dropna()
    resid = y.sub(y.mean(axis=0), axis=1).sub(y.mean(axis=1) - y.values.mean(), axis=0)
    k, r = y.shape[1], y.shape[0]
    trial_sd = math.sqrt(float((resid.values ** 2).sum()) / ((r - 1) * (k - 1)))
    round_var = float(y.mean(axis=1).var(ddof=1)) - trial_sd ** 2 / k
    return trial_sd, math.sqrt(max(0.0, round_var))


def _frame(a: np.ndarray, b: np.ndarray) -> pd.DataFrame:
    rows = [{"experiment": "ab", "model": "m", "variant": v, "is_baseline": v == "a",
             "status": "ok", "trial": r, "round": r, "samples_per_s": float(x),
             "step_ms": 1000 / float(x)} for v, xs in (("a", a), ("b", b))
            for r, x in enumerate(xs)]
    frame = pd.DataFrame(rows)
    for column in TRIAL_COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    return frame


def paired_call(rng, ratio: float, rounds: int, trial_sd: float, round_sd: float) -> str:
    drift = rng.normal(0, round_sd, rounds)
    a = np.exp(drift + rng.normal(0, trial_sd, rounds))
    b = ratio * np.exp(drift + rng.normal(0, trial_sd, rounds))
    row = summarise(_frame(a, b)).set_index("variant").loc["b"]
    return row["verdict"], row["speedup_lo"] <= ratio <= row["speedup_hi"]


def separate_call(rng, ratio: float, rounds: int, trial_sd: float, round_sd: float,
                  day_sd: float) -> tuple[str, bool, str]:
    def day(level: float) -> np.ndarray:
        return level * np.exp(rng.normal(0, day_sd) + rng.normal(0, round_sd, rounds)
                              + rng.normal(0, trial_sd, rounds))
    a, b = day(1.0), day(ratio)
    point, lo, hi = intervals.welch_ratio_ci(b, a)
    _, blo, bhi = intervals.unpaired_ratio_ci(b, a, resamples=500)
    return intervals.verdict(lo, hi), lo <= ratio <= hi, intervals.verdict(blo, bhi)


def simulate(trial_sd: float, round_sd: float, ratio: float, rounds: int, runs: int,
             day_factor: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    decided = (intervals.FASTER, intervals.SLOWER)
    paired = [paired_call(rng, ratio, rounds, trial_sd, round_sd) for _ in range(runs)]
    separate = [separate_call(rng, ratio, rounds, trial_sd, round_sd, day_factor * round_sd)
                for _ in range(runs)]
    return {"ratio": ratio, "rounds": rounds,
            "paired calls": np.mean([v in decided for v, _ in paired]),
            "paired coverage": np.mean([c for _, c in paired]),
            "separate Welch calls": np.mean([v in decided for v, _, _ in separate]),
            "separate Welch coverage": np.mean([c for _, c, _ in separate]),
            "separate bootstrap calls": np.mean([v in decided for _, _, v in separate])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--day-factor", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-sd", type=float, help="instead of RUN_DIR's fit (e.g. 0.083, the "
                   "quiet reference machine's: benchmarks/README.md)")
    p.add_argument("--round-sd", type=float, help="likewise (e.g. 0.050)")
    args = p.parse_args()
    trials = pd.read_csv(f"{args.run_dir}/trials.csv", dtype={"reference": str})
    trial_sd, round_sd = fitted_noise(trials)
    trial_sd = args.trial_sd if args.trial_sd is not None else trial_sd
    round_sd = args.round_sd if args.round_sd is not None else round_sd
    print(f"fitted: per-trial sd {trial_sd:.3f}, round-effect sd {round_sd:.3f} (log units); "
          f"day sd = {args.day_factor:g} x the round effect's")
    table = [simulate(trial_sd, round_sd, r, args.rounds, args.runs, args.day_factor,
                      args.seed) for r in (1.0, 1.1)]
    print(pd.DataFrame(table).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
