"""Error rates of the quality verdicts, simulated through analysis.quality.summarise, the
function the command line runs on quality.csv.

Each simulated run is a quality.csv: S paired seeds, a baseline and k variants. Seed s gives the
baseline a step-0 loss L0_s and a loss L_s after the probe (seeds differ: sd of log L 0.3, which
the per-seed normalisation removes); a variant's loss is L_s + (its true learning lost + e) x
(L0_s - L_s), e ~ N(0, sd): the share of the baseline's learning it lost, with noise. sd is the
noise of a technique that changes only the rounding, fitted (--fit) to the per-seed learning
lost of the non-baseline variants of real quality.csv files (with their step-0 losses), about
each variant's own mean.

    python benchmarks/quality_sim.py --fit path/to/quality.csv
    python benchmarks/quality_sim.py --sd 0.05 --runs 4000

Prints a markdown table: per scenario, how often a variant is called worse, non-inferior or
inconclusive at the default tolerance (bench.quality_tolerance 0.05: 5 % of the learning).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speedbench.analysis import quality  # noqa: E402

SEEDS_SD = 0.3  # between seeds, of the baseline's log loss after the probe


def fitted_sd(paths: list[str]) -> float:
    """sd of the per-seed learning lost over the non-baseline variants of the given
    quality.csv files whose numerics differ from the baseline's, about each one's mean."""
    resid = []
    for path in paths:
        rows = pd.read_csv(path)
        rows = rows[rows["status"] == "ok"]
        for (_, _), g in rows.groupby(["experiment", "model"]):
            base = g[g["is_baseline"].astype(bool)].set_index("seed")
            for _, v in g[~g["is_baseline"].astype(bool)].groupby("variant"):
                lost = ((v.set_index("seed")["loss"] - base["loss"])
                        / (base["initial_loss"] - base["loss"])).dropna()
                if len(lost) > 1 and (lost != 0).any():  # identical numerics: no noise
                    resid += list((lost - lost.mean()) * np.sqrt(len(lost) / (len(lost) - 1)))
    if len(resid) < 3:
        raise SystemExit("--fit: fewer than 3 paired seeds of a non-baseline variant found")
    return float(np.std(resid))


def one_run(rng, seeds: int, lost: list[float], sd: float) -> pd.DataFrame:
    initial = 2.3 * rng.lognormal(0, 0.03, seeds)
    base = 0.5 * rng.lognormal(0, SEEDS_SD, seeds)
    rows = []
    for v, share in enumerate([0.0] + lost):
        noise = np.zeros(seeds) if v == 0 else rng.normal(0, sd, seeds)
        loss = base + (share + noise) * (initial - base)
        rows += [{"experiment": "sim", "model": "m", "variant": "base" if v == 0 else f"v{v}",
                  "is_baseline": v == 0, "seed": s, "steps": 12, "loss": loss[s],
                  "initial_loss": initial[s], "chance_loss": np.log(10), "status": "ok"}
                 for s in range(seeds)]
    return pd.DataFrame(rows)


def rates(seeds: int, lost: list[float], sd: float, runs: int, seed: int = 0) -> dict:
    """Shares of runs whose first variant is called worse / non-inferior / inconclusive."""
    rng = np.random.default_rng(seed)
    calls = pd.Series(
        [quality.summarise(one_run(rng, seeds, lost, sd), quality.TOLERANCE)
         .set_index("variant").loc["v1", "quality_verdict"] for _ in range(runs)])
    return calls.value_counts(normalize=True).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="*", default=[], help="quality.csv files")
    ap.add_argument("--sd", type=float, default=None, help="noise sd (share of the learning)")
    ap.add_argument("--runs", type=int, default=1000)
    args = ap.parse_args()
    sd = args.sd if args.sd is not None else fitted_sd(args.fit) if args.fit else 0.02
    print(f"noise: sd of a seed's learning lost = {sd:.4f}"
          + (f" (fitted to {', '.join(args.fit)})" if args.fit else "") + "\n")
    print("| true learning lost by v1 | seeds | variants | runs | worse | non-inferior | "
          "inconclusive |")
    print("|---|---|---|---|---|---|---|")
    for seeds in (3, 5):
        for lost in (0.0, 0.05, 0.10, 0.30, 1.0):
            r = rates(seeds, [lost, 0.0], sd, args.runs)
            print(f"| {lost:.0%} | {seeds} | 2 + baseline | {args.runs} | "
                  f"{r.get(quality.WORSE, 0):.1%} | {r.get(quality.NON_INFERIOR, 0):.1%} | "
                  f"{r.get('inconclusive', 0):.1%} |")


if __name__ == "__main__":
    main()
