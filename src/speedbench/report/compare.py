"""Comparison of several runs (machines, PyTorch versions, days): one report side by side.

The first run of the list is the reference (the report tool puts it first). Rows are aligned by (experiment, model, variant); for each
other run the ratio of its geometric mean throughput to the reference's, with Welch's t
interval on log throughput over both runs' trials (intervals.welch_ratio_ci), Bonferroni-
adjusted over the rows compared, and a verdict only when the CI excludes 1. Separate runs
confound what differs between them (a torch version) with the day: the report says so and
points to the paired A/B of environments (config/arms.py), which interleaves both.
What cannot be compared (rows in one run only, missing columns) is listed, not guessed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from speedbench import results
from speedbench.results import atomic, fresh_dir
from speedbench.analysis import intervals
from speedbench.analysis.numbers import AUTO, ratio_text
from speedbench.analysis.summary import summarised
from speedbench.report import plots
from speedbench.report.ab_section import SEPARATE_RUNS
from speedbench.report.document import Document, shortened, slug, write
from speedbench.report.render import _num
from speedbench.results.runs import KEYS, ReportError, Run, label_runs, load_run
from speedbench.results.schema import OK

# env.json entries that differ between any two runs anyway and explain nothing.
ENV_IGNORED = ("hostname", "cpu_flags")  # CPU flags get their own table (flag_differences)
# config.yaml entries that name where a run went, not what it measured.
CONFIG_IGNORED = ("run_dir", "out_dir", "label")


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v, default=str)
    return out


MOST_ROWS = 200  # a table of differences, at most (a cell: document.MOST_CHARS)


def differences(runs: list[Run], what: str = "env", ignored=ENV_IGNORED) -> pd.DataFrame:
    """One row per entry of env.json (what="env") or config.yaml (what="cfg") whose value
    differs between runs (absent shown as '-'), names and values shortened, at most MOST_ROWS
    rows (then a last row counts the rest)."""
    flat = [_flatten(getattr(r, what)) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rows, more = [], 0
    for k in keys:
        if k.split(".")[0] in ignored:
            continue
        values = [f.get(k, "-") for f in flat]
        if len(set(values)) > 1 and len(rows) < MOST_ROWS:
            rows.append({"setting": shortened(k),
                         **{r.label: shortened(str(v)) for r, v in zip(runs, values)}})
        elif len(set(values)) > 1:
            more += 1
    if more:
        rows.append({"setting": f"… and {more:,} more", **{r.label: "" for r in runs}})
    return pd.DataFrame(rows, columns=["setting"] + [r.label for r in runs])


def env_differences(runs: list[Run]) -> pd.DataFrame:
    return differences(runs, "env", ENV_IGNORED)


def flag_differences(runs: list[Run]) -> pd.DataFrame:
    """One row per CPU flag (env.json's cpu_flags) that some runs have and others lack:
    "yes", "no", or "unknown" for a run recorded without flags."""
    flags = [(r.env or {}).get("cpu_flags") for r in runs]
    known = [set(f) for f in flags if isinstance(f, list)]
    if len(known) < 2:
        return pd.DataFrame(columns=["CPU flag"] + [r.label for r in runs])
    rows = []
    for flag in dict.fromkeys(f for fl in flags if isinstance(fl, list) for f in fl):
        if len({flag in k for k in known}) > 1:
            rows.append({"CPU flag": flag, **{
                r.label: ("yes" if flag in f else "no") if isinstance(f, list) else "unknown"
                for r, f in zip(runs, flags)}})
    return pd.DataFrame(rows, columns=["CPU flag"] + [r.label for r in runs])


def config_differences(runs: list[Run]) -> pd.DataFrame:
    """Settings that differ; claims are left out (their wording is not a measurement)."""
    return differences(runs, "cfg", CONFIG_IGNORED + ("claims",))


def _ok_throughput(run: Run, key: tuple) -> np.ndarray:
    t = run.trials
    sel = (t["experiment"] == key[0]) & (t["model"] == key[1]) & (t["variant"] == key[2])
    vals = t.loc[sel & (t["status"] == OK), "samples_per_s"].to_numpy(float)
    return vals[np.isfinite(vals)]


def _row_status(run: Run, key: tuple) -> str:
    s = run.summary
    sel = s[(s["experiment"] == key[0]) & (s["model"] == key[1]) & (s["variant"] == key[2])]
    return str(sel["status"].iloc[0]) if len(sel) else "not run"


def ratio(ref: Run, other: Run, key: tuple, level: float = 0.95) -> dict:
    """other / ref throughput for one row: the ratio of geometric means with Welch's interval
    on log throughput at `level` (intervals.welch_ratio_ci), its verdict, or why it cannot be
    computed."""
    a, b = _ok_throughput(other, key), _ok_throughput(ref, key)
    if not len(a) or not len(b):
        who = other if not len(a) else ref
        return {"ratio": math.nan, "lo": math.nan, "hi": math.nan,
                "verdict": f"not compared: {_row_status(who, key)} in {who.label}",
                "status": f"{_row_status(who, key)} in {who.label}"}
    r, lo, hi = intervals.welch_ratio_ci(a, b, level)
    return {"ratio": r, "lo": lo, "hi": hi, "verdict": intervals.verdict(lo, hi), "status": OK}


def _keys(run: Run) -> list[tuple]:
    return [tuple(k) for k in run.summary[KEYS].drop_duplicates().to_numpy()]


def _listing(keys: list[tuple], most: int = 8) -> str:
    return ", ".join("/".join(k) for k in keys[:most]) + (" ..." if len(keys) > most else "")


def align(runs: list[Run]) -> tuple[list[tuple], list[str]]:
    """Rows of the reference found in at least one other run; notes on the rows left out."""
    ref_keys = _keys(runs[0])
    others = [set(_keys(r)) for r in runs[1:]]
    shared = [k for k in ref_keys if any(k in o for o in others)]
    notes = []
    for run, keys in zip(runs[1:], others):
        missing = [k for k in ref_keys if k not in keys]
        extra = [k for k in _keys(run) if k not in set(ref_keys)]
        if missing:
            notes.append(f"{len(missing)} rows of {runs[0].label} are not in {run.label}: "
                         + _listing(missing))
        if extra:
            notes.append(f"{len(extra)} rows of {run.label} are not in {runs[0].label}: "
                         + _listing(extra))
    if not shared:
        listing = "; ".join(f"{r.label}: {', '.join(sorted(set(k[0] for k in _keys(r))))}"
                            for r in runs)
        raise ReportError("nothing to compare: the runs share no (experiment, model, variant) "
                          f"row (experiments per run: {listing})")
    return shared, notes


def comparison_rows(runs: list[Run], keys: list[tuple]) -> pd.DataFrame:
    """Tidy: one row per (key, other run) with both medians, the ratio and its verdict."""
    ref, rows = runs[0], []
    level = compared_level(runs, keys)
    for key in keys:
        for other in runs[1:]:
            rows.append({**dict(zip(KEYS, key)), "run": other.label,
                         **ratio(ref, other, key, level), "level": level})
    return pd.DataFrame(rows)


def compared_level(runs: list[Run], keys: list[tuple]) -> float:
    """Each run-to-run interval's level: the family's error shared by every comparison
    (Bonferroni), as within a run."""
    return intervals.comparison_level(len(keys) * (len(runs) - 1))


def _summary_row(run: Run, key: tuple):
    s = run.summary
    sel = s[(s["experiment"] == key[0]) & (s["model"] == key[1]) & (s["variant"] == key[2])]
    return sel.iloc[0] if len(sel) else None


def comparison_table(runs: list[Run], keys: list[tuple], rows: pd.DataFrame) -> pd.DataFrame:
    """The table people read: medians per run, ratio to the reference, speed-ups per run."""
    ref, out = runs[0], []
    memory = all("peak_mem_mb" not in r.missing for r in runs)
    for key in keys:
        line = {"model": key[1], "variant": key[2]}
        for run in runs:
            s = _summary_row(run, key)
            line[f"samples/s {run.label}"] = _num(s["samples_per_s"]) if s is not None else "-"
        for run in runs[1:]:
            r = rows[(rows["model"] == key[1]) & (rows["variant"] == key[2])
                     & (rows["experiment"] == key[0]) & (rows["run"] == run.label)].iloc[0]
            line[f"{run.label} / {ref.label} [adj. CI]"] = ratio_text(r["ratio"], r["lo"],
                                                                       r["hi"], AUTO)
            line[f"verdict: {run.label} vs {ref.label}"] = r["verdict"]
        for run in runs:
            s = _summary_row(run, key)
            line[f"speed-up {run.label}"] = (
                "-" if s is None
                else ratio_text(s["speedup"], s["speedup_lo"], s["speedup_hi"], AUTO)
                if s["status"] == OK else s["status"])
        if memory:
            for run in runs:
                s = _summary_row(run, key)
                line[f"peak MB {run.label}"] = _num(s["peak_mem_mb"]) if s is not None else "-"
        out.append(line)
    return pd.DataFrame(out)


def _stacked(runs: list[Run], keys: list[tuple], what: str) -> pd.DataFrame:
    """The trials (or summaries) of all runs restricted to the aligned rows, with a run column."""
    wanted = pd.DataFrame(keys, columns=KEYS)
    frames = [getattr(r, what).merge(wanted, on=KEYS).assign(run=r.label) for r in runs]
    return pd.concat(frames, ignore_index=True)


def experiment_figures(runs: list[Run], keys: list[tuple], rows: pd.DataFrame, experiment: str,
                       out_dir: Path) -> list[tuple[str, str]]:
    keys = [k for k in keys if k[0] == experiment]
    ref, figures = runs[0], []
    many = len(runs) > 2
    trials = _stacked(runs, keys, "trials")
    if len(trials[trials["status"] == OK]):
        figures.append(("Throughput per run, side by side", plots.compare_throughput(trials)))
    ratios = rows[rows["experiment"] == experiment].copy()
    ratios["label"] = ratios["variant"] + (" · " + ratios["run"] if many else "")
    figures.append((f"Throughput relative to {ref.label}",
                    plots.forest(ratios, f"throughput relative to {ref.label} (x, log scale)",
                                 f"Each run's throughput over {ref.label}'s: geometric-mean "
                                 "ratio, adjusted Welch CI",
                                 label="label")))
    summary = _stacked(runs, keys, "summary")
    speed = summary[~summary["is_baseline"]].rename(
        columns={"speedup": "ratio", "speedup_lo": "lo", "speedup_hi": "hi"})
    if len(speed):
        # grouped model by model, variant by variant, the runs next to each other
        order = {k: i for i, k in enumerate(keys)}
        speed = speed.assign(label=speed["variant"] + " · " + speed["run"],
                             _row=[order[tuple(k)] for k in speed[KEYS].to_numpy()])
        speed = speed.sort_values("_row", kind="stable")
        figures.append(("Speed-up over the baseline in each run: does the tip pay off on both?",
                        plots.forest(speed, "speed-up over baseline (x, log scale)",
                                     "Speed-up over the baseline, run by run: median ratio, 95% CI",
                                     label="label")))
    out = []
    for i, (caption, fig) in enumerate(figures):
        path = f"plots/compare-{slug(experiment)}-{i}.png"
        plots.save(fig, out_dir / path)
        out.append((caption, path))
    return out


def method_text(runs: list[Run], keys: list[tuple]) -> str:
    """How runs are compared: the interval, its level and the family."""
    return ("Rows are aligned by (experiment, model, variant). For each, the ratio of the "
            "geometric mean throughput of a run to that of the reference run (--reference, "
            "else the first run given that measured something), with Welch's t interval on the logs of both runs' trials (simulated, it "
            "holds its level from 3 trials a side and at adjusted levels, where the bootstrap "
            "of medians used before covered 0.89 of a nominal 0.95 at 3 trials), at "
            f"{compared_level(runs, keys):.2%} each: the family's 5% shared by the "
            f"{len(keys) * (len(runs) - 1)} comparisons (Bonferroni). 'faster' or 'slower' only "
            "when the CI excludes 1. A run's speed-up over its own baseline shows whether a tip "
            "pays off on each machine.")


def build_document(runs: list[Run], out_dir: Path) -> Document:
    keys, notes = align(runs)
    rows = comparison_rows(runs, keys)
    doc = Document(title="speedbench comparison: " + " vs ".join(r.label for r in runs),
                   subtitle=f"reference: {runs[0].label} · {len(keys)} rows compared")
    doc.note(SEPARATE_RUNS)
    doc.heading("Runs")
    doc.table(pd.DataFrame([{  # every cell shortened: a run's files are not trusted
        "run": shortened(r.label), "directory": shortened(str(r.path)),
        "device": shortened(str((r.env or {}).get("device", "?"))),
        "device name": shortened(str((r.env or {}).get("device_name", "?"))),
        "torch": shortened(str(((r.env or {}).get("versions") or {}).get("torch", "?"))),
        "experiments": shortened(", ".join(r.experiments)), "trials": len(r.trials),
        "state": "interrupted: summary recomputed" if any("no summary.csv" in n for n in r.notes)
        else "complete"} for r in runs]))
    doc.heading("Environment differences")
    diffs = env_differences(runs)
    if len(diffs):
        doc.para("Entries of env.json that differ between the runs: the first place to look "
                 "for the reason behind a difference in speed.")
        doc.table(diffs)
    else:
        doc.para("The recorded environments are identical (apart from the host name): "
                 "differences below come from the machine's state or noise.")
    flags = flag_differences(runs)
    if len(flags):
        doc.heading("CPU flags that differ", 3)
        doc.para("Vector and matrix units the CPUs have or lack (AVX-512, bf16/fp16 arithmetic, "
                 "AMX): they decide whether a 16-bit precision can pay off on a CPU.")
        doc.table(flags)
    settings = config_differences(runs)
    if len(settings):
        doc.heading("Settings that differ", 3)
        doc.note("The runs were made with different settings: a ratio below then compares "
                 "different workloads as well as different machines.")
        doc.table(settings)
    for run in runs:
        notes += [f"{run.label}: {n}" for n in run.notes]
    for experiment in dict.fromkeys(k[0] for k in keys):
        doc.heading(f"Experiment: {experiment}")
        ex_keys = [k for k in keys if k[0] == experiment]
        ex_rows = rows[rows["experiment"] == experiment]
        counts = ex_rows["verdict"].value_counts()
        doc.lead(f"{len(ex_keys)} (model, variant) rows compared with {runs[0].label}: "
                 + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".")
        doc.table(comparison_table(runs, ex_keys, rows))
        doc.figures(experiment_figures(runs, keys, rows, experiment, out_dir))
    doc.heading("How runs are compared")
    doc.para(method_text(runs, keys))
    if notes:
        doc.heading("What could not be compared", 3)
        doc.bullets(notes)
    return doc


def compare_runs(run_dirs: list, out_dir: Path | None) -> Path:
    """Load the runs, write report.md/report.html comparing them into out_dir (None: a new
    folder results/compare/<timestamp>[-n], made atomically so that two comparisons started in
    the same second never share one); returns report.md."""
    for p in run_dirs:  # a run still going: its report, and a comparison, must wait for it
        if results.run_in_progress(Path(p)):
            raise ReportError(f"{p}: its run is still going; compare it when it has ended")
    runs = [summarised(load_run(p)) for p in run_dirs]
    label_runs(runs)
    align(runs)  # fails before anything is written when nothing can be compared
    out_dir = Path(out_dir) if out_dir is not None else fresh_dir(Path("results", "compare"),
                                                                   key="--out")
    atomic.real_dir(out_dir / "plots")
    write(build_document(runs, out_dir), out_dir, plots.DPI)
    return out_dir / "report.md"
