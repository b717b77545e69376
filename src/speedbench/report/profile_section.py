"""The profiling tables (phases, profiler overhead) for the report, and the console text with
the findings, read back from a run's phases.csv, findings.csv and trials.csv (written when
some variant ran with `profile` on; see speedbench/measure/profile.py)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from speedbench import results
from speedbench.results import runs
from speedbench.results.schema import OK

PHASE_LABELS = {"data": "data wait", "h2d": "host-to-device", "forward": "forward",
                "backward": "backward", "optimizer": "optimizer step", "other": "other"}
OVERHEAD = ("Step times in ms, medians over trials: the timed window (throughput); the "
            "unprofiled reference windows run just before and just after the profiled ones, so "
            "that drift hits both alike; the phase window; the window under the mode's "
            "profiler. Overhead = profiler / reference - 1.")
FILES = ("profile/<model>/<variant>/ holds the profilers' files: cprofile.txt and "
         "cprofile_<phase>.prof (advanced); trace.json (open in ui.perfetto.dev or "
         "chrome://tracing), tensorboard/ and torch_ops.txt (pytorch).")
METHOD = ("Phase times come from a separate window of the same number of steps, run after the "
          "timed one, with the device synchronised at the end of every phase so that device "
          "work is charged to its own phase. Those syncs happen in profile mode only: the "
          "throughput figures come from the unprofiled window. Cells: mean ms per optimizer "
          "step (share of the step); `covered` is the share the phases account for, the rest "
          "being loop bookkeeping.")


def phase_table(phases: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, variant): step time and each phase as `ms (share)`; a variant of
    several experiments (a recipe search's steps all have a `current`) one row each, named
    `experiment/variant`."""
    rows = []
    keys = [k for k in ("experiment", "model", "variant") if k in phases]
    several = "experiment" in phases and phases["experiment"].nunique() > 1
    for key, g in phases.groupby(keys, sort=False):
        experiment, model, variant = key if len(key) == 3 else ("", *key)
        variant = f"{experiment}/{variant}" if several else variant
        g = g.set_index("phase")
        top = g["share"].idxmax()
        step_ms = g.at[top, "mean_ms"] / g.at[top, "share"] if g.at[top, "share"] > 0 else math.nan
        row = {"model": model, "variant": variant, "step ms": f"{step_ms:.1f}"}
        for phase, label in PHASE_LABELS.items():
            if phase in g.index:
                row[label] = f"{g.at[phase, 'mean_ms']:.2f} ({100 * g.at[phase, 'share']:.0f}%)"
        row["covered"] = f"{100 * g['share'].sum():.1f}%"
        rows.append(row)
    return pd.DataFrame(rows)


def overhead_table(trials: pd.DataFrame) -> pd.DataFrame:
    """Median step times: the timed window, the unprofiled reference windows bracketing the
    profiled ones, the phase window, and the window under the mode's profiler."""
    if "profile" not in trials:
        return pd.DataFrame()
    on = trials["profile"].notna() & (trials["profile"] != "off") & (trials["status"] == OK)
    prof = trials[on]
    rows = []
    for (model, variant), g in prof.groupby(["model", "variant"], sort=False):
        plain, profiled = g["reference_step_ms"].median(), g["profiled_step_ms"].median()
        rows.append({"model": model, "variant": variant, "profile": g["profile"].iloc[0],
                     "trials": len(g), "timed window ms": f"{g['step_ms'].median():.1f}",
                     "reference ms": f"{plain:.1f}",
                     "with phase syncs": f"{g['phase_step_ms'].median():.1f}",
                     "under the profiler": f"{profiled:.1f}",
                     "overhead": f"{100 * (profiled / plain - 1):+.0f}%"})
    return pd.DataFrame(rows)


def load(run_dir: Path) -> Optional[dict]:
    run_dir = Path(run_dir)
    tables = runs.load_profile_tables(run_dir)
    if tables is None:
        return None
    phases, findings = tables
    trials = results.load_trials(run_dir) if (run_dir / "trials.csv").exists() else pd.DataFrame()
    groups = list(dict.fromkeys(zip(phases["model"], phases["variant"])))
    return {"phases": phase_table(phases), "overhead": overhead_table(trials),
            "findings": findings, "groups": groups}


def _findings_by_group(data: dict) -> list[tuple[str, list]]:
    """[(`model / variant`, [finding rows])], every profiled group, clean ones included."""
    f = data["findings"]
    out = []
    for model, variant in data["groups"]:
        mine = f[(f["model"] == model) & (f["variant"] == variant)] if not f.empty else f
        rows = list(mine.itertuples())
        out.append((f"{model} / {variant}", rows))
    return out


def console_text(run_dir: Path) -> str:
    data = load(run_dir)
    if data is None:
        return ""
    out = ["Where the time goes (device synchronised at every phase end, profile mode only):",
           data["phases"].to_string(index=False)]
    if not data["overhead"].empty:
        out += ["", "Profiler overhead:", data["overhead"].to_string(index=False)]
    out += ["", "Findings:"]
    for group, rows in _findings_by_group(data):
        out.append(f"  {group}: " + ("no finding" if not rows else ""))
        out += [f"    - {r.symptom}: {r.figure}\n      tip: {r.tip}\n      set: {r.knob}"
                for r in rows]
    return "\n".join(out)
