"""summary.csv's rows (`summarise`): medians, the paired speed-up with its CI and verdict per
(model, variant); analysis/intervals.py is the engine. `summary_of` makes the whole file, the
one way both the run (run.py) and a report rebuilt from trials.csv (`summarised`) make it: the
speed verdicts, the scaling efficiency, the quality verdicts (analysis/quality.py).

Scaling efficiency of data-parallel variants (`add_efficiency`), how close N devices come to N
times one: efficiency = throughput / (devices x the single-device baseline's throughput), which
is the speed-up over that baseline divided by the devices; its CI is the speed-up's CI divided
likewise. 1.0 is perfect scaling. Defined only when the baseline runs on one device (under
torchrun every variant spans all ranks, so there is no single-device reference and the column is
empty).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from speedbench.analysis import energy, quality
from speedbench.analysis.intervals import (
    BASELINE, FAMILY_LEVEL, INCONCLUSIVE, NO_CI, SCREENING, Looks, classify, count_comparisons,
    min_detectable, pair_key, paired, paired_log_ratios, paired_ratio_ci, reference_rows,
    relative_halfwidth,
    stopped_early, t_quantile, threshold_of)
from speedbench.results.schema import NOT_MEASURED, OK, STOPPED_SLOWER, parse_status


def _short(status: str) -> str:
    """`n/a`, `error`, `oom`, `diverged`: the kind of a failure, for the verdict column."""
    return status.split(":")[0]


def status_of(statuses: pd.Series) -> str:
    """`ok` when any trial measured; otherwise the most common failure."""
    if (statuses == OK).any():
        return OK
    return statuses.mode().iloc[0]


def summarise(trials: pd.DataFrame, family: float = FAMILY_LEVEL,
              per_experiment: bool = False,
              levels: dict[tuple[str, str], float] | None = None) -> pd.DataFrame:
    """One row per (model, variant): medians over ok trials, the paired speed-up over the
    baseline with its family-wise adjusted CI at the level of the look its rounds stopped at,
    the verdict (a recipe search's screen, fewer rounds than the run's floor: `screening`),
    and the rounds behind it.

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
        first, looks, every = _schedule(per_model)
        plan = Looks(comparisons, first, looks, family, every)
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
                   "is_baseline": bool(g["is_baseline"].iloc[0]), "status": status_of(g["status"]),
                   "trials": len(ok), **_medians(g, ok), **_arm_of(g)}
            ref = reference_rows(per_model, g, base_rows)  # the baseline, or its arm's
            level = fixed if fixed is not None else plan.level(_rounds_paired(ok, ref, key))
            row.update(_mem_ratio(ok, ref, key, level))
            row["loss_delta"] = row["final_loss"] - (
                ref["final_loss"].median() if ref is not base_rows and len(ref) else base_loss)
            row.update(_speedup(row, ok, ref, key, level, threshold_of(g),
                                floor if fixed is not None else None))
            row.update(energy.paired_energy(ok, ref, key, level, threshold_of(g),
                                            row["is_baseline"]))
            row["comparisons"], row["family_level"], row["ci_level"] = comparisons, family, level
            row["family_scope"] = "allotted" if (experiment, model) in levels else \
                "experiment" if per_experiment else "run"
            row.update(_flops(ok, row["step_ms"]))
            rows.append({**row, **position})
    return pd.DataFrame(rows)


def _arm_of(g: pd.DataFrame) -> dict:
    """An A/B's `arm` and `reference` of a variant (config/arms.py); nothing without."""
    if "arm" not in g or not g["arm"].notna().any():
        return {}
    return {c: str(g[c].iloc[0]) if c in g and pd.notna(g[c].iloc[0]) else ""
            for c in ("arm", "reference")}


def _schedule(per_model: pd.DataFrame) -> tuple[int, int, int]:
    """(min_rounds, looks, look_every) the rounds loop recorded (trials.csv; the first round's
    rows have no `looks` yet when it was planned after them); (1, 1, 1), one look, without. A
    run written before `look_every` looked every min_rounds rounds."""
    def most(col: str) -> int:
        got = pd.to_numeric(per_model[col], errors="coerce").dropna() \
            if col in per_model else pd.Series(dtype=float)
        return int(got.max()) if len(got) else 0
    first = max(1, most("min_rounds"))
    return first, max(1, most("looks")), max(1, most("look_every") or first)


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


def summary_of(trials: pd.DataFrame, quality_rows: pd.DataFrame | None,
               tolerance: float = quality.TOLERANCE, family: float = FAMILY_LEVEL,
               per_experiment: bool = False,
               levels: dict[tuple[str, str], float] | None = None) -> pd.DataFrame:
    """summary.csv's rows: the speed verdicts (`summarise`, with `family`, `per_experiment` and
    `levels` as there), the scaling efficiency (`add_efficiency`) and the quality verdicts of
    quality.csv's rows at `tolerance` (quality.attach; none without quality.csv)."""
    summary = summarise(trials, family, per_experiment=per_experiment, levels=levels)
    return quality.attach(add_efficiency(summary, trials), quality_rows, tolerance)


