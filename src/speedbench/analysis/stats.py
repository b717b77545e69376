"""summary.csv's rows (`summarise`: medians, the paired speed-up with its CI and verdict per
(model, variant); analysis/intervals.py is the engine), the report's prose on the method
and the warnings."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench.analysis.intervals import (
    BASELINE, DEFAULT_THRESHOLD, FAMILY_LEVEL, INCONCLUSIVE, SCREENING, Looks, classify,
    comparison_level, count_comparisons, min_detectable, pair_key, paired, paired_log_ratios,
    paired_ratio_ci, relative_halfwidth, stopped_early, t_quantile, threshold_of)
from speedbench.results.schema import OK, STOPPED_SLOWER


def _short(status: str) -> str:
    """`n/a`, `error`, `oom`, `diverged`: the kind of a failure, for the verdict column."""
    return status.split(":")[0]


def _status(statuses: pd.Series) -> str:
    """`ok` when any trial measured; otherwise the most common failure."""
    if (statuses == OK).any():
        return OK
    return statuses.mode().iloc[0]


def summarise(trials: pd.DataFrame, family: float = FAMILY_LEVEL,
              per_experiment: bool = False,
              levels: dict[tuple[str, str], float] | None = None) -> pd.DataFrame:
    """One row per (model, variant): medians over ok trials, the paired speed-up over the
    baseline with its family-wise adjusted CI at the level of the look its rounds stopped at,
    the verdict (`screening` below the run's floor of rounds), and the rounds behind it.

    The family is the whole run (a suite's members together), or with `per_experiment` each
    experiment alone (runs written before the run-wide allotment). `levels` gives the CI level
    of the (experiment, model) pairs whose share of the run's error was allotted in advance
    (a recipe search's measurements, the findings' checks); the other comparisons share
    `family`."""
    rows = []
    key = pair_key(trials)
    levels = levels or {}
    allotted = trials[["experiment", "model"]].apply(tuple, axis=1).isin(set(levels)) \
        if len(trials) else pd.Series(dtype=bool)
    run_comparisons = count_comparisons(trials[~allotted] if len(trials) else trials)
    floor = _floor(trials)
    for (experiment, model), per_model in trials.groupby(["experiment", "model"], sort=False):
        comparisons = count_comparisons(trials[trials["experiment"] == experiment]) \
            if per_experiment else run_comparisons
        plan = Looks(comparisons, *_schedule(per_model), family)
        fixed = levels.get((experiment, model))  # allotted in advance: the level it used
        if fixed is not None:
            comparisons = count_comparisons(per_model)
        base_rows = per_model[per_model["is_baseline"].astype(bool)
                              & (per_model["status"] == OK)]
        base_loss = base_rows["final_loss"].median() if len(base_rows) else math.nan
        position = dict(zip(("position_effect", "position_lo", "position_hi"),
                            position_effect(per_model, key)))
        for variant, g in per_model.groupby("variant", sort=False):
            ok = g[g["status"] == OK]
            row = {"experiment": experiment, "model": model, "variant": variant,
                   "is_baseline": bool(g["is_baseline"].iloc[0]), "status": _status(g["status"]),
                   "trials": len(ok), **_medians(g, ok)}
            level = fixed if fixed is not None else plan.level(_rounds_paired(ok, base_rows, key))
            row.update(_mem_ratio(ok, base_rows, key, level))
            row["loss_delta"] = row["final_loss"] - base_loss
            row.update(_speedup(row, ok, base_rows, key, level, threshold_of(g), floor))
            row["comparisons"], row["family_level"], row["ci_level"] = comparisons, family, level
            row["family_scope"] = "allotted" if (experiment, model) in levels else \
                "experiment" if per_experiment else "run"
            row.update(_flops(ok, row["step_ms"]))
            rows.append({**row, **position})
    return pd.DataFrame(rows)


def _schedule(per_model: pd.DataFrame) -> tuple[int, int]:
    """(min_rounds, looks) the rounds loop recorded (trials.csv; the first round's rows have
    no `looks` yet when it was planned after them); (1, 1), one look, without."""
    def most(col: str) -> int:
        got = pd.to_numeric(per_model[col], errors="coerce").dropna() \
            if col in per_model else pd.Series(dtype=float)
        return int(got.max()) if len(got) else 1
    return max(1, most("min_rounds")), max(1, most("looks"))


def _floor(trials: pd.DataFrame) -> int:
    """The run's floor of rounds for a verdict: the most `min_rounds` any measurement of it
    recorded (bench.repeats); 0 for a run without the column."""
    got = pd.to_numeric(trials["min_rounds"], errors="coerce").dropna() \
        if "min_rounds" in trials else pd.Series(dtype=float)
    return int(got.max()) if len(got) else 0


def _rounds_paired(ok: pd.DataFrame, base_rows: pd.DataFrame, key: str) -> int:
    if not len(ok) or not len(base_rows):
        return 0
    return len(paired_log_ratios(*paired(ok, base_rows, "samples_per_s", key)))


def position_effect(per_model: pd.DataFrame, key: str = "round",
                    level: float = 0.95) -> tuple[float, float, float]:
    """First in its round vs later, over all variants of one model: the ratio of a trial's
    throughput when it ran first to its throughput at a later position, with a t interval over
    rounds. Each trial's log throughput less its variant's mean; per round, the first trial's
    residual less the mean of the others' (the round's own speed cancels). Balanced orders make
    it unbiased. NaN without positions or below two rounds."""
    nan = (math.nan,) * 3
    if "position" not in per_model or not len(per_model):
        return nan
    ok = per_model[(per_model["status"] == OK)
                   & (pd.to_numeric(per_model["samples_per_s"], errors="coerce") > 0)]
    ok = ok.assign(log=np.log(pd.to_numeric(ok["samples_per_s"])),
                   pos=pd.to_numeric(ok["position"], errors="coerce")).dropna(subset=["pos"])
    if ok.empty:
        return nan
    res = ok["log"] - ok.groupby("variant")["log"].transform("mean")
    first = ok["pos"] == ok.groupby(key)["pos"].transform("min")
    by_round = res.groupby([ok[key], first]).mean().unstack()
    d = (by_round[True] - by_round[False]).dropna().to_numpy(float) \
        if {True, False} <= set(by_round.columns) else np.array([])
    if len(d) < 2:
        return nan
    half = t_quantile(level, len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return math.exp(d.mean()), math.exp(d.mean() - half), math.exp(d.mean() + half)


# A position effect is worth a warning when its CI excludes 1 and it exceeds this (2 %).
POSITION_MATERIAL = 0.02


def summarised(run):
    """A loaded run (results.runs.Run) with its summary: summary.csv as the run wrote it, or,
    where the reader could not use that file, recomputed from the run's trials."""
    if run.summary is None:
        # a recipe search adjusts each of its measurements on its own
        run.summary = summarise(run.trials, per_experiment=run.recipe_search)
        from speedbench.analysis import quality  # it builds on this module
        bench = run.cfg.get("bench") if isinstance(run.cfg.get("bench"), dict) else {}
        run.summary = quality.attach(run.summary, run.quality,
                                     bench.get("quality_tolerance", quality.TOLERANCE))
    return run


MEMORY_SPLIT = ("state_mem_mb", "params_mem_mb", "grads_mem_mb", "opt_state_mem_mb",
                "activation_mem_mb")


def _medians(g: pd.DataFrame, ok: pd.DataFrame) -> dict:
    """A variant's medians over its ok trials, and their spread."""
    def median(col: str) -> float:
        return ok[col].median() if len(ok) else math.nan

    med = {"samples_per_s": median("samples_per_s"), "step_ms": median("step_ms"),
           "cv": _cv(ok["samples_per_s"]), "spread": spread(ok["samples_per_s"]),
           "unsteady": _unsteady(ok), "data_wait_frac": median("data_wait_frac"),
           "peak_mem_mb": median("peak_mem_mb"), "host_rss_mb": median("host_rss_mb"),
           "final_loss": median("final_loss")}
    for col in MEMORY_SPLIT:  # the memory split, when recorded
        if col in ok:
            med[col] = pd.to_numeric(ok[col], errors="coerce").median()
    if "peak_phase" in ok and ok["peak_phase"].notna().any():
        med["peak_phase"] = ok["peak_phase"].dropna().mode().iloc[0]
    # A variant stopped early keeps the step time it measured before it stopped.
    slow = g[stopped_early(g["status"])]
    measured = ok if len(ok) else slow
    if not len(ok) and len(slow):
        med["samples_per_s"] = pd.to_numeric(slow.get("samples_per_s"), errors="coerce").median()
        med["step_ms"] = pd.to_numeric(slow.get("step_ms"), errors="coerce").median()
    if "probe_samples_per_s" in measured:  # the too-slow rule's throughput
        med["probe_samples_per_s"] = pd.to_numeric(measured["probe_samples_per_s"],
                                                   errors="coerce").median()
    return med


def _speedup(row: dict, ok: pd.DataFrame, base_rows: pd.DataFrame, key: str, level: float,
             threshold: float, floor: int = 0) -> dict:
    """The paired speed-up over the baseline, its CI and verdict, and the rounds behind it."""
    speed, rounds = (math.nan,) * 3, 0
    if row["is_baseline"]:
        speed = (1.0, math.nan, math.nan) if len(ok) else speed
        verdict = BASELINE if len(ok) else _short(row["status"])
        rounds = int(ok[key].nunique()) if len(ok) else 0
    elif len(ok) and len(base_rows):
        a, b = paired(ok, base_rows, "samples_per_s", key)
        rounds = len(paired_log_ratios(a, b))
        speed = paired_ratio_ci(a, b, level)
        verdict = classify(*speed, threshold=threshold) if rounds >= floor else SCREENING
    elif stopped_early(pd.Series([row["status"]])).iloc[0] and len(base_rows):
        verdict, speed = STOPPED_SLOWER, (_probe_ratio(row, base_rows), math.nan, math.nan)
    else:
        verdict = _short(row["status"]) if not len(ok) else "no baseline"
    return {"rounds": rounds, "verdict": verdict, "speedup": speed[0], "speedup_lo": speed[1],
            "speedup_hi": speed[2], "ci_halfwidth": relative_halfwidth(speed[1], speed[2]),
            "min_detectable": (min_detectable(speed[1], speed[2], threshold)
                               if verdict == INCONCLUSIVE else math.nan),
            "noise_threshold": threshold}


def _probe_ratio(row: dict, base_rows: pd.DataFrame) -> float:
    """A stopped variant's measured speed-up: its probe's steady throughput over the
    baseline's (NaN where the run did not record them)."""
    if "probe_samples_per_s" not in base_rows:
        return math.nan
    base = pd.to_numeric(base_rows["probe_samples_per_s"], errors="coerce").median()
    return row.get("probe_samples_per_s", math.nan) / base if base > 0 else math.nan


def _mem_ratio(ok: pd.DataFrame, base_rows: pd.DataFrame, key: str, level: float) -> dict:
    """Peak memory over the baseline's, paired by round, at the run's adjusted level."""
    out = dict.fromkeys(("mem_ratio", "mem_ratio_lo", "mem_ratio_hi"), math.nan)
    if not len(ok) or not len(base_rows):
        return out
    a, b = paired(ok, base_rows, "peak_mem_mb", key)
    if len(paired_log_ratios(a, b)):
        out["mem_ratio"], out["mem_ratio_lo"], out["mem_ratio_hi"] = paired_ratio_ci(a, b, level)
    return out


def _cv(values: pd.Series) -> float:
    """Coefficient of variation of the trials' throughput (spread relative to the mean)."""
    if len(values) < 2:
        return math.nan
    return float(values.std(ddof=1) / values.mean())


# torch.utils.benchmark warns when a measurement's IQR exceeds 10 % of its median.
SPREAD_WARN = 0.1


def spread(values: pd.Series) -> float:
    """Interquartile range of the trials' throughput relative to its median (NaN below 2)."""
    v = pd.Series(values, dtype=float).dropna()
    if len(v) < 2 or not v.median() > 0:
        return math.nan
    return float((v.quantile(0.75) - v.quantile(0.25)) / v.median())


def _unsteady(ok: pd.DataFrame) -> int:
    """How many trials timed their window without their warm-up having found a steady step time."""
    if "warmup_steady" not in ok:
        return 0
    return int(ok["warmup_steady"].astype(str).str.lower().isin(["false", "0"]).sum())


def _flops(ok: pd.DataFrame, step_ms: float) -> dict:
    """FLOPs per step, achieved TFLOP/s at the median step time, the measured peak, the fraction."""
    out = dict.fromkeys(("flops_per_step", "achieved_tflops", "peak_tflops", "peak_fraction"),
                        math.nan)
    if "flops_per_step" in ok and ok["flops_per_step"].notna().any():
        out["flops_per_step"] = float(ok["flops_per_step"].dropna().iloc[0])
        out["achieved_tflops"] = out["flops_per_step"] / (step_ms / 1000) / 1e12
    if "peak_tflops" in ok and ok["peak_tflops"].notna().any():
        out["peak_tflops"] = float(ok["peak_tflops"].dropna().median())
        if out["peak_tflops"] > 0:
            out["peak_fraction"] = out["achieved_tflops"] / out["peak_tflops"]
    return out


def spread_warnings(summary: pd.DataFrame) -> list[str]:
    """Warnings about trials too noisy to trust, or timed before a steady state was found."""
    noisy, unsteady = [], []
    for r in summary.itertuples():
        s = float(getattr(r, "spread", math.nan))
        if s > SPREAD_WARN:
            noisy.append(f"{r.model}/{r.variant} {s:.0%}")
        n = float(getattr(r, "unsteady", 0))
        if n > 0:
            unsteady.append(f"{r.model}/{r.variant} {int(n)} of {int(r.trials)}")
    lines = _position_warnings(summary)
    if noisy:
        lines.append(f"WARNING: trial spread (IQR/median of samples/s) over {SPREAD_WARN:.0%}: "
                     + ", ".join(noisy) + ". Something else may be using the machine, or the "
                     "window is too short: add bench.repeats or bench.steps, or raise "
                     "bench.time_budget_s so that more rounds fit.")
    if unsteady:
        lines.append("WARNING: trials timed before warm-up found a steady step time: "
                     + ", ".join(unsteady)
                     + " (bench.warmup_max or the trial's time cap came first).")
    return lines


# A stalled window: its stall (trials.csv's stall_ms, measure/timing.stall_ms: one step far
# outside the window's own distribution) cost over this share of the window's time.
STALL_SHARE = 0.10
STALLS_NAMED = 3  # the note names this many stalled windows, the largest first


def stalled_windows(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials whose window stalled (stall_ms over STALL_SHARE of elapsed_s), the largest
    share first, with that share (`stall_share`); none in a run without stall_ms."""
    if trials is None or "stall_ms" not in trials or "elapsed_s" not in trials:
        return pd.DataFrame()
    stall = pd.to_numeric(trials["stall_ms"], errors="coerce") / 1000
    elapsed = pd.to_numeric(trials["elapsed_s"], errors="coerce")
    share = stall / elapsed.where(elapsed > 0)
    hit = trials.assign(stall_ms=1000 * stall, stall_share=share)[share > STALL_SHARE]
    return hit.sort_values("stall_share", ascending=False, kind="stable")


def stall_note(trials: pd.DataFrame) -> str | None:
    """One line naming the stalled windows (model/variant, round, ms lost and share of the
    window), with what to do; None when no window stalled."""
    hit = stalled_windows(trials)
    if hit.empty:
        return None
    named = [f"{r.model}/{r.variant} round {_round_of(r)} lost {r.stall_ms:.0f} ms in one "
             f"step ({100 * r.stall_share:.0f} % of its window)"
             for r in hit.head(STALLS_NAMED).itertuples()]
    more = f", and {len(hit) - STALLS_NAMED} more" if len(hit) > STALLS_NAMED else ""
    head, its = ("A window stalled", "its figures are") if len(hit) == 1 \
        else (f"{len(hit)} windows stalled", "their figures are")
    return (f"{head}: " + "; ".join(named) + f"{more}; {its} noisy (a pause of the process or "
            "the machine, far outside the trial's own step times). Measure again, on a quiet "
            "machine, for figures to rely on.")


def _round_of(row) -> str:
    value = getattr(row, "round", getattr(row, "trial", math.nan))
    number = pd.to_numeric(pd.Series([value]), errors="coerce").iloc[0]
    return str(int(number)) if pd.notna(number) else "?"


def _position_warnings(summary: pd.DataFrame) -> list[str]:
    """A warning for each model whose first-in-round trials ran materially faster or slower."""
    if "position_effect" not in summary:
        return []
    hit = []
    for (model,), r in summary.groupby(["model"], sort=False):
        effect, lo, hi = (float(pd.to_numeric(r[c], errors="coerce").iloc[0])
                          for c in ("position_effect", "position_lo", "position_hi"))
        if (lo > 1 or hi < 1) and abs(math.log(effect)) > math.log1p(POSITION_MATERIAL):
            hit.append(f"{model} {effect:.3f}x [{lo:.3f}, {hi:.3f}]")
    if not hit:
        return []
    return ["WARNING: the first trial of a round ran at a different speed from the later ones "
            "(first vs later, 95 % CI): " + ", ".join(hit) + ". The balanced orders keep the "
            "speed-ups unbiased, but the machine is warming up, cooling down or carrying state "
            "from one trial to the next: a longer bench.warmup may help."]


METHOD = ("Speed-up = geometric mean of the per-round ratios of a variant's throughput to the "
          "baseline's in the same round, with a Student t interval over rounds, "
          "Bonferroni-adjusted for every comparison of the run and for the looks of adaptive "
          "rounds (rounds stop at a look once every comparison is decided; each look spends a "
          "Pocock-type share of the error). faster / slower: the interval "
          "excludes 1 and the estimate exceeds the noise threshold; equivalent: the interval "
          "lies within +-threshold; inconclusive: anything else.")


def family_text(summary: pd.DataFrame) -> str:
    """The report's sentence on error control and on the loss column."""
    parts = []
    if summary is not None and "comparisons" in summary and len(summary):
        m = int(pd.to_numeric(summary["comparisons"], errors="coerce").fillna(0).max())
        fam = float(pd.to_numeric(summary["family_level"], errors="coerce").dropna().iloc[0]) \
            if summary["family_level"].notna().any() else FAMILY_LEVEL
        thr = pd.to_numeric(summary.get("noise_threshold"), errors="coerce").dropna()
        scope = summary["family_scope"].dropna() if "family_scope" in summary else pd.Series()
        if len(scope) and (scope == "allotted").any():
            family = ("The run's 5 % family-wise error was shared out before anything was "
                      "measured (a recipe search's measurements, the findings' checks: "
                      "docs/experiments.md); each CI is at the level of its share, Bonferroni-"
                      "adjusted over its measurement's comparisons (ci_level in summary.csv), "
                      f"so the chance of any false faster/slower call in the whole run is at "
                      f"most {FAMILY_LEVEL:.0%}. ")
        elif len(scope) and (scope == "experiment").all():
            family = (f"Each experiment of this run is its own family (a recipe search's "
                      f"measurements are separate decisions; up to {m} comparisons in one): its "
                      f"CIs are Bonferroni-adjusted over its own comparisons, so the chance of "
                      f"any false faster/slower call in one experiment is at most {fam:.0%}. ")
        else:
            family = (f"{m} comparison{'' if m == 1 else 's'} in this run; each CI is at level "
                      f"{_levels_text(summary, m, fam)}, so the chance of any false "
                      f"faster/slower call in the whole run is at most {fam:.0%}. ")
        parts.append(
            family + "Noise threshold: "
            f"{(thr.iloc[0] if len(thr) else DEFAULT_THRESHOLD):.0%}. An inconclusive row "
            "gives the smallest effect the run could have detected (min_detectable in "
            "summary.csv).")
    parts.append(LOSS_MEANING)
    return " ".join(parts)


def _levels_text(summary: pd.DataFrame, m: int, fam: float) -> str:
    """The CIs' level: one Bonferroni level, or the range the looks of adaptive rounds gave."""
    levels = pd.to_numeric(summary.get("ci_level"), errors="coerce").dropna()
    low, high = (levels.min(), levels.max()) if len(levels) else (comparison_level(m, fam),) * 2
    if math.isclose(low, high, abs_tol=1e-9):
        return f"{low:.2%} (Bonferroni)"
    return (f"{low:.2%} to {high:.2%} (Bonferroni over the comparisons and over the looks of "
            "the adaptive rounds: each look spends its share of the error, so the interval of "
            "the look a comparison stopped at keeps its level)")


# What the loss columns mean (the quality probe, measure/quality.py; analysis/quality.py)
LOSS_MEANING = ("Held-out loss = the quality probe's: each variant trains fresh models from "
                "bench.quality_seeds paired seeds (the same weights and data order for every "
                "variant in a seed) for the same number of samples seen (bench.quality_steps "
                "optimizer steps of the baseline), then evaluates them on held-out data in fp32; "
                "the median over seeds is shown. Loss ratio = the geometric mean of the per-seed "
                "ratios to the baseline's loss, with a t CI at the Bonferroni level of the run's "
                "quality comparisons. Quality: non-inferior when the CI's upper end is at most "
                "1 + bench.quality_tolerance, worse when its lower end is above it, else "
                "inconclusive; identical numerics give exactly 1. A few steps judge whether a "
                "technique breaks training, not how well it trains in the end: time to target "
                "(target.enabled=true) judges that. loss Δ is the difference from the "
                "baseline's first-seed loss.")
