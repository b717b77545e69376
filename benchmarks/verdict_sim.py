"""Error rates of speedbench's verdicts, simulated with a synthetic timing source.

No training: each trial's throughput is drawn from a noise model shaped like a shared 2-core
CPU (heavy-tailed trial noise, interference outliers, drift within and across rounds, a
position effect), for runs of one baseline and several variants measured in shuffled rounds.
The analysis is the one stats.summarise applies (paired per-round log-ratios, Student t
interval, Bonferroni over the run's comparisons, adaptive rounds until the CI is narrow or the
round cap is reached), vectorised over runs; the verdicts are stats.classify's.

    python benchmarks/verdict_sim.py            # the table in benchmarks/README.md
    python benchmarks/verdict_sim.py --runs 20000 --rounds 5 --max-rounds 12

tests/test_verdicts_sim.py runs the same code with 1,000+ runs.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from speedbench.analysis import stats  # noqa: E402

# Noise model, all on the log scale of throughput (0.03 ~ 3 %).
TRIAL_SD = 0.04        # per-trial noise, Student t with 3 degrees of freedom scaled to this sd
ROUND_DRIFT_SD = 0.02  # random walk of the machine's speed from one round to the next
SLOPE_SD = 0.01        # drift within a round, per position
FIRST_SLOW = 0.02      # the first trial of a round runs this much slower (cold caches)
OUTLIER_P = 0.05       # chance that another job interferes with a trial...
OUTLIER_HIT = (0.10, 0.40)  # ...and slows it by this much
CODES = {stats.FASTER: 1, stats.SLOWER: -1, stats.EQUIVALENT: 0, stats.INCONCLUSIVE: 2}


def throughputs(rng: np.random.Generator, runs: int, rounds: int, effects: np.ndarray
                ) -> np.ndarray:
    """Simulated samples/s, shape (runs, rounds, variants); variant 0 is the baseline and
    `effects[v]` each variant's true speed-up (1.0 = identical)."""
    v = len(effects)
    t = rng.standard_t(3, (runs, rounds, v)) * TRIAL_SD / math.sqrt(3)  # var of t3 is 3
    drift = np.cumsum(rng.normal(0, ROUND_DRIFT_SD, (runs, rounds, 1)), axis=1)
    position = np.argsort(rng.random((runs, rounds, v)), axis=2)  # shuffled order per round
    slope = rng.normal(0, SLOPE_SD, (runs, rounds, 1)) * position
    cold = -FIRST_SLOW * (position == 0)
    hit = rng.random((runs, rounds, v)) < OUTLIER_P
    outlier = np.where(hit, np.log1p(-rng.uniform(*OUTLIER_HIT, (runs, rounds, v))), 0.0)
    log_tp = math.log(100.0) + np.log(effects) + t + drift + slope + cold + outlier
    return np.exp(log_tp)


