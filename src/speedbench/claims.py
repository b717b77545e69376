"""The articles' claims, checked against a run: measured effect with CI, memory cost, verdict.

An experiment lists its claims in its config (`claims:`): `tip`, `source`, `quote`, the
`variants` the claim is about (default: every variant but the baseline), the variant they are
compared with (`versus`, default: the baseline), and a `kind`:
- faster: holds when the CI of the throughput ratio lies above 1; does not hold when it lies
  below 1 or contains it.
- less_memory (optional `factor`, e.g. 0.5 for "half the memory"): holds when the CI of the
  peak-memory ratio lies at or below the factor; "partly" when it lies below 1 but not below
  the factor; does not hold otherwise.
- lower / higher, with `metric` (a trials.csv column such as data_wait_frac or host_rss_mb):
  holds when the CI of the metric's ratio lies below / above 1.
- best: names the fastest variant per model; holds when the claim's variant is it or is not
  significantly slower than it (the CI of their throughput ratio contains 1).
`requires: cuda` marks a claim stated for GPUs: its verdict is n/a on other devices.
Every verdict follows from a 95% bootstrap CI (stats.bootstrap_ratio_ci), never from a
threshold. Rows whose variant, or the variant it is compared with, could not run carry that
n/a or failure status as the verdict.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from speedbench import stats

HOLDS, FAILS, PARTLY = "holds", "does not hold", "partly"
COLUMNS = ["tip", "source", "claim", "experiment", "model", "variant", "measured", "memory",
           "loss Δ", "verdict"]
NAN3 = (math.nan, math.nan, math.nan)


def _fmt_ci(x: float, lo: float, hi: float) -> str:
    if x is None or math.isnan(x):
        return "-"
    if lo is None or math.isnan(lo):
        return f"{x:.2f}x"
    return f"{x:.2f}x [{lo:.2f}, {hi:.2f}]"


def _nan(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _values(trials: pd.DataFrame, experiment, model, variant, metric: str) -> np.ndarray:
    sel = trials[(trials["experiment"] == experiment) & (trials["model"] == model)
                 & (trials["variant"] == variant) & (trials["status"] == "ok")]
    return pd.to_numeric(sel[metric], errors="coerce").dropna().to_numpy()


def _ratio(trials: Optional[pd.DataFrame], row: pd.Series, reference: str, metric: str):
    """(ratio, lo, hi) of `metric` medians, row's variant over `reference`, 95% bootstrap CI."""
    if trials is None or metric not in trials:
        return NAN3
    a = _values(trials, row["experiment"], row["model"], row["variant"], metric)
    b = _values(trials, row["experiment"], row["model"], reference, metric)
    if not len(a) or not len(b) or np.median(b) == 0:
        return NAN3
    return stats.bootstrap_ratio_ci(a, b)


def _direction(lo: float, hi: float, want: str) -> str:
    """Verdict for a ratio CI when the claim says the ratio is above (or below) 1."""
    v = stats.verdict(lo, hi)  # faster = CI above 1, slower = below 1
    if v == stats.TOO_FEW:
        return f"inconclusive ({v})"
    hit = stats.FASTER if want == "above" else stats.SLOWER
    if v == hit:
        return HOLDS
    said = {stats.FASTER: "higher", stats.SLOWER: "lower", stats.SAME: stats.SAME}[v]
    return f"{FAILS} ({said})"


