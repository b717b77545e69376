"""The report of one run: report.md, report.html (self-contained, escaped), plots/, console table.

Layout: the recommendation first; then per experiment (a run may hold several) a sentence at a
glance, its figures (each with a sentence saying what it shows), the summary table and the
profiler's findings; then the articles' claims, the environment, and last how it was measured
and what the report had to leave out.
"""
from __future__ import annotations

import math
import re
import shlex
import shutil
import textwrap
from pathlib import Path
from typing import Optional

import pandas as pd

from speedbench.results import atomic
from speedbench.analysis import claims as claims_mod
from speedbench.analysis import intervals
from speedbench.analysis.numbers import AUTO, ratio_text
from speedbench.analysis.summary import summarised
from speedbench.report import energy_section
from speedbench.report import (ab_section, capacity_section, explain_section, host_sweep, memory_section,
                               method, plots, profile_section, recipe_section, recommend,
                               settings, to_target_section, unfinished)
from speedbench.report.document import Document, shortened, slug, write
from speedbench.report.numbers import learning_lost
from speedbench.results.runs import Run, load_recipe, load_run
from speedbench.analysis.quality import NO_VERDICT
from speedbench.results.schema import OK, STOPPED_SLOWER



def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as people read it: one formatted row per (model, variant); the experiment
    comes first when the run holds several (a suite such as `tips`); a column of no value
    (every row `-`) is left out."""
    table = pd.DataFrame({
        "model": summary["model"], "variant": summary["variant"], "status": summary["status"],
        "samples/s": summary["samples_per_s"].map(_num),
        "speed-up [adj. CI]": [ratio_text(r.speedup, r.speedup_lo, r.speedup_hi, AUTO)
                               for r in summary.itertuples()],
        "verdict": summary["verdict"],
        "peak mem MB": summary["peak_mem_mb"].map(_num),
        "mem ratio": [ratio_text(r.mem_ratio, spec=AUTO) if "mem_ratio" in summary else "-"
                      for r in summary.itertuples()],
        **_quality(summary, short=False),
        # Achieved FLOP/s (FlopCounterMode FLOPs / median step time), the peak measured on the
        # spot in the variant's dtype (flops.py) and the share reached; GFLOP/s at 3 significant
        # digits, so that 0.724 and 92.1 read alike.
        "GFLOP/s": _col(summary, "achieved_tflops").map(_gflops),
        "peak GFLOP/s": _col(summary, "peak_tflops").map(_gflops),
        "% of peak": _col(summary, "peak_fraction").map(peak_share),
    })
    if "rss_growth_mb" in summary and summary["rss_growth_mb"].notna().any():
        # torchrun on the CPU: a process's RSS growth, not a tensor peak: never a ratio
        table.insert(list(table.columns).index("mem ratio") + 1, "process RSS growth MB",
                     summary["rss_growth_mb"].map(_num))
    if "scaling_efficiency" in summary:  # data-parallel variants (summary.add_efficiency)
        table.insert(4, "devices", summary["devices"])
        table.insert(5, "scaling eff. [95% CI]", [
            ratio_text(r.scaling_efficiency, r.scaling_efficiency_lo, r.scaling_efficiency_hi,
                       AUTO, unit="")
            for r in summary.itertuples()])
    if summary["experiment"].nunique() > 1:
        table.insert(0, "experiment", summary["experiment"])
    # a column with no value in any row (nothing measured) says nothing, and widens the table
    empty = [c for c in table.columns if c not in ("experiment", "model", "variant", "status",
                                                   "verdict") and (table[c] == "-").all()]
    return table.drop(columns=empty)


QUALITY_SHORT = {"non-inferior": "non-inf.", "inconclusive": "inconcl."}


def _quality(summary: pd.DataFrame, short: bool) -> dict:
    """The loss columns: the held-out loss over the probe's seeds, its ratio to the baseline's
    with the CI (full table only) and the quality verdict (analysis/quality.py); a run
    written before quality.csv has only its one-seed probe loss."""
    if "quality_verdict" not in summary:
        return {"probe loss": summary["final_loss"].map(
            lambda v: _num(v, "{:.3g}" if short else "{:.3f}"))}
    # "no loss (too slow: ...)": the status column already gives the reason
    verdicts = summary["quality_verdict"].fillna("-").astype(str).map(lambda v: v.split(" (")[0])
    if short:
        return {"loss": summary["quality_loss"].map(lambda v: _num(v, "{:.3g}")),
                "quality": verdicts.map(lambda v: "no verd.*" if v.startswith(NO_VERDICT)
                                        else QUALITY_SHORT.get(v, _clip(v, 9)))}
    return {"held-out loss": summary["quality_loss"].map(lambda v: _num(v, "{:.3f}")),
            "learning lost [adj. CI]": [learning_lost(r._asdict())
                                        for r in summary.itertuples()],
            "quality": verdicts}



def _sig(x, digits: int = 3) -> str:
    """`digits` significant digits without scientific notation for the sizes reports show
    (0.000724, 92.1, 1,500)."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def peak_share(fraction) -> str:
    """A share of the measured peak in %; above 100 % the peak itself was measured low (other
    work held the cores while it was timed), so no number is shown."""
    if fraction is not None and math.isfinite(fraction) and fraction > 1:
        return "over 100 (peak measured low)"
    return _sig(100 * fraction, 2) if fraction is not None else "-"


