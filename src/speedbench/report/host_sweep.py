"""A setting whose cost shows on the host, as a view of its own: throughput, data wait and
host memory (training process plus its workers) per value of the setting, and per model the
value with the highest median throughput, called significantly faster only when summary.csv's
verdict for it (paired, error-controlled) says so. A technique asks for it in its metadata (`host_sweep`: the trials.csv column and
the view's title; the loader asks for its worker count), which the run writes to
techniques.json (report.settings.host_sweeps)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from speedbench.report import plots  # noqa: E402
from speedbench.report.document import Document, slug  # noqa: E402
from speedbench.results.schema import OK  # noqa: E402

PANELS = [("samples_per_s", "throughput (samples/s)"),
          ("data_wait_frac", "data-wait fraction of step time"),
          ("host_rss_mb", "host memory, main + workers (MB)")]


def sweep(trials: pd.DataFrame, column: str) -> pd.DataFrame:
    """Medians per (experiment, model, value of `column`), for experiments that vary it."""
    if column not in trials:  # a run from a version that did not record it
        return pd.DataFrame()
    ok = trials[trials["status"] == OK]
    ok = ok.assign(**{column: pd.to_numeric(ok[column], errors="coerce")}).dropna(subset=[column])
    varied = [e for e, g in ok.groupby("experiment") if g[column].nunique() > 1]
    ok = ok[ok["experiment"].isin(varied)]
    if ok.empty:
        return pd.DataFrame()
    out = (ok.groupby(["experiment", "model", column], sort=False)
           .agg(variant=("variant", "first"), samples_per_s=("samples_per_s", "median"),
                data_wait_frac=("data_wait_frac", "median"), host_rss_mb=("host_rss_mb", "median"))
           .reset_index().sort_values(["experiment", "model", column]))
    top = out.groupby(["experiment", "model"])["samples_per_s"].transform("max")
    out["top"] = out["samples_per_s"] == top
    return out.rename(columns={column: "value"})


def with_verdicts(s: pd.DataFrame, summary: pd.DataFrame | None) -> pd.DataFrame:
    """Each value's verdict against the experiment's baseline, from summary.csv."""
    if summary is None or not len(summary) or "verdict" not in summary:
        return s.assign(verdict="")
    verdicts = summary.set_index(["experiment", "model", "variant"])["verdict"]
    return s.assign(verdict=[str(verdicts.get((r.experiment, r.model, r.variant), ""))
                             for r in s.itertuples()])


def table(s: pd.DataFrame, title: str) -> pd.DataFrame:
    return pd.DataFrame({
        "model": s["model"], title: s["value"].astype(int), "variant": s["variant"],
        "samples/s": s["samples_per_s"].map("{:.1f}".format),
        "data wait": s["data_wait_frac"].map("{:.0%}".format),
        "host MB (main + workers)": s["host_rss_mb"].map("{:.0f}".format),
        "verdict": s["verdict"],
    })


def best_settings(s: pd.DataFrame, column: str) -> str:
    """Per model, the value with the highest median throughput: the best setting only when it
    is significantly faster than the baseline; otherwise said to be no more than a median."""
    parts = []
    for r in s[s["top"]].itertuples():
        setting = (f"{r.model}: {column}={int(r.value)} ({r.variant}, "
                   f"{r.samples_per_s:.1f} samples/s, data wait {r.data_wait_frac:.0%})")
        if r.verdict == "faster":
            parts.append(f"{setting}, the best setting: significantly faster than the baseline")
        else:
            parts.append(f"{setting}, the highest median only: not significantly faster than "
                         "the baseline, so no setting is called best")
    return "Highest median throughput per model: " + "; ".join(parts) + "."


def figure(s: pd.DataFrame, title: str) -> plt.Figure:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (col, label) in zip(axes, PANELS):
        for model, g in s.groupby("model", sort=False):
            ax.plot(g["value"], g[col], marker="o", label=model)
        ax.set_xlabel(title)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{title} (medians of trials)")
    fig.tight_layout()
    return fig


def add(doc: Document, trials: pd.DataFrame, view: dict, out_dir,
        summary: pd.DataFrame | None = None) -> None:
    """The view's section of one experiment, when the experiment varies its column;
    `view` is {"column", "title"}; `summary` gives each value's verdict."""
    column, title = view["column"], view.get("title") or view["column"]
    s = sweep(trials, column)
    if not len(s):
        return
    s = with_verdicts(s, summary)
    doc.heading(title, 3)
    doc.para(best_settings(s, column))
    doc.table(table(s, title))
    path = f"plots/{slug(s['experiment'].iloc[0])}-host-{slug(column)}.png"
    plots.save(figure(s, title), out_dir / path)
    doc.figures([(f"Throughput, the share of the step spent waiting for data, and host memory, "
                  f"against {column}.", path)])
