"""The report's "time to target" part: the held-out loss against training time and against
samples seen (one curve per variant and seed, the target drawn), and the table of
analysis.to_target, from to_target.csv and curves.csv (studies/to_target.py)."""
from __future__ import annotations

import math
from typing import Callable

import pandas as pd
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from speedbench.analysis import to_target
from speedbench.analysis.numbers import ratio_text
from speedbench.report import plots
from speedbench.report.document import Document, slug

METHOD = ("Each variant trains from the same seeds (the same weights and data order per seed) "
          "until its loss on held-out data reaches the target, evaluated at a fixed cadence of "
          "samples seen; evaluation is not timed (BatchNorm's statistics recalibrated on "
          "training samples first). Time to target = training time to the first evaluation at "
          "or below it; the one-time costs of the first step and of the steps a technique "
          "declares (compile's eager and compiling steps) are left out and shown apart "
          "(one-time). time, steps and ms/step are geometric means over the seeds, so that "
          "time = steps x ms/step; '>=' marks a figure in which a seed that stopped short of "
          "the target enters with its time at the stop. A miss at target.max_steps, or a run "
          "stopped as far too slow or diverged, counts as infinite time (AlgoPerf): the "
          "variant missed the target, its speed-up at most the bound its censored time gives, "
          "with no interval and so no call of the family; a run its share of "
          "bench.time_budget_s stopped, or the wall-clock cap target.max_s where the baseline "
          "reached the target within it (a load can run out a clock), is not measured (no "
          "call). Speed-up = geometric mean of the per-seed ratios (baseline "
          "time / variant time) with a t interval at the Bonferroni level of the run's "
          "time-to-target comparisons (a family of its own), split exactly into step speed "
          "(baseline / variant time per step) x steps (baseline / variant steps to target).")


def _fmt(x, text: Callable[[float], str] = "{:.3g}".format, bound: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "not reached"
    return bound + text(x)


def _ci(row) -> str:
    if not math.isfinite(row["speedup"]):
        return "-"
    if row.get("speedup_bound"):
        return f"{row['speedup_bound']} {ratio_text(row['speedup'])}"
    return ratio_text(row["speedup"], row["speedup_lo"], row["speedup_hi"])


def _at_least(row) -> str:
    """'>= ' where a seed enters the row's figures with its time at a stop short of the
    target."""
    return ">= " if row.get("censored", 0) else ""


def table(summary: pd.DataFrame) -> pd.DataFrame:
    rows = summary.to_dict("records")
    return pd.DataFrame({
        "model": [r["model"] for r in rows],
        "variant": [r["variant"] for r in rows],
        "reached": [f"{r['reached']}/{r['seeds']}" for r in rows],
        "time to target (s)": [_fmt(r["time_to_target_s"], "{:.4g}".format, _at_least(r))
                               for r in rows],
        "= steps": [_fmt(r["steps_to_target"], "{:.4g}".format, _at_least(r)) for r in rows],
        "x ms/step": [_fmt(r["step_ms"], "{:.4g}".format) for r in rows],
        "one-time (s)": [_fmt(r["one_time_s"], "{:.2f}".format) for r in rows],
        "from cold (s)": [_fmt(r["cold_s"], bound=_at_least(r)) for r in rows],
        "speed-up [CI]": [_ci(r) for r in rows],
        "= step speed": [_fmt(r["step_speed_ratio"], ratio_text) for r in rows],
        "x steps": [_fmt(r["steps_ratio"], ratio_text) for r in rows],
        "verdict": [r["verdict"] for r in rows],
    })


def target_text(summary: pd.DataFrame) -> str:
    parts = []
    for model, rows in summary.groupby("model", sort=False):
        r = rows.iloc[0]
        floor = r["entropy_floor"]
        reached = rows["reached_loss"].dropna()
        text = (f"{model}: target held-out loss {to_target.loss_text(r['target_loss'])} "
                f"({r['target_source']})")
        if isinstance(floor, float) and math.isfinite(floor):
            text += (f"; the lowest loss any model can reach on this data (the chain's entropy "
                     f"rate) is {floor:.4g}")
        if len(reached):
            text += f"; loss at the evaluation that reached it: {reached.min():.4g}-{reached.max():.4g}"
        parts.append(text + ".")
    return " ".join(parts)


NICE = [m * 10.0 ** e for e in range(-3, 4) for m in (1, 1.5, 2, 3, 5, 7)]


def _log_loss_axis(ax) -> None:
    """A log axis labelled with plain numbers (the figures draw no mathtext)."""
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = [v for v in NICE if lo <= v <= hi] or [lo, hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel("held-out loss")


@plots._styled
def curves_figure(curves: pd.DataFrame, summary: pd.DataFrame, model: str):
    """Held-out loss against training time (left) and samples seen (right), a line per variant
    and seed, the target dashed and the entropy floor dotted."""
    rows = curves[curves["model"] == model]
    fig, (left, right) = plots._panels(2, 5.0, 3.6)
    variants = list(dict.fromkeys(summary.loc[summary["model"] == model, "variant"]))
    colours = {v: plots.RUN_COLOURS[i % len(plots.RUN_COLOURS)] for i, v in enumerate(variants)}
    for variant in variants:  # the table's order: the baseline first
        for i, (_, line) in enumerate(rows[rows["variant"] == variant].groupby("seed")):
            label = plots.clip(str(variant), 24) if i == 0 else None
            for ax, x in ((left, "train_s"), (right, "samples")):
                ax.plot(line[x], line["loss"], color=colours[variant], lw=1.2, alpha=0.85,
                        label=label if ax is left else None)
    head = summary[summary["model"] == model].iloc[0]
    for ax in (left, right):
        if math.isfinite(head["target_loss"]):
            ax.axhline(head["target_loss"], color="#555555", ls="--", lw=1)
        floor = head["entropy_floor"]
        if isinstance(floor, float) and math.isfinite(floor):
            ax.axhline(floor, color="#999999", ls=":", lw=1)
        _log_loss_axis(ax)
    left.set_xlabel("training time (s, evaluation excluded)")
    right.set_xlabel("samples seen")
    left.legend(fontsize=8, frameon=False)
    plots._suptitle(fig, f"{model}: held-out loss (dashed: target, dotted: entropy floor)")
    fig.tight_layout()
    return fig


def add(doc: Document, runs: pd.DataFrame, curves: pd.DataFrame | None, experiment: str,
        out_dir, threshold: float) -> None:
    """The section for one experiment, when its run measured time to target."""
    mine = runs[runs["experiment"] == experiment]
    if mine.empty:
        return
    summary = to_target.summarise(runs, threshold)  # the run's family: every experiment's
    summary = summary[summary["experiment"] == experiment]
    doc.heading("Time to target quality", 3)
    doc.para(target_text(summary))
    if curves is not None and len(curves):
        figures = []
        for model in dict.fromkeys(summary["model"]):
            path = f"plots/{slug(experiment)}-to-target-{slug(model)}.png"
            plots.save(curves_figure(curves, summary, model), out_dir / path)
            figures.append((f"{model}: held-out loss against time and samples", path))
        doc.figures(figures)
    doc.table(table(summary))
    doc.para(METHOD)


def console_lines(runs: pd.DataFrame, threshold: float) -> list[str]:
    """The time-to-target table for the console."""
    if runs is None or runs.empty:
        return []
    summary = to_target.summarise(runs, threshold)
    return ["Time to target quality", target_text(summary), "",
            table(summary).to_string(index=False)]
