"""The recipe's waterfall: naive -> each technique added by the search -> final, cumulative
speed-up over naive with its CI (matplotlib, Agg; no torch).

Input: one model's waterfall rows (recipe.csv's `waterfall` part, or search.SearchResult's
`waterfall`): label, speedup, lo, hi (cumulative, over naive) and step_gain (the option's gain
on top of the recipe before it, as measured in its search step).
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from speedbench.report.plots import BASE_COLOUR, STYLE, _xticks  # noqa: E402

GAIN, LOSS, FINAL = "#2a9d8f", "#e76f51", "#264653"


def figure(rows: pd.DataFrame, model: str = "") -> plt.Figure:
    """Floating bars from one cumulative speed-up to the next; the last bar, the final recipe,
    stands on 1x with its CI. A bar without a measured cumulative value (the closing
    measurement did not run) is drawn from the product of step gains, hatched."""
    with plt.rc_context(STYLE):
        rows = rows.reset_index(drop=True)
        n = len(rows)
        fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * (n + 1) + 1.5), 3.8))
        cum = _cumulative(rows)
        labels = [str(v) for v in rows["label"]]
        prev = 1.0
        for i in range(n):
            value, measured = cum[i]
            if i == 0:
                ax.bar(i, value, color=BASE_COLOUR, width=0.6)
            else:
                ax.bar(i, value - prev, bottom=prev, width=0.6,
                       color=GAIN if value >= prev else LOSS,
                       hatch=None if measured else "//", edgecolor="white")
                gain = rows.loc[i, "step_gain"] if "step_gain" in rows else math.nan
                if _finite(gain):
                    ax.annotate(f"x{gain:.2f}\nstep", (i + 0.3, (value + prev) / 2),
                                xytext=(3, 0), textcoords="offset points", ha="left",
                                va="center", fontsize=8, color="#444444")
            if i > 0 and i < n:
                ax.plot([i - 1 + 0.3, i - 0.3], [prev, prev], color="#999999", lw=0.8)
            prev = value
        # the final recipe: a full bar with the cumulative CI
        final, measured = cum[-1]
        lo, hi = (rows.iloc[-1]["lo"], rows.iloc[-1]["hi"]) if n > 1 else (math.nan, math.nan)
        ax.bar(n, final, color=FINAL, width=0.6, hatch=None if measured else "//",
               edgecolor="white")
        if _finite(lo) and _finite(hi):
            ax.errorbar(n, final, yerr=[[final - lo], [hi - final]], color="black", capsize=4,
                        lw=1.2)
        text = f"{final:.2f}x" + (f"\n[{lo:.2f}, {hi:.2f}]" if _finite(lo) else "")
        ax.annotate(text, (n, max(final, hi if _finite(hi) else final)), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=9, fontweight="bold")
        for i in range(1, n):  # cumulative CIs of the intermediate recipes
            lo_i, hi_i = rows.loc[i, "lo"], rows.loc[i, "hi"]
            if _finite(lo_i) and _finite(hi_i):
                ax.errorbar(i, cum[i][0], yerr=[[cum[i][0] - lo_i], [hi_i - cum[i][0]]],
                            color="#333333", capsize=3, lw=0.9)
        _xticks(ax, labels + ["final"])
        ax.axhline(1.0, color="#888888", lw=0.8, ls="--")
        top = max([v for v, _ in cum] + [hi if _finite(hi) else 0, 1.0])
        ax.set_ylim(0, top * 1.22)
        ax.set_ylabel("speed-up over naive (x)")
        ax.set_title(f"Recipe waterfall{': ' + model if model else ''}")
        fig.tight_layout()
        return fig


def _cumulative(rows: pd.DataFrame) -> list[tuple[float, bool]]:
    """(cumulative speed-up, measured?) per row: measured when the closing measurement gave it,
    else the running product of step gains."""
    out, running = [], 1.0
    for i, r in rows.iterrows():
        gain = r.get("step_gain", math.nan)
        if i > 0 and _finite(gain):
            running *= gain
        value = r.get("speedup", math.nan)
        out.append((float(value), True) if _finite(value) else (running, False))
        if _finite(value):
            running = float(value)
    return out


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def figures(waterfall: pd.DataFrame) -> dict[str, plt.Figure]:
    """One figure per model of a run's waterfall table (a `model` column)."""
    return {str(m): figure(g, str(m)) for m, g in waterfall.groupby("model", sort=False)}