def busy_note(env: dict) -> Optional[str]:
    """One line when the machine was busy while the run went (env.json's machine_load), with
    what to do about it; None when it was not, or the run predates the record."""
    load = env.get("machine_load") if isinstance(env, dict) else None
    if not isinstance(load, dict) or not load.get("busy"):
        return None
    steal = load.get("cpu_steal")
    share, others = load.get("own_cpu_share"), load.get("others_cpu_share")
    details = [f"CPU steal {100 * steal:.0f} %" if isinstance(steal, (int, float)) else None,
               f"this run got {100 * share:.0f} % of them" if isinstance(share, (int, float))
               else None,
               f"other processes {100 * others:.0f} %" if isinstance(others, (int, float))
               else None]
    said = "; ".join(d for d in details if d)
    cores, machine = load.get("cores"), load.get("machine_cores")
    # the load average is the machine's; the shares are of the cores this run may use
    where = f"{cores} cores" if not machine or machine == cores else \
        f"the machine's {machine} cores, of which this run may use {cores}"
    return (f"The machine was busy: load {load.get('load_highest')} on {where}"
            f"{f' ({said})' if said else ''}; figures are noisy and speed-ups may come out "
            f"inconclusive. Measure again on a quiet machine"
            + (f", or {_fewer_threads(env)}." if _fewer_threads(env) else "."))


def _fewer_threads(env: dict) -> str:
    """What to give speedbench on a busy machine: bench.threads=auto, with the threads it set
    or would set here (env.json's bench_threads: the cores other processes kept busy); '' where
    the run had one thread already."""
    threads = env.get("bench_threads") or {}
    busy, cores = threads.get("others_busy_cores"), env.get("cpu_affinity") or env.get("cpu_count")
    ran, default = threads.get("torch_threads"), threads.get("torch_default")
    if threads.get("setting") == "auto" or (isinstance(ran, int) and isinstance(default, int)
                                            and ran < default):  # the run fitted them itself
        if isinstance(ran, int) and ran <= 1:  # fewer than one: none to give
            return ""
        return f"give fewer threads than this run's {ran} (bench.threads=N)"
    if isinstance(busy, (int, float)) and isinstance(cores, int):
        fit = max(1, min(cores, math.floor(cores - busy + 0.5)))
        return (f"with bench.threads=auto ({fit} thread(s) here: the cores other processes "
                "left free at the start)")
    return "with bench.threads=auto (the cores other processes leave free)"


def model_change_notes(env: dict) -> list[str]:
    """env.json's `model_changes`: what a model's own code changed in the process (the default
    dtype, grad mode, ...), which the run put back after its trials; at most 20, each shortened."""
    changes = env.get("model_changes") if isinstance(env, dict) else None
    if not isinstance(changes, list):
        return []
    return [shortened(str(c), 400) for c in changes[:20] if isinstance(c, str)]


def _gflops(tflops) -> str:
    return _sig(1000 * tflops) if tflops is not None else "-"


def peak_note(summary: pd.DataFrame, trials: pd.DataFrame) -> str:
    """The hardware limit per kind of peak (the dtype of the matrix products: fp32, tf32,
    bf16, fp16), and how much of it the models reach: "bf16's peak is 7.6x fp32's here, yet
    the models reach 6-9% of it" is the finding a percentage column hides."""
    if "peak_tflops" not in summary or "peak_kind" not in trials or \
            not summary["peak_tflops"].notna().any():
        return ""
    kind = trials.drop_duplicates(["model", "variant"]).set_index(
        ["model", "variant"])["peak_kind"]
    rows = summary.assign(peak_kind=[kind.get((r.model, r.variant))
                                     for r in summary.itertuples()])
    rows = rows[rows["peak_tflops"].notna() & rows["peak_kind"].notna()]
    if rows.empty:
        return ""
    peaks = rows.groupby("peak_kind", sort=False)["peak_tflops"].median()
    ref = peaks.get("fp32")
    parts = []
    for prec, peak in peaks.items():
        share = rows.loc[rows["peak_kind"] == prec, "peak_fraction"].dropna() * 100
        times = (f" ({ratio_text(peak / ref, spec='.2g')} fp32's)" if ref and prec != "fp32"
                 else "")
        low, high = (_sig(share.min(), 2), _sig(share.max(), 2)) if len(share) else ("", "")
        reach = ("" if not len(share) else f", of which the models reach {low}%" if low == high
                 else f", of which the models reach {low}-{high}%")
        parts.append(f"{prec} {_gflops(peak)} GFLOP/s{times}{reach}")
    return ("The hardware limit, measured here as the best rate of a large matrix product in "
            "each precision: " + "; ".join(parts) + ". A low share means time goes to "
            "work other than matrix products (memory traffic, data, overheads), so a faster "
            "matrix unit cannot pay off in full.")


