"""The report's prose on how a run was measured and what to trust: the method (`METHOD`), the
error control and the loss columns (`family_text`), and the warnings about noisy rounds
(judged on the paired per-round spread against the quiet machine's, blaming a load only where
the run recorded one), unsteady or stalled trials. The figures they name are analysis's (summary.csv; analysis/intervals.py)."""
from __future__ import annotations

import math

import pandas as pd

from speedbench.analysis.intervals import (BURST_OVER, DEFAULT_THRESHOLD, FAMILY_LEVEL, LOOKS,
                                           MAX_LOOKS, burst_rounds, comparison_level,
                                           pair_key, reference_rows)
from speedbench.analysis.numbers import ratio_text
from speedbench.analysis.power import NOISY_LEVEL, QUIET_ROUND_SD, noisier_than_quiet
from speedbench.results.schema import FORMAT_VERSION, OK


# The one statement of the rounds' stopping rule (adaptive.wants_more_rounds) in the report.
METHOD = ("Speed-up = geometric mean of the per-round ratios of a variant's throughput to the "
          "baseline's in the same round, with a Student t interval over rounds, "
          "Bonferroni-adjusted for every comparison of the run and for the looks of adaptive "
          f"rounds (with bench.target_ci: {LOOKS} looks, up to {MAX_LOOKS} where the model's "
          "budget fits more, the first after bench.repeats rounds, the later ones spread over "
          "the model's share of the run's budget; "
          "at a look the rounds stop once every comparison is decided or its CI's relative "
          "half-width is at most bench.target_ci; otherwise they go on while a round fits in "
          "the model's share of the run's bench.time_budget_s, and rounds that end between two "
          "looks are reported at the next look's level; each look spends a Pocock-type share "
          "of the error). faster / slower: the interval "
          "excludes 1 and the estimate exceeds the noise threshold; equivalent: the interval "
          "lies within +-threshold; inconclusive: anything else.")


