"""What a number of rounds can decide: the plan a run states before its rounds.

The speed-up's interval is a t interval on the per-round log ratios (intervals.py): with `r`
rounds and a per-round sd `sd` of the log ratio, its half-width is t(level, r - 1) sd / sqrt(r).
An effect is called when its estimate clears both that half-width and the noise threshold; at
the true effect, half the runs clear it (the estimate falls either side), and POWER_Z more
standard errors make it `power` of them (a normal approximation, good enough for a plan).
"""
from __future__ import annotations

import math

from speedbench.analysis.intervals import t_quantile

POWER_Z = 0.84  # one-sided normal quantile of 80 % power
MAX_ROUNDS = 200


def halfwidth(rounds: int, sd: float, level: float) -> float:
    """The log half-width of the paired speed-up's interval after `rounds` rounds (inf below
    two)."""
    if rounds < 2:
        return math.inf
    return t_quantile(level, rounds - 1) * sd / math.sqrt(rounds)


def smallest_call(rounds: int, sd: float, level: float, threshold: float) -> float:
    """The smallest relative effect `rounds` rounds call in most runs (0.12 = 12 %)."""
    need = halfwidth(rounds, sd, level) + POWER_Z * sd / math.sqrt(max(rounds, 1))
    return math.expm1(max(need, math.log1p(threshold)))


def rounds_for(effect: float, sd: float, level: float) -> int | None:
    """The rounds that call a true `effect` (1.1 = 10 % faster) in most runs; None past
    MAX_ROUNDS."""
    target = math.log(effect)
    for r in range(2, MAX_ROUNDS + 1):
        if halfwidth(r, sd, level) + POWER_Z * sd / math.sqrt(r) <= target:
            return r
    return None


def sd_from_interval(lo: float, hi: float, rounds: int, level: float) -> float:
    """The per-round sd of the log ratio that a `level` interval [lo, hi] after `rounds`
    rounds implies (halfwidth inverted)."""
    return math.log(hi / lo) / 2 * math.sqrt(rounds) / t_quantile(level, rounds - 1)


# The machine's quiet figure for the paired per-round sd of a log speed-up: the highest measured
# on the quiet reference machine, nothing else running (benchmarks/README.md, "Trial noise":
# 0.10-0.16 for the ResNet and VAE, 0.26-0.33 for the transformer, 5-20-step windows).
QUIET_ROUND_SD = 0.30
NOISY_LEVEL = 0.99  # the one-sided level at which rounds are called noisier than that
NOISY_Z = 2.326  # its standard normal quantile


def chi2_quantile(df: int, z: float = NOISY_Z) -> float:
    """The chi-square quantile whose standard normal equivalent is `z` (Wilson-Hilferty: within
    2 % of the exact value from 2 degrees of freedom on at the 99 % point)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def noisier_than_quiet(round_sd: float, rounds: int, quiet: float = QUIET_ROUND_SD) -> bool:
    """Whether the paired per-round log ratios' sd over `rounds` rounds (at least 3) is
    significantly above the quiet machine's figure (one-sided chi-square test at NOISY_LEVEL):
    on a quiet machine a row warns in at most 1 % of runs, whatever its rounds."""
    if not rounds or rounds < 3 or not round_sd == round_sd:
        return False
    return (rounds - 1) * round_sd ** 2 / quiet ** 2 > chi2_quantile(rounds - 1)
