"""Memory forecasts before measuring: the peak at another micro-batch, and the largest
micro-batch that fits in a memory size, from the baseline's measured split at its peak.

A linear model. At the peak, trials.csv splits the tensor memory into what does not depend on
the batch (parameters, the gradients alive then, the optimizer's state: `state` here, the peak
less its activations) and the rest (`activation_mem_mb`: activations saved for backward,
temporaries), which is taken to grow in proportion to the micro-batch B:

    peak(B) = S + A * B / B0        largest B in M MB = floor(B0 * (M - S) / A)

It ignores the allocator's fragmentation and cached blocks, workspaces (cuDNN, cuBLAS), the
CUDA context, temporaries that do not scale with the batch, and a peak that moves to another
phase at another size (the optimizer's, say): the report shows each forecast beside the
measured peak where there is one, with its error. Pure pandas (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from speedbench.results.schema import OK


def peak_at(state_mb: float, activation_mb: float, b0: int, b: int) -> float:
    """The forecast peak MB at micro-batch `b`: the state stays, the activations scale."""
    return state_mb + activation_mb * b / b0


def largest_fit(state_mb: float, activation_mb: float, b0: int,
                memory_mb: float) -> Optional[int]:
    """The largest micro-batch whose forecast peak fits in `memory_mb` (0: not even one
    sample); None where the activations are 0 or not measured (no batch dependence to scale)."""
    if not (activation_mb > 0 and math.isfinite(state_mb) and math.isfinite(memory_mb)):
        return None
    return max(math.floor(b0 * (memory_mb - state_mb) / activation_mb), 0)


@dataclass(frozen=True)
class Split:
    """One variant's measured peak (median over its ok trials) and its parts, at `micro_batch`."""

    peak_mb: float
    activation_mb: float
    micro_batch: int

    @property
    def state_mb(self) -> float:
        # the peak less its activations, so that the forecast at the measured micro-batch is
        # the measured peak itself (a sum of medians would not be)
        return self.peak_mb - self.activation_mb

    def peak_at(self, b: int) -> float:
        return peak_at(self.state_mb, self.activation_mb, self.micro_batch, b)

    def largest_fit(self, memory_mb: float) -> Optional[int]:
        return largest_fit(self.state_mb, self.activation_mb, self.micro_batch, memory_mb)


def _numbers(rows: pd.DataFrame, column: str) -> pd.Series:
    return pd.to_numeric(rows[column], errors="coerce") if column in rows else \
        pd.Series(math.nan, index=rows.index)


def split(trials: pd.DataFrame, model: str, variant: str) -> Optional[Split]:
    """The variant's split from its ok trials; None without a peak, its activations or its
    micro-batch (no ok trial, a device without a tensor peak, a run written before them)."""
    rows = trials[(trials["model"] == model) & (trials["variant"] == variant)
                  & (trials["status"] == OK)]
    peak = _numbers(rows, "peak_mem_mb").median()
    activations = _numbers(rows, "activation_mem_mb").median()
    micro = _numbers(rows, "batch_size").median()
    if not all(math.isfinite(x) for x in (peak, activations, micro)) or micro < 1:
        return None
    return Split(float(peak), float(activations), int(micro))


def baseline_of(trials: pd.DataFrame, model: str) -> Optional[str]:
    names = trials[(trials["model"] == model) & trials["is_baseline"].astype(bool)]["variant"]
    return names.iloc[0] if len(names) else None


def forecast_vs_measured(trials: pd.DataFrame) -> pd.DataFrame:
    """Per model and variant: its micro-batch, the peak forecast from the baseline's split, the
    measured peak and the error (forecast / measured - 1), the baseline first. Only models
    where a variant changes the micro-batch (elsewhere every forecast is the baseline's peak:
    nothing to learn)."""
    out = []
    for model in dict.fromkeys(trials["model"]):
        base = baseline_of(trials, model)
        base_split = split(trials, model, base) if base is not None else None
        if base_split is None:
            continue
        rows = []
        for variant in dict.fromkeys(trials[trials["model"] == model]["variant"]):
            got = split(trials, model, variant)
            if got is None:
                continue
            forecast = base_split.peak_at(got.micro_batch)
            rows.append({"model": model, "variant": variant, "micro_batch": got.micro_batch,
                         "forecast_mb": forecast, "measured_mb": got.peak_mb,
                         "error": forecast / got.peak_mb - 1 if got.peak_mb > 0 else math.nan})
        if any(r["micro_batch"] != base_split.micro_batch for r in rows):
            # the baseline first, then by micro-batch (trials.csv is in the rounds' random order)
            out += sorted(rows, key=lambda r: (r["variant"] != base, r["micro_batch"]))
    return pd.DataFrame(out, columns=["model", "variant", "micro_batch", "forecast_mb",
                                      "measured_mb", "error"])
