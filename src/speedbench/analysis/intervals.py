"""The interval engine: paired speed-up estimates, error-controlled confidence intervals, and
verdicts.

Design (benchmarks/README.md shows the simulation behind each choice):
- Trials run in rounds: every variant of a model once per round. A variant is compared with
  the baseline *in the same round* (column `round`, else `trial`), so that drift of the
  machine's speed, which hits a whole round alike, cancels in the ratio.
- The speed-up is the geometric mean of the per-round throughput ratios; its CI is a Student t
  interval on the per-round log-ratios. (With 3-10 rounds a percentile bootstrap over rounds is
  anti-conservative: at the levels multiplicity control asks for it degenerates into the range
  of the log-ratios and calls a difference whenever all rounds agree in sign.)
- Family-wise error: every comparison of a run gets a Bonferroni-adjusted interval, level
  1 - FAMILY_LEVEL / comparisons, so that the chance of any false faster/slower call in the run
  stays at or below FAMILY_LEVEL (5 %).
- Four verdicts, with `bench.noise_threshold` (relative, e.g. 0.05 = 5 %):
  faster / slower: the adjusted CI excludes 1 and the estimate is beyond the threshold;
  equivalent: the adjusted CI lies inside [1 - threshold, 1 + threshold];
  inconclusive: anything else; `min_detectable` says the smallest effect this run could have
  called (the CI's relative half-width, at least the threshold).
- A fifth, `slower (stopped early)` (STOPPED_SLOWER): a variant the quality probe stopped as
  far slower (studies/stopping.py), with the interval of that test; a slower call of the run,
  it counts in the family, whose error the test and the rounds share (STOP_SHARE).
- No call, `not measured` (NOT_MEASURED): a variant a limit stopped rather than evidence (a step
  past bench.max_trial_s, the run's budget), with what it had measured and no interval.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd

from speedbench.results.schema import OK, TOO_SLOW

FASTER, SLOWER, EQUIVALENT, INCONCLUSIVE = "faster", "slower", "equivalent", "inconclusive"
# For comparisons without a threshold (two runs compared by report/compare.py, claims).
SAME = "no significant difference"
# A measurement with fewer rounds than the run's floor (bench.repeats; a recipe search's screen)
# decides nothing in summary.csv: its verdict says so.
SCREENING = "screening"
# One paired round (bench.mode=quick, or a budget that fitted one): a speed-up, no interval.
NO_CI = "no CI"
TOO_FEW = "too few trials"
BASELINE = "baseline"
FAMILY_LEVEL = 0.05  # family-wise error rate of a run's faster/slower calls
# Of FAMILY_LEVEL, the share set aside for the findings' checks (search/check_findings.py) when a
# profiled run checks what it finds; the experiments (a recipe search's too) share the rest.
CHECK_SHARE = 0.01
# Of each comparison's share of the family, the part the probe's far-slower test may spend
# (studies/stopping.py): a variant stopped early is a slower call of the family; its rounds'
# interval gets the rest.
STOP_SHARE = 0.1
DEFAULT_THRESHOLD = 0.05  # bench.noise_threshold's default; keep in step with config/schema.py


# ---- Student t quantiles without scipy (exact for integer degrees of freedom) ----

def _t_central(theta: float, df: int) -> float:
    """P(|T| < sqrt(df) tan(theta)) for Student's t with integer df (Abramowitz & Stegun
    26.7.3-4)."""
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(2, df, 2):  # 1, (1/2)c^2, (1*3)/(2*4) c^4, ...
            term *= (k - 1) / k * c * c
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term, total = c, c
    for k in range(3, df, 2):  # c, (2/3)c^3, (2*4)/(3*5) c^5, ...
        term *= (k - 1) / k * c * c
        total += term
    return 2 / math.pi * (theta + s * total)


@functools.lru_cache(maxsize=4096)
def t_quantile(level: float, df: int) -> float:
    """Two-sided critical value: P(|T| < t) = level, for df >= 1 (bisection, 1e-12; cached:
    the same few levels and degrees of freedom recur)."""
    if df < 1:
        return math.inf
    lo, hi = 0.0, math.pi / 2
    for _ in range(80):
        mid = (lo + hi) / 2
        if _t_central(mid, int(df)) < level:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan((lo + hi) / 2)


# ---- paired ratios ----

def comparison_level(comparisons: int, family: float = FAMILY_LEVEL) -> float:
    """Confidence level of each of `comparisons` Bonferroni-adjusted intervals."""
    return 1 - family / max(1, comparisons)


# ---- group-sequential looks: alpha spent across them ----

LOOKS = 3  # adaptive rounds: looks after repeats, 2 x repeats and 3 x repeats rounds at most
MAX_LOOKS = 8  # ... and more where the budget fits them at their widest spacing (planned_looks)


def spending_share(look: int, looks: int) -> float:
    """Share of the family's error spent at look `look` of `looks` (equally spaced): the
    increments of the Pocock-type spending function ln(1 + (e - 1) t) (Lan & DeMets, 1983).
    One look spends it all."""
    def spent(t: float) -> float:
        return math.log1p((math.e - 1) * t)
    return spent(look / looks) - spent((look - 1) / looks)


def sequential_level(comparisons: int, look: int = 1, looks: int = 1,
                     family: float = FAMILY_LEVEL) -> float:
    """Level of each of `comparisons` intervals of the rounds at look `look` of `looks`:
    Bonferroni over the comparisons and over the looks (each look its spending share), of the
    family's error less STOP_SHARE (the probes' far-slower test spends that). The union bound
    holds for any stopping rule, so the interval reported at the look a run stops at keeps its
    level."""
    return 1 - family * (1 - STOP_SHARE) * spending_share(look, looks) / max(1, comparisons)


def planned_looks(time_budget_s: float, min_rounds: int, round_s: float) -> int:
    """Looks the model's time budget allows at the first round's pace: `looks` x `min_rounds`
    rounds must fit, 1 to LOOKS; more, up to MAX_LOOKS, where the budget fits a look beyond
    LOOKS looks at their widest spacing (MAX_SPACING), so that a long budget is spent on the
    comparisons still undecided rather than left unspent. Chosen after the first round, before
    any look, so that no error is spent on looks the budget cannot reach; the pace is not the
    data's effect, so choosing by it keeps each look's level."""
    if not round_s > 0 or not math.isfinite(time_budget_s):
        return LOOKS
    fit = int(time_budget_s // round_s)
    looks = max(1, min(LOOKS, fit // min_rounds))
    while LOOKS <= looks < MAX_LOOKS and \
            most_rounds(min_rounds, looks + 1, MAX_SPACING * min_rounds) <= fit:
        looks += 1
    return looks


# The later looks' spacing grows with the budget, at most this many times bench.repeats: a
# budget that fits more rounds spends them on the comparisons still undecided, while the first
# look stays at bench.repeats rounds, so that a clear effect still stops early.
MAX_SPACING = 4


def look_spacing(time_budget_s: float, min_rounds: int, round_s: float, looks: int) -> int:
    """Rounds between two looks after the first (which comes after `min_rounds`, bench.repeats),
    planned with the looks after the first round: the later looks spread over the model's
    budget at the first round's pace, at least `min_rounds` and at most MAX_SPACING x
    `min_rounds` apart."""
    if not round_s > 0 or not math.isfinite(time_budget_s) or looks < 2:
        return min_rounds
    fit = int(time_budget_s // round_s) - min_rounds  # the rounds after the first look
    return max(min_rounds, min(MAX_SPACING * min_rounds, fit // (looks - 1)))


def most_rounds(min_rounds: int, looks: int, every: int | None = None) -> int:
    """The rounds at the last of `looks` looks: the first after `min_rounds`, then one every
    `every` rounds (default `min_rounds`)."""
    return min_rounds + (max(1, looks) - 1) * (every or min_rounds)


def look_of(rounds: int, min_rounds: int, looks: int, every: int | None = None) -> int:
    """The look a comparison of `rounds` paired rounds ended at (the first look after
    `min_rounds` rounds, then one every `every`, default `min_rounds`): the last one all of
    whose rounds it has, the first at least."""
    if rounds < min_rounds:
        return 1
    return max(1, min(looks, 1 + (rounds - min_rounds) // max(1, every or min_rounds)))


def reported_look(rounds: int, min_rounds: int, looks: int, every: int | None = None) -> int:
    """The look whose share of the error a comparison of `rounds` rounds is reported at: the
    look it ended at or, ended between two looks (the budget ran out, or the rounds went on past
    a look whose next one would not fit), the next look: the interim analysis at the look
    before has spent that look's share, the next one's no analysis has."""
    look = look_of(rounds, min_rounds, looks, every)
    if rounds > min_rounds and not is_look(rounds, min_rounds, every):
        look = min(looks, look + 1)
    return look


def is_look(rounds: int, min_rounds: int, every: int | None = None) -> bool:
    """Whether `rounds` rounds end at a look (look_of's schedule)."""
    return rounds >= min_rounds and (rounds - min_rounds) % max(1, every or min_rounds) == 0


class Looks:
    """The looks of one model's rounds: the first after `min_rounds` rounds, then one every
    `every` (default `min_rounds`), `looks` at most."""

    def __init__(self, comparisons: int, min_rounds: int, looks: int,
                 family: float = FAMILY_LEVEL, every: int | None = None):
        self.comparisons, self.min_rounds, self.looks = comparisons, min_rounds, looks
        self.family, self.every = family, every

    def level(self, rounds: int) -> float:
        """The CI level of a comparison with `rounds` paired rounds (reported_look)."""
        look = reported_look(rounds, self.min_rounds, self.looks, self.every)
        return sequential_level(self.comparisons, look, self.looks, self.family)


def paired_log_ratios(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.asarray(num, float), np.asarray(den, float)
    keep = np.isfinite(num) & np.isfinite(den) & (num > 0) & (den > 0)
    return np.log(num[keep]) - np.log(den[keep])


MAX_LOG = 709.0  # math.exp overflows above about 709.78


def paired_ratio_ci(num, den, level: float = 0.95) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios num[i]/den[i] with a t interval on their logs;
    (ratio, nan, nan) below two pairs. The only paired interval: the summary, the recipe search
    and the findings check all use it."""
    d = paired_log_ratios(num, den)
    if len(d) == 0:
        return math.nan, math.nan, math.nan
    centre = float(d.mean())
    if len(d) < 2:
        return math.exp(centre), math.nan, math.nan
    half = t_quantile(level, len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    # two wild pairs at a strict level: the upper end can pass what a float holds
    upper = math.exp(centre + half) if centre + half < MAX_LOG else math.inf
    return math.exp(centre), math.exp(centre - half), upper


def relative_halfwidth(lo: float, hi: float) -> float:
    """Half-width of a ratio CI, relative: sqrt(hi / lo) - 1 (NaN when undefined)."""
    if not (lo > 0 and hi > 0):
        return math.nan
    return math.sqrt(hi / lo) - 1


def classify(point: float, lo: float, hi: float, threshold: float = DEFAULT_THRESHOLD) -> str:
    """faster / slower / equivalent / inconclusive for a speed-up and its adjusted CI."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return INCONCLUSIVE
    if lo > 1 and point > 1 + threshold:
        return FASTER
    if hi < 1 and point < 1 - threshold:
        return SLOWER
    if lo >= 1 - threshold and hi <= 1 + threshold:
        return EQUIVALENT
    return INCONCLUSIVE


def min_detectable(lo: float, hi: float, threshold: float = DEFAULT_THRESHOLD) -> float:
    """Smallest relative effect this comparison could have called: its CI's relative
    half-width, and never below the threshold (NaN with too few rounds)."""
    half = relative_halfwidth(lo, hi)
    return max(threshold, half) if np.isfinite(half) else math.nan


def pair_key(trials: pd.DataFrame) -> str:
    """The column that says which round a trial belongs to: `round`, else `trial`."""
    if "round" in trials and pd.to_numeric(trials["round"], errors="coerce").notna().any():
        return "round"
    return "trial"


def reference_rows(group: pd.DataFrame, rows: pd.DataFrame, base: pd.DataFrame
                   ) -> pd.DataFrame:
    """What a variant's `rows` are compared with, in one model's `group`: the rows of the
    variant its `reference` column names (an A/B's arms: config/arms.py), else `base`, the
    baseline's."""
    ref = str(rows["reference"].iloc[0]) if "reference" in rows and len(rows) else ""
    if ref in ("", "nan", "None"):
        return base
    named = group[group["variant"] == ref]
    return named[named["status"] == OK] if "status" in named else named


# A round is a burst when other processes took this much more of the CPU in it than in the
# pair's usual round (others_cpu_share, env.CpuWindow). Four such rounds out of 21 gave a
# quiet-machine A/B of identical speeds 0.68x [0.33, 1.37]; without them 0.98x [0.89, 1.07].
BURST_OVER = 0.25


def burst_rounds(variant: pd.DataFrame, base: pd.DataFrame, key: str,
                 rounds: pd.Index) -> pd.Index:
    """The `rounds` in which another process's burst took over BURST_OVER more of the CPU
    than in the pair's median round, during either side's trial. The choice reads the machine,
    never the figures, and drops both sides of a round, so it favours neither. None are
    dropped where that would leave under half of the rounds or under two (a machine busy
    throughout: the load is the norm there, and the pairing cancels it) or where trials.csv
    has no others_cpu_share (older runs)."""
    if "others_cpu_share" not in variant or "others_cpu_share" not in base or not len(rounds):
        return pd.Index([])
    sides = [pd.to_numeric(f["others_cpu_share"], errors="coerce").groupby(f[key]).max()
             for f in (variant, base)]
    return bursts_in(pd.concat(sides, axis=1).max(axis=1).reindex(rounds))


def bursts_in(share: pd.Series) -> pd.Index:
    """The labels of `share` (others' CPU share per round, the larger of the pair's two
    trials) that burst_rounds leaves out; the recipe search's arms use it on their own
    per-round lists, so that the search and summary.csv state the same intervals."""
    typical = share.median()
    if not np.isfinite(typical):
        return pd.Index([])
    burst = share.index[share > typical + BURST_OVER]
    kept = len(share) - len(burst)
    return burst if kept >= 2 and 2 * kept >= len(share) else pd.Index([])


def paired(variant: pd.DataFrame, base: pd.DataFrame, metric: str, key: str):
    """(variant values, baseline values) of `metric`, aligned on the rounds both measured,
    less the rounds a burst of other processes hit (burst_rounds)."""
    a = variant.groupby(key)[metric].median()
    b = base.groupby(key)[metric].median()
    both = a.index.intersection(b.index)
    both = both.difference(burst_rounds(variant, base, key, both))
    return (pd.to_numeric(a[both], errors="coerce").to_numpy(float),
            pd.to_numeric(b[both], errors="coerce").to_numpy(float))


# ---- the older unpaired tools (two runs compared; plots) ----

def welch_ratio_ci(num, den, level: float = 0.95) -> tuple[float, float, float]:
    """Ratio of the geometric means num/den with Welch's t interval on the logs: two
    separate runs' trials (no pairing), which holds its level at 5-10 trials a side where a
    bootstrap of medians does not; (ratio, nan, nan) below two trials on a side."""
    a = np.log(np.asarray(num, float))
    b = np.log(np.asarray(den, float))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not len(a) or not len(b):
        return math.nan, math.nan, math.nan
    centre = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return math.exp(centre), math.nan, math.nan
    va, vb = float(a.var(ddof=1)) / len(a), float(b.var(ddof=1)) / len(b)
    if va + vb == 0:
        return math.exp(centre), math.exp(centre), math.exp(centre)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_quantile(level, max(1, int(df))) * math.sqrt(va + vb)  # df rounded down
    return math.exp(centre), math.exp(centre - half), math.exp(min(centre + half, MAX_LOG))


def unpaired_ratio_ci(num: np.ndarray, den: np.ndarray, level: float = 0.95,
                       resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of medians num/den with a percentile bootstrap CI (trials resampled per side).
    For unpaired samples only (two separate runs): trials of one run are compared paired."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    point = float(np.median(num) / np.median(den))
    if len(num) < 2 or len(den) < 2:
        return point, math.nan, math.nan
    rng = np.random.default_rng(seed)
    a = np.median(rng.choice(num, (resamples, len(num))), axis=1)
    b = np.median(rng.choice(den, (resamples, len(den))), axis=1)
    lo, hi = np.quantile(a / b, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)


def verdict(lo: float, hi: float) -> str:
    """Direction of a ratio CI without a threshold: faster / slower / no significant difference."""
    if math.isnan(lo) or math.isnan(hi):
        return TOO_FEW
    if lo > 1:
        return FASTER
    if hi < 1:
        return SLOWER
    return SAME


def median_ci(values, level: float = 0.95, resamples: int = 4000, seed: int = 0):
    """Median with a percentile bootstrap CI; (median, nan, nan) below two values."""
    values = np.asarray(values, float)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(values))
    if len(values) < 2:
        return med, math.nan, math.nan
    boots = np.median(np.random.default_rng(seed).choice(values, (resamples, len(values))), axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return med, float(lo), float(hi)


# ---- a run's comparisons ----

def threshold_of(g: pd.DataFrame) -> float:
    """The noise threshold the trials recorded (bench.noise_threshold); the default without
    one."""
    if "noise_threshold" in g and pd.to_numeric(g["noise_threshold"], errors="coerce").notna().any():
        return float(pd.to_numeric(g["noise_threshold"], errors="coerce").dropna().iloc[0])
    return DEFAULT_THRESHOLD


def stopped_early(statuses: pd.Series) -> pd.Series:
    """Rows of a variant stopped early as far slower (quality.py)."""
    return statuses.astype(str).str.startswith(TOO_SLOW)


def count_comparisons(trials: pd.DataFrame) -> int:
    """Speed-up comparisons a run makes: each non-baseline (experiment, model, variant) with an
    ok trial, or stopped early as far slower, whose baseline has an ok trial. The family every
    CI of the run is adjusted for."""
    if trials.empty or "status" not in trials:
        return 0
    ok = trials[(trials["status"] == OK) | stopped_early(trials["status"])]
    base = ok[ok["is_baseline"].astype(bool) & (ok["status"] == OK)]
    base = base[["experiment", "model"]].drop_duplicates()
    others = ok[~ok["is_baseline"].astype(bool)][["experiment", "model", "variant"]]
    others = others.drop_duplicates().merge(base, on=["experiment", "model"])
    return len(others)
