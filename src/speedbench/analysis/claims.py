"""The articles' claims, checked against a run: measured effect with CI, memory cost, verdict.

An experiment lists its claims in its config (`claims:`): `tip`, `source` (the article, by a
name a reader can find), `quote`, the `variants` the claim is about (default: every variant but
the baseline), the variant they are compared with (`versus`, default: the baseline), and a
`kind`. Every ratio is paired by round and its CI is at the run's family-wise adjusted level
(intervals.py), the level of the summary's speed-ups. A claim is judged only on evidence:
- faster (optional `factor`, e.g. 3 for "3-8 times"): holds when the CI lies above 1 beyond the
  noise threshold and, with a factor, at or above it. Does not hold when the CI excludes the
  claimed effect (slower, equivalent, or wholly below the factor while not faster: then
  "partly" when faster but short of the factor). Otherwise inconclusive, with the smallest
  effect the run could have detected.
- less_memory (optional `factor`, e.g. 0.5 for "half the memory"; `metric`, default
  peak_mem_mb, e.g. activation_mem_mb): holds when the CI lies below 1 and at or below the
  factor; "partly" when below 1 but wholly above the factor; does not hold when the CI
  excludes the claim (at or above 1, or wholly above the factor); else inconclusive. Equal
  memory never holds.
- lower / higher, with `metric` (a trials.csv column such as data_wait_frac or host_rss_mb):
  holds when the CI of the metric's ratio lies below / above 1; does not hold when it excludes
  that side (equality included); else inconclusive.
- best: holds when the claim's variant is the fastest and significantly faster than every
  other variant; does not hold when another is significantly faster; else inconclusive.
Scope: `requires: cuda` marks a claim stated for GPUs: n/a on other devices; with
`min_capability` (e.g. 7.0: the article names V100 and 2080 Ti, compute capability 7.0 and 7.5)
also n/a on older GPUs; `cpu_flags` (e.g. [amx_bf16, avx512_bf16]) marks a claim stated for CPUs
with one of those features (env.json's cpu_flags): n/a on other CPUs and on GPUs. Rows whose
variant, or the variant it is compared with, could not run
carry that n/a or failure status as the verdict.
"""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from speedbench.analysis import intervals
from speedbench.analysis.numbers import ratio_text
from speedbench.results.schema import OK

HOLDS, FAILS, PARTLY, INCONCLUSIVE = "holds", "does not hold", "partly", "inconclusive"
COLUMNS = ["tip", "source", "claim", "experiment", "model", "variant", "measured", "memory",
           "loss Δ", "verdict"]
NAN3 = (math.nan, math.nan, math.nan)


