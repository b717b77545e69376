"""Explained verdicts in the report and on the console: one sentence per decided comparison,
a waterfall of its parts beside its forecast, and each forecast beside its measured CI
(explain.csv and forecast.csv, read through analysis/explain.py; no torch)."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd

from speedbench.analysis import explain
from speedbench.analysis.numbers import ratio_text
from speedbench.report import plots, waterfall
from speedbench.report.document import Document, slug
from speedbench.results import runs
from speedbench.results.schema import EXPLAIN_CATEGORIES, FORECAST_STEPS, OK

METHOD = ("After the rounds, fresh models of the baseline, before, between and (time "
          "permitting) after those of the variants measured, ran a few untimed steps under "
          "torch.profiler, warmed up as a trial is (never in a timed window). Each profiled "
          "step's wall time is split by operator category (the self time of each event: "
          "matrix products and convolutions, other operators, the data wait, the optimizer "
          "step, host reads of device values, compiled code, the Python between operators, "
          "the rest), so that the parts sum to the step; on a CPU the profiler's own cost is "
          "taken out (its excess over unprofiled steps of the same model). A part is the "
          "variant's mean less the baseline's (the variant scaled to the baseline's samples "
          "per step), in ms per step, with a 95 % interval over the profiled steps; the parts "
          "sum to the profiled change. Unexplained is what they leave of the change the "
          "rounds measured (the profiler's own cost, drift, noise): the table gives each "
          "side's profiled step beside its timed one.")
FORECAST = ("Forecast: before the rounds, each technique declared the most it could gain here "
            f"from {FORECAST_STEPS} profiled baseline steps (Amdahl on the share of the step it "
            "acts on, at that share's 99 % upper limit over the steps profiled; each reason "
            f"says how many: fewer than {FORECAST_STEPS} make no bound). A measured CI wholly "
            "above a forecast that is a bound is flagged: the "
            "forecast or the measurement is wrong. amp's is not a bound: it applies the "
            "16-bit/fp32 matmul peak ratio (measured in alternated windows; none where their "
            "ratios disagreed) to the matrix products alone, while autocast also runs "
            "element-wise ops in 16 bits; it is shown, marked, and sets nothing aside.")


def explained(table, forecast, summary, experiment: str | None = None) -> pd.DataFrame:
    """The explained comparisons (explain.csv) with their forecasts (forecast.csv), of one
    experiment if given."""
    rows = explain.with_forecasts(explain.comparisons(table, summary), forecast)
    if experiment is not None and not rows.empty:
        rows = rows[rows["experiment"] == experiment]
    return rows


def _x(x: float) -> str:
    return ratio_text(x, spec=".3g")


def _ci(row) -> str:
    return ratio_text(row["speedup"], row["speedup_lo"], row["speedup_hi"], ".3g")


def parts_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per comparison: verdict, speed-up, forecast, each category's change [interval] and the
    unexplained rest, ms per baseline step."""
    out = []
    for _, r in rows.iterrows():
        row = {"model": r["model"], "variant": r["variant"], "verdict": r["verdict"],
               "speed-up [CI]": _ci(r), "forecast": _x(r["forecast"])
               + (" (below the CI)" if r["above"] else "")}
        for c in EXPLAIN_CATEGORIES:
            lo, hi = r[f"{c}_lo"], r[f"{c}_hi"]
            row[explain.LABELS[c]] = f"{r[f'{c}_ms']:+.2f}" + (
                f" [{lo:+.2f}, {hi:+.2f}]" if math.isfinite(lo) else "")
        row["profiled"] = f"{r['profiled_ms']:+.2f}"
        row["measured"] = f"{r['measured_ms']:+.2f}"
        # where an unexplained rest comes from: each side's profiled step against its timed one
        row["steps profiled / timed"] = (f"{r['base_profiled_ms']:.1f} / {r['baseline_ms']:.1f}"
                                         f" -> {r['variant_profiled_ms']:.1f} / "
                                         f"{r['variant_ms']:.1f}")
        share = r["unexplained_share"]
        row["unexplained"] = f"{r['unexplained_ms']:+.2f}" + (
            f" ({100 * share:.0f} %)" if math.isfinite(share) else "")
        out.append(row)
    return pd.DataFrame(out)


def forecast_table(forecast: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Every forecast beside the measured speed-up and verdict."""
    out = []
    for _, f in forecast.iterrows():
        s = summary[(summary["experiment"] == f["experiment"]) & (summary["model"] == f["model"])
                    & (summary["variant"] == f["variant"])]
        s = s.iloc[0] if len(s) else None
        ok, bound = f["status"] == OK, explain.is_bound(f)
        value = float(f["forecast"]) if ok else math.nan
        measured = "-" if s is None else _ci(s)
        above = s is not None and bound and explain.above(s["speedup_lo"], value)
        out.append({"model": f["model"], "variant": f["variant"],
                    "technique": f["technique"] if isinstance(f["technique"], str) else "",
                    "forecast": ("n/a" if not ok else _x(value) if bound
                                 else f"{_x(value)} (not a bound)"),
                    "measured [CI]": measured + (" (above the forecast)" if above else ""),
                    "verdict": "-" if s is None else s["verdict"],
                    "why": f["reason"] if ok else f["status"]})
    return pd.DataFrame(out)


def add(doc: Document, run, experiment: str, out_dir: Path) -> None:
    """The section of one experiment: sentences, waterfalls, the parts and the forecasts."""
    rows = explained(run.explain, run.forecast, run.summary, experiment)
    forecast = run.forecast[run.forecast["experiment"] == experiment] \
        if run.forecast is not None else pd.DataFrame()
    if rows.empty and forecast.empty:
        return
    doc.heading("Why: where the time went, and the most it could have", 3)
    decided = explain.decided(rows)
    if len(decided):
        doc.para(METHOD)
        doc.bullets([explain.sentence(r) for _, r in decided.iterrows()])
        figures = []
        for _, r in decided.iterrows():
            path = f"plots/{slug(experiment)}-why-{slug(r['model'])}-{slug(r['variant'])}.png"
            plots.save(waterfall.parts_figure(r), out_dir / path)
            figures.append((f"{r['model']} / {r['variant']}: the parts of the change, then "
                            "the profiled and the measured change; the dashed line is the "
                            "forecast", path))
        doc.figures(figures)
        doc.table(parts_table(decided))
    elif len(rows):
        doc.para("No comparison was decided (faster, slower or equivalent): nothing to explain.")
    if len(forecast):
        doc.para(FORECAST)
        doc.table(forecast_table(forecast, run.summary))


def console_lines(run_dir: Path, summary: pd.DataFrame) -> list[str]:
    """The closing note: each decided comparison's sentence, then each forecast beside its
    measured CI (none without explain.csv and forecast.csv)."""
    table, forecast = runs.load_explain(run_dir)
    rows = explain.decided(explained(table, forecast, summary))
    out = []
    if len(rows):
        out += ["Why (profiled untimed steps, ms per baseline step, variant - baseline):"]
        out += [_item(explain.sentence(r)) for _, r in rows.iterrows()]
    if forecast is not None and len(forecast):
        table = forecast_table(forecast, summary)
        out += ["Forecasts (the most each could gain, before measuring; 'not a bound': part of",
                "the step only) beside the measured:"]
        out += [_item(f"{r['model']} {r['variant']}: forecast {r['forecast']}, measured "
                      f"{r['measured [CI]']} {r['verdict']}; {r['why']}")
                for _, r in table.iterrows()]
    return out


def _item(text: str) -> str:
    """One item of the closing note, within the console's 100 columns."""
    return textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="    ")
