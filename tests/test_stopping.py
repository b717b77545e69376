"""When a probe stops a variant (studies/stopping.py), and the run's one clock (budget.py)."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from speedbench.analysis.intervals import FAMILY_LEVEL, STOP_SHARE
from speedbench.studies import costs, stopping
from speedbench.measure.budget import Budget

BENCH = SimpleNamespace(warmup=3, steps=10, max_trial_s=6.0, time_budget_s=140.0, repeats=5)


def ref(step_s, factor=4.0, comparisons=6, rounds_s=math.inf, others_s=0.0):
    return stopping.Reference(list(step_s), 32, factor, stopping.stop_level(comparisons),
                              rounds_s, others_s)


def test_the_test_spends_the_comparisons_share_of_the_family_over_its_looks():
    level = stopping.stop_level(6)
    assert level == pytest.approx(1 - STOP_SHARE * FAMILY_LEVEL / 6 / len(stopping.STOP_LOOKS))


def test_a_variant_far_slower_is_stopped_at_a_look_with_its_interval():
    base = ref([0.30, 0.31, 0.29])
    slow = [8.1, 8.3, 8.0, 8.2, 8.1, 8.2]  # a 16-bit ResNet step on a CPU without 16-bit
    assert stopping.flagged(slow[:3], 32, base)  # the first look flags it, calls nothing
    assert stopping.far_slower(slow[:3], 32, base) is None
    got = stopping.far_slower(slow, 32, base)  # the last look calls it, re-checked
    assert got is not None
    ratio, lo, hi = got
    assert lo < ratio < hi < 1 / 4 and ratio == pytest.approx(0.3 / 8.15, rel=0.02)
    assert stopping.far_slower(slow[:2], 32, base) is None  # not a look: 2 steady steps
    assert stopping.far_slower(slow[:4], 32, base) is None  # not a look: 4
    status = stopping.stopped_status(got, slow, base, 7)
    assert status.startswith("too slow: ") and "x slower [" in status


def test_no_baseline_steps_give_no_ratio_and_no_numpy_warning():
    """A baseline whose probe failed (a model's fault at its third call) left no steps: the
    ratio's mean of an empty slice printed numpy's RuntimeWarning on the run's console."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for variant, base in (([0.1, 0.1], []), ([], [0.1, 0.1])):
            got = stopping.speed_ratio(variant, 32, ref(base), 0.95)
            assert all(math.isnan(v) for v in got)


def test_the_reference_has_the_steps_that_let_a_far_slower_variant_be_stopped():
    """fp16 on a CPU, 12x slower than fp32: against 3 baseline steps that spread 40 % Welch's
    t has about 2 degrees of freedom and the test cannot stop it (a real default amp run let
    it take 8 s of every round); against the REFERENCE_STEPS the baseline now gives, it can."""
    variant, spread = [0.85, 0.88, 0.84] * 2, [0.045, 0.038, 0.058, 0.046, 0.039, 0.056]
    assert stopping.REFERENCE_STEPS == len(spread) == stopping.probe_floor(reference=True)
    assert stopping.probe_floor(reference=False) == stopping.STOP_LOOKS[0]
    # Welch's t alone (no trial level): 3 reference steps give about 2 degrees of freedom
    short = ref(spread[:3], comparisons=2)
    assert stopping.speed_ratio(variant, 32, short, short.level, level_sd=0)[2] * 4 >= 1
    ratio, lo, hi = stopping.far_slower(variant, 32, ref(spread, comparisons=2))
    assert hi < 1 / 4 and ratio == pytest.approx(0.047 / 0.857, rel=0.05)


@pytest.mark.parametrize("base, variant", [
    ([0.09, 0.10, 0.09], [0.09, 1.1, 0.09]),  # one 1.1 s stall of a fine variant
    ([0.30, 0.31, 0.29], [0.9, 0.9, 0.9, 0.9, 0.9, 0.9]),  # 3x slower: under the factor 4
    ([0.30, 0.31, 0.29], [0.3 * 3.15] * 3),  # the 3.15x a loaded A/A pair once stopped at
])
def test_a_stall_or_a_slowdown_under_the_factor_never_stops(base, variant):
    for k in stopping.STOP_LOOKS:
        assert stopping.far_slower(variant[:k], 32, ref(base)) is None


def test_no_factor_and_no_reference_never_stop():
    assert stopping.far_slower([9.0] * 3, 32, ref([0.3] * 3, factor=None)) is None
    assert stopping.far_slower([9.0] * 3, 32, None) is None


def test_identical_variants_are_stopped_far_less_often_than_the_level_allows():
    """A/A with heavy-tailed steps (a tenth of them stalled 2-20x): the test spends at most its
    share of the family; here it spends none (an F-fold margin on top of the level)."""
    rng = np.random.default_rng(0)
    level = stopping.stop_level(1)  # one comparison: the laxest level a run uses
    stops, runs = 0, 4000

    def steps(n):
        x = 0.1 * np.exp(rng.normal(0, 0.2, n))
        stall = rng.random(n) < 0.1
        return list(np.where(stall, x * rng.uniform(2, 20, n), x))
    for _ in range(runs):
        base = stopping.Reference(steps(stopping.REFERENCE_STEPS), 32, 4.0, level)
        variant = steps(6)
        stops += any(stopping.far_slower(variant[:k], 32, base) is not None
                     for k in stopping.STOP_LOOKS)
    assert stops / runs <= (1 - level) * len(stopping.STOP_LOOKS)


def test_a_variant_whose_two_rounds_cannot_fit_is_not_measured_with_the_budget_to_give():
    # the rounds have 27 s; a round's other trials take 6 s
    base = ref([0.3] * 3, rounds_s=27.0, others_s=6.0)
    assert stopping.over_budget(8.2, False, BENCH, base)  # 2 x (15 x 8.2 capped ~31 + 6) > 27
    assert not stopping.over_budget(0.25, False, BENCH, base)
    # a first step carries one-time costs: it decides only when far too long
    assert not stopping.over_budget(1.0, True, BENCH, base)
    assert stopping.over_budget(60.0, True, BENCH, base)
    status, given = stopping.budget_status(8.2, False, BENCH, base, 6.0, BENCH.time_budget_s)
    assert status.startswith("not measured: a steady probe step took 8.2 s")
    # the status names no figure: the run's one figure (recommend.more_budget) takes `given`
    assert status.endswith("; to measure it give a larger bench.time_budget_s")
    assert given > BENCH.time_budget_s
    assert not stopping.over_budget(8.2, False, BENCH, ref([0.3] * 3))  # no budget: never


def test_a_trial_costs_its_setup_warm_up_window_and_two_more_steps_at_most_its_cap():
    setup = costs.TRIAL_SETUP_S
    assert costs.trial_seconds(0.1, BENCH) == pytest.approx(setup + 15 * 0.1)
    assert costs.trial_seconds(8.0, BENCH) == pytest.approx(setup + 6.0 + 3 * 8.0)
    uncapped = SimpleNamespace(**{**vars(BENCH), "max_trial_s": None})
    assert costs.trial_seconds(8.0, uncapped) == pytest.approx(setup + 15 * 8.0)


def test_a_budget_is_one_clock_whose_parts_pass_on_what_they_leave():
    now = [0.0]
    run = Budget(100.0, clock=lambda: now[0])
    first = run.part(1 / 2)
    assert first.seconds == 50.0 and run.left() == 100.0
    now[0] = 20.0  # the first part used 20 s of its 50
    assert first.left() == 30.0 and not first.over()
    second = run.part(1 / 1)  # the last part takes all that is left, 30 s unused included
    assert second.seconds == 80.0
    assert run.limit(5.0) == 5.0 and run.limit(None) == 80.0
    now[0] = 101.0
    assert run.over() and run.left() == 0.0 and run.limit(5.0) == 0.0
    assert Budget(None).left() == math.inf and Budget(None).limit(None) is None


def test_a_runs_budget_keeps_time_back_for_its_report():
    assert Budget.of_run(140.0).seconds == pytest.approx(140.0 - 8.0)
    assert Budget.of_run(20.0).seconds == pytest.approx(18.0)
    assert Budget.of_run(None).seconds is None


def test_the_commands_first_run_counts_its_budget_from_the_process_start():
    """bench.time_budget_s bounds what a user times: a process 1 s old (a sleep standing in
    for Python's start-up and torch's import) has its first run's clock 1 s gone; a second
    run in the same process (a sweep's next job) starts its own clock."""
    import subprocess
    import sys

    code = ("import time; time.sleep(1.0)\n"
            "from speedbench.measure import budget\n"
            "age = budget.process_age_s(); budget.count_from_process_start()\n"
            "first = budget.Budget.of_run(60.0, start=budget.run_start())\n"
            "second = budget.Budget.of_run(60.0, start=budget.run_start())\n"
            "print(age, first.spent(), second.spent())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    age, first_spent, second_spent = map(float, out)
    if age == 0.0:
        pytest.skip("this platform does not tell a process's start (/proc)")
    assert age >= 0.98 and first_spent >= 0.98  # /proc's clock ticks: 10 ms
    assert second_spent < 0.5


def test_a_trials_cpu_window_counts_the_runs_live_children_as_its_own():
    """A child of this run still running (a DataLoader worker, a launched trial) is the run's
    own work, not another process's: the measured audit found it counted as others. The check
    compares the window's own CPU time with what the kernel says the child used, so that it
    holds at any load (beside CPU hogs the child simply gets less)."""
    import os
    import subprocess
    import sys
    import time

    from speedbench.measure import env

    stat = Path("/proc/self/stat")
    if not stat.exists():
        pytest.skip("no /proc here")
    window = env.CpuWindow()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        child_s, deadline = 0.0, time.monotonic() + 60
        while child_s < 0.3 and time.monotonic() < deadline:  # spins, alive, to the check
            time.sleep(0.1)
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            child_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        counted_s = env._own_cpu_s() - window.own
        others = window.others()
    finally:
        child.kill()
        child.wait()
    assert child_s >= 0.3, "the child got no CPU time in 60 s"
    assert counted_s >= child_s - 0.05  # the live child's time is the run's own
    assert 0.0 <= others <= 1.0


def test_the_trials_other_processes_slowed_are_named():
    import pandas as pd

    from speedbench.report import method

    trials = pd.DataFrame({"model": ["m"] * 4, "variant": ["a", "b", "a", "b"],
                           "others_cpu_share": [0.05, 0.6, 0.1, 0.02]})
    note = method.busy_trials_note(trials)
    assert note.startswith("1 of 4 trials ran while other processes took over 25%") and \
        "m/b 1" in note
    assert method.busy_trials_note(trials.assign(others_cpu_share=0.01)) is None


def test_one_slow_steady_probe_step_does_not_leave_a_variant_not_measured():
    """Finding 6 (measurement audit 5): the budget check judged the latest single steady step,
    so one load burst in an identical variant's probe left it `not measured`. It judges the
    lower median of the steady steps now: one slow step cannot decide alone, two can."""
    from speedbench.studies import quality

    base = ref([0.3] * 6, rounds_s=27.0, others_s=6.0)
    burst = [0.9, 0.3, 8.2]  # first step, a steady step, one 8.2 s burst
    assert quality._stopped(burst, 1, 32, BENCH, base) == {}
    assert quality._stopped(burst + [0.31], 1, 32, BENCH, base) == {}
    slow = quality._stopped([0.9, 8.1, 8.2], 1, 32, BENCH, base)  # truly slow: two steps
    assert slow["status"].startswith("not measured: its steady probe steps took (lower "
                                     "median of 2) 8.1 s")
    # a probe with one steady step and no more is judged on it
    assert quality._stopped([0.9, 8.2], 1, 32, BENCH, base, last=True)["status"].startswith(
        "not measured: a steady probe step took 8.2 s")
    # a step the hard cap cut short took at least that long: it decides alone
    assert quality._stopped([0.9, 0.3, 8.2], 1, 32, BENCH, base, overran=True)


def test_a_not_measured_status_names_what_the_rounds_had_left_not_their_nominal_share():
    """Finding 6: the note said `more than the 60 s of rounds its share of the run holds` when
    the plan said 3 s were left; the check and the note use what the model's budget has left
    where that is less than the share."""
    share = ref([0.3] * 6, rounds_s=60.0, others_s=0.5)
    left = stopping.Reference(share.step_s, 32, 4.0, share.level, 60.0, 0.5,
                              left=lambda: 3.0)
    step = 0.5  # two rounds: about 2 x (0.5 + 15 x 0.5 + 0.5) s, under 60, over 3
    assert not stopping.over_budget(step, False, BENCH, share)
    assert stopping.over_budget(step, False, BENCH, left)
    status, _ = stopping.budget_status(step, False, BENCH, left, 0.5, BENCH.time_budget_s)
    assert "more than the 3 s its model's budget had left for the rounds" in status
    assert "share of the run holds" not in status
    said, _ = stopping.budget_status(8.2, False, BENCH, share, 0.5, BENCH.time_budget_s)
    assert "the 60 s of rounds its share of the run holds" in said


def _identical_pairs():
    """Every ordered pair of identical quiet trials (same model, precision and harness, other
    rounds) of benchmarks/data/step_times*.csv: (reference steps 1-6, the other's steps 1-6)."""
    import glob
    import itertools

    import pandas as pd

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
    for path in sorted(glob.glob(str(root / "step_times*.csv"))):
        data = pd.read_csv(path)
        for _, g in data.groupby(["model", "precision", "harness"]):
            trials = [t.sort_values("step")["step_ms"].to_numpy() / 1000
                      for _, t in g.groupby("round")]
            for a, b in itertools.permutations(trials, 2):
                yield list(a[1:7]), list(b[1:7])


def test_the_stops_interval_covers_an_identical_pair_as_its_level_says():
    """Finding 1 (measurement audit 5): over the ordered pairs of identical quiet trials in the
    project's step_times data, the stop's 99.92 % interval (stop_level(6), two-sided) covered
    1 in 78-89 % and the 90 % one in 39-47 %: the steps of one fresh model share its level,
    which Welch's t over steps cannot see. Widened by the trial level, both keep their level."""
    level = stopping.stop_level(6)
    cover = {(lvl, k): [] for lvl in (0.95, level) for k in stopping.STOP_LOOKS}
    for base, other in _identical_pairs():
        r = stopping.Reference(base, 32, 4.0, level)
        for (lvl, k), hits in cover.items():
            _, lo, hi = stopping.speed_ratio(other[:k], 32, r, lvl)
            hits.append(lo <= 1 <= hi)
    rates = {key: float(np.mean(hits)) for key, hits in cover.items()}
    assert len(cover[(level, 3)]) > 4000
    assert min(rates[(0.95, k)] for k in stopping.STOP_LOOKS) >= 0.88, rates  # nominal 90 %
    assert min(rates[(level, k)] for k in stopping.STOP_LOOKS) >= 0.995, rates  # 99.92 %


def test_a_load_burst_over_the_first_looks_steps_is_re_checked_and_not_called():
    """Finding 1 (measurement audit 5): a load that slows an identical variant's first three
    steady probe steps 20-fold stopped it, `slower (stopped early)`, a call of the family. The
    first look flags it; the fresh steps after it, at the machine's normal speed, do not
    confirm it, so there is no call. Through quality._stopped and the probe's loop rule."""
    from speedbench.studies import quality

    base = ref([0.06] * 6)
    burst = [0.12, 1.2, 1.25, 1.18]  # first step, then three steady steps in a 20x burst
    assert quality._stopped(burst, 1, 32, BENCH, base) == {}  # before: too slow, 20x slower
    assert stopping.flagged(burst[1:], 32, base)  # the probe runs on to the last look
    after = burst + [0.061, 0.059, 0.062]
    assert quality._stopped(after, 1, 32, BENCH, base) == {}
    slow = burst + [1.21, 1.19, 1.22]  # still 20x slower on the fresh steps: a call
    assert quality._stopped(slow, 1, 32, BENCH, base)["status"].startswith("too slow: ")
