"""Memory forecasts in the report: each variant's peak forecast from the baseline's split
beside the measured one (where variants change the micro-batch), and the forecast largest
micro-batch beside the searched one (capacity.csv), through analysis/memory.py (no torch)."""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis import memory
from speedbench.report.document import Document

METHOD = ("Forecast: the baseline's peak split at its micro-batch B0 into state S (parameters, "
          "the gradients alive then, the optimizer's state) and activations A (the rest), the "
          "peak at micro-batch B is S + A x B / B0: a linear model, blind to the allocator's "
          "fragmentation, workspaces and temporaries that do not scale with the batch. "
          "Measured: the variant's median peak over its trials; error: forecast / measured - 1. "
          "A variant that accumulates keeps the micro-batch, so its forecast is the baseline's "
          "peak.")
FACTORS = (2, 4)  # the forecast-only peaks where no larger batch was measured or searched


def _mb(x) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"  # a tiny model's peak is under 1 MB


def forecast_table(trials: pd.DataFrame) -> pd.DataFrame:
    """memory.forecast_vs_measured, as the report shows it."""
    rows = memory.forecast_vs_measured(trials)
    return pd.DataFrame({
        "model": rows["model"], "variant": rows["variant"], "micro-batch": rows["micro_batch"],
        "forecast peak MB": rows["forecast_mb"].map(_mb),
        "measured peak MB": rows["measured_mb"].map(_mb),
        "error": rows["error"].map(lambda e: f"{100 * e:+.1f} %" if math.isfinite(e) else "-"),
    })


def add(doc: Document, trials: pd.DataFrame) -> None:
    """The forecast-vs-measured table of one experiment's trials; nothing where no variant
    changes the micro-batch or no split was measured."""
    table = forecast_table(trials)
    if table.empty:
        return
    doc.heading("Memory: forecast beside measured", 3)
    doc.para(METHOD)
    doc.table(table)


def largest_forecast(trials: pd.DataFrame, row: dict) -> str:
    """A capacity.csv row's forecast largest micro-batch in its device_mem_mb, from the
    searched variant's split in the trials ('-' without either)."""
    got = memory.split(trials, row["model"], row["variant"])
    total = pd.to_numeric(row.get("device_mem_mb"), errors="coerce")
    largest = got.largest_fit(float(total)) if got is not None else None
    return "-" if largest is None else f"{largest}"


def forecast_only(trials: pd.DataFrame, capacity: pd.DataFrame) -> pd.DataFrame:
    """Where no search ran (the CPU): each searched model's baseline peak forecast at
    FACTORS times its micro-batch, no measurement to compare."""
    out = []
    for r in capacity.to_dict("records"):
        got = memory.split(trials, r["model"], r["variant"])
        if got is None:
            continue
        row = {"model": r["model"], "variant": r["variant"], "micro-batch": got.micro_batch,
               "measured peak MB": _mb(got.peak_mb)}
        for k in FACTORS:
            row[f"forecast peak MB at {k}x (forecast only)"] = _mb(got.peak_at(k * got.micro_batch))
        out.append(row)
    return pd.DataFrame(out)