def _col(summary: pd.DataFrame, name: str) -> pd.Series:
    """A summary column, or NaNs for runs written before it existed."""
    return summary[name] if name in summary else pd.Series(math.nan, index=summary.index)


# The console: at most 100 columns (fewer on a narrower terminal), short verdict words with a
# legend, columns dropped from the least useful when they do not fit.
CONSOLE_WIDTH = 100
VERDICT_SHORT = {"no significant difference": "n.s.", "too few trials": "few trials"}
VERDICT_LEGEND = {"faster": "faster/slower: the CI excludes 1",
                  "slower": "faster/slower: the CI excludes 1",
                  "n.s.": "n.s.: no significant difference",
                  "equivalent": "equivalent: within the noise threshold",
                  "inconclusive": "inconclusive: neither, more trials needed",
                  "few trials": "few trials: too few trials for a CI",
                  "slower (stopped)": "slower (stopped): its probe steps, F times slower or "
                                      "more at the run's error level",
                  "not measured": "not measured: a limit stopped it, no call",
                  "screening": "screening: a recipe search's screen, it decides nothing",
                  "no CI": "no CI: one round, a speed-up without an interval"}
# The columns a narrow terminal loses first.
DROP_ORDER = ("% peak", "GFLOP/s", "probe loss", "loss", "mem x", "devices", "scaling", "mem MB", "samples/s")


def console_width() -> int:
    return max(60, min(CONSOLE_WIDTH, shutil.get_terminal_size((CONSOLE_WIDTH, 24)).columns))


def _clip(text, most: int = 16) -> str:
    text = str(text)
    return text if len(text) <= most else text[:most - 1] + "~"


