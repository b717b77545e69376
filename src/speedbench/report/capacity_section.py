"""The report's "largest batch that fits" part, from capacity.csv (see speedbench.measure.capacity)."""
from __future__ import annotations

import math

import pandas as pd

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


def table(capacity: pd.DataFrame) -> pd.DataFrame:
    rows = capacity.to_dict("records")
    return pd.DataFrame({
        "model": [r["model"] for r in rows],
        "variant": [r["variant"] for r in rows],
        "largest micro-batch": [_largest(r) for r in rows],
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
