"""Figures: each a pure function from a tidy DataFrame to a matplotlib Figure (Agg backend).

Conventions: one panel per model; the baseline in a dark colour; medians with 95% bootstrap
CIs; ratios on a log axis so that 0.5x and 2x sit at the same distance from 1x. Strings from
configs are drawn as plain text (no mathtext), so a variant named `$x` cannot break a figure.
"""
from __future__ import annotations

import contextlib
import functools
import math
import textwrap
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from speedbench.report.numbers import clip  # noqa: E402
from speedbench.results import atomic  # noqa: E402
from speedbench.results.schema import OK  # noqa: E402
from speedbench.analysis import intervals
from speedbench.analysis.numbers import ratio_text
from speedbench.analysis.summary import status_of

VERDICT_COLOURS = {intervals.FASTER: "#2a9d8f", intervals.SLOWER: "#e76f51",
                   intervals.SAME: "#8d99ae", intervals.BASELINE: "#264653"}
OTHER_COLOUR = "#b0b7c3"
BASE_COLOUR, VARIANT_COLOUR = "#264653", "#5fa8d3"
RUN_COLOURS = ["#264653", "#e9c46a", "#2a9d8f", "#e76f51", "#8d99ae", "#f4a261"]
PHASE_COLOURS = {"data": "#e9c46a", "h2d": "#f4a261", "forward": "#5fa8d3",
                 "backward": "#264653", "optimizer": "#2a9d8f"}
# The generic column whose many values make a curve, beside the run's settings columns.
WORLD_SIZE = {"world_size": "world size (processes)"}
STYLE = {"text.parse_math": False, "font.size": 10, "axes.titlesize": 11,
         "axes.titleweight": "bold", "axes.spines.top": False, "axes.spines.right": False,
         "axes.edgecolor": "#888888", "figure.facecolor": "white"}
DPI = 120


def _styled(fn):
    """Build the figure under speedbench's style (plain-text labels, light axes), without the
    libraries' warnings on the console (quiet)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with plt.rc_context(STYLE), quiet():
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def quiet():
    """matplotlib's warnings (a tight layout not applied, a glyph a font lacks: a control
    character in a hand-edited name) and numpy's (a NaN or inf a hand-edited file holds, which
    the report notes) are not the reader's business: the figure is drawn all the same."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _ok(trials: pd.DataFrame) -> pd.DataFrame:
    return trials[(trials["status"] == OK) & np.isfinite(trials["samples_per_s"])]


def _order(values) -> list:
    return list(dict.fromkeys(values))