def verdicts(tp: np.ndarray, min_rounds: int, threshold: float, target_ci: float | None,
             family: float = stats.FAMILY_LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(verdict codes (runs, comparisons): +1 faster, -1 slower, 0 equivalent, 2 inconclusive;
    rounds used per run; relative CI half-widths), with adaptive stopping: after `min_rounds`,
    a run stops at the first round count where every half-width <= target_ci, else at the cap
    (all rounds simulated)."""
    runs, max_rounds, v = tp.shape
    m = v - 1
    level = stats.comparison_level(m, family)
    d = np.log(tp[:, :, 1:]) - np.log(tp[:, :, :1])  # (runs, rounds, m)
    n = np.arange(1, max_rounds + 1)[None, :, None]
    s1, s2 = np.cumsum(d, axis=1), np.cumsum(d * d, axis=1)
    mean = s1 / n
    var = np.maximum(s2 - n * mean ** 2, 0) / np.maximum(n - 1, 1)
    crit = np.array([stats.t_quantile(level, k - 1) if k > 1 else np.inf
                     for k in range(1, max_rounds + 1)])[None, :, None]
    half = np.where(n > 1, np.where(np.isfinite(crit), crit, 0) * np.sqrt(var / n), np.inf)
    width = np.expm1(half)  # relative half-width, sqrt(hi/lo) - 1
    stop = np.full(runs, max_rounds - 1)
    if target_ci is not None:
        narrow = (width <= target_ci).all(axis=2)
        narrow[:, :min_rounds - 1] = False
        first = np.where(narrow.any(axis=1), narrow.argmax(axis=1), max_rounds - 1)
        stop = first
    idx = np.arange(runs)
    mean, half, width = mean[idx, stop], half[idx, stop], width[idx, stop]
    lo, hi, point = np.exp(mean - half), np.exp(mean + half), np.exp(mean)
    classify = np.vectorize(lambda *ci: CODES[stats.classify(*ci, threshold=threshold)])
    return classify(point, lo, hi), stop + 1, width


def aa_rate(runs: int = 1000, variants: int = 7, min_rounds: int = 5, max_rounds: int = 12,
            threshold: float = stats.DEFAULT_THRESHOLD, target_ci: float | None = 0.03,
            seed: int = 0) -> dict:
    """A/A: `variants` identical recipes (one the baseline). Share of runs with any
    faster/slower call (the family-wise false-call rate), and of comparisons called equivalent."""
    rng = np.random.default_rng(seed)
    tp = throughputs(rng, runs, max_rounds, np.ones(variants))
    code, used, width = verdicts(tp, min_rounds, threshold, target_ci)
    return {"runs": runs, "family_false_call": float((np.abs(code) == 1).any(axis=1).mean()),
            "equivalent": float((code == 0).mean()), "rounds_mean": float(used.mean()),
            "halfwidth_median": float(np.median(width))}


def power(effect: float, runs: int = 1000, variants: int = 7, min_rounds: int = 5,
          max_rounds: int = 12, threshold: float = stats.DEFAULT_THRESHOLD,
          target_ci: float | None = 0.03, seed: int = 1) -> dict:
    """One variant truly `effect` times faster, the others identical to the baseline: share
    of runs that call it faster (slower when effect < 1), and runs with a false call on the
    identical ones."""
    rng = np.random.default_rng(seed)
    effects = np.ones(variants)
    effects[1] = effect
    tp = throughputs(rng, runs, max_rounds, effects)
    code, used, _ = verdicts(tp, min_rounds, threshold, target_ci)
    want = 1 if effect > 1 else -1
    return {"effect": effect, "called": float((code[:, 0] == want).mean()),
            "false_call_others": float((np.abs(code[:, 1:]) == 1).any(axis=1).mean()),
            "rounds_mean": float(used.mean())}


def bootstrap_aa(runs: int = 2000, variants: int = 7, rounds: int = 5, resamples: int = 2000,
                 threshold: float = stats.DEFAULT_THRESHOLD, seed: int = 2) -> float:
    """The alternative rejected: a percentile bootstrap over rounds of the mean log-ratio, at
    the same Bonferroni level. Family-wise false-call rate under A/A."""
    rng = np.random.default_rng(seed)
    tp = throughputs(rng, runs, rounds, np.ones(variants))
    d = np.log(tp[:, :, 1:]) - np.log(tp[:, :, :1])  # (runs, rounds, m)
    level = stats.comparison_level(variants - 1)
    pick = rng.integers(0, rounds, (resamples, rounds))
    boots = d[:, pick, :].mean(axis=2)  # (runs, resamples, m)
    lo = np.exp(np.quantile(boots, (1 - level) / 2, axis=1))
    hi = np.exp(np.quantile(boots, (1 + level) / 2, axis=1))
    point = np.exp(d.mean(axis=1))
    call = ((lo > 1) & (point > 1 + threshold)) | ((hi < 1) & (point < 1 - threshold))
    return float(call.any(axis=1).mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10000)
    p.add_argument("--variants", type=int, default=7)
    p.add_argument("--rounds", type=int, default=5, help="minimum rounds (bench.repeats)")
    p.add_argument("--max-rounds", type=int, default=12, help="rounds the time budget allows")
    p.add_argument("--target-ci", type=float, default=0.03)
    p.add_argument("--threshold", type=float, default=stats.DEFAULT_THRESHOLD)
    p.add_argument("--bootstrap", action="store_true",
                   help="also the A/A rate of a bootstrap over rounds (the rejected method)")
    a = p.parse_args(argv)
    kw = dict(runs=a.runs, variants=a.variants, min_rounds=a.rounds, max_rounds=a.max_rounds,
              threshold=a.threshold, target_ci=a.target_ci)
    aa = aa_rate(**kw)
    print(f"A/A, {a.variants} identical variants, {a.runs} runs, rounds {a.rounds}..{a.max_rounds}"
          f" (mean {aa['rounds_mean']:.1f}): runs with any faster/slower call "
          f"{aa['family_false_call']:.2%}; comparisons called equivalent {aa['equivalent']:.1%};"
          f" median CI half-width {aa['halfwidth_median']:.1%}")
    if a.bootstrap:
        print(f"A/A with a percentile bootstrap over {a.rounds} rounds instead of the t interval: "
              f"runs with any faster/slower call {bootstrap_aa(rounds=a.rounds):.2%}")
    print("| true speed-up | called | false calls on the 5 identical | mean rounds |")
    print("|---|---|---|---|")
    for effect in (0.8, 0.9, 1.05, 1.1, 1.2, 1.3, 1.5):
        r = power(effect, **kw)
        print(f"| {effect:.2f}x | {r['called']:.1%} | {r['false_call_others']:.2%} | "
              f"{r['rounds_mean']:.1f} |")


if __name__ == "__main__":
    main()
