"""Energy per sample beside speed: each variant's joules per sample over the baseline's, paired
by round with the same t interval and family-wise level as its speed-up (intervals.py), a
verdict in energy's words, and the energy to a target loss (the samples time to target took,
at the variant's measured joules per sample).

Where the trials measured no energy (a CPU without a readable RAPL counter, a GPU without
nvidia-ml-py) every figure is NaN and the verdict is the trials' own
`n/a: no energy counter here (<reason>)`: never an estimate.
"""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis.intervals import (BASELINE, EQUIVALENT, FASTER, INCONCLUSIVE, NO_CI,
                                           SLOWER, classify, paired, paired_log_ratios,
                                           paired_ratio_ci)
from speedbench.results.schema import OK

COLUMNS = ("energy_per_sample_j", "energy_ratio", "energy_ratio_lo", "energy_ratio_hi",
           "energy_verdict")
LESS, MORE = "less energy", "more energy"
WORDS = {FASTER: LESS, SLOWER: MORE, EQUIVALENT: EQUIVALENT, INCONCLUSIVE: INCONCLUSIVE}
NO_COUNTER = "n/a: no energy counter here"


def measured(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose window the counter measured (energy_status ok, a number)."""
    if "energy_per_sample_j" not in rows or "energy_status" not in rows:
        return rows.iloc[0:0]
    joules = pd.to_numeric(rows["energy_per_sample_j"], errors="coerce")
    return rows[(rows["energy_status"] == OK) & joules.notna()]


def why_none(rows: pd.DataFrame) -> str:
    """The trials' own reason for no energy figure (the most common), or the generic one."""
    if "energy_status" in rows:
        said = rows["energy_status"].dropna().astype(str)
        said = said[said.str.startswith("n/a")]
        if len(said):
            return said.mode().iloc[0]
    return f"{NO_COUNTER} (the trials recorded none)"


def paired_energy(ok: pd.DataFrame, base_rows: pd.DataFrame, key: str, level: float,
                  threshold: float, is_baseline: bool) -> dict:
    """A summary row's energy columns: the median joules per sample; over the baseline's,
    paired by round at `level` (energy_ratio < 1: less energy per sample); the verdict by the
    speed rule on the baseline's joules over the variant's, in energy's words."""
    mine, base = measured(ok), measured(base_rows)
    out = dict.fromkeys(COLUMNS, math.nan)
    if not len(mine):
        out["energy_verdict"] = why_none(ok if len(ok) else base_rows)
        return out
    out["energy_per_sample_j"] = float(pd.to_numeric(mine["energy_per_sample_j"]).median())
    if is_baseline:
        out["energy_ratio"], out["energy_verdict"] = 1.0, BASELINE
        return out
    a, b = paired(mine, base, "energy_per_sample_j", key) if len(base) else ([], [])
    if not len(paired_log_ratios(a, b)):
        out["energy_verdict"] = why_none(base_rows) if not len(base) else "no paired round"
        return out
    ratio = paired_ratio_ci(a, b, level)
    out["energy_ratio"], out["energy_ratio_lo"], out["energy_ratio_hi"] = ratio
    gain = paired_ratio_ci(b, a, level)  # > 1: less energy per sample, as a speed-up is
    out["energy_verdict"] = NO_CI if math.isnan(gain[1]) else \
        WORDS[classify(*gain, threshold=threshold)]
    return out


def to_target(samples: float, joules_per_sample: float) -> float:
    """The energy a run to the target took: the samples it trained, at the variant's measured
    joules per sample (NaN without either)."""
    if not (math.isfinite(samples) and math.isfinite(joules_per_sample)):
        return math.nan
    return samples * joules_per_sample


def to_target_rows(runs: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per (experiment, model, variant) of a time-to-target run: the median samples to the
    target and the energy they took at the summary's joules per sample."""
    if runs is None or not len(runs) or "energy_per_sample_j" not in summary:
        return pd.DataFrame()
    reached = runs[runs["status"] == OK]
    per = reached.groupby(["experiment", "model", "variant"], sort=False)["samples"].median()
    joules = summary.set_index(["experiment", "model", "variant"])["energy_per_sample_j"]
    rows = [{"experiment": e, "model": m, "variant": v, "samples": s,
             "energy_to_target_j": to_target(float(s), float(joules.get((e, m, v), math.nan)))}
            for (e, m, v), s in per.items()]
    return pd.DataFrame(rows)
