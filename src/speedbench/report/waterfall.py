"""The recipe's waterfall: naive -> each technique added by the search, each bar the stage's
cumulative speed-up over naive with its CI, as the closing measurement gave them
(intervals.paired_ratio_ci, through the search; matplotlib, Agg; no torch).

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

from speedbench.report.plots import BASE_COLOUR, STYLE, _xticks  # noqa: E402

GAIN, LOSS, FINAL = "#2a9d8f", "#e76f51", "#264653"


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
            text = f"{value:.2f}x"
            if i > 0:
                ax.errorbar(i, value, yerr=[[value - lo], [hi - value]], color="black",
                            capsize=4, lw=1.1)
                text += f"\n[{lo:.2f}, {hi:.2f}]"
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

