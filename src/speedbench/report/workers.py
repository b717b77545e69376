"""The DataLoader-workers view of a run: throughput, data wait and host memory (training
process plus its workers) per worker count, and the best setting per model."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from speedbench.results.schema import OK  # noqa: E402

PANELS = [("samples_per_s", "throughput (samples/s)"),
          ("data_wait_frac", "data-wait fraction of step time"),
          ("host_rss_mb", "host memory, main + workers (MB)")]


def sweep(trials: pd.DataFrame) -> pd.DataFrame:
    """Medians per (experiment, model, worker count), for experiments that vary num_workers."""
    if "num_workers" not in trials:  # a run from a version that did not record it
        return pd.DataFrame()
    ok = trials[trials["status"] == OK]
    varied = [e for e, g in ok.groupby("experiment") if g["num_workers"].nunique() > 1]
    ok = ok[ok["experiment"].isin(varied)]
    if ok.empty:
        return pd.DataFrame()
    out = (ok.groupby(["experiment", "model", "num_workers"], sort=False)
           .agg(variant=("variant", "first"), samples_per_s=("samples_per_s", "median"),
                data_wait_frac=("data_wait_frac", "median"), host_rss_mb=("host_rss_mb", "median"))
           .reset_index().sort_values(["experiment", "model", "num_workers"]))
    best = out.groupby(["experiment", "model"])["samples_per_s"].transform("max")
    out["best"] = out["samples_per_s"] == best
    return out


def table(s: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "model": s["model"], "workers": s["num_workers"].astype(int), "variant": s["variant"],
        "samples/s": s["samples_per_s"].map("{:.1f}".format),
        "data wait": s["data_wait_frac"].map("{:.0%}".format),
        "host MB (main + workers)": s["host_rss_mb"].map("{:.0f}".format),
        "best": s["best"].map({True: "best", False: ""}),
    })


def best_settings(s: pd.DataFrame) -> str:
    """One sentence naming the fastest worker count per model."""
    best = s[s["best"]]
    parts = [f"{r.model}: {int(r.num_workers)} workers ({r.variant}, "
             f"{r.samples_per_s:.1f} samples/s, data wait {r.data_wait_frac:.0%})"
             for r in best.itertuples()]
    return "Best setting (highest median throughput): " + "; ".join(parts) + "."


def figure(s: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (col, label) in zip(axes, PANELS):
        for model, g in s.groupby("model", sort=False):
            ax.plot(g["num_workers"], g[col], marker="o", label=model)
        ax.set_xlabel("DataLoader workers")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("DataLoader workers (medians of trials)")
    fig.tight_layout()
    return fig
