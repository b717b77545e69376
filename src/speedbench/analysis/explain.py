"""Explained verdicts: where a comparison's step-time change went, beside its forecast.

measure/explain.py profiles a few untimed steps of the baseline and of each variant after the
rounds and splits each step's wall time into operator categories (schema.EXPLAIN_CATEGORIES)
that sum to it; explain.csv keeps per category the mean and sd over the profiled steps. Here,
from explain.csv and summary.csv (no torch):

- `Breakdown`: one profiled variant's steps, ms per category; `share` is what the techniques'
  forecasts (Technique.bound) read.
- `comparisons`: per comparison and category, the change in ms (variant - baseline, the
  variant's steps scaled to the baseline's samples per step) with a Welch t interval over the
  profiled steps. The parts sum to the profiled change exactly; the measured change is the
  rounds' (the baseline's step_ms x (1 / speed-up - 1)); what the parts leave of it is
  `unexplained` (profiler overhead, drift, noise).
- `sentence`: "bf16 1.45x: matmul/conv -38 ms, elementwise +4 ms; 3 ms unexplained (7 %)".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from speedbench.analysis import intervals
from speedbench.analysis.numbers import ratio_text
from speedbench.results.schema import EXPLAIN_CATEGORIES, OK

LABELS = {"matmul": "matmul/conv", "elementwise": "elementwise", "data": "data wait",
          "optimizer": "optimizer", "host_sync": "host-device sync", "python": "Python overhead",
          "compiled": "compiled code", "other": "other"}
DECIDED = ("faster", "slower", "equivalent")
PART_LEVEL = 0.95  # each part's interval: a description of the profiled steps, not a call
SENTENCE_PARTS = 3  # the largest parts a sentence names; the rest are in the table
UNEXPLAINED_NOTE = 0.15  # a larger unexplained share says whether the profile's noise holds it
BOUND_LEVEL = 0.99  # one-sided: the share a forecast reads is its upper limit at this level
# The profiler only adds time, so a profiled step is never faster than an unprofiled one of the
# same model; unprofiled steps over PLAIN_OVER of the profiled ones were slowed (a load), and
# the profiler's cost, which the upper shares count for the technique, cannot be told: no bound.
# (Profiled steps a load slowed in part widen the upper limit, or raise the profiler's cost:
# the shares' bound stays one.)
PLAIN_OVER = 1.2
# Other processes that took over BOUND_OTHERS of the machine's CPU time while the profile ran
# (measure/env.CpuWindow; BUSY_OTHERS, a busy machine's mark) slowed its steps by a load whose
# time landed on whatever ran, diluting the shares of the rest, in every step alike where the
# load lasted the whole profile (the upper limit cannot see that): no bound.
BOUND_OTHERS = 0.25


@dataclass(frozen=True)
class UpperShares:
    """The most each category can be of a profiled step (Breakdown.upper), `steps` profiled
    steps at one-sided `level`: what a forecast that is a bound reads (`share`)."""

    shares: dict
    steps: int
    level: float
    step_ms: float
    counters: dict = field(default_factory=dict)
    unsteady: str = ""  # why the steps are no ground for a bound (a load), "" where they are

    def share(self, category: str) -> float:
        return self.shares.get(category, 0.0)


@dataclass
class Breakdown:
    """The profiled steps of one variant: per step, category -> ms; they sum to the step."""

    steps: list[dict] = field(default_factory=list)
    overhead_ms: float = math.nan  # the profiler's own cost taken out of each step (CPU)
    counters: dict = field(default_factory=dict)  # the techniques' (profile_counters)
    plain_ms: float = math.nan  # the same model's unprofiled step (CPU), before the profile
    others_cpu: float = math.nan  # other processes' share of the CPU while it was profiled

    def values(self, category: str) -> np.ndarray:
        if category == "step":
            return np.array([sum(s.values()) for s in self.steps], dtype=float)
        return np.array([s.get(category, 0.0) for s in self.steps], dtype=float)

    def mean(self, category: str) -> float:
        v = self.values(category)
        return float(v.mean()) if len(v) else math.nan

    def sd(self, category: str) -> float:
        v = self.values(category)
        return float(v.std(ddof=1)) if len(v) > 1 else math.nan

    @property
    def step_ms(self) -> float:
        return self.mean("step")

    def share(self, category: str) -> float:
        """The category's share of the mean step, in [0, 1]; 0 without steps."""
        step = self.step_ms
        return self.mean(category) / step if step > 0 else 0.0

    def upper(self, level: float = BOUND_LEVEL) -> UpperShares:
        """Each category's share at its one-sided `level` upper limit: its profiled time (the
        profiler only adds time to a category, so this bounds its own; `overhead_ms` undoes
        the scaling) over the unprofiled step (`step_ms`), Student's t over the profiled
        steps (their spread, a load's included). With fewer than 2 steps, 1: anything."""
        n, step = len(self.steps), self.step_ms
        inflation = 1 + self.overhead_ms / step \
            if step > 0 and math.isfinite(self.overhead_ms) else 1.0
        t = intervals.t_quantile(2 * level - 1, n - 1) if n > 1 else math.inf
        shares = {}
        for c in EXPLAIN_CATEGORIES:
            v = self.values(c) * inflation
            hi = v.mean() + t * v.std(ddof=1) / math.sqrt(n) if n > 1 else math.inf
            shares[c] = min(1.0, hi / step) if step > 0 else 1.0
        return UpperShares(shares, n, level, step, dict(self.counters), self.unsteady())

    def unsteady(self) -> str:
        """Why these steps are no ground for a bound (BOUND_OTHERS: other processes took the
        CPU meanwhile; PLAIN_OVER: a load slowed the unprofiled steps), or ""."""
        if self.others_cpu > BOUND_OTHERS:  # NaN (not known): the other checks only
            return (f"other processes took {self.others_cpu:.0%} of the CPU while it was "
                    "profiled (a load)")
        profiled = self.step_ms + (self.overhead_ms if math.isfinite(self.overhead_ms) else 0)
        if math.isfinite(self.plain_ms) and profiled > 0 \
                and self.plain_ms > PLAIN_OVER * profiled:
            return (f"its unprofiled steps took {self.plain_ms:.3g} ms, the profiled ones "
                    f"{profiled:.3g} ms (a load?)")
        return ""

    def rows(self) -> list[dict]:
        """explain.csv's numbers: each category, the whole step (`step`), and the profiler's
        cost taken out of it (`profiler`; empty where none was)."""
        return [{"category": c, "steps": len(self.steps), "mean_ms": self.mean(c),
                 "sd_ms": self.sd(c)} for c in (*EXPLAIN_CATEGORIES, "step")] + \
            [{"category": "profiler", "steps": len(self.steps), "mean_ms": self.overhead_ms}]


