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
    """The summary with `devices` and `scaling_efficiency[_lo, _hi]` when a variant spans more
    devices than a single-device baseline; unchanged otherwise (e.g. under torchrun)."""
    if "devices" not in trials or trials["devices"].isna().all():
        return summary
    # rows with no measurement (n/a) have no device count: they ran on none, count one
    devices = trials.groupby(["experiment", "model", "variant"], sort=False)["devices"].max().fillna(1)
    out = summary.copy()
    out["devices"] = [int(devices.get((r.experiment, r.model, r.variant), 1))
                      for r in out.itertuples()]
    base_devices = out[out["is_baseline"]].set_index(["experiment", "model"])["devices"]
    # Only experiments that spread some variant over several devices (a suite holds others).
    parallel = set(out.loc[out["devices"] > 1, "experiment"])
    single = [base_devices.get((r.experiment, r.model)) == 1 and r.experiment in parallel
              for r in out.itertuples()]
    if not any(single) or not (out["devices"] > 1).any():
        return summary
    for col in ("", "_lo", "_hi"):
        out[f"scaling_efficiency{col}"] = [r[f"speedup{col}"] / r["devices"] if one else math.nan
                                           for one, (_, r) in zip(single, out.iterrows())]
    return out
