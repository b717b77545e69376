"""Waterfalls (matplotlib, Agg; no torch).

`figure`: the recipe's waterfall: naive -> each technique added by the search, each bar the
stage's cumulative speed-up over naive with its CI, as the closing measurement gave them
(intervals.paired_ratio_ci, through the search).
`parts_figure`: one comparison's step-time change split by operator category (an explained
verdict, analysis/explain.py), then the profiled and the measured change, the forecast beside.

Input: one model's waterfall rows (recipe.csv's `waterfall` part, or search.SearchResult's
`waterfall`): label, speedup, lo, hi (cumulative, over naive, measured) and step_gain (the
option's gain when added, conditional on its selection). A stage the closing measurement did
not measure is left out of the figure: a speed-up is never drawn from a product of step gains.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from speedbench.analysis.explain import LABELS  # noqa: E402
from speedbench.analysis.numbers import ratio_text  # noqa: E402
from speedbench.report.plots import BASE_COLOUR, STYLE, _xticks  # noqa: E402
from speedbench.results.schema import EXPLAIN_CATEGORIES  # noqa: E402

GAIN, LOSS, FINAL, PROFILED = "#2a9d8f", "#e76f51", "#264653", "#8d99ae"


def measured(rows: pd.DataFrame) -> pd.DataFrame:
    """The stages with a measured cumulative speed-up (naive always; the others need a CI)."""
    rows = rows.reset_index(drop=True)
    keep = [i == 0 or (_finite(r.get("speedup")) and _finite(r.get("lo")) and _finite(r.get("hi")))
            for i, r in rows.iterrows()]
    return rows[keep].reset_index(drop=True)


def figure(rows: pd.DataFrame, model: str = "") -> plt.Figure:
    """One bar per measured stage, its height the cumulative speed-up over naive, its error bar
    the CI; the last stage, the final recipe, in the dark colour."""
    with plt.rc_context(STYLE):
        rows = measured(rows)
        n = len(rows)
        fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * n + 1.5), 3.8))
        top = 1.0
        for i, r in rows.iterrows():
            value, lo, hi = float(r["speedup"]), r.get("lo"), r.get("hi")
            colour = BASE_COLOUR if i == 0 else FINAL if i == n - 1 else \
                GAIN if value >= 1 else LOSS
            ax.bar(i, value, color=colour, width=0.6)
            # the CI, after the naive stage, on a line of its own
            text = ratio_text(value, *((lo, hi) if i > 0 else ())).replace(" [", "\n[")
            if i > 0:
                ax.errorbar(i, value, yerr=[[value - lo], [hi - value]], color="black",
                            capsize=4, lw=1.1)
            peak = hi if i > 0 else value
            top = max(top, peak)
            ax.annotate(text, (i, peak), xytext=(0, 4), textcoords="offset points",
                        ha="center", fontsize=8, fontweight="bold" if i == n - 1 else None)
        _xticks(ax, [str(v) for v in rows["label"]])
        ax.axhline(1.0, color="#888888", lw=0.8, ls="--")
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("speed-up over naive (x), measured")
        ax.set_title(f"Recipe waterfall{': ' + model if model else ''}")
        fig.tight_layout()
        return fig


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def figures(waterfall: pd.DataFrame) -> dict[str, plt.Figure]:
    """One figure per model of a run's waterfall table (a `model` column)."""
    return {str(m): figure(g, str(m)) for m, g in waterfall.groupby("model", sort=False)}



def _change_ms(base_ms: float, speedup: float) -> float:
    """A speed-up as the change in ms of a baseline step (negative: time saved)."""
    return base_ms * (1 / speedup - 1) if _finite(speedup) and speedup > 0 else math.nan


def parts_figure(row) -> plt.Figure:
    """One comparison (a row of analysis.explain.comparisons, with its forecast): each
    category's change as a bar floating from the running total, with its interval over the
    profiled steps; then their sum (profiled) and the rounds' change with its CI (measured);
    the forecast's largest saving as a dashed line. ms per baseline step, variant - baseline."""
    with plt.rc_context(STYLE):
        cats = [c for c in EXPLAIN_CATEGORIES if _finite(row[f"{c}_ms"]) and row[f"{c}_ms"]]
        fig, ax = plt.subplots(figsize=(max(5.0, 0.75 * len(cats) + 3.0), 3.8))
        total = 0.0
        for i, c in enumerate(cats):
            d = float(row[f"{c}_ms"])
            ax.bar(i, d, bottom=total, color=GAIN if d < 0 else LOSS, width=0.6)
            lo, hi = row[f"{c}_lo"], row[f"{c}_hi"]
            if _finite(lo) and _finite(hi):
                ax.errorbar(i, total + d, yerr=[[max(0.0, d - lo)], [max(0.0, hi - d)]],
                            color="black", capsize=3, lw=0.9)
            total += d
        n = len(cats)
        ax.bar(n, row["profiled_ms"], color=PROFILED, width=0.6)
        measured, base = float(row["measured_ms"]), float(row["baseline_ms"])
        ax.bar(n + 1, measured, color=FINAL, width=0.6)
        lo, hi = _change_ms(base, row["speedup_hi"]), _change_ms(base, row["speedup_lo"])
        if _finite(lo) and _finite(hi):
            ax.errorbar(n + 1, measured, color="black", capsize=4, lw=1.1,
                        yerr=[[max(0.0, measured - lo)], [max(0.0, hi - measured)]])
        forecast = row.get("forecast", math.nan)
        if _finite(forecast) and forecast > 0:
            ax.axhline(_change_ms(base, forecast), color="#888888", lw=1, ls="--",
                       label=f"forecast: at most {ratio_text(forecast, spec='.3g')}")
            ax.legend(loc="best", fontsize=8, frameon=False)
        ax.axhline(0.0, color="black", lw=0.8)
        _xticks(ax, [LABELS[c] for c in cats] + ["profiled", "measured"])
        ax.set_ylabel("change, ms per baseline step")
        ax.set_title(f"Why {row['variant']} is {ratio_text(row['speedup'], spec='.3g')} on "
                     f"{row['model']}")
        fig.tight_layout()
        return fig
