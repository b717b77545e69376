"""The results schema: the run directory's format version, every CSV's columns, the step's
phase names, and the one status vocabulary (a typed trial status).

The writers and the reader (results/), the statistics and the report all take these names from
here. Pure Python, no torch: the report imports it.

trials.csv: TRIAL_COLUMNS (the contract columns first, then more), then the columns the
techniques add (`trial_columns(extra)`; speedbench.techniques.column_names()). TRIAL_COLUMNS
are generic: identity and measurements that every trial has, whatever its recipe; a
technique's settings are its own columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# The run directory's format, written into env.json (`format_version`); the reader branches on it.
# A run without one is read as format 1.
#   6: a round that a burst of other processes hit is left out of the paired comparisons
#      (intervals.burst_rounds); summary.csv's figures are without those rounds
#   5: steps.csv (each timed step's time); samples_per_s and step_ms from the window's typical
#      step (timing.typical_step_s), its mean in window_samples_per_s and window_step_ms; a
#      variant a limit stopped is `not measured: ...` (no call), one the probe's far-slower
#      test stopped `too slow: ...` with probe_speedup[_lo, _hi]
#   4: the memory split at the peak (params_mem_mb, grads_mem_mb, opt_state_mem_mb,
#      activation_mem_mb, peak_phase); state_mem_mb counts the gradients (taken before
#      zero_grad). Before, state_mem_mb left the gradients out and activation_mem_mb held them.
#      A variant stopped early (`too slow`, from the probe's steady steps) is a comparison of
#      the family, verdict `slower (stopped early)`; probe_samples_per_s
#   3: trials.csv's `round` and `position` (trials paired by round), techniques.json; the
#      techniques' columns (precision, accumulate, ...) after the generic ones in trials.csv,
#      and none in capacity.csv (its `variant` names the settings)
#   2: profile columns (profile, reference_step_ms, phase_step_ms, ...)
#   1: the first format: trials paired by `trial`
FORMAT_VERSION = 6

# The contract columns come first (in this order); more follow.
TRIAL_COLUMNS = [
    "experiment", "model", "variant", "is_baseline", "trial", "status", "device", "world_size",
    "samples_per_s", "step_ms", "data_wait_frac", "peak_mem_mb", "final_loss",
    "host_rss_mb", "host_rss_main_mb", "steps", "warmup_steps", "batch_size",
    "elapsed_s", "host_reads", "omp_num_threads", "torch_threads",
    # profile != off (profile.py): the mode; step times in an unprofiled reference window, with
    # phase syncs, and under the mode's profiler; that profiler's overhead over the reference
    "profile", "reference_step_ms", "phase_step_ms", "profiled_step_ms", "profile_overhead",
    "devices", "rank_step_ms",
    "warmup_steady", "flops_per_step", "achieved_tflops", "peak_tflops",
    # rounds (studies/rounds.py): `round` runs every variant of a model once, in a balanced
    # random order drawn from `order_seed`; `position` is the trial's place in its round (0
    # first). `trial` == `round`. The group-sequential schedule: bench.repeats, the floor
    # (`min_rounds`) and the first look; then a look every `look_every` rounds (last column),
    # `looks` at most (adaptive.wants_more_rounds).
    "round", "position", "order_seed", "min_rounds", "looks",
    # verdicts (summary.py, quality.py, timing.step_memory): the run's noise threshold; the
    # quality probe's first-step time, length and samples (final_loss is its loss; window_loss
    # the timed window's mean, for reference); parameters + gradients + optimizer state, and
    # the peak tensor memory split at the peak into those and the rest (activations,
    # temporaries); the peak's kind (FLOPs)
    "noise_threshold", "first_step_ms", "second_step_ms", "quality_steps", "quality_samples", "window_loss",
    "state_mem_mb", "activation_mem_mb", "peak_kind",
    "params_mem_mb", "grads_mem_mb", "opt_state_mem_mb", "peak_phase",
    # the quality probe's steady throughput, and a variant's speed over the baseline's from
    # their steady probe steps with the far-slower test's interval (studies/stopping.py; set
    # where a probe stopped it)
    "probe_samples_per_s", "probe_speedup", "probe_speedup_lo", "probe_speedup_hi",
    # the timed window's stall (timing.stall_ms): its longest step's excess over its median
    # step, in ms, where that step took over 5x the median; else 0 (NaN: not measured)
    "stall_ms",
    # the window's mean step and its throughput (samples_per_s and step_ms come from the
    # window's typical step: timing.typical_step_s of its steps' times, steps.csv)
    "window_samples_per_s", "window_step_ms",
    # the share of the machine's CPU other processes used while the trial ran (env.CpuWindow):
    # a burst of other work shows in the trials it slowed
    "others_cpu_share",
    # under torchrun on the CPU (no tensor peak there): the largest rank's process RSS growth
    # over the trial, in MB, never compared with a tensor peak
    "rss_growth_mb",
    # the rounds between two later looks of the group-sequential rounds (intervals.look_spacing:
    # bench.repeats, or more where the model's budget fits more rounds)
    "look_every",
    # an A/B of environments (config/arms.py): the variant's arm, and the variant it is
    # compared with (empty: the baseline)
    "arm", "reference",
    # the timed window's energy from a hardware counter (measure/energy.py: NVML, RAPL), per
    # sample, and `ok` or `n/a: no energy counter here (<reason>)`: never an estimate
    "energy_j", "energy_per_sample_j", "energy_status",
    # the bench.time_budget_s the run's plan gives it (costs.run_budget_figure: a verdict on
    # 1.1x on every model, every variant's two rounds), or, where its probe stopped it for time,
    # what would measure it (stopping.budget_status); the run's one figure is their largest
    # (recommend.more_budget). NaN: none known
    "budget_need_s",
    # a trial over several processes that speedbench launched through torchrun (launch.py):
    # the launch's wall seconds, its start-up, rendezvous, data and exit beside the trial
    # itself (empty for a trial in this process)
    "launch_s",
]
# The contract: every trials.csv has these (experiment ... final_loss); a reader notes the ones
# an older run lacks.
REQUIRED_TRIAL_COLUMNS = TRIAL_COLUMNS[:13]
SUMMARY_COLUMNS = [
    "experiment", "model", "variant", "is_baseline", "status", "samples_per_s", "speedup",
    "speedup_lo", "speedup_hi", "verdict", "trials", "step_ms", "cv", "data_wait_frac",
    "peak_mem_mb", "mem_ratio", "host_rss_mb", "final_loss", "loss_delta",
    "spread", "unsteady", "flops_per_step", "achieved_tflops", "peak_tflops", "peak_fraction",
    "rss_growth_mb",
    # verdicts (summary.py): paired rounds, the CI's relative half-width, the smallest effect an
    # inconclusive row could have shown, the threshold, and the family the CIs are adjusted for
    "rounds", "ci_halfwidth", "min_detectable", "noise_threshold", "comparisons",
    # the speed-up of the windows' mean steps, beside the typical step's (summary.py)
    "window_speedup",
    # the paired per-round sd of the log speed-up (what its CI is made of; the noise warning
    # judges it), and the most CPU other processes took during the row's or baseline's trials
    "round_sd", "others_cpu_share",
    "family_level", "ci_level", "family_scope", "state_mem_mb", "activation_mem_mb",
    "params_mem_mb", "grads_mem_mb", "opt_state_mem_mb", "peak_phase", "probe_samples_per_s",
    # the model's first-in-round throughput over its later trials' (summary.position_effect)
    "position_effect", "position_lo", "position_hi",
    # the quality probe's held-out loss over its seeds, its paired ratio to the baseline's, what
    # the baseline learned (nats) and the share of it the variant lost, with the CI the
    # verdict is judged on (analysis/quality.py)
    "quality_loss", "quality_seeds", "loss_ratio", "learned_nats", "learning_lost",
    "learning_lost_lo", "learning_lost_hi", "quality_level", "quality_tolerance",
    "quality_tolerance_nats", "quality_verdict",
    # an A/B of environments: the variant's arm and what it is compared with (trials.csv's)
    "arm", "reference",
    # the largest bench.time_budget_s its rows need (trials.csv's budget_need_s)
    "budget_need_s",
    # joules per sample (the trials' median), over the baseline's paired by round with the
    # speed-up's level, and the verdict in energy's words or the trials' n/a (analysis/energy.py)
    "energy_per_sample_j", "energy_ratio", "energy_ratio_lo", "energy_ratio_hi", "energy_verdict",
]
# The parts of one optimizer step the phase clock times (train.Trainer.step), in step order.
PHASES = ("data", "h2d", "forward", "backward", "optimizer", "other")
PHASE_COLUMNS = ["experiment", "model", "variant", "phase", "mean_ms", "total_ms", "share"]
FINDING_COLUMNS = ["experiment", "model", "variant", "symptom", "figure", "tip", "knob"]
CAPACITY_COLUMNS = ["experiment", "model", "variant", "status", "largest_batch", "first_oom",
                    "peak_mem_mb", "device_mem_mb", "tries", "search_s", "stopped"]
# What a report needs of capacity.csv (older runs may lack the rest).
REQUIRED_CAPACITY_COLUMNS = CAPACITY_COLUMNS[:6]
# recipe.csv (search/driver.py): the search's tables, one `table` kind per row.
RECIPE_COLUMNS = ["model", "table", "step", "label", "option", "group", "speedup", "lo", "hi",
                  "verdict", "step_gain", "step_lo", "step_hi", "rounds", "status", "overrides"]
# Time to target (studies/to_target.py): a row per model, variant and seed, and a row per
# evaluation of each such run
TO_TARGET_COLUMNS = ["experiment", "model", "variant", "is_baseline", "seed", "position",
                     "order_seed", "status", "target_loss", "target_source", "entropy_floor",
                     "final_loss", "steps", "samples", "per_step", "time_s", "cold_s",
                     "one_time_s", "step_ms", "cap_s"]
REQUIRED_TO_TARGET_COLUMNS = TO_TARGET_COLUMNS[:-1]  # cap_s: a run written before it lacks it
# quality.csv: the quality probe's held-out loss per model, variant and seed (studies/quality.py)
# initial_loss: the same model's before its first step; chance_loss: a uniform guess's (nats)
QUALITY_COLUMNS = ["experiment", "model", "variant", "is_baseline", "seed", "steps", "samples",
                   "loss", "status", "initial_loss", "chance_loss", "reference"]
REQUIRED_QUALITY_COLUMNS = QUALITY_COLUMNS[:9]  # a run written before the step-0 loss
# steps.csv: each timed step of each trial (measure/trial.py), in ms
STEP_COLUMNS = ["experiment", "model", "variant", "round", "position", "step", "step_ms"]
CURVE_COLUMNS = ["experiment", "model", "variant", "seed", "steps", "samples", "train_s", "loss"]
# explain.csv (measure/explain.py): where a profiled step's time went, per operator category,
# for the baseline before the rounds (`stage` forecast) and for the baseline and each variant
# after them (`stage` paired); `category` step is the whole step (the categories sum to it).
# mean_ms and sd_ms are over the profiled steps; per_step is the samples an optimizer step
# takes (the report compares variants per baseline step's samples). A row without a number
# says in `status` why (n/a, not measured).
EXPLAIN_CATEGORIES = ("matmul", "elementwise", "data", "optimizer", "host_sync", "python", "compiled",
                      "other")
EXPLAIN_COLUMNS = ["experiment", "model", "variant", "is_baseline", "stage", "category",
                   "steps", "mean_ms", "sd_ms", "per_step", "status"]
# forecast.csv: each variant's forecast before its rounds, declared by the technique it changes
# (Technique.bound): the most it could gain here, the share of the baseline's step it acts on,
# and why; `status` ok, or why there is none (n/a: no bound declared, several techniques, ...)
FORECAST_COLUMNS = ["experiment", "model", "variant", "technique", "forecast", "share",
                    "reason", "status", "is_bound"]
# profiled baseline steps behind the forecasts (measure/explain.py; the labels name them): two
# gave the transformer's matmul share 0.28-0.41 in four consecutive forecasts
FORECAST_STEPS = 4
CAPACITY_LIMIT_FACTOR = 256  # the largest-batch search stops at this many times the model's batch


def trial_columns(extra: Iterable[str] = ()) -> list[str]:
    """trials.csv's header: TRIAL_COLUMNS, then the `extra` ones it does not already hold."""
    return TRIAL_COLUMNS + [c for c in dict.fromkeys(extra) if c not in TRIAL_COLUMNS]


