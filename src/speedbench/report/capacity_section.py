"""The report's "largest batch that fits" part, from capacity.csv (see speedbench.studies.capacity)."""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from speedbench.report import memory_section
from speedbench.report.document import Document
from speedbench.results.schema import CAPACITY_LIMIT_FACTOR as LIMIT_FACTOR
from speedbench.results.schema import OK

STOPPED = {"limit": f"still fitting at the search's limit ({LIMIT_FACTOR} x the model's batch)",
           "time": "the search ran out of bench.largest_batch_s"}


def _int(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{int(x)}"


def _largest(row) -> str:
    n = _int(row.get("largest_batch"))
    return f">= {n}" if row.get("stopped") in STOPPED and n != "-" else n


def searched(capacity: pd.DataFrame) -> bool:
    """Whether any row holds a search (not only n/a rows, whose reason the text gives)."""
    return not capacity["status"].str.startswith("n/a").all()


def table(capacity: pd.DataFrame, trials: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The searched rows; with the run's trials, each beside its forecast from the variant's
    measured split (memory_section.largest_forecast)."""
    rows = capacity.to_dict("records")
    forecast = {} if trials is None else \
        {"forecast (linear)": [memory_section.largest_forecast(trials, r) for r in rows]}
    return pd.DataFrame({
        "model": [r["model"] for r in rows],
        "variant": [r["variant"] for r in rows],
        "largest micro-batch": [_largest(r) for r in rows],
        **forecast,
        "first out of memory": [_int(r.get("first_oom")) for r in rows],
        "peak MB": [_int(r.get("peak_mem_mb")) for r in rows],
        "device MB": [_int(r.get("device_mem_mb")) for r in rows],
        "tries": [_int(r.get("tries")) for r in rows],
        "status": [r["status"] if r["status"] != OK or r.get("stopped") not in STOPPED
                   else f"ok ({STOPPED[r['stopped']]})" for r in rows],
    })


def text(capacity: pd.DataFrame) -> str:
    ok = capacity[capacity["status"] == OK]
    if ok.empty:
        reasons = "; ".join(s.removeprefix("n/a: ") for s in dict.fromkeys(capacity["status"]))
        return f"Not found on this run: {reasons}."
    sizes = ", ".join(f"{r['model']} {_largest(r)}" for r in ok.to_dict("records"))
    return ("Largest micro-batch that fits in device memory at the baseline's settings (doubling "
            "until out of memory, then halving the gap; two optimizer steps each): "
            f"{sizes}. Accumulating k such micro-batches trains on an effective batch k times "
            "larger in the memory of one.")


FORECAST_ONLY = ("Forecast only (no search here, nothing measured to compare): the baseline's "
                 "peak at 2x and 4x its micro-batch, its measured state plus its activations "
                 "scaled with the batch (a linear model, blind to fragmentation and workspaces).")


def add(doc: Document, capacity: pd.DataFrame, trials: pd.DataFrame) -> None:
    """The section: what was found, the searched rows beside their forecasts; where nothing
    was searched (the CPU), the baseline's peak forecast at larger batches."""
    doc.heading("Largest batch that fits", 3)
    doc.para(text(capacity))
    if searched(capacity):
        doc.table(table(capacity, trials))
        return
    forecast = memory_section.forecast_only(trials, capacity)
    if len(forecast):
        doc.para(FORECAST_ONLY)
        doc.table(forecast)