def _nan(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _level(summary: Optional[pd.DataFrame]) -> float:
    """The run's per-comparison CI level (Bonferroni over its comparisons), else 95 %."""
    if summary is not None and "ci_level" in summary and summary["ci_level"].notna().any():
        return float(summary["ci_level"].dropna().iloc[0])
    return 0.95


def _threshold(row: pd.Series) -> float:
    t = _nan(row.get("noise_threshold"))
    return intervals.DEFAULT_THRESHOLD if math.isnan(t) else t


def _select(trials: pd.DataFrame, experiment, model, variant) -> pd.DataFrame:
    return trials[(trials["experiment"] == experiment) & (trials["model"] == model)
                  & (trials["variant"] == variant) & (trials["status"] == OK)]


def _ratio(trials: Optional[pd.DataFrame], row: pd.Series, reference: str, metric: str,
           level: float = 0.95):
    """(ratio, lo, hi) of `metric`, row's variant over `reference`, paired by round: geometric
    mean of the per-round ratios with a t interval at `level` (intervals.paired_ratio_ci)."""
    if trials is None or metric not in trials:
        return NAN3
    key = intervals.pair_key(trials)
    a = _select(trials, row["experiment"], row["model"], row["variant"])
    b = _select(trials, row["experiment"], row["model"], reference)
    if not len(a) or not len(b):
        return NAN3
    return intervals.paired_ratio_ci(*intervals.paired(a, b, metric, key), level)


def _inconclusive(lo: float, hi: float, threshold: float, what: str = "") -> str:
    if math.isnan(lo) or math.isnan(hi):
        return f"{INCONCLUSIVE} (too few rounds)"
    detectable = intervals.min_detectable(lo, hi, threshold)
    return f"{INCONCLUSIVE} ({what + '; ' if what else ''}effects under ±{detectable:.0%} " \
           f"could not be seen)"


def _direction(lo: float, hi: float, want: str, threshold: float) -> str:
    """A lower/higher claim: holds when the CI is on the claimed side of 1, does not hold when
    it excludes that side (equality included), else inconclusive."""
    if math.isnan(lo) or math.isnan(hi):
        return _inconclusive(lo, hi, threshold)
    if (hi < 1) if want == "below" else (lo > 1):
        return HOLDS
    if (lo >= 1) if want == "below" else (hi <= 1):
        return f"{FAILS} ({'not lower' if want == 'below' else 'not higher'})"
    return _inconclusive(lo, hi, threshold, "the CI contains 1")


def judge_faster(ratio: tuple, factor: float = 1.0, threshold: float = intervals.DEFAULT_THRESHOLD
                 ) -> str:
    """Verdict of "faster" (by at least `factor` when > 1) on a speed-up CI."""
    point, lo, hi = ratio
    v = intervals.classify(point, lo, hi, threshold)
    if factor <= 1:
        if v == intervals.FASTER:
            return HOLDS
        if v in (intervals.SLOWER, intervals.EQUIVALENT):
            return f"{FAILS} ({v})"
        return _inconclusive(lo, hi, threshold)
    if math.isnan(lo):
        return _inconclusive(lo, hi, threshold)
    if v == intervals.FASTER and lo >= factor:
        return HOLDS
    if hi < factor:  # the CI excludes the claimed magnitude
        if v == intervals.FASTER:
            return f"{PARTLY} (faster, but the CI stays below {factor:g}x)"
        return f"{FAILS} ({v}; the CI stays below {factor:g}x)"
    return _inconclusive(lo, hi, threshold, f"the CI reaches {factor:g}x")


def judge_less_memory(ratio: tuple, factor: float = 1.0) -> str:
    """Verdict of "less memory" (x`factor` or less) on a memory-ratio CI."""
    _, lo, hi = ratio
    if math.isnan(lo) or math.isnan(hi):
        return f"{INCONCLUSIVE} (too few rounds or no memory figure)"
    if hi < 1 and hi <= factor:
        return HOLDS
    if hi < 1 and lo > factor:
        return f"{PARTLY} (less memory, not x{factor:g})"
    if lo >= 1:
        return f"{FAILS} (not less)"
    if lo > factor:
        return f"{FAILS} (the CI lies above x{factor:g})"
    if hi < 1:
        return f"{INCONCLUSIVE} (less memory; the CI contains x{factor:g})"
    return f"{INCONCLUSIVE} (the CI contains 1)"


def judge(claim: dict, row: pd.Series, reference: Optional[pd.Series] = None,
          peers: Optional[pd.DataFrame] = None, trials: Optional[pd.DataFrame] = None,
          level: float = 0.95) -> tuple[str, str]:
    """(measured effect, verdict) of one claim on one summary row.

    `reference` is the summary row compared with (the baseline unless the claim says `versus`),
    `peers` every summary row of the same experiment and model, `trials` the run's trials.csv,
    `level` the CI level of a comparison (the run's adjusted one); without trials only faster
    against the baseline can be judged.
    """
    kind = claim.get("kind", "faster")
    if row["status"] != OK:
        return "-", row["status"]
    threshold = _threshold(row)
    if kind == "best":
        return _judge_best(row, peers, trials, level)
    if reference is not None and reference["status"] != OK:
        return "-", reference["status"]
    versus = claim.get("versus")
    ref_name = reference["variant"] if reference is not None else None
    against = f" vs {versus}" if versus else ""
    if kind == "faster":
        if versus:
            ratio = _ratio(trials, row, ref_name, "samples_per_s", level)
        else:
            ratio = (row["speedup"], row["speedup_lo"], row["speedup_hi"])
        measured = "speed-up " + ratio_text(*ratio) + against
        return measured, judge_faster(ratio, float(claim.get("factor", 1.0)), threshold)
    if kind == "less_memory":
        metric = claim.get("metric", "peak_mem_mb")
        factor = float(claim.get("factor", 1.0))
        if trials is not None and metric in trials:
            ratio = _ratio(trials, row, ref_name, metric, level)
        elif metric == "peak_mem_mb" and not versus:
            ratio = (_nan(row.get("mem_ratio")), _nan(row.get("mem_ratio_lo")),
                     _nan(row.get("mem_ratio_hi")))
        else:
            return "-", f"{INCONCLUSIVE} (this run recorded no {metric})"
        label = "memory" if metric == "peak_mem_mb" else metric.removesuffix("_mb")
        measured = f"{label} " + ratio_text(*ratio) + against
        if not versus and not math.isnan(_nan(row.get("speedup"))):  # what the saving costs
            measured += "; speed-up " + ratio_text(row["speedup"], row["speedup_lo"],
                                                   row["speedup_hi"])
        return measured, judge_less_memory(ratio, factor)
    if kind in ("lower", "higher"):
        metric = claim.get("metric", "samples_per_s")
        ratio = _ratio(trials, row, ref_name, metric, level)
        measured = f"{metric} " + ratio_text(*ratio) + against
        return measured, _direction(ratio[1], ratio[2], "below" if kind == "lower" else "above",
                                    threshold)
    return "-", f"unknown claim kind '{kind}'"


def _judge_best(row: pd.Series, peers: Optional[pd.DataFrame],
                trials: Optional[pd.DataFrame], level: float) -> tuple[str, str]:
    """Best = the fastest, and significantly faster than every other variant measured."""
    ok = peers[peers["status"] == OK] if peers is not None else pd.DataFrame()
    if ok.empty or ok["samples_per_s"].isna().all():
        return "-", f"{INCONCLUSIVE} (nothing measured)"
    best = ok.loc[ok["samples_per_s"].idxmax()]
    measured = f"fastest: {best['variant']} ({best['samples_per_s']:.1f} samples/s)"
    others = [v for v in ok["variant"] if v != row["variant"]]
    if not others:
        return measured, f"{INCONCLUSIVE} (nothing to compare with)"
    ratios = {v: _ratio(trials, row, v, "samples_per_s", level) for v in others}
    beaten_by = [v for v, r in ratios.items() if r[2] < 1]
    if beaten_by:
        return measured, f"{FAILS} (slower than {', '.join(beaten_by)})"
    if all(r[1] > 1 for r in ratios.values()):
        return measured, HOLDS
    ties = [v for v, r in ratios.items() if not r[1] > 1]
    worst = ratios[ties[0]]
    if best["variant"] == row["variant"]:
        measured += f"; vs {ties[0]} " + ratio_text(*worst)
    else:
        measured += f"; {row['variant']} vs {ties[0]} " + ratio_text(*worst)
    return measured, f"{INCONCLUSIVE} (not significantly faster than {', '.join(ties)})"


def _device(trials: Optional[pd.DataFrame], experiment, model) -> Optional[str]:
    if trials is None or "device" not in trials:
        return None
    sel = trials.loc[(trials["experiment"] == experiment) & (trials["model"] == model), "device"]
    return str(sel.iloc[0]) if len(sel) else None


def out_of_scope(claim: dict, device: Optional[str], env: Optional[dict] = None
                 ) -> Optional[str]:
    """'n/a: ...' when the run's device is outside the claim's scope; None when in scope (or
    the device is unknown)."""
    if claim.get("cpu_flags") and device:
        return _cpu_scope(claim["cpu_flags"], device, env)
    if claim.get("cpu_model") and device:
        return _cpu_model_scope(claim["cpu_model"], device, env)
    if claim.get("requires") != "cuda" or not device:
        return None
    if not device.startswith("cuda"):
        return f"n/a: the claim is stated for CUDA GPUs; this run is on {device}"
    need = claim.get("min_capability")
    gpus = (env or {}).get("cuda_devices") or (env or {}).get("gpus") or []
    index = int(device.split(":")[1]) if ":" in device else 0
    have = next((g.get("capability") for g in gpus if g.get("index") == index), None)
    if need is not None and have is not None and float(have) < float(need):
        return (f"n/a: the claim is stated for GPUs of compute capability {need} or later; "
                f"this GPU has {have}")
    return None


def _cpu_scope(flags: list, device: str, env: Optional[dict]) -> Optional[str]:
    """A claim stated for CPUs with one of `flags` (env.json's cpu_flags): n/a elsewhere."""
    if device != "cpu":
        return (f"n/a: the claim is stated for CPUs with {' or '.join(flags)}; this run is on "
                f"{device}")
    have = (env or {}).get("cpu_flags")
    if have is not None and not set(flags) & set(have):
        lacks = {1: "does not have it", 2: "has neither"}.get(len(flags), "has none of them")
        return f"n/a: the claim is stated for CPUs with {' or '.join(flags)}; this CPU {lacks}"
    return None


def _cpu_model_scope(word: str, device: str, env: Optional[dict]) -> Optional[str]:
    """A claim stated for one maker's CPUs (`word` in env.json's cpu_model): n/a elsewhere."""
    if device != "cpu":
        return f"n/a: the claim is stated for {word} CPUs; this run is on {device}"
    have = (env or {}).get("cpu_model")
    if have and word.lower() not in have.lower():
        return f"n/a: the claim is stated for {word} CPUs; this CPU is {have}"
    return None


def evaluate(claims: list[dict], summary: pd.DataFrame,
             trials: Optional[pd.DataFrame] = None, env: Optional[dict] = None) -> pd.DataFrame:
    """One row per (claim, model, variant) that the run measured, or found n/a. `env` (the
    run's env.json) gives the GPUs' compute capability for `min_capability`."""
    rows = []
    level = _level(summary)
    for claim in claims:
        experiment = claim.get("experiment")
        sel = summary[summary["experiment"] == experiment] if experiment else summary
        for (exp, model), peers in sel.groupby(["experiment", "model"], sort=False):
            base = peers[peers["is_baseline"].astype(bool)]
            versus = claim.get("versus")
            ref = peers[peers["variant"] == versus] if versus else base
            reference = ref.iloc[0] if len(ref) else None
            wanted = claim.get("variants") or list(peers.loc[~peers["is_baseline"].astype(bool),
                                                             "variant"])
            for _, row in peers[peers["variant"].isin(wanted)].iterrows():
                if versus and reference is None:
                    measured, verdict = "-", f"n/a: no variant '{versus}' in this run"
                else:
                    measured, verdict = judge(claim, row, reference, peers, trials, level)
                scope = out_of_scope(claim, _device(trials, exp, model), env)
                if scope and not verdict.startswith(("n/a", "error", "oom")):
                    verdict = scope
                rows.append({
                    "tip": claim.get("tip", ""), "source": claim.get("source", ""),
                    "claim": claim.get("quote", ""), "experiment": exp, "model": model,
                    "variant": row["variant"], "measured": measured,
                    **_costs(claim, row, reference if versus else None), "verdict": verdict})
    return pd.DataFrame(rows, columns=COLUMNS)


def _costs(claim: dict, row, versus) -> dict:
    """The memory and loss columns of a claim's row: against the baseline (the summary's
    paired memory ratio and loss Δ), or against the claim's `versus` row (medians' ratio and
    difference). A memory claim's `measured` is the memory ratio already."""
    if versus is None:
        memory = ratio_text(_nan(row.get("mem_ratio")), _nan(row.get("mem_ratio_lo")),
                            _nan(row.get("mem_ratio_hi")))
        loss = _nan(row.get("loss_delta"))
    else:
        ref_mem = _nan(versus.get("peak_mem_mb"))
        memory = ratio_text(_nan(row.get("peak_mem_mb")) / ref_mem if ref_mem > 0 else math.nan)
        loss = _nan(row.get("final_loss")) - _nan(versus.get("final_loss"))
    return {"memory": "-" if claim.get("kind") == "less_memory" else memory,
            "loss Δ": "-" if math.isnan(loss) else f"{loss:+.3f}"}