# --- status: `ok`, `n/a: <reason>`, `oom`, `oom (<where>)`, `diverged`, `error: <reason>` ----------
OK, NA, OOM, DIVERGED, ERROR = "ok", "n/a", "oom", "diverged", "error"
# A variant stopped early by evidence: its probe steps significantly far slower than the
# baseline's (quality.py: `too slow: 12.3x slower [9.8, 15.4] ...`); summary.csv's verdict for it
# is STOPPED_SLOWER, a call of the family with that interval
TOO_SLOW = "too slow"
STOPPED_SLOWER = "slower (stopped early)"
# A trial or variant stopped by a limit, not by evidence: a step past bench.max_trial_s's hard
# cap (trial.py, watchdog.py), the run's bench.time_budget_s, or a probe step too long for its
# trials to fit the budget: `not measured: <which limit and what it measured>; <the key that
# lets it run>`. No call: summary.csv's verdict is NOT_MEASURED
NOT_MEASURED = "not measured"
# An option the recipe search dropped, its screen CI below 0.5x: `hopeless: 0.05x [...] in step 1`
HOPELESS = "hopeless"
# A time-to-target run that did not reach the target within its cap (to_target.py): at
# target.max_steps a miss, counted as infinite time (no interval: outside the family); at the
# wall-clock cap target.max_s (its reason ends with TIME_CAP) a load can cause it, so where the
# baseline did not hit it, it is censoring, not a miss (analysis/to_target.py)
MISSED = "missed"
TIME_CAP = "the cap target.max_s"
# An option the recipe search refused, its held-out loss significantly worse (selection.py):
# `refused: held-out loss significantly worse ...`
REFUSED = "refused"
KINDS = (OK, NA, OOM, DIVERGED, ERROR, TOO_SLOW, NOT_MEASURED, HOPELESS, MISSED, REFUSED)
# written `kind: reason`; the others `kind (reason)`
_COLON_KINDS = (NA, ERROR, TOO_SLOW, NOT_MEASURED, HOPELESS, MISSED, REFUSED)