def console_frame(summary: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The compact table and its footnotes (the reasons of rows that have no number)."""
    reasons: list[str] = []
    verdicts = []
    for r in summary.itertuples():
        if r.status != OK:
            if r.status not in reasons:
                reasons.append(r.status)
            word = "slower (stopped)" if r.verdict == STOPPED_SLOWER \
                else str(r.status).split(':')[0]
            verdicts.append(f"{word} [{reasons.index(r.status) + 1}]")
        else:
            verdicts.append(VERDICT_SHORT.get(r.verdict, _clip(r.verdict, 12)))
    table = pd.DataFrame({
        "model": summary["model"].map(_clip), "variant": summary["variant"].map(_clip),
        "samples/s": summary["samples_per_s"].map(_num),
        # A CI from two rounds at a Bonferroni level can span many decades: keep it short.
        "speed-up [CI]": [ratio_text(r.speedup, r.speedup_lo, r.speedup_hi, ci_spec=".3g",
                                     sep=",") for r in summary.itertuples()],
        "verdict": verdicts,
        "mem MB": summary["peak_mem_mb"].map(lambda v: _num(v, "{:.0f}")),
        "mem x": _col(summary, "mem_ratio").map(lambda v: _num(v, "{:.2f}")),
        **_quality(summary, short=True),
        "GFLOP/s": _col(summary, "achieved_tflops").map(_gflops),
        "% peak": _col(summary, "peak_fraction").map(peak_share),
    })
    if "scaling_efficiency" in summary:
        table.insert(5, "devices", summary["devices"].map(lambda v: _num(v, "{:.0f}")))
        table.insert(6, "scaling", _col(summary, "scaling_efficiency").map(
            lambda v: _num(v, "{:.2f}")))
    if summary["experiment"].nunique() > 1:
        table.insert(0, "exp.", summary["experiment"].map(lambda v: _clip(v, 14)))
    return table, [f"[{i}] {r}" for i, r in enumerate(reasons, 1)] + _no_quality(summary)


def _no_quality(summary: pd.DataFrame) -> list[str]:
    """`* resnet: no quality verdict: the baseline has not learned ...`, once per model."""
    if "quality_verdict" not in summary:
        return []
    said = {f"* {r.model}: {r.quality_verdict}" for r in summary.itertuples()
            if str(r.quality_verdict).startswith(NO_VERDICT)}
    return sorted(said)


def console_table(summary: pd.DataFrame, width: Optional[int] = None) -> str:
    """The summary for a terminal `width` columns wide (default: this one's, at most 100):
    the table, the legend of its verdict words, the reasons of rows without a number."""
    width = min(width or console_width(), CONSOLE_WIDTH)
    table, notes = console_frame(summary)
    text = table.to_string(index=False)
    for column in DROP_ORDER:
        if max(map(len, text.splitlines())) <= width:
            break
        if column in table:
            table = table.drop(columns=column)
            text = table.to_string(index=False)
    words = [w for w in dict.fromkeys(v.split(" [")[0] for v in table["verdict"])
             if w in VERDICT_LEGEND]  # a row without a number: its word, then its note
    legend = list(dict.fromkeys(VERDICT_LEGEND[w] for w in words))
    lines = text.splitlines()
    if legend:
        lines += textwrap.wrap("verdict: " + "; ".join(legend) + ".", width,
                               subsequent_indent="  ")
    for note in notes:
        lines += textwrap.wrap(note, width, subsequent_indent="    ")
    return "\n".join(line[:width] for line in lines)


def console_warnings(summary: pd.DataFrame, experiment: Optional[str] = None,
                     overrides: Optional[list[str]] = None,
                     width: Optional[int] = None, repeats: Optional[int] = None,
                     program: Optional[list[str]] = None, busy: bool = False,
                     budget_s: Optional[float] = None) -> list[str]:
    """Noise warnings, short, each with a command to paste that measures again with more
    rounds: the same command line with the budget the recommendation gives (`budget_s`, the
    run's bench.time_budget_s: see more_budget), or, with none, more repeats (_more_repeats;
    `repeats` is the run's bench.repeats); `program`, the words that started the run:
    `speedbench`, or torchrun's; `busy`: env.json's machine_load said the machine was busy,
    method.load_cause)."""
    width = width or console_width()
    noisy = [n.split(" sd ")[0] for n in method.noisy_rows(summary)]
    unsteady = [f"{r.model}/{r.variant}" for r in summary.itertuples()
                if float(getattr(r, "unsteady", 0) or 0) > 0]
    if not noisy and not unsteady:
        return []
    # run_dir= would name the directory this run already filled
    kept = [o for o in overrides or [] if not o.lstrip("+").startswith((
        "bench.repeats=", "bench.target_ci=", "bench.warmup_max=", "run_dir=")
        + (("bench.time_budget_s=",) if budget_s else ()))]
    repeats_more = None if budget_s else _more_repeats(summary, repeats)
    more = f"bench.time_budget_s={recommend.more_budget(summary, budget_s):g}" if budget_s else (
        f"bench.repeats={repeats_more}" if repeats_more else None)
    lines, extra = [], []
    if noisy:
        lines.append("warning: the paired per-round speed-ups vary more than on a quiet "
                     f"machine (sd over {method.QUIET_ROUND_SD:.2f}) for " + _listing(noisy)
                     + "; " + method.load_cause(summary, busy))
        extra += [more] if more else []
    if unsteady:
        lines.append("warning: some trials were timed before their step time was steady: "
                     + _listing(unsteady))
        extra.append("bench.warmup_max=30")
    if budget_s and not noisy:  # the run's one figure, in every command that measures again
        extra.insert(0, more)
    kept = [w for o in kept for w in shorter(o, width)]  # a long +arms={...}: one per leaf
    flags = [o for o in kept if o.startswith("-")]  # --config-dir=...: before the overrides
    command = list(program or ["speedbench"]) + flags + ([f"+experiment={experiment}"] if experiment and not any(
        o.lstrip("+").startswith("experiment=") for o in kept) else []) + \
        [o for o in kept if not o.startswith("-")] + extra
    out = []
    for line in lines:
        out += textwrap.wrap(line, width, subsequent_indent="  ")
    out.append("  measure again:")
    out += _shell_lines(command, width, indent="    ")
    return out


FLATTENED = ("arms",)  # overrides whose {...} value Hydra composes the same one leaf at a time
# a string Hydra would read otherwise than as this string: quoted in a flattened override
PLAIN_VALUE = re.compile(r"[A-Za-z_/~.][\w./:+~@-]*")


def shorter(override: str, width: int) -> list[str]:
    """An override too long for a line of `width`, for an `arms={...}` one: one
    `++arms.<arm>.<key>=value` per leaf (Hydra composes the same config); else as given."""
    if len(shlex.quote(override)) + 6 <= width or not override.lstrip("+").startswith(
            tuple(f"{k}=" for k in FLATTENED)):
        return [override]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        value = OverridesParser.create().parse_overrides([override])[0].value()
    except Exception:  # (Hydra refused it at the run's start already: not reached)
        return [override]
    if not isinstance(value, dict) or not value:
        return [override]
    return [f"++{key}={_hydra_value(leaf)}"
            for key, leaf in _leaves(override.lstrip("+").split("=", 1)[0], value)]


def _leaves(prefix: str, value) -> list[tuple[str, object]]:
    if isinstance(value, dict) and value:
        return [kv for k, v in value.items() for kv in _leaves(f"{prefix}.{k}", v)]
    return [(prefix, value)]


def _hydra_value(value) -> str:
    """A leaf as Hydra's override grammar reads it back: strings quoted unless plain."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_hydra_value(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = str(value)
    if not isinstance(value, str) or (PLAIN_VALUE.fullmatch(text) and text.lower() not in (
            "true", "false", "null", "nan", "inf")):
        return text
    return "'" + text.replace("'", "\\'") + "'"


def _more_repeats(summary: pd.DataFrame, repeats: Optional[int] = None) -> Optional[int]:
    """bench.repeats for measuring again: twice the rounds this run measured (the most ok
    trials of a variant), else twice the run's bench.repeats (`repeats`); None when neither is
    known (the command then leaves bench.repeats as it was)."""
    trials = pd.to_numeric(summary["trials"], errors="coerce") if "trials" in summary \
        else pd.Series(dtype=float)
    most = trials.max() if trials.notna().any() else math.nan
    rounds = int(most) if most > 0 else repeats
    return 2 * int(rounds) if rounds else None


def _shell_lines(words: list[str], width: int, indent: str) -> list[str]:
    """A command split into lines within `width`, continued with backslashes, so that it
    still pastes as one command. A word too long for a line of its own is cut into quoted
    pieces, each continued at the start of the next line (a backslash-newline inside a word
    joins its pieces; an indent there would split it)."""
    lines, line = [], indent
    for word in words:
        quoted = shlex.quote(word)
        if line.strip() and len(line) + 1 + len(quoted) + 2 > width:
            lines.append(line + " \\")
            line = indent + "  "
        line += "" if not line.strip() else " "
        if len(line) + len(quoted) > width:
            pieces = _pieces(word, width - len(line) - 1, width - 1)
            lines += [(line if i == 0 else "") + p + "\\" for i, p in enumerate(pieces[:-1])]
            line = pieces[-1]
        else:
            line += quoted
    return lines + [line]


def _pieces(word: str, first: int, rest: int) -> list[str]:
    """`word` as shell-quoted pieces that, set side by side, make it again: the first within
    `first` columns, the others within `rest`."""
    pieces, start = [], 0
    while start < len(word):
        room, end = (rest if pieces else first), start + 1
        while end < len(word) and len(shlex.quote(word[start:end + 1])) <= room:
            end += 1
        pieces.append(shlex.quote(word[start:end]))
        start = end
    return pieces


def _listing(items: list[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def console_lines(summary: pd.DataFrame, experiment: Optional[str] = None,
                  overrides: Optional[list[str]] = None, table: bool = True,
                  repeats: Optional[int] = None, program: Optional[list[str]] = None,
                  busy: bool = False, budget_s: Optional[float] = None) -> list[str]:
    """What a run prints at its end, before the path of its report: the table and the
    warnings, each line within the terminal's width (at most 100 columns). A recipe search
    prints no table: its recommendation, which follows, gives the search's own figures."""
    return ([console_table(summary)] if table else []) + \
        console_warnings(summary, experiment, overrides, repeats=repeats, program=program,
                         busy=busy, budget_s=budget_s)


def report_line(run_dir: Path, trials: int, seconds: float) -> str:
    """The run's last line: what it did, and the absolute path of report.html to open."""
    return f"{trials} trials in {seconds:.0f} s; report: {(Path(run_dir) / 'report.html').resolve()}"


def env_pairs(env: dict) -> list[tuple[str, str]]:
    """The environment facts that explain a result, as (label, value) lines."""
    if not env:
        return [("environment", "unknown (no env.json)")]
    v = env.get("versions") or {}
    gpus = env.get("cuda_devices") or []
    pairs = [("device", f"{env.get('device')} ({env.get('device_name')})")]
    if gpus:
        pairs.append(("GPUs", "; ".join(f"{g.get('name')} {g.get('memory_gb')} GB" for g in gpus)))
        pairs.append(("CUDA / cuDNN / driver", f"{env.get('torch_cuda_version')} / "
                      f"{env.get('cudnn_version')} / {env.get('nvidia_driver')}"))
    pairs += [
        ("CPU", f"{env.get('cpu_model')}, {env.get('cpu_count')} cores "
                f"({env.get('cpu_affinity')} usable), ISA {env.get('torch_config_cpu')}"),
        ("threads", f"{env.get('torch_threads')} torch{_threads_set(env)}, "
                    f"{env.get('torch_interop_threads')} inter-op; OMP_NUM_THREADS={(env.get('env') or {}).get('OMP_NUM_THREADS', 'unset')}"),
        ("software", f"torch {v.get('torch')}, Python {env.get('python')}, "
                     f"pandas {v.get('pandas')}, speedbench {v.get('speedbench')}"),
        ("platform", str(env.get("platform"))),
        ("git revision", str(env.get("git_revision"))
         + {True: " (uncommitted changes)", False: " (clean)"}.get(env.get("git_dirty"), "")),
    ]
    if env.get("cpu_flags") is not None:
        pairs.insert(2, ("CPU flags", " ".join(map(str, env["cpu_flags"]))
                         or "none of those that matter"))
    if env.get("machine_load") or env.get("load_average"):
        pairs.insert(-3, ("load average (1 min)", _load_text(env)))
    # env.json is the run's file, not trusted: one huge value must not make the report huge
    return [(label, shortened(value, 400)) for label, value in pairs]


def _threads_set(env: dict) -> str:
    """` (the run set them: torch's default was 2)` where bench.threads or the start-up check
    (run.fit_threads) changed torch's count; '' where the run kept it."""
    threads = env.get("bench_threads") or {}
    ran, default = threads.get("torch_threads"), threads.get("torch_default")
    if not isinstance(ran, int) or not isinstance(default, int) or ran == default:
        return ""
    why = f"bench.threads={threads['setting']}" if threads.get("setting") else \
        "fewer multiplied matrices faster at its start" if threads.get("matmul_rates") else \
        "other processes kept cores busy at its start"
    return f" (set by the run, {why}; torch's default: {default})"


def _load_text(env: dict) -> str:
    load = env.get("machine_load")
    if not isinstance(load, dict) or not load:  # a run before the machine's load was watched
        start, end = env.get("load_average"), env.get("load_average_end")
        first = lambda x: x[0] if isinstance(x, list) and x else "unknown"  # noqa: E731
        return f"{first(start)} at the start" + (f", {first(end)} at the end" if end else "")
    steal, share = load.get("cpu_steal"), load.get("own_cpu_share")
    number = lambda x: isinstance(x, (int, float))  # noqa: E731
    return (f"{load.get('load_start')} at the start, {load.get('load_highest')} at most, "
            f"{load.get('load_end')} at the end, on {load.get('cores')} cores"
            + (f"; CPU steal {100 * steal:.0f} %" if number(steal) else "")
            + (f"; this run's CPU share {100 * share:.0f} %" if number(share) else ""))


def method_text(cfg: dict) -> str:
    bench = cfg.get("bench") or {}
    if not bench:
        return (method.METHOD + " (The run's config.yaml is missing, so its measurement window "
                "is unknown.)")
    warmup = (f"at least {bench.get('warmup')} warm-up steps, continuing until the last 3 step "
              f"times agree within {bench.get('steady_tol')} of their median (at most "
              f"{bench.get('warmup_max')})" if bench.get("steady_tol") and bench.get("warmup")
              else f"{bench.get('warmup')} warm-up steps")
    # the adaptive rounds' rule is METHOD's, which follows: here only this run's settings
    adaptive = (f", more in adaptive rounds (bench.target_ci {bench.get('target_ci')}, "
                f"bench.time_budget_s {bench.get('time_budget_s')} s for the whole run)"
                if bench.get("target_ci") else "")
    return (f"Each trial builds a fresh model with seed {bench.get('seed')}, runs {warmup}, then "
            f"times up to {bench.get('steps')} optimizer steps in one window synchronised with "
            f"the device only at its ends (capped at {bench.get('max_trial_s')} s per trial). "
            f"{bench.get('repeats')} trials per variant, interleaved across variants{adaptive}. "
            + method.METHOD + " Memory = the peak bytes of the tensors one untimed optimizer "
            "step holds (CPU: every tensor torch allocates, tracked op by op; CUDA: the "
            "allocator's peak), split into parameters + gradients + optimizer state and the "
            "rest (activations, temporaries); host RSS adds the pages only the DataLoader "
            "workers hold (USS). TFLOP/s = FLOPs per "
            "optimizer step (torch FlopCounterMode: matrix products, convolutions, attention; "
            "forward and backward) / median step time; % of peak = that over the best rate of a "
            "large matrix product in the variant's dtype, measured in the run.")


def at_a_glance(summary: pd.DataFrame) -> str:
    """One sentence per experiment: how many pairs got faster or slower, and the extremes."""
    rows = summary[~summary["is_baseline"]]
    if rows.empty:
        return "No variant besides the baseline was measured."
    counts = rows["verdict"].value_counts()
    called = (intervals.FASTER, intervals.SLOWER, intervals.EQUIVALENT, intervals.INCONCLUSIVE)
    parts = [f"{counts.get(v, 0)} {v}" for v in called if counts.get(v, 0)]
    # the rest by their own word (no CI, stopped early, n/a ...), not all "not measured"
    rest = rows.loc[~rows["verdict"].isin(called), "verdict"].fillna("").astype(str)
    words = rest.str.split(" [", regex=False).str[0].str.split(":").str[0].str.strip()
    for word, n in words.replace("", "not measured").value_counts().items():
        parts.append(f"{n} {word}")
    text = f"Of {len(rows)} (model, variant) pairs: {', '.join(parts)}."
    # Only a significant result is crowned (verdict faster / slower, family-wise controlled).
    faster = rows[rows["verdict"] == intervals.FASTER]
    slower = rows[rows["verdict"] == intervals.SLOWER]
    if len(faster):
        best = faster.loc[faster["speedup"].idxmax()]
        text += (f" Best: {best['variant']} on {best['model']}, {ratio_text(best['speedup'])} "
                 "(faster).")
    else:
        text += " No variant is significantly faster than its baseline."
    if len(slower):
        worst = slower.loc[slower["speedup"].idxmin()]
        text += (f" Worst: {worst['variant']} on {worst['model']}, "
                 f"{ratio_text(worst['speedup'])} (slower).")
    return text


def claims_table(cfg: dict, summary: pd.DataFrame, trials: pd.DataFrame,
                 notes: list[str], env: Optional[dict] = None) -> pd.DataFrame:
    claims = cfg.get("claims") or []
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        notes.append("the config's claims: is not a list of mappings: claims left out")
        return pd.DataFrame()
    return claims_mod.evaluate(claims, summary, trials, env)


def claim_tally(verdicts: pd.Series) -> str:
    """'Holds for 1 of 6 (model, variant) pairs; partly 2; does not hold 3.'"""
    kinds = verdicts.map(lambda v: next((k for k in (claims_mod.HOLDS, claims_mod.PARTLY,
                                                     claims_mod.FAILS) if v.startswith(k)),
                                        "not measured or inconclusive"))
    counts = kinds.value_counts()
    rest = [f"{k} {n}" for k, n in counts.items() if k != claims_mod.HOLDS]
    return (f"Holds for {counts.get(claims_mod.HOLDS, 0)} of {len(verdicts)} (model, variant) "
            f"pairs" + ("; " + "; ".join(rest) if rest else "") + ".")


def findings_table(findings: pd.DataFrame) -> pd.DataFrame:
    cols = ["model", "variant", "symptom", "figure", "tip", "knob"]
    cols += ["check"] if "check" in findings else []  # the knob measured (recipe.check_findings)
    return findings[cols].rename(
        columns={"figure": "measured", "knob": "knob to try", "check": "knob, measured"}
    ).fillna("-")


# The names experiment_section gives its figures: plots/<experiment>-<figure>.png
FIGURE_FILE = re.compile(
    r".+-(speedup|throughput|memory|phases|scaling|workers|sweep-\w+|host-[\w.-]+)\.png$")


def _remove_stale_figures(out_dir: Path, written: set[str]) -> None:
    """Figures of an earlier build that this one did not redraw (the run's data changed)."""
    if (out_dir / "plots").is_symlink():  # never delete inside a folder elsewhere
        return
    for png in (out_dir / "plots").glob("*.png"):
        if FIGURE_FILE.match(png.name) and f"plots/{png.name}" not in written:
            png.unlink()


def noise_threshold(cfg: dict) -> float:
    """bench.noise_threshold of the run's config (the default where it is absent)."""
    value = (cfg.get("bench") or {}).get("noise_threshold") if isinstance(cfg, dict) else None
    return float(value) if isinstance(value, (int, float)) else intervals.DEFAULT_THRESHOLD


def experiment_section(doc: Document, run: Run, experiment: str, out_dir: Path) -> None:
    """Summary table, figures and findings of one experiment of the run."""
    trials = run.trials[run.trials["experiment"] == experiment]
    summary = run.summary[run.summary["experiment"] == experiment]
    phases = run.phases[run.phases["experiment"] == experiment] if run.phases is not None else None
    doc.heading(f"Experiment: {experiment}")
    doc.lead(at_a_glance(summary))
    figures = []
    for name, (caption, fig) in plots.figures_for(trials, summary, phases,
                                                  settings.columns(run)).items():
        path = f"plots/{slug(experiment)}-{name}.png"
        plots.save(fig, out_dir / path)
        figures.append((caption, path))
    doc.figures(figures)
    doc.table(summary_table(summary))
    note = peak_note(summary, trials)
    if note:
        doc.para(note)
    load = run.env.get("machine_load") if isinstance(run.env, dict) else None
    for warning in method.spread_warnings(summary, bool(isinstance(load, dict)
                                                        and load.get("busy"))):
        doc.note(warning)
    explain_section.add(doc, run, experiment, out_dir)  # why, and the forecasts
    memory_section.add(doc, trials)  # the peaks forecast from the baseline's split
    energy_section.add(doc, summary, trials, run.to_target)
    for view in settings.host_sweeps(run):
        host_sweep.add(doc, trials, view, out_dir, summary)
    if run.to_target is not None:
        to_target_section.add(doc, run.to_target, run.curves, experiment, out_dir,
                              noise_threshold(run.cfg))
    capacity = run.capacity[run.capacity["experiment"] == experiment] \
        if run.capacity is not None else pd.DataFrame()
    if len(capacity):
        capacity_section.add(doc, capacity, trials)
    if phases is not None and len(phases):
        doc.heading("Where the time goes (profile)", 3)
        doc.para(profile_section.METHOD)
        doc.table(profile_section.phase_table(phases))
        overhead = profile_section.overhead_table(trials)
        if len(overhead):
            doc.heading("Profiler overhead", 3)
            doc.para(profile_section.OVERHEAD)
            doc.table(overhead)
        doc.para(profile_section.FILES)
    found = run.findings[run.findings["experiment"] == experiment] \
        if run.findings is not None else pd.DataFrame()
    if len(found) or (phases is not None and len(phases)):
        doc.heading("What the profiler found", 3)
        if len(found):
            doc.table(findings_table(found))
        else:
            doc.para("Clean recipe: no finding, none of the checked symptoms was measured.")


def recommendation_section(doc: Document, run: Run, out_dir: Optional[Path] = None) -> None:
    """The first section after the title: per model, use / skip / could not test here
    (recommend.py); for a recipe search, how it was found follows (recipe_section.py)."""
    recipe_rows = load_recipe(run.path)
    budget_s = ((run.cfg or {}).get("bench") or {}).get("time_budget_s")
    recommend.add_section(doc, run.summary, recipe_rows, runs=run.to_target,
                          budget_s=budget_s if isinstance(budget_s, (int, float)) else None)
    if recipe_rows is not None and out_dir is not None:
        recipe_section.add(doc, recipe_rows, run.path, out_dir)


def build_document(run: Run, out_dir: Path) -> Document:
    """Order: the recommendation, then per experiment its figures and tables, the articles'
    claims, the environment, and how it was measured."""
    experiments = run.experiments
    devices = ", ".join(dict.fromkeys(run.trials["device"].astype(str)))
    # a recipe search's measurements are its steps, not what the run is about
    name = "recipe search" if run.recipe_search else ", ".join(experiments)
    doc = Document(title=f"speedbench report: {name}",
                   subtitle=f"{run.path.name} · {devices} · {len(run.trials)} trials")
    busy = busy_note(run.env)
    if busy:  # first: it explains every figure below
        doc.note(busy)
    for note in method.trial_notes(run.trials):  # stalled windows, trials others slowed
        doc.note(note)
    stopped = unfinished.note(run)
    if stopped:  # the run never got to its end: what it never measured
        doc.note(stopped)
    for change in model_change_notes(run.env):  # a model's code changed the process
        doc.note(change[:1].upper() + change[1:])
    recommendation_section(doc, run, out_dir)
    ab_section.add(doc, run.summary, run.env)  # an A/B of environments (arms)
    for experiment in experiments:
        experiment_section(doc, run, experiment, out_dir)
    _remove_stale_figures(out_dir, {p for b in doc.blocks if b[0] == "figures" for _, p in b[1]})
    notes = list(run.notes)
    claims = claims_table(run.cfg, run.summary, run.trials, notes, run.env)
    if len(claims):
        doc.heading("The articles' claims, measured")
        doc.para("Each claim of the speed-tip articles, checked on this machine: 'holds' only "
                 "when the measured effect's CI (family-wise adjusted) supports it, 'does not "
                 "hold' only when the CI excludes it, 'inconclusive' otherwise.")
        for (tip, source, quote), rows in claims.groupby(["tip", "source", "claim"], sort=False):
            doc.quote(quote, f"{tip}: {source}")
            doc.para(claim_tally(rows["verdict"]))
            doc.table(rows[["experiment", "model", "variant", "measured", "memory", "loss Δ",
                            "verdict"]])
    doc.heading("Environment")
    doc.pairs(env_pairs(run.env))
    doc.heading("How this was measured")
    doc.para(method_text(run.cfg))
    doc.para(method.family_text(run.summary))
    members = run.members
    if members:  # a suite: each member experiment ran with its own settings
        doc.para("Each experiment ran with its own settings: " + "; ".join(
            f"{e}: warm-up {b.get('warmup')}, steps {b.get('steps')}, repeats {b.get('repeats')}, "
            f"cap {b.get('max_trial_s')} s" for e, b in members.items()) + ".")
    if notes:
        doc.heading("What this report could not use", 3)
        doc.bullets(notes)
    return doc


def write_report(run_dir: Path, cfg: Optional[dict] = None, out_dir: Optional[Path] = None) -> Path:
    """Rebuild plots/, report.md and report.html from the files in run_dir (into out_dir if
    given). Returns the path of report.md."""
    run = summarised(load_run(run_dir, cfg))
    out = Path(out_dir) if out_dir else Path(run_dir)
    atomic.real_dir(out / "plots")
    write(build_document(run, out), out, plots.DPI)
    return out / "report.md"