def welch(m1: float, s1: float, n1: int, m0: float, s0: float, n0: int,
          level: float = PART_LEVEL) -> tuple[float, float]:
    """The interval of m1 - m0 from two samples' means, sds and sizes (Welch's t); NaN where
    a side has fewer than two steps."""
    if n1 < 2 or n0 < 2 or not (np.isfinite(s1) and np.isfinite(s0)):
        return math.nan, math.nan
    v1, v0 = s1 ** 2 / n1, s0 ** 2 / n0
    se = math.sqrt(v1 + v0)
    if se == 0:
        return m1 - m0, m1 - m0
    df = (v1 + v0) ** 2 / (v1 ** 2 / (n1 - 1) + v0 ** 2 / (n0 - 1))
    t = intervals.t_quantile(level, max(1, int(df)))
    return m1 - m0 - t * se, m1 - m0 + t * se


def comparisons(explain: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (experiment, model, variant) explained: its verdict and speed-up, the
    measured and profiled changes (ms per baseline step), unexplained ms and share, and per
    category `<c>_ms`, `<c>_lo`, `<c>_hi` (the change and its interval)."""
    if explain is None or explain.empty or summary is None or summary.empty:
        return pd.DataFrame()
    paired = explain[(explain["stage"] == "paired") & (explain["status"] == OK)]
    # one profile per (experiment, model, variant, category): where a plan of the same name ran
    # twice (a suite's members), the last one
    paired = paired.drop_duplicates(["experiment", "model", "variant", "category"], keep="last")
    rows = []
    for (exp, model), g in paired.groupby(["experiment", "model"], sort=False):
        base = g[g["is_baseline"].astype(str).str.lower().isin(["true", "1"])]
        if base.empty:
            continue
        b = base.set_index("category")
        b_step = _summary_row(summary, exp, model, base["variant"].iloc[0])
        for variant, v in g[~g.index.isin(base.index)].groupby("variant", sort=False):
            s = _summary_row(summary, exp, model, variant)
            if s is None or b_step is None:
                continue
            rows.append(_comparison(exp, model, variant, b, v.set_index("category"), s,
                                    float(b_step.get("step_ms", math.nan))))
    return pd.DataFrame(rows)


def _summary_row(summary: pd.DataFrame, exp, model, variant):
    got = summary[(summary["experiment"] == exp) & (summary["model"] == model)
                  & (summary["variant"] == variant)]
    return None if got.empty else got.iloc[0]


def _comparison(exp, model, variant, b: pd.DataFrame, v: pd.DataFrame, s, base_ms: float
                ) -> dict:
    """The parts of one comparison; the variant's ms scaled to the baseline's samples."""
    scale = float(b["per_step"].iloc[0]) / float(v["per_step"].iloc[0])
    row = {"experiment": exp, "model": model, "variant": variant, "verdict": s["verdict"],
           "speedup": float(s["speedup"]), "speedup_lo": float(s["speedup_lo"]),
           "speedup_hi": float(s["speedup_hi"])}
    profiled = 0.0
    for c in EXPLAIN_CATEGORIES:
        m1, s1, n1 = (scale * float(v.at[c, "mean_ms"]), scale * float(v.at[c, "sd_ms"]),
                      int(v.at[c, "steps"]))
        m0, s0, n0 = float(b.at[c, "mean_ms"]), float(b.at[c, "sd_ms"]), int(b.at[c, "steps"])
        row[f"{c}_ms"] = m1 - m0
        row[f"{c}_lo"], row[f"{c}_hi"] = welch(m1, s1, n1, m0, s0, n0)
        profiled += m1 - m0
    measured = base_ms * (1 / row["speedup"] - 1) if row["speedup"] > 0 else math.nan
    # the profiled steps' own noise: the whole step's change, with its interval
    row["profiled_lo"], row["profiled_hi"] = welch(
        scale * float(v.at["step", "mean_ms"]), scale * float(v.at["step", "sd_ms"]),
        int(v.at["step", "steps"]), float(b.at["step", "mean_ms"]),
        float(b.at["step", "sd_ms"]), int(b.at["step", "steps"]))
    row.update(baseline_ms=base_ms, base_profiled_ms=float(b.at["step", "mean_ms"]),
               variant_ms=base_ms / row["speedup"] if row["speedup"] > 0 else math.nan,
               variant_profiled_ms=scale * float(v.at["step", "mean_ms"]),
               profiled_ms=profiled, measured_ms=measured,
               unexplained_ms=measured - profiled,
               unexplained_share=abs(measured - profiled) / abs(measured)
               if measured else math.nan)
    return row


def with_forecasts(explained: pd.DataFrame, forecast: pd.DataFrame | None) -> pd.DataFrame:
    """`explained` with each variant's forecast, its reason, and `above` (the measured
    speed-up's whole CI above its forecast: one of them is wrong)."""
    out = explained.copy()
    if out.empty:
        return out
    out["forecast"], out["forecast_reason"], out["above"] = math.nan, "", False
    out["is_bound"] = True
    if forecast is None or forecast.empty:
        return out
    f = forecast.set_index(["experiment", "model", "variant"])
    for i, r in out.iterrows():
        key = (r["experiment"], r["model"], r["variant"])
        if key in f.index:
            got = f.loc[key]
            got = got.iloc[0] if isinstance(got, pd.DataFrame) else got
            out.at[i, "forecast"] = float(got["forecast"])
            out.at[i, "forecast_reason"] = str(got["reason"] if got["status"] == OK
                                               else got["status"])
            out.at[i, "is_bound"] = is_bound(got)
            out.at[i, "above"] = is_bound(got) and above(r["speedup_lo"],
                                                         float(got["forecast"]))
    return out


def is_bound(row) -> bool:
    """Whether a forecast.csv row is an upper bound (its `is_bound`; a run written before the
    column: yes, as it then claimed)."""
    value = row.get("is_bound", True)
    if value is None or value != value:
        return True
    return str(value).strip().lower() not in ("false", "0")


def above(lo: float, forecast: float) -> bool:
    """Whether a measured CI lies wholly above its forecast."""
    return bool(np.isfinite(lo) and np.isfinite(forecast) and lo > forecast)


def _ms(x: float) -> str:
    return f"{x:+.3g} ms" if abs(x) >= 0.01 else f"{x:+.2f} ms"


def sentence(row) -> str:
    """`bf16 1.45x: matmul/conv -38 ms, elementwise +4 ms, optimizer -2 ms; 3 ms unexplained
    (7 % of the change)`: the largest parts by size, then the remainder."""
    parts = sorted(EXPLAIN_CATEGORIES, key=lambda c: -abs(row[f"{c}_ms"]))[:SENTENCE_PARTS]
    named = ", ".join(f"{LABELS[c]} {_ms(row[f'{c}_ms'])}" for c in parts)
    rest = row["unexplained_ms"]
    share = row["unexplained_share"]
    tail = f"{abs(rest):.3g} ms unexplained" + (f" ({100 * share:.0f} % of the "
                                               f"{row['measured_ms']:+.3g} ms measured)"
                                               if np.isfinite(share) else "")
    lo, hi = row.get("profiled_lo", math.nan), row.get("profiled_hi", math.nan)
    if np.isfinite(share) and share > UNEXPLAINED_NOTE and lo <= row["measured_ms"] <= hi:
        tail += (f", within the profiled steps' noise (their change "
                 f"{_ms(row['profiled_ms'])}, 95 % interval [{lo:+.3g}, {hi:+.3g}] ms)")
    speedup = ratio_text(row["speedup"], spec=".3g")
    text = f"{row['model']} {row['variant']} {speedup}: {named}; {tail}"
    if np.isfinite(row.get("forecast", math.nan)):
        text += (f"; forecast at most {ratio_text(row['forecast'], spec='.3g')}"
                 if is_bound(row) else f"; forecast {ratio_text(row['forecast'], spec='.3g')}"
                 " from part of the step (not a bound)")
        if row.get("above"):
            text += " (measured above it: the forecast or the measurement is wrong)"
    return text + "."


def decided(explained: pd.DataFrame) -> pd.DataFrame:
    """The comparisons with a speed verdict (faster, slower, equivalent)."""
    if explained.empty:
        return explained
    return explained[explained["verdict"].isin(DECIDED)]