def judge(claim: dict, row: pd.Series, reference: Optional[pd.Series] = None,
          peers: Optional[pd.DataFrame] = None, trials: Optional[pd.DataFrame] = None
          ) -> tuple[str, str]:
    """(measured effect, verdict) of one claim on one summary row.

    `reference` is the summary row compared with (the baseline unless the claim says `versus`),
    `peers` every summary row of the same experiment and model, `trials` the run's trials.csv;
    without trials only faster and less_memory against the baseline can be judged.
    """
    kind = claim.get("kind", "faster")
    if row["status"] != "ok":
        return "-", row["status"]
    if kind == "best":
        return _judge_best(row, peers, trials)
    if reference is not None and reference["status"] != "ok":
        return "-", reference["status"]
    versus = claim.get("versus")
    ref_name = reference["variant"] if reference is not None else None
    against = f" vs {versus}" if versus else ""
    if kind == "faster":
        if versus:
            ratio = _ratio(trials, row, ref_name, "samples_per_s")
        else:
            ratio = (row["speedup"], row["speedup_lo"], row["speedup_hi"])
        v = stats.verdict(ratio[1], ratio[2])
        measured = "speed-up " + _fmt_ci(*ratio) + against
        if v == stats.FASTER:
            return measured, HOLDS
        if v in (stats.SLOWER, stats.SAME):
            return measured, f"{FAILS} ({v})"
        return measured, f"inconclusive ({v})"
    if kind == "less_memory":
        factor = float(claim.get("factor", 1.0))
        if versus:
            ratio = _ratio(trials, row, ref_name, "peak_mem_mb")
        else:
            ratio = (_nan(row.get("mem_ratio")), _nan(row.get("mem_ratio_lo")),
                     _nan(row.get("mem_ratio_hi")))
        measured = "memory " + _fmt_ci(*ratio) + against
        if not versus and not math.isnan(_nan(row.get("speedup"))):  # what the saving costs
            measured += "; speed-up " + _fmt_ci(row["speedup"], row["speedup_lo"], row["speedup_hi"])
        hi = ratio[2]
        if math.isnan(hi):
            return measured, "inconclusive (too few trials or no memory figure)"
        if hi <= factor:
            return measured, HOLDS
        if hi < 1:
            return measured, f"{PARTLY} (less memory, not x{factor:g})"
        return measured, FAILS
    if kind in ("lower", "higher"):
        metric = claim.get("metric", "samples_per_s")
        ratio = _ratio(trials, row, ref_name, metric)
        measured = f"{metric} " + _fmt_ci(*ratio) + against
        return measured, _direction(ratio[1], ratio[2], "below" if kind == "lower" else "above")
    return "-", f"unknown claim kind '{kind}'"


def _judge_best(row: pd.Series, peers: Optional[pd.DataFrame],
                trials: Optional[pd.DataFrame]) -> tuple[str, str]:
    ok = peers[peers["status"] == "ok"] if peers is not None else pd.DataFrame()
    if ok.empty or ok["samples_per_s"].isna().all():
        return "-", "inconclusive (nothing measured)"
    best = ok.loc[ok["samples_per_s"].idxmax()]
    measured = f"best: {best['variant']} ({best['samples_per_s']:.1f} samples/s)"
    if best["variant"] == row["variant"]:
        return measured, HOLDS
    ratio = _ratio(trials, row, best["variant"], "samples_per_s")
    measured += f"; {row['variant']} vs best " + _fmt_ci(*ratio)
    v = stats.verdict(ratio[1], ratio[2])
    if v == stats.TOO_FEW:
        return measured, f"inconclusive ({v})"
    return measured, f"{FAILS} (slower than {best['variant']})" if v == stats.SLOWER else HOLDS


def _device(trials: Optional[pd.DataFrame], experiment, model) -> Optional[str]:
    if trials is None or "device" not in trials:
        return None
    sel = trials.loc[(trials["experiment"] == experiment) & (trials["model"] == model), "device"]
    return str(sel.iloc[0]) if len(sel) else None


def evaluate(claims: list[dict], summary: pd.DataFrame,
             trials: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per (claim, model, variant) that the run measured, or found n/a."""
    rows = []
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
                    measured, verdict = judge(claim, row, reference, peers, trials)
                device = _device(trials, exp, model)
                if claim.get("requires") == "cuda" and device and not device.startswith("cuda") \
                        and not verdict.startswith(("n/a", "error", "oom")):
                    verdict = f"n/a: the claim is stated for CUDA GPUs; this run is on {device}"
                rows.append({
                    "tip": claim.get("tip", ""), "source": claim.get("source", ""),
                    "claim": claim.get("quote", ""), "experiment": exp, "model": model,
                    "variant": row["variant"], "measured": measured,
                    # A memory claim's `measured` is the memory ratio already.
                    "memory": "-" if claim.get("kind") == "less_memory" else _fmt_ci(
                        _nan(row.get("mem_ratio")), _nan(row.get("mem_ratio_lo")),
                        _nan(row.get("mem_ratio_hi"))),
                    "loss Δ": "-" if math.isnan(_nan(row.get("loss_delta")))
                    else f"{row['loss_delta']:+.3f}",
                    "verdict": verdict})
    return pd.DataFrame(rows, columns=COLUMNS)
