"""The articles' claims, checked against a run's summary: measured effect and a verdict.

An experiment lists its claims in its config (`claims:`). Each claim has a `kind`:
- faster: holds when the speed-up CI lies above 1; does not hold when it lies below 1 or
  contains it. With `than: VARIANT` the speed-up is over that variant instead of the
  baseline: the ratio of the two speed-ups, with the conservative interval lo/ref_hi..hi/ref_lo
  (wider than a joint bootstrap would give; a call made on it is a safe one).
- less_memory (optional `factor`, e.g. 0.5 for "half the memory"): holds when the CI of the
  peak-memory ratio lies at or below the factor; "partly" when it lies below 1 but not below
  the factor; does not hold otherwise.
Rows whose variant could not run carry its n/a or failure status as the verdict.
"""
from __future__ import annotations

import math

import pandas as pd

from speedbench import stats

HOLDS, FAILS, PARTLY = "holds", "does not hold", "partly"


def _fmt_ci(x: float, lo: float, hi: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isnan(lo):
        return f"{x:.2f}x"
    return f"{x:.2f}x [{lo:.2f}, {hi:.2f}]"


def judge(claim: dict, row: pd.Series) -> tuple[str, str]:
    """(measured effect, verdict) of one claim on one summary row."""
    if row["status"] != "ok":
        return "-", row["status"]
    kind = claim.get("kind", "faster")
    if kind == "faster":
        label = f"speed-up over {claim['than']}" if claim.get("than") else "speed-up"
        measured = f"{label} " + _fmt_ci(row["speedup"], row["speedup_lo"], row["speedup_hi"])
        v = row["verdict"]
        if v == stats.FASTER:
            return measured, HOLDS
        if v in (stats.SLOWER, stats.SAME):
            return measured, f"{FAILS} ({v})"
        return measured, f"inconclusive ({v})"
    if kind == "less_memory":
        factor = float(claim.get("factor", 1.0))
        lo, hi = row.get("mem_ratio_lo", math.nan), row.get("mem_ratio_hi", math.nan)
        measured = "memory " + _fmt_ci(row.get("mem_ratio", math.nan), lo, hi)
        if math.isnan(hi):
            return measured, "inconclusive (too few trials or no memory figure)"
        if hi <= factor:
            return measured, HOLDS
        if hi < 1:
            return measured, f"{PARTLY} (less memory, not x{factor:g})"
        return measured, FAILS
    return "-", f"unknown claim kind '{kind}'"


def evaluate(claims: list[dict], summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (claim, model, variant) that the run measured."""
    rows = []
    for claim in claims:
        experiment = claim.get("experiment")
        wanted = claim.get("variants") or []
        sel = summary[summary["variant"].isin(wanted)]
        if experiment:
            sel = sel[sel["experiment"] == experiment]
        for _, row in sel.iterrows():
            if claim.get("than"):
                row = relative_to(row, summary, claim["than"])
            measured, verdict = judge(claim, row)
            rows.append({"tip": claim.get("tip", ""), "source": claim.get("source", ""),
                         "claim": claim.get("quote", ""), "model": row["model"],
                         "variant": row["variant"], "measured": measured, "verdict": verdict})
    return pd.DataFrame(rows, columns=["tip", "source", "claim", "model", "variant", "measured",
                                       "verdict"])


def relative_to(row: pd.Series, summary: pd.DataFrame, than: str) -> pd.Series:
    """`row` with its speed-up and verdict taken over variant `than` rather than the baseline."""
    ref = summary[(summary["model"] == row["model"]) & (summary["experiment"] == row["experiment"])
                  & (summary["variant"] == than)]
    out = row.copy()
    if ref.empty:
        out["status"] = f"no variant '{than}' to compare with"
        return out
    ref = ref.iloc[0]
    if ref["status"] != "ok":
        out["status"] = f"{ref['status']} ({than})"
        return out
    if ref["is_baseline"]:
        return out
    out["speedup"] = row["speedup"] / ref["speedup"]
    out["speedup_lo"] = row["speedup_lo"] / ref["speedup_hi"]
    out["speedup_hi"] = row["speedup_hi"] / ref["speedup_lo"]
    out["verdict"] = stats.verdict(out["speedup_lo"], out["speedup_hi"])
    return out
