"""The A/B of Python environments in the report and on the console (config/arms.py): per model
each other arm's speed over the first arm's (the version effect) with its CI, verdict, memory
and held-out loss; each technique's speed-up under each arm ("bf16 was 1.31x under a, 1.12x
under b"); and the arms' software side by side (env.json's `arms`), with what cannot differ
between two arms on one machine. Every figure is summary.csv's: the same paired rounds, CIs
and family-wise error control as every other comparison of the run."""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis.numbers import ratio_text
from speedbench.report.document import Document

SEPARATOR = "@"  # config/arms.py's <variant>@<arm>
METHOD = ("Both arms ran in every round, in a balanced order (Williams), on the same data and "
          "seeds, each trial in a fresh worker process of its arm's interpreter (its start and "
          "torch's import outside the timed window). B over A is the paired speed-up of the "
          "baseline recipe under B over the same recipe under A; a technique under an arm is "
          "compared with that arm's baseline. The held-out loss is the quality probe's, "
          "compared within the quality tolerance: two torch versions need not agree bit for bit.")
FIXED = ("What cannot differ between the arms on one machine: the GPU driver, the kernel, the "
         "CPU and its microcode, and the other processes; the CUDA shown is each wheel's runtime, "
         "not the driver's.")
FACTS = (("torch", "torch"), ("torch git", "torch_git_version"), ("python", "python"),
         ("interpreter", "python_executable"), ("CUDA runtime (wheel)", "torch_cuda_runtime"),
         ("cuDNN", "cudnn"), ("oneDNN", "onednn"), ("CPU capability", "cpu_capability"),
         ("build", "build"),
         ("numpy", "numpy"), ("torchvision", "torchvision"), ("environment", "env"))
SEPARATE_RUNS = ("Two separate runs confound the version with the day (the machine's load, "
                 "clock and thermal state); a paired A/B interleaves both in every round: "
                 "python -m speedbench '+arms={a: {python: A/bin/python}, b: {python: "
                 "B/bin/python}}' (docs/outputs.md, scripts/make-arm.sh).")


def _text(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)


def has_arms(summary: pd.DataFrame) -> bool:
    return "arm" in summary and summary["arm"].map(_text).ne("").any()


def _armed(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with `arm` and `reference` as text ('' where missing)."""
    return summary.assign(**{c: summary[c].map(_text) if c in summary else ""
                             for c in ("arm", "reference")})


def version_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """Per model and other arm: B over A (the baseline recipe under each arm)."""
    summary = _armed(summary)
    rows = summary[summary["arm"].map(_text).ne("") & ~summary["is_baseline"].astype(bool)
                   & summary["reference"].map(_text).eq("")] if has_arms(summary) else summary[:0]
    first = summary[summary["is_baseline"].astype(bool)].set_index("model")["arm"] \
        if len(rows) else {}
    return pd.DataFrame({
        "model": rows["model"], "arms": [f"{r.arm} over {first.get(r.model, '?')}"
                                         for r in rows.itertuples()],
        "speed-up [CI]": [_ratio(r) for r in rows.to_dict("records")],
        "verdict": rows["verdict"], "memory x": rows.get("mem_ratio", pd.Series()).map(_x),
        "loss Δ": rows.get("loss_delta", pd.Series()).map(_delta),
        "quality": rows.get("quality_verdict", pd.Series(index=rows.index)).map(_text),
    })


def technique_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """Per model and technique: its speed-up under each arm, one column per arm."""
    if not has_arms(summary):
        return pd.DataFrame()
    summary = _armed(summary)
    rows = summary[summary["reference"].map(_text).ne("")]
    if not len(rows):
        return pd.DataFrame()
    table = rows.assign(technique=rows["variant"].str.rsplit(SEPARATOR, n=1).str[0],
                        cell=[_cell(r) for r in rows.to_dict("records")])
    wide = table.pivot_table(index=["model", "technique"], columns="arm", values="cell",
                             aggfunc="first", sort=False)
    return wide.reset_index().rename_axis(columns=None)


def _cell(row: dict) -> str:
    """'1.31x [1.20, 1.43] faster', or the verdict alone where there is no speed-up."""
    ratio = _ratio(row)
    return row["verdict"] if ratio == "-" else f"{ratio} {row['verdict']}"


def technique_sentences(summary: pd.DataFrame, model: str | None = None) -> list[str]:
    """'transformer: bf16 was 1.31x under a, 1.12x under b' (the verdict where no speed-up);
    with `model`, that model's alone, without its name."""
    if not has_arms(summary):
        return []
    summary = _armed(summary)
    rows = summary[summary["reference"].ne("")]
    if model is not None:
        rows = rows[rows["model"].astype(str) == model]
    rows = rows.assign(technique=rows["variant"].str.rsplit(SEPARATOR, n=1).str[0])
    lines = []
    for (name, technique), group in rows.groupby(["model", "technique"], sort=False):
        said = [(f"{r['speedup']:.2f}x" if _ratio(r) != "-" else r["verdict"])
                + f" under {r['arm']}" for r in group.to_dict("records")]
        lines.append(("" if model is not None else f"{name}: ")
                     + f"{technique} was " + ", ".join(said))
    return lines


def facts_table(env: dict) -> pd.DataFrame:
    """env.json's `arms`, one column per arm."""
    arms = env.get("arms") if isinstance(env, dict) else None
    if not arms:
        return pd.DataFrame()
    return pd.DataFrame({"": [label for label, _ in FACTS], **{
        name: [_fact(facts.get(key)) for _, key in FACTS] for name, facts in arms.items()}})


def _fact(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def _ratio(row: dict) -> str:
    return ratio_text(row.get("speedup"), row.get("speedup_lo"), row.get("speedup_hi"))


def _x(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) and math.isfinite(value) else "-"


def _delta(value) -> str:
    return f"{value:+.3f}" if isinstance(value, float) and math.isfinite(value) else "-"


def add(doc: Document, summary: pd.DataFrame, env: dict) -> None:
    """The report's section; nothing for a run without arms."""
    if not has_arms(summary):
        return
    doc.heading("A/B of environments")
    doc.para(METHOD)
    doc.table(version_rows(summary))
    wide = technique_rows(summary)
    if len(wide):
        doc.heading("Techniques under each arm", 3)
        doc.table(wide)
        doc.bullets(technique_sentences(summary))
    facts = facts_table(env)
    if len(facts):
        doc.heading("The arms' software", 3)
        doc.table(facts)
    doc.para(FIXED)


def console_lines(summary: pd.DataFrame) -> list[str]:
    """The A/B in a few lines: B over A per model, then the techniques under each arm."""
    rows = version_rows(summary)
    lines = [f"A/B: {r['model']}: {r['arms']}: {r['speed-up [CI]']} {r['verdict']}; memory "
             f"{r['memory x']}x; loss {r['loss Δ']} ({r['quality'] or 'no quality check'})"
             for r in rows.to_dict("records")]
    return lines + [f"A/B: {s}" for s in technique_sentences(summary)]