@dataclass(frozen=True)
class Status:
    """A trial's (or capacity row's) status: what happened (`kind`) and why (`reason`)."""

    kind: str
    reason: str = ""

    def __str__(self) -> str:
        if not self.reason:
            return self.kind
        if self.kind in _COLON_KINDS:
            return f"{self.kind}: {self.reason}"
        return f"{self.kind} ({self.reason})"

    @property
    def ok(self) -> bool:
        return self.kind == OK

    @property
    def na(self) -> bool:
        return self.kind == NA

    @property
    def failed(self) -> bool:
        """The trial ran and broke (oom, diverged, error), as opposed to ok or n/a."""
        return self.kind in (OOM, DIVERGED, ERROR)


def parse_status(text) -> Status:
    """The inverse of str(Status): 'n/a: no CUDA' -> Status('n/a', 'no CUDA'). Text of no known
    kind (another version's) is kept whole as the kind."""
    text = "" if text is None or text != text else str(text).strip()  # NaN: an empty cell
    for kind in _COLON_KINDS:
        if text == kind or text.startswith(kind + ":"):
            return Status(kind, text[len(kind) + 1:].strip())
    for kind in KINDS:
        if text == kind:
            return Status(kind)
        if text.startswith(kind + " (") and text.endswith(")"):
            return Status(kind, text[len(kind) + 2:-1])
    return Status(text)


def time_capped(text) -> bool:
    """Whether a status is a time-to-target run stopped by the wall-clock cap target.max_s."""
    status = parse_status(text)
    return status.kind == MISSED and status.reason.endswith(TIME_CAP)


def format_status(kind: str, reason: str = "") -> str:
    return str(Status(kind, reason))


def na(reason: str) -> str:
    """`n/a: <reason>`, the status of a trial that cannot be measured honestly here."""
    return format_status(NA, reason)


def reason_of(text) -> str:
    return parse_status(text).reason
