"""report.md, report.html (self-contained, escaped) and the console table, from a run's files."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml

from speedbench import claims as claims_mod
from speedbench import results, stats
from speedbench.report import plots
from speedbench.report import workers as workers_view


def _ci(x, lo, hi, unit="x") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if lo is None or math.isnan(lo):
        return f"{x:.2f}{unit}"
    return f"{x:.2f}{unit} [{lo:.2f}, {hi:.2f}]"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as people read it: one formatted row per (model, variant); the experiment
    comes first when the run holds several (a suite such as `tips`)."""
    table = pd.DataFrame({
        "model": summary["model"], "variant": summary["variant"], "status": summary["status"],
        "samples/s": summary["samples_per_s"].map(_num),
        "speed-up [95% CI]": [_ci(r.speedup, r.speedup_lo, r.speedup_hi)
                              for r in summary.itertuples()],
        "verdict": summary["verdict"],
        "peak mem MB": summary["peak_mem_mb"].map(_num),
        "mem ratio": [_ci(r.mem_ratio, math.nan, math.nan) if "mem_ratio" in summary else "-"
                      for r in summary.itertuples()],
        "loss": summary["final_loss"].map(lambda v: _num(v, "{:.3f}")),
    })
    if summary["experiment"].nunique() > 1:
        table.insert(0, "experiment", summary["experiment"])
    return table


def console_table(summary: pd.DataFrame) -> str:
    return summary_table(summary).to_string(index=False)


def _markdown(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |")
    return "\n".join(lines)


def env_lines(env: dict) -> list[tuple[str, str]]:
    v = env.get("versions", {})
    return [("device", f"{env.get('device')} ({env.get('device_name')})"),
            ("CPU", f"{env.get('cpu_model')}, {env.get('cpu_count')} cores, "
                    f"{env.get('torch_threads')} torch threads"),
            ("torch", f"{v.get('torch')} (CUDA {env.get('torch_cuda_version')})"),
            ("OMP_NUM_THREADS", str(env.get("env", {}).get("OMP_NUM_THREADS", "unset"))),
            ("git", str(env.get("git_revision")))]


def write_report(run_dir: Path, cfg: Optional[dict] = None) -> Path:
    """Rebuild plots, report.md and report.html from the files in run_dir."""
    run_dir = Path(run_dir)
    if cfg is None:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    trials = results.load_trials(run_dir)
    # Only empty cells are missing: pandas would otherwise read the verdict "n/a" as NaN.
    summary = pd.read_csv(run_dir / "summary.csv", keep_default_na=False, na_values=[""]) \
        if (run_dir / "summary.csv").exists() else stats.summarise(trials)
    env = json.loads((run_dir / "env.json").read_text()) if (run_dir / "env.json").exists() else {}
    (run_dir / "plots").mkdir(exist_ok=True)
    experiments = list(dict.fromkeys(trials["experiment"].astype(str)))
    if len(experiments) > 1:  # a suite: one throughput figure per experiment
        figures = {f"throughput: {e}": f"plots/throughput_{e}.png" for e in experiments}
        for e in experiments:
            plots.save(plots.throughput(trials[trials["experiment"] == e]),
                       run_dir / f"plots/throughput_{e}.png")
    else:
        figures = {"throughput": "plots/throughput.png"}
        plots.save(plots.throughput(trials), run_dir / figures["throughput"])
    sweep = workers_view.sweep(trials)
    if len(sweep):
        figures["workers"] = "plots/workers.png"
        plots.save(workers_view.figure(sweep), run_dir / figures["workers"])
    claim_rows = claims_mod.evaluate(list(cfg.get("claims") or []), summary, trials)
    experiment = ", ".join(dict.fromkeys(summary["experiment"].astype(str)))
    bench = cfg.get("bench", {})
    method = (f"Each trial builds a fresh model with seed {bench.get('seed')}, runs "
              f"{bench.get('warmup')} warm-up steps, then times up to {bench.get('steps')} optimizer "
              f"steps in one window synchronised with the device only at its ends (capped at "
              f"{bench.get('max_trial_s')} s per trial). {bench.get('repeats')} trials per variant, "
              "interleaved across variants. Speed-up = ratio of median throughputs, 95% percentile "
              "bootstrap CI; a difference is called only when the CI excludes 1.")
    if (cfg.get("suite") or {}).get("experiments"):
        method += " Each experiment ran with its own settings: " + "; ".join(
            f"{e}: warm-up {b.get('warmup')}, steps {b.get('steps')}, repeats {b.get('repeats')}, "
            f"cap {b.get('max_trial_s')} s" for e, b in _member_benches(run_dir).items()) + "."
    sections = {"summary": summary_table(summary), "claims": claim_rows,
                "workers": workers_view.table(sweep) if len(sweep) else pd.DataFrame(),
                "best": workers_view.best_settings(sweep) if len(sweep) else ""}
    md = render_markdown(experiment, env, sections, figures, method)
    (run_dir / "report.md").write_text(md)
    (run_dir / "report.html").write_text(render_html(experiment, env, sections, figures, method, run_dir))
    return run_dir / "report.md"


def _member_benches(run_dir: Path) -> dict:
    """bench settings of each member of a suite run (members/*.yaml)."""
    return {p.stem: (yaml.safe_load(p.read_text()) or {}).get("bench", {})
            for p in sorted((run_dir / "members").glob("*.yaml"))}


def render_markdown(experiment, env, sections, figures, method) -> str:
    out = [f"# speedbench report: {experiment}", ""]
    out += [f"- **{k}**: {v}" for k, v in env_lines(env)]
    out += ["", "## Summary", "", _markdown(sections["summary"]), ""]
    out += [f"![{name}]({path})" for name, path in figures.items() if name != "workers"]
    if len(sections.get("workers", ())):
        out += ["", "## DataLoader workers", "", sections["best"], "",
                _markdown(sections["workers"]), "", f"![workers]({figures['workers']})"]
    if len(sections["claims"]):
        out += ["", "## The articles' claims, measured", "", _markdown(sections["claims"])]
    out += ["", "## How this was measured", "", method, ""]
    return "\n".join(out)


def _img(run_dir: Path, path: str, alt: str) -> str:
    data = base64.b64encode((run_dir / path).read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_html(experiment, env, sections, figures, method, run_dir: Path) -> str:
    e = html.escape
    env_html = "".join(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in env_lines(env))
    body = [f"<h1>speedbench report: {e(experiment)}</h1>", f"<ul>{env_html}</ul>",
            "<h2>Summary</h2>", sections["summary"].to_html(index=False, escape=True, border=0)]
    body += [_img(run_dir, p, n) for n, p in figures.items() if n != "workers"]
    if len(sections.get("workers", ())):
        body += ["<h2>DataLoader workers</h2>", f"<p>{e(sections['best'])}</p>",
                 sections["workers"].to_html(index=False, escape=True, border=0),
                 _img(run_dir, figures["workers"], "workers")]
    if len(sections["claims"]):
        body += ["<h2>The articles' claims, measured</h2>",
                 sections["claims"].to_html(index=False, escape=True, border=0)]
    body += ["<h2>How this was measured</h2>", f"<p>{e(method)}</p>"]
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{padding:4px 10px;border-bottom:1px solid #ddd;"
             "text-align:left}img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>speedbench: {e(experiment)}</title><style>{style}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")
