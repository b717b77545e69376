"""Energy per sample in the report: per variant, the joules per sample, the paired ratio to the
baseline's with its CI and the verdict (analysis/energy.py), and the energy to the target where
the run trained to one; where no trial measured energy, one line with the trials' reason."""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis import energy
from speedbench.analysis.numbers import ratio_text
from speedbench.report.document import Document

METHOD = ("Energy: a hardware counter (NVML's total energy on NVIDIA GPUs, RAPL on CPUs) read "
          "at the timed window's two synchronised ends, windows of 1 s or more only; joules "
          "per sample per trial, compared with the baseline's paired by round with the same "
          "interval and level as the speed-up. Never an estimate: where no counter is readable "
          "the figures are n/a.")


def _joules(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.4g}"


def energy_table(summary: pd.DataFrame) -> pd.DataFrame:
    rows = summary.to_dict("records")
    return pd.DataFrame({
        "model": [r["model"] for r in rows], "variant": [r["variant"] for r in rows],
        "J/sample": [_joules(r.get("energy_per_sample_j")) for r in rows],
        "energy ratio [CI]": [ratio_text(r.get("energy_ratio"), r.get("energy_ratio_lo"),
                                         r.get("energy_ratio_hi")) for r in rows],
        "energy verdict": [str(r.get("energy_verdict", "-")) for r in rows],
    })


def add(doc: Document, summary: pd.DataFrame, trials: pd.DataFrame,
        runs: pd.DataFrame | None = None) -> None:
    """The energy table of one experiment, or the line saying why there is none."""
    if not len(summary):
        return
    doc.heading("Energy per sample", 3)
    if not len(energy.measured(trials)):
        doc.para(f"{energy.why_none(trials)}: no energy figure on this run, and none "
                 "estimated.")
        return
    doc.para(METHOD)
    doc.table(energy_table(summary))
    target = energy.to_target_rows(runs, summary)
    if len(target):
        doc.table(pd.DataFrame({
            "model": target["model"], "variant": target["variant"],
            "samples to target": target["samples"].map(lambda s: f"{s:,.0f}"),
            "energy to target (J)": target["energy_to_target_j"].map(_joules)}))