def summarised(run):
    """A loaded run (results.runs.Run) with its summary: summary.csv as the run wrote it, or,
    where the reader could not use that file, recomputed from the run's trials and quality.csv
    as the run makes it (`summary_of`)."""
    if run.summary is None:
        bench = run.cfg.get("bench") if isinstance(run.cfg.get("bench"), dict) else {}
        # a recipe search adjusts each of its measurements on its own
        run.summary = summary_of(run.trials, run.quality,
                                 bench.get("quality_tolerance", quality.TOLERANCE),
                                 per_experiment=run.recipe_search)
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
           "final_loss": median("final_loss"),
           "rss_growth_mb": median("rss_growth_mb") if "rss_growth_mb" in ok else math.nan}
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
    if "budget_need_s" in g:  # the most any of its rows needs (the plan's, its probe's)
        med["budget_need_s"] = pd.to_numeric(g["budget_need_s"], errors="coerce").max()
    # the probe's throughput, and a stopped variant's probe test (stopping.py)
    for col in ("probe_samples_per_s", "probe_speedup", "probe_speedup_lo", "probe_speedup_hi"):
        if col in g:
            med[col] = pd.to_numeric((measured if len(measured) else g)[col],
                                     errors="coerce").median()
    return med


def _speedup(row: dict, ok: pd.DataFrame, base_rows: pd.DataFrame, key: str, level: float,
             threshold: float, floor: int | None = None) -> dict:
    """The paired speed-up over the baseline, its CI and verdict, and the rounds behind it."""
    speed, rounds, round_sd = (math.nan,) * 3, 0, math.nan
    if row["is_baseline"]:
        speed = (1.0, math.nan, math.nan) if len(ok) else speed
        verdict = BASELINE if len(ok) else _short(row["status"])
        rounds = int(ok[key].nunique()) if len(ok) else 0
    elif len(ok) and len(base_rows):
        a, b = paired(ok, base_rows, "samples_per_s", key)
        logs = paired_log_ratios(a, b)
        rounds = len(logs)
        round_sd = float(np.std(logs, ddof=1)) if rounds >= 3 else math.nan
        speed = paired_ratio_ci(a, b, level)
        # a recipe search's screen (its level allotted, fewer rounds than the run's floor)
        # ranks options; it decides nothing
        screen = floor is not None and rounds < floor
        verdict = SCREENING if screen else NO_CI if rounds < 2 else \
            classify(*speed, threshold=threshold)
    elif stopped_early(pd.Series([row["status"]])).iloc[0] and len(base_rows):
        verdict, speed = STOPPED_SLOWER, _probe_ratio(row, base_rows)
    elif parse_status(row["status"]).kind == NOT_MEASURED:
        # a limit stopped it: no call and no speed-up (its probe's unpaired ratio, a moment's
        # load as much as the recipe, stays in probe_speedup)
        verdict = NOT_MEASURED
    else:
        verdict = _short(row["status"]) if not len(ok) else "no baseline"
    return {"rounds": rounds, "verdict": verdict, "speedup": speed[0], "speedup_lo": speed[1],
            "speedup_hi": speed[2], "window_speedup": _window_ratio(row, ok, base_rows, key),
            "ci_halfwidth": relative_halfwidth(speed[1], speed[2]),
            "min_detectable": (min_detectable(speed[1], speed[2], threshold)
                               if verdict == INCONCLUSIVE else math.nan),
            "noise_threshold": threshold, "round_sd": round_sd,
            "others_cpu_share": _others_share(ok, base_rows)}


def _others_share(ok: pd.DataFrame, base_rows: pd.DataFrame) -> float:
    """The most CPU other processes took while a trial of the row or of its baseline ran
    (trials.csv's others_cpu_share; NaN where the run did not record it)."""
    got = [pd.to_numeric(f["others_cpu_share"], errors="coerce") for f in (ok, base_rows)
           if "others_cpu_share" in f and len(f)]
    values = pd.concat(got).dropna() if got else pd.Series(dtype=float)
    return float(values.max()) if len(values) else math.nan


def _window_ratio(row: dict, ok: pd.DataFrame, base_rows: pd.DataFrame, key: str) -> float:
    """The speed-up of the windows' mean steps (window_samples_per_s, paired by round), beside
    the typical step's: where they part, slow steps the typical step leaves out (stalls,
    periodic work) weigh on the window. NaN without the column or a pair."""
    if row["is_baseline"] or "window_samples_per_s" not in ok or not len(ok) \
            or not len(base_rows):
        return math.nan
    return paired_ratio_ci(*paired(ok, base_rows, "window_samples_per_s", key))[0]


def _probe_ratio(row: dict, base_rows: pd.DataFrame) -> tuple[float, float, float]:
    """A stopped variant's measured speed-up and interval: its probe test's (stopping.py),
    else its probe's steady throughput over the baseline's, no interval (NaN where the run
    recorded neither)."""
    test = tuple(row.get(f"probe_speedup{end}", math.nan) for end in ("", "_lo", "_hi"))
    if test[0] == test[0]:
        return test
    if "probe_samples_per_s" not in base_rows:
        return math.nan, math.nan, math.nan
    base = pd.to_numeric(base_rows["probe_samples_per_s"], errors="coerce").median()
    point = row.get("probe_samples_per_s", math.nan) / base if base > 0 else math.nan
    return point, math.nan, math.nan


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
