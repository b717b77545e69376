"""Error rates of the quality verdicts, simulated through analysis.quality.summarise, the
function the command line runs on quality.csv.

Each simulated run is a quality.csv: S paired seeds, a baseline and k variants. Seed s gives the
baseline a held-out loss L_s (seeds differ: sd of log L 0.05, which pairing removes); a variant's
loss is L_s x its true ratio x exp(e), e ~ N(0, sd). sd is the noise of a technique that changes
only the rounding: fitted (--fit) to the per-seed log loss ratios of the non-baseline variants
of real quality.csv files whose variants compute the same update (AdamW's for-loop, foreach and
fused implementations: +experiment=optimizer).

    python benchmarks/quality_sim.py --fit path/to/quality.csv
    python benchmarks/quality_sim.py --sd 0.01 --runs 4000

Prints a markdown table: per scenario, how often a variant is called worse, non-inferior or
inconclusive at the default tolerance (bench.quality_tolerance 0.05).
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

SEEDS_SD = 0.05  # between seeds: removed by pairing, kept for realism


def fitted_sd(paths: list[str]) -> float:
    """sd of the per-seed log loss ratio (variant / baseline) over the non-baseline variants of
    the given quality.csv files whose numerics differ from the baseline's (a variant with the
    same loss in every seed has no noise to give), around each variant's own mean (a fixed
    offset is an effect, not noise)."""
    resid = []
    for path in paths:
        rows = pd.read_csv(path)
        rows = rows[rows["status"] == "ok"]
        for (_, model), g in rows.groupby(["experiment", "model"]):
            base = g[g["is_baseline"].astype(bool)].set_index("seed")["loss"]
            for _, v in g[~g["is_baseline"].astype(bool)].groupby("variant"):
                d = np.log(v.set_index("seed")["loss"] / base).dropna()
                if len(d) > 1 and (d != 0).any():  # identical numerics: no noise to fit
                    resid += list((d - d.mean()) * np.sqrt(len(d) / (len(d) - 1)))
    if len(resid) < 3:
        raise SystemExit("--fit: fewer than 3 paired seeds of a non-baseline variant found")
    return float(np.std(resid))


def one_run(rng, seeds: int, ratios: list[float], sd: float) -> pd.DataFrame:
    base = 2.0 * rng.lognormal(0, SEEDS_SD, seeds)
    rows = []
    for v, ratio in enumerate([1.0] + ratios):
        noise = np.ones(seeds) if v == 0 else rng.lognormal(0, sd, seeds)
        rows += [{"experiment": "sim", "model": "m", "variant": "base" if v == 0 else f"v{v}",
                  "is_baseline": v == 0, "seed": s, "loss": base[s] * ratio * noise[s],
                  "status": "ok"} for s in range(seeds)]
    return pd.DataFrame(rows)


def rates(seeds: int, ratios: list[float], sd: float, runs: int, seed: int = 0) -> dict:
    """Shares of runs whose first variant is called worse / non-inferior / inconclusive."""
    rng = np.random.default_rng(seed)
    calls = pd.Series(
        [quality.summarise(one_run(rng, seeds, ratios, sd), quality.TOLERANCE)
         .set_index("variant").loc["v1", "quality_verdict"] for _ in range(runs)])
    return calls.value_counts(normalize=True).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="*", default=[], help="quality.csv files")
    ap.add_argument("--sd", type=float, default=None, help="noise sd (log loss ratio)")
    ap.add_argument("--runs", type=int, default=1000)
    args = ap.parse_args()
    sd = args.sd if args.sd is not None else fitted_sd(args.fit) if args.fit else 0.02
    print(f"noise: sd of a seed's log loss ratio = {sd:.4f}"
          + (f" (fitted to {', '.join(args.fit)})" if args.fit else "") + "\n")
    print("| true loss ratio of v1 | seeds | variants | runs | worse | non-inferior | "
          "inconclusive |")
    print("|---|---|---|---|---|---|---|")
    for seeds in (3, 5):
        for ratio in (1.0, 1.05, 1.10, 1.30):
            r = rates(seeds, [ratio, 1.0], sd, args.runs)
            print(f"| {ratio:.2f} | {seeds} | 2 + baseline | {args.runs} | "
                  f"{r.get(quality.WORSE, 0):.1%} | {r.get(quality.NON_INFERIOR, 0):.1%} | "
                  f"{r.get('inconclusive', 0):.1%} |")


if __name__ == "__main__":
    main()