# The one statement of which calls the 5 % covers (README.md says the same: tests/test_report.py)
FAMILIES = ("Three families, each with a family-wise error of at most "
            f"{100 * FAMILY_LEVEL:g} % over its own comparisons (Bonferroni): the speed calls "
            "(the rounds' faster, slower and equivalent, and the quality probes' early stops, "
            "slower (stopped early), which spend part of the same error), the quality verdicts "
            "(non-inferior, worse), and the time-to-target verdicts (faster, slower, "
            "equivalent; a missed target has no interval, reported outside the family). Any "
            f"false call among all three: at most {300 * FAMILY_LEVEL:g} %.")


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
                      f"so the chance of any false speed call in the whole run is at most "
                      f"{FAMILY_LEVEL:.0%}. ")
        elif len(scope) and (scope == "experiment").all():
            family = (f"Each experiment of this run is its own family (a recipe search's "
                      f"measurements are separate decisions; up to {m} comparisons in one): its "
                      f"CIs are Bonferroni-adjusted over its own comparisons, so the chance of "
                      f"any false speed call in one experiment is at most {fam:.0%}. ")
        else:
            family = (f"{m} speed comparison{'' if m == 1 else 's'} in this run; each CI is at "
                      f"level {_levels_text(summary, m, fam)}, so the chance of any false "
                      f"speed call in the whole run is at most {fam:.0%}. ")
        parts.append(
            family + FAMILIES + " Noise threshold: "
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


# What the loss columns mean (the quality probe, studies/quality.py; analysis/quality.py)
LOSS_MEANING = ("Held-out loss = the quality probe's (nats): each variant trains fresh models "
                "from bench.quality_seeds paired seeds (the same weights and data order for "
                "every variant in a seed) for the same number of samples seen "
                "(bench.quality_steps optimizer steps of the baseline), then evaluates them on "
                "held-out data in fp32, BatchNorm's statistics recalibrated on training samples "
                "first; the median over seeds is shown. Each seed is also evaluated before its "
                "first step: the baseline must beat that step-0 loss, and chance where the task "
                "has one, by 0.05 nats in every seed, else no variant gets a quality verdict "
                "(the row says which bench.quality_steps should do). Learning lost = per seed, "
                "the variant's loss less the baseline's over what the baseline learned (its "
                "step-0 loss less its loss), in nats over nats, averaged over the seeds with a "
                "t CI at the Bonferroni level of the run's quality comparisons: 0 for the same "
                "loss, 1 for a recipe that learned nothing. Quality: non-inferior when the CI's "
                "upper end is at most bench.quality_tolerance (5 % of the baseline's learning), "
                "worse when its lower end is above it, else inconclusive; identical numerics "
                "give exactly 0 (loss ratio 1). A few steps judge whether a technique breaks "
                "training, not how well it trains in the end: time to target "
                "(target.enabled=true) judges that. loss Δ is the difference from the "
                "baseline's first-seed loss.")


# torch.utils.benchmark warns when a measurement's IQR exceeds 10 % of its median; the trials'
# unpaired spread (summary.csv's `spread`) stays a column, but no warning judges it: the rounds'
# level cancels in the paired ratios the verdicts use, and a bare hand-written loop on a quiet
# machine is over 10 % in a third of rows (measurement audit 5).
SPREAD_WARN = 0.1


# A position effect is worth a warning when its CI excludes 1 and it exceeds this (2 %).
POSITION_MATERIAL = 0.02


def noisy_rows(summary: pd.DataFrame) -> list[str]:
    """`model/variant sd 0.42 (6 rounds)` for each row whose paired per-round log ratios vary
    significantly more than on a quiet machine (power.noisier_than_quiet)."""
    if "round_sd" not in summary:
        return []
    return [f"{r.model}/{r.variant} sd {r.round_sd:.2f} ({int(r.rounds)} rounds)"
            for r in summary.itertuples()
            if noisier_than_quiet(float(r.round_sd), int(getattr(r, "rounds", 0) or 0))]


def load_cause(summary: pd.DataFrame, busy: bool = False) -> str:
    """What the noisy rounds are blamed on: the load, only where the record says so (a trial's
    others_cpu_share over BUSY_TRIAL, or env.json's busy machine), else not."""
    share = pd.to_numeric(summary.get("others_cpu_share"), errors="coerce").max() \
        if "others_cpu_share" in summary else math.nan
    if share > BUSY_TRIAL:
        return (f"other processes were using the machine (up to {share:.0%} of the CPU during "
                "a trial): measure again on a quiet machine")
    if busy:
        return ("other processes were using the machine (env.json's machine load): measure "
                "again on a quiet machine")
    if share == share:
        return (f"no load was recorded (other processes took at most {share:.0%} of the CPU "
                "during a trial): the steps' own variation, or a pause outside the record; more "
                "rounds narrow the interval")
    return "the run recorded no load figure to tell whether another load caused it"


def spread_warnings(summary: pd.DataFrame, busy: bool = False) -> list[str]:
    """Warnings about rounds too noisy to trust, or trials timed before a steady state was
    found. `busy`: env.json's machine_load said the machine was busy."""
    noisy, unsteady = noisy_rows(summary), []
    for r in summary.itertuples():
        n = float(getattr(r, "unsteady", 0))
        if n > 0:
            unsteady.append(f"{r.model}/{r.variant} {int(n)} of {int(r.trials)}")
    lines = _position_warnings(summary) + _tail_warnings(summary)
    if noisy:
        lines.append("WARNING: the paired per-round speed-ups vary more than on a quiet machine "
                     f"(sd of the log ratio over {QUIET_ROUND_SD:.2f}, one-sided "
                     f"{NOISY_LEVEL:.0%}): " + ", ".join(noisy) + "; "
                     + load_cause(summary, busy) + ". The intervals include this noise; add "
                     "bench.repeats or raise bench.time_budget_s so that more rounds fit.")
    if unsteady:
        lines.append("WARNING: trials timed before warm-up found a steady step time: "
                     + ", ".join(unsteady)
                     + " (bench.warmup_max or the trial's time cap came first).")
    return lines


def _tail_warnings(summary: pd.DataFrame) -> list[str]:
    """Rows whose windows' mean-step speed-up parts from the typical step's by more than the
    noise threshold: slow steps (stalls, periodic work) the typical step leaves out."""
    parted = []
    for r in summary.itertuples():
        typical, window = getattr(r, "speedup", math.nan), getattr(r, "window_speedup", math.nan)
        threshold = getattr(r, "noise_threshold", DEFAULT_THRESHOLD)
        if typical > 0 and window > 0 and abs(math.log(window / typical)) > math.log1p(threshold):
            parted.append(f"{r.model}/{r.variant} {ratio_text(typical)} (typical step) against "
                          f"{ratio_text(window)} (window mean)")
    if not parted:
        return []
    return ["WARNING: the speed-up of the windows' mean step parts from that of the typical "
            "step: " + ", ".join(parted) + ". Slow steps weigh on the windows (stalls, work "
            "done every few steps): steps.csv has every step; measure again on a quiet "
            "machine."]


def _position_warnings(summary: pd.DataFrame) -> list[str]:
    """A warning for each model whose first-in-round trials ran materially faster or slower."""
    if "position_effect" not in summary:
        return []
    hit = []
    for (model,), r in summary.groupby(["model"], sort=False):
        effect, lo, hi = (float(pd.to_numeric(r[c], errors="coerce").iloc[0])
                          for c in ("position_effect", "position_lo", "position_hi"))
        if (lo > 1 or hi < 1) and abs(math.log(effect)) > math.log1p(POSITION_MATERIAL):
            hit.append(f"{model} {ratio_text(effect, lo, hi, '.3f')}")
    if not hit:
        return []
    return ["WARNING: the first trial of a round ran at a different speed from the later ones "
            "(first vs later, 95 % CI): " + ", ".join(hit) + ". The balanced orders keep the "
            "speed-ups unbiased, but the machine is warming up, cooling down or carrying state "
            "from one trial to the next: a longer bench.warmup may help."]


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


BUSY_TRIAL = 0.25  # a trial during which other processes took over a quarter of the CPU
BURSTS_LEFT_OUT_SINCE = 6  # the run-directory format whose summaries leave burst rounds out


def busy_trials_note(trials: pd.DataFrame) -> str | None:
    """One line naming the trials other processes slowed (others_cpu_share over BUSY_TRIAL
    while they ran: a burst the run-wide figure dilutes); None when none was."""
    if "others_cpu_share" not in trials or not len(trials):
        return None
    share = pd.to_numeric(trials["others_cpu_share"], errors="coerce")
    hit = trials[share > BUSY_TRIAL]
    if hit.empty:
        return None
    per = hit.groupby(["model", "variant"], sort=False).size()
    named = ", ".join(f"{m}/{v} {n}" for (m, v), n in per.head(STALLS_NAMED).items())
    more = f", and {len(per) - STALLS_NAMED} more" if len(per) > STALLS_NAMED else ""
    # a run of an older format kept those rounds in its summary.csv: no claim that it did not
    version = trials.attrs.get("format_version", FORMAT_VERSION)  # none: this run's own frame
    left = len(left_out_rounds(trials)) if version >= BURSTS_LEFT_OUT_SINCE else 0
    points = f"{100 * BURST_OVER:.0f} points"
    noisier = (f"{left} round(s) that a burst hit (others took over {points} more of the CPU "
               "than in the model's usual round) are left out of the comparisons, and the "
               "rest are noisier" if left else "Their rounds are noisier")
    return (f"{len(hit)} of {len(trials)} trials ran while other processes took over "
            f"{BUSY_TRIAL:.0%} of the CPU (others_cpu_share in trials.csv): {named}{more}. "
            f"{noisier}; measure again on a quiet machine for figures to rely on.")


def left_out_rounds(trials: pd.DataFrame) -> set[tuple]:
    """(model, round) of every round that intervals.burst_rounds leaves out of some paired
    comparison of the run (each variant against its reference)."""
    left: set[tuple] = set()
    if "status" not in trials or "is_baseline" not in trials:
        return left
    ok = trials[trials["status"] == OK]
    for model, group in ok.groupby("model", sort=False):
        key = pair_key(group)
        is_base = group["is_baseline"].astype(bool)
        for _, rows in group[~is_base].groupby("variant", sort=False):
            ref = reference_rows(group, rows, group[is_base])
            both = pd.Index(rows[key].dropna().unique()).intersection(ref[key].dropna().unique())
            left |= {(model, r) for r in burst_rounds(rows, ref, key, both)}
    return left


def trial_notes(trials: pd.DataFrame) -> list[str]:
    """The notes about single trials that open the console and the report: stalled windows,
    trials slowed by other processes."""
    return [n for n in (stall_note(trials), busy_trials_note(trials)) if n]


def _round_of(row) -> str:
    value = getattr(row, "round", getattr(row, "trial", math.nan))
    number = pd.to_numeric(pd.Series([value]), errors="coerce").iloc[0]
    return str(int(number)) if pd.notna(number) else "?"