def in_summary_order(trials: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """The trials in the summary's order of models and variants (the config's, baseline first),
    so that every figure's panels and bars come in the order of the speed-up plot and the table,
    not in the random order of the first round; pairs the summary lacks go last."""
    rank = {pair: i for i, pair in enumerate(zip(summary["model"], summary["variant"]))}
    models = {m: i for i, m in enumerate(_order(summary["model"]))}
    keys = [(models.get(m, len(models)), rank.get((m, v), len(rank)))
            for m, v in zip(trials["model"], trials["variant"])]
    order = sorted(range(len(trials)), key=keys.__getitem__)
    return trials.iloc[order]


def _panels(n: int, width_each: float, height: float = 3.4):
    """One row of n panels; at most 12 inches wide, so that a page shows it unshrunk."""
    width_each = min(width_each, max(3.2, 12.0 / max(1, n)))
    fig, axes = plt.subplots(1, max(1, n), figsize=(max(4.0, width_each * max(1, n)), height),
                             squeeze=False)
    return fig, list(axes[0])


def _xticks(ax, labels: list[str]) -> None:
    """Variant names under bars; slanted when there are many or they are long."""
    slant = len(labels) > 3 or max((len(str(v)) for v in labels), default=0) > 8
    ax.set_xticks(np.arange(len(labels)), [str(v) for v in labels], rotation=25 if slant else 0,
                  ha="right" if slant else "center", rotation_mode="anchor" if slant else "default")


def _suptitle(fig: plt.Figure, text: str, **kwargs) -> None:
    """A figure title wrapped to the figure's width (about 14 characters per inch)."""
    fig.suptitle(textwrap.fill(text, int(fig.get_figwidth() * 14)), fontsize=11, **kwargs)


def _median_ci_err(values) -> tuple[float, float, float]:
    """(median, error below, error above) for matplotlib's yerr; zero error without a CI."""
    med, lo, hi = intervals.median_ci(values)
    return med, (0.0 if math.isnan(lo) else med - lo), (0.0 if math.isnan(hi) else hi - med)


def _status_of(trials: pd.DataFrame, model: str, variant: str) -> str:
    rows = trials[(trials["model"] == model) & (trials["variant"] == variant)]
    return status_of(rows["status"]) if len(rows) else "no trials"


def _bar_panels(trials: pd.DataFrame, column: str, ylabel: str, title: str,
                ratio_labels: bool = False) -> plt.Figure:
    """Median of `column` per variant with CI bars, one panel per model; failures labelled."""
    models = _order(trials["model"])
    n_var = max(len(_order(trials.loc[trials["model"] == m, "variant"])) for m in models)
    fig, axes = _panels(len(models), max(3.2, 0.62 * n_var + 1.6))
    ok = _ok(trials)
    for ax, model in zip(axes, models):
        per_model = trials[trials["model"] == model]
        variants = _order(per_model["variant"])
        baseline = set(per_model.loc[per_model["is_baseline"], "variant"])
        meds, lo, hi = [], [], []
        for v in variants:
            vals = ok.loc[(ok["model"] == model) & (ok["variant"] == v), column].dropna()
            m, el, eh = _median_ci_err(vals)
            meds.append(m), lo.append(el), hi.append(eh)
        x = np.arange(len(variants))
        colours = [BASE_COLOUR if v in baseline else VARIANT_COLOUR for v in variants]
        ax.set_axisbelow(True)
        ax.bar(x, np.nan_to_num(meds), yerr=[lo, hi], capsize=4, color=colours,
               error_kw={"ecolor": "#333333", "elinewidth": 1})
        for xi, v in zip(x, variants):  # every trial as a dot: the spread behind the median
            vals = ok.loc[(ok["model"] == model) & (ok["variant"] == v), column].dropna()
            jitter = np.linspace(-0.12, 0.12, len(vals)) if len(vals) > 1 else np.zeros(len(vals))
            ax.scatter(xi + jitter, vals, s=9, color="#f4a261", edgecolors="#333333",
                       linewidths=0.4, zorder=3)
        top = np.nanmax(np.array(meds, float) + np.array(hi)) if np.isfinite(meds).any() else 1.0
        base_med = next((m for v, m in zip(variants, meds) if v in baseline), math.nan)
        for xi, v, m, eh in zip(x, variants, meds, hi):
            if math.isnan(m):
                ax.text(xi, top * 0.02, clip(_status_of(trials, model, v), 18), rotation=90,
                        ha="center", va="bottom", fontsize=8, color="#6c757d")
            elif ratio_labels and v not in baseline and base_med > 0:
                ax.text(xi, m + eh + top * 0.02, ratio_text(m / base_med), ha="center",
                        va="bottom", fontsize=8, color="#333333")
        _xticks(ax, variants)
        ax.set_title(model)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    _suptitle(fig, title)
    fig.tight_layout()
    return fig


@_styled
def throughput(trials: pd.DataFrame) -> plt.Figure:
    """Samples/s per variant, one panel per model: median of trials, 95% bootstrap CI bars."""
    return _bar_panels(trials, "samples_per_s", "throughput (samples/s)",
                       "Throughput per variant: median, 95% CI, dots = trials (higher is better; "
                       "dark = baseline)")


@_styled
def peak_memory(trials: pd.DataFrame) -> plt.Figure:
    """Peak memory per variant (MB), one panel per model, ratio to the baseline on each bar."""
    cuda = trials["device"].astype(str).str.startswith("cuda").any()
    what = "peak CUDA memory (MB)" if cuda else "peak tensor memory (MB)"
    return _bar_panels(trials, "peak_mem_mb", what,
                       f"{what[0].upper() + what[1:]} per variant: median, 95% CI "
                       "(lower is better; labels: ratio to baseline)", ratio_labels=True)


def _ratio_ticks(lo: float, hi: float) -> list[float]:
    """Ticks between lo and hi, about four to nine of them: finer steps on narrow ranges,
    1-3 per decade on wide ones (0.01x, 0.03x, 0.1x, 0.3x, 1x, 3x rather than powers of ten
    alone), and powers of ten only beyond four decades."""
    span = hi / lo
    steps = ((1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8) if span < 4 else (1, 1.5, 2, 3, 5, 7)
             if span < 8 else (1, 2, 5) if span < 200 else (1, 3) if span < 10 ** 4 else (1,))
    ticks = (round(c * 10.0 ** k, 12) for k in range(-6, 7) for c in steps)
    return [t for t in ticks if lo <= t <= hi]


def _ratio_axis(ax, lo: float, hi: float) -> None:
    """Log x axis spanning [lo, hi] and 1, labelled 0.5x, 1x, 2x ..."""
    lo, hi = min(lo, 0.8) / 1.25, max(hi, 1.25) * 1.25
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(FixedLocator(_ratio_ticks(lo, hi)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_locator(NullLocator())


def forest(rows: pd.DataFrame, xlabel: str, title: str, panel: str = "model",
           label: str = "variant") -> plt.Figure:
    """Ratios with CIs as points and whiskers, coloured by verdict, the value and verdict
    written in a column at the right. One panel per value of `panel`, stacked, sharing x.

    rows: columns panel, label, ratio, lo, hi, verdict, status (rows whose status is not ok
    show their status instead of a point).
    """
    with plt.rc_context(STYLE):
        panels = _order(rows[panel])
        counts = [int((rows[panel] == p).sum()) for p in panels]
        finite = rows[["ratio", "lo", "hi"]].to_numpy(float)
        finite = finite[np.isfinite(finite) & (finite > 0)]
        lo_all = finite.min() if len(finite) else 0.5
        hi_all = finite.max() if len(finite) else 2.0
        height = 0.9 + sum(0.34 * c + 0.5 for c in counts)
        fig, axes = plt.subplots(len(panels), 1, figsize=(8.6, height),
                                 sharex=True, squeeze=False,
                                 gridspec_kw={"height_ratios": [c + 0.6 for c in counts]})
        axes = list(axes[:, 0])
        for ax, p in zip(axes, panels):
            sel = rows[rows[panel] == p].reset_index(drop=True)
            y = np.arange(len(sel))[::-1]
            side = blended_transform_factory(ax.transAxes, ax.transData)
            for yi, r in zip(y, sel.itertuples()):
                if r.status != OK or not np.isfinite(r.ratio):
                    ax.text(1.02, yi, clip(r.status, 34), transform=side, va="center",
                            fontsize=9, color="#6c757d")
                    continue
                colour = VERDICT_COLOURS.get(r.verdict, OTHER_COLOUR)
                if np.isfinite(r.lo) and np.isfinite(r.hi):
                    ax.plot([r.lo, r.hi], [yi, yi], color=colour, linewidth=3,
                            solid_capstyle="round")
                ax.plot([r.ratio], [yi], "o", color=colour, markersize=8, markeredgecolor="white")
                ax.text(1.02, yi, f"{ratio_text(r.ratio, r.lo, r.hi)}  {r.verdict}", transform=side,
                        va="center", fontsize=9, color=colour)
            ax.set_yticks(y, [clip(str(v), 40) for v in sel[label]])
            ax.set_ylim(-0.6, len(sel) - 0.4)
            ax.set_title(str(p), loc="left", fontsize=10)
            ax.grid(axis="x", alpha=0.3)
            ax.axvline(1.0, color="#333333", linewidth=1, linestyle="--")
        _ratio_axis(axes[-1], lo_all, hi_all)
        axes[-1].set_xlabel(xlabel)
        _suptitle(fig, title, x=0.02, ha="left")
        fig.tight_layout()
        # room on the right for the ratios' text, never left of the labels' margin
        fig.subplots_adjust(right=min(0.95, max(0.6, fig.subplotpars.left + 0.15)))
        return fig


def speedup(summary: pd.DataFrame) -> plt.Figure:
    """Speed-up over the baseline per variant with 95% CI and the verdict, one panel per model."""
    rows = summary[~summary["is_baseline"]].rename(
        columns={"speedup": "ratio", "speedup_lo": "lo", "speedup_hi": "hi"})
    base = _order(summary.loc[summary["is_baseline"], "variant"])
    return forest(rows, "speed-up over baseline (x, log scale)",
                  f"Speed-up over the baseline ({', '.join(base) or 'none'}): paired rounds, "
                  "adjusted CI (right of dashed line = faster)")


@_styled
def step_breakdown(phases: pd.DataFrame) -> plt.Figure:
    """Mean time per optimizer step split into phases (stacked bars), one panel per model."""
    models = _order(phases["model"])
    order = [p for p in PHASE_COLOURS if p in set(phases["phase"])]
    order += [p for p in _order(phases["phase"]) if p not in order]
    n_var = max(len(_order(phases.loc[phases["model"] == m, "variant"])) for m in models)
    fig, axes = _panels(len(models), max(3.2, 0.62 * n_var + 1.6))
    extra = iter(RUN_COLOURS[::-1] * 4)
    colours = {p: PHASE_COLOURS.get(p) or next(extra) for p in order}
    for ax, model in zip(axes, models):
        per_model = phases[phases["model"] == model]
        variants = _order(per_model["variant"])
        table = per_model.pivot_table(index="variant", columns="phase", values="mean_ms",
                                      aggfunc="sum").reindex(index=variants).fillna(0)
        bottom = np.zeros(len(variants))
        ax.set_axisbelow(True)
        for p in order:
            if p in table.columns:
                vals = table[p].to_numpy(float)
                ax.bar(np.arange(len(variants)), vals, bottom=bottom, color=colours[p],
                       label=p if ax is axes[0] else None)
                bottom += vals
        _xticks(ax, variants)
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("time per step (ms)")
    fig.legend(loc="upper right", fontsize=8, frameon=False, ncols=len(order))
    fig.suptitle("Where a step's time goes: mean per phase", fontsize=11, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def sweep_knob(trials: pd.DataFrame, knob: str) -> bool:
    """True when `knob` takes three or more values and each variant has one value (per model)."""
    ok = _ok(trials)
    if knob not in ok.columns or ok[knob].isna().all():
        return False
    values = pd.to_numeric(ok[knob], errors="coerce")
    if values.isna().any() or values.nunique() < 3:
        return False
    per_variant = ok.assign(_v=values).groupby(["model", "variant"])["_v"].nunique()
    per_value = ok.assign(_v=values).groupby(["model", "_v"])["variant"].nunique()
    return bool((per_variant == 1).all() and (per_value == 1).all())


@_styled
def sweep(trials: pd.DataFrame, knob: str, label: str = "") -> plt.Figure:
    """Throughput against a knob's value (median, 95% CI), a line per model; `label` names
    the x axis (the knob's column by default).

    For world_size the ideal-scaling line (throughput at the smallest size x size ratio) is
    drawn dashed beside each model's curve.
    """
    ok = _ok(trials).assign(_v=lambda d: pd.to_numeric(d[knob], errors="coerce"))
    fig, ax = plt.subplots(figsize=(7.6, 3.8))
    for i, model in enumerate(_order(ok["model"])):
        colour = RUN_COLOURS[i % len(RUN_COLOURS)]
        pts = []
        for value, g in ok[ok["model"] == model].groupby("_v"):
            pts.append((value, *_median_ci_err(g["samples_per_s"])))
        x, med, el, eh = (np.array(c, float) for c in zip(*pts))
        ax.errorbar(x, med, yerr=[el, eh], marker="o", capsize=3, color=colour, label=model)
        if knob == "world_size" and len(x) and x[0] > 0:
            ax.plot(x, med[0] * x / x[0], linestyle="--", color=colour, alpha=0.6,
                    label=f"{model}: ideal scaling")
    values = sorted(ok["_v"].unique())
    ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.set_xlabel(label or knob)
    ax.set_ylabel("throughput (samples/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"Throughput against {knob}: median, 95% CI")
    fig.tight_layout()
    return fig


@_styled
def compare_throughput(trials: pd.DataFrame) -> plt.Figure:
    """Runs side by side: throughput per variant (median, 95% CI) with one bar per run.

    trials: the trials of several runs stacked, with a `run` column naming each run.
    """
    runs = _order(trials["run"])
    models = _order(trials["model"])
    ok = _ok(trials)
    n_var = max(len(_order(trials.loc[trials["model"] == m, "variant"])) for m in models)
    fig, axes = _panels(len(models), max(3.4, (0.28 * len(runs) + 0.35) * n_var + 1.6), 3.6)
    width = 0.8 / len(runs)
    for ax, model in zip(axes, models):
        variants = _order(trials.loc[trials["model"] == model, "variant"])
        for j, run in enumerate(runs):
            stats_ = [_median_ci_err(ok.loc[(ok["model"] == model) & (ok["variant"] == v)
                                            & (ok["run"] == run), "samples_per_s"])
                      for v in variants]
            med, el, eh = (np.array(c, float) for c in zip(*stats_))
            x = np.arange(len(variants)) - 0.4 + width * (j + 0.5)
            ax.bar(x, np.nan_to_num(med), width * 0.95, yerr=[el, eh], capsize=2,
                   color=RUN_COLOURS[j % len(RUN_COLOURS)], label=run if ax is axes[0] else None,
                   error_kw={"ecolor": "#333333", "elinewidth": 1})
        _xticks(ax, variants)
        ax.set_title(model)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("throughput (samples/s)")
    fig.legend(loc="lower center", ncols=min(len(runs), 3), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    _suptitle(fig, "Throughput per run, side by side: median, 95% CI")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def figures_for(trials: pd.DataFrame, summary: pd.DataFrame,
                phases: pd.DataFrame | None = None,
                settings: dict[str, str] | None = None) -> dict[str, tuple[str, plt.Figure]]:
    """The figures one experiment's data supports: name → (caption, Figure). Only drawn
    when their data is present. `settings`: the run's settings columns → axis label
    (report.settings.columns); each that takes many values gets a sweep figure."""
    out = {}
    trials = in_summary_order(trials, summary)
    if summary.loc[~summary["is_baseline"], "speedup"].notna().any():
        out["speedup"] = ("Each variant's speed-up over the baseline: the dot is the geometric mean of its per-round "
                          "ratios, the bar its CI adjusted for the run's comparisons, the colour the verdict; "
                          "right of the dashed line is faster.",
                          speedup(summary))
    if len(_ok(trials)):
        out["throughput"] = ("Samples per second of each variant: bar = median of the trials, whisker = "
                             "95% CI, dots = single trials; the dark bar is the baseline.",
                             throughput(trials))
    if _ok(trials)["peak_mem_mb"].notna().any():
        out["memory"] = ("Peak memory of each variant (on a CPU, the peak bytes of tensors torch allocates in a "
                         "step; on CUDA, the allocator's peak), with its ratio to the baseline above each bar.",
                         peak_memory(trials))
    if phases is not None and len(phases):
        out["phases"] = ("Mean time of one optimizer step split into its phases (data wait, "
                         "host-to-device copy, forward, backward, optimizer).",
                         step_breakdown(phases))
    if "scaling_efficiency" in summary and summary["scaling_efficiency"].notna().any():
        out["scaling"] = ("Throughput against the devices used, next to perfect scaling (dashed), "
                          "and the scaling efficiency, where 1.0 is perfect.",
                          scaling(summary))
    for knob, label in {**(settings or {}), **WORLD_SIZE}.items():
        if sweep_knob(trials, knob):
            out[f"sweep-{knob}"] = (f"Throughput of each model (median, 95% CI) against {knob}: where the "
                                  "curve flattens, more stops paying.", sweep(trials, knob, label))
    return out


def save(fig: plt.Figure, path) -> None:
    try:  # written whole or not at all (atomic.py)
        with quiet():
            atomic.save_figure(fig, path, dpi=DPI)
    finally:
        plt.close(fig)


@_styled
def scaling(summary: pd.DataFrame) -> plt.Figure:
    """Data parallelism against the devices used: throughput next to the ideal (N x the
    single-device baseline), and scaling efficiency (1.0 = perfect). One line per model."""
    rows = summary[summary["status"] == OK].sort_values("devices")
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
