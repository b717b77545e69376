"""Scaling efficiency of data-parallel variants: how close N devices come to N times one.

efficiency = throughput / (devices x the single-device baseline's throughput), which is the
speed-up over that baseline divided by the devices; its CI is the speed-up's CI divided likewise.
1.0 is perfect scaling. Defined only when the baseline runs on one device (under torchrun every
variant spans all ranks, so there is no single-device reference and the column is empty).
"""
from __future__ import annotations

import math

import pandas as pd


def add_efficiency(summary: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """The summary with `devices` and `scaling_efficiency[_lo, _hi]`, when any variant is
    data-parallel; unchanged otherwise."""
    if "parallel" not in trials or not (trials["parallel"].fillna("none") != "none").any():
        return summary
    devices = trials.groupby(["experiment", "model", "variant"], sort=False)["devices"].max()
    out = summary.copy()
    out["devices"] = [int(devices.get((r.experiment, r.model, r.variant), 1))
                      for r in out.itertuples()]
    base_devices = out[out["is_baseline"]].set_index(["experiment", "model"])["devices"]
    for col in ("", "_lo", "_hi"):
        out[f"scaling_efficiency{col}"] = [
            r[f"speedup{col}"] / r["devices"]
            if base_devices.get((r["experiment"], r["model"])) == 1 else math.nan
            for _, r in out.iterrows()]
    return out
