"""Figures: each a pure function from a tidy DataFrame to a matplotlib Figure (Agg backend)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from speedbench import stats  # noqa: E402

VERDICT_COLOURS = {stats.FASTER: "#2a9d8f", stats.SLOWER: "#e76f51", stats.SAME: "#8d99ae",
                   stats.BASELINE: "#264653"}


def throughput(trials: pd.DataFrame) -> plt.Figure:
    """Samples/s per variant, one panel per model: median of trials, 95% bootstrap CI bars."""
    ok = trials[trials["status"] == "ok"]
    models = list(dict.fromkeys(trials["model"]))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(4.2 * max(1, len(models)), 3.6),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        variants = list(dict.fromkeys(trials.loc[trials["model"] == model, "variant"]))
        meds, errs, colours = [], [[], []], []
        for v in variants:
            vals = ok.loc[(ok["model"] == model) & (ok["variant"] == v), "samples_per_s"]
            med, lo, hi = stats.median_ci(vals)
            meds.append(med)
            errs[0].append(0 if np.isnan(lo) else med - lo)
            errs[1].append(0 if np.isnan(hi) else hi - med)
            base = trials.loc[(trials["model"] == model) & (trials["variant"] == v), "is_baseline"]
            colours.append("#264653" if base.any() else "#2a9d8f")
        x = np.arange(len(variants))
        ax.bar(x, np.nan_to_num(meds), yerr=errs, capsize=4, color=colours)
        for xi, m in zip(x, meds):
            if np.isnan(m):
                ax.text(xi, 0, "n/a", ha="center", va="bottom", fontsize=9, color="#6c757d")
        ax.set_xticks(x, variants, rotation=20, ha="right")
        ax.set_title(model)
        ax.set_ylabel("throughput (samples/s)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Throughput per variant (median, 95% CI)")
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, path) -> None:
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling(summary: pd.DataFrame) -> plt.Figure:
    """Data parallelism against the devices used: throughput next to the ideal (N x the
    single-device baseline), and scaling efficiency (1.0 = perfect). One line per model."""
    rows = summary[summary["status"] == "ok"].sort_values("devices")
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(9, 3.6))
    for model, g in rows.groupby("model", sort=False):
        line, = ax_tp.plot(g["devices"], g["samples_per_s"], "o-", label=model)
        base = g[g["is_baseline"]]
        if len(base) and int(base["devices"].iloc[0]) == 1:
            ideal = base["samples_per_s"].iloc[0] * np.array(sorted(set(g["devices"])))
            ax_tp.plot(sorted(set(g["devices"])), ideal, "--", color=line.get_color(), alpha=0.5)
        eff = g.dropna(subset=["scaling_efficiency"])
        ax_eff.plot(eff["devices"], eff["scaling_efficiency"], "o", color=line.get_color())
        for r in g.itertuples():
            ax_tp.annotate(r.variant, (r.devices, r.samples_per_s), textcoords="offset points",
                           xytext=(4, 4), fontsize=8)
    ax_eff.axhline(1.0, color="#6c757d", linestyle="--", linewidth=1)
    ax_tp.set(xlabel="devices (GPUs, or processes on a CPU)", ylabel="throughput (samples/s)",
              title="Throughput (dashed: N x single)")
    ax_eff.set(xlabel="devices (GPUs, or processes on a CPU)", ylabel="throughput / (N x single)",
               title="Scaling efficiency")
    devices = sorted(set(rows["devices"])) or [1]
    for ax in (ax_tp, ax_eff):
        ax.set_xticks(devices)
        ax.grid(alpha=0.3)
    ax_tp.legend(fontsize=8)
    fig.tight_layout()
    return fig
