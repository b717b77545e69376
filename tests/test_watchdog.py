"""bench.max_trial_s as a hard cap: the deadline (SIGALRM), the trial it stops, the backstop
that ends a process stuck outside Python, and the stalled-window flag."""
from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import TINY, compose_cfg, said_lines
from speedbench.measure import timing, watchdog
from speedbench.measure.watchdog import StepOverrun, deadline

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="POSIX timers")


def _no_timer() -> bool:
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_deadline_interrupts_a_sleep_and_restores_the_handler():
    before = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(StepOverrun) as stopped:
        with deadline(0.2, "model m, variant v") as guard:
            time.sleep(5)
    took = time.monotonic() - started
    # Upper bounds well short of the 5 s sleep: they show the sleep was cut, and hold on a
    # loaded 2-core machine (a tighter one tests the scheduler, not the watchdog).
    assert 0.19 < took < 4.0
    assert guard.fired and stopped.value.deadline is guard
    assert 0.19 < stopped.value.elapsed_s < 4.0
    assert signal.getsignal(signal.SIGALRM) is before and _no_timer()


def test_a_deadline_that_is_not_reached_does_nothing():
    before = signal.getsignal(signal.SIGALRM)
    with deadline(1.0, "quick") as guard:  # 1 s: a loaded machine's lag stays short of it
        time.sleep(0.05)
    time.sleep(max(0.0, guard.started + 1.1 - time.monotonic()))  # past where it would fire
    assert not guard.fired
    assert signal.getsignal(signal.SIGALRM) is before and _no_timer()
    with deadline(None, "no cap") as none, deadline(float("inf"), "no cap") as inf:
        assert _no_timer()
    assert not none.active and not inf.active


def test_an_outer_deadline_survives_an_inner_one():
    started = time.monotonic()
    with pytest.raises(StepOverrun) as stopped:
        with deadline(0.4, "outer") as outer:
            with deadline(5, "inner") as inner:
                time.sleep(0.05)
            time.sleep(5)  # the outer one still stops this
    assert stopped.value.deadline is outer and not inner.fired
    assert 0.39 < stopped.value.elapsed_s and time.monotonic() - started < 4.0  # not 5 s
    # and an inner one that falls due first is the one raised; the outer goes on
    with deadline(5, "outer") as outer:
        with pytest.raises(StepOverrun) as inner_stop:
            with deadline(0.1, "inner"):
                time.sleep(5)
        time.sleep(0.1)
    assert inner_stop.value.deadline.what == "inner" and not outer.fired
    assert inner_stop.value.elapsed_s > 0.09
    assert _no_timer()


def test_the_previous_handler_and_timer_are_restored_less_the_time_inside():
    rang = []
    previous = signal.signal(signal.SIGALRM, lambda *_: rang.append(time.monotonic()))
    try:
        # the outside timer 1 s: a loaded machine's lag inside stays short of it
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with deadline(5, "inner"):
            time.sleep(0.1)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 0.9  # the outside timer goes on, less the time spent inside
        time.sleep(1)
        assert len(rang) == 1 and rang[0] - start > 0.95  # not rearmed early
        # an outside timer that falls due inside a deadline still rings its own handler
        rang.clear()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with deadline(5, "inner") as guard:
            time.sleep(0.3)
        assert len(rang) == 1 and not guard.fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_disarm_lets_the_cleanup_run_and_other_signals_keep_their_handlers():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with deadline(1.0, "m") as guard:  # 1 s: a loaded machine's lag stays short of it
        assert {s: signal.getsignal(s) for s in handlers} == handlers
        guard.disarm()
        assert _no_timer()  # nothing armed after disarm
        time.sleep(max(0.0, guard.started + 1.1 - time.monotonic()))  # nor an alarm at 1 s
    assert not guard.fired


def test_a_deadline_given_no_time_leaves_nothing_behind():
    """A block entered with its time already spent (a probe seed started at its budget's end)
    raises inside the block, so its exit runs: no deadline stays in force and no backstop
    thread is left to end the process later (before, 89 of 200 such blocks left one)."""
    for _ in range(100):
        with pytest.raises(StepOverrun):
            with deadline(-0.01, "a block given no time", grace=60):
                time.sleep(0.01)
        assert not watchdog._stack
    time.sleep(0.05)  # a backstop thread ends once its block has
    assert not [t for t in threading.enumerate() if t.name == "speedbench-watchdog"]
    assert signal.getsignal(signal.SIGALRM) is not watchdog._on_alarm


def test_off_the_main_thread_it_is_a_no_op():
    got = {}

    def body():
        with deadline(0.05, "thread") as guard:
            time.sleep(0.2)
        got["guard"] = guard

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not got["guard"].active and not got["guard"].fired


def test_with_step_s_a_block_of_short_steps_runs_on_and_a_long_step_is_stopped():
    # step_s 10 x each step and a grace of 1 s: a loaded machine's lag stays short of both
    with deadline(0.1, "steps", step_s=0.5, grace=1.0) as guard:
        step = guard.stepping(lambda: time.sleep(0.05))
        for _ in range(24):  # 1.2 s: past the deadline and its grace, each step within 0.5 s
            step()
    assert not guard.fired  # and the backstop moved on with the steps: the process lives
    started = time.monotonic()
    with pytest.raises(StepOverrun):
        with deadline(0.2, "steps", step_s=0.15) as guard:
            step = guard.stepping(lambda s: time.sleep(s))
            step(0.05)
            step(0.05)
            step(5)  # stopped once it has run 0.15 s (the deadline has passed by then)
    assert 0.2 < time.monotonic() - started < 4.0


def test_an_overrun_waits_for_an_import_to_end(tmp_path, monkeypatch):
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(0.3)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(StepOverrun):
        with deadline(0.05, "m"):
            import slow_to_import  # noqa: F401  the alarm falls due in here
            time.sleep(5)  # and is raised here
    assert 0.3 < time.monotonic() - started < 4.0
    assert sys.modules["slow_to_import"].DONE  # the module is whole


def test_an_overrun_lost_in_a_finalizer_is_raised_again():
    class Slow:
        def __del__(self):
            time.sleep(0.3)  # the alarm lands in here: its exception is "ignored"

    with pytest.raises(StepOverrun):
        with deadline(0.1, "m"):
            Slow()  # dropped at once: __del__ runs
            time.sleep(5)


# --- a trial whose step outlasts bench.max_trial_s ---------------------------------------------

TESTS = Path(__file__).resolve().parent
IMAGES = "dataset: {kind: images, image_size: 32, num_classes: 10}"
# Under autocast, every forward after the first sleeps: the quality probe's one step does not,
# the trial's warm-up step does not, its timed window's first step does.
SLEEPY = ("model={_target_: fault_models.Tiny, fail: sleeps_in_autocast, sleep_s: 8, "
          f"sleep_after: 1, {IMAGES}}}")
CAPPED = ["bench.max_trial_s=0.5", "bench.quality_steps=0", "bench.too_slow_factor=null",
          "+variants.fp32={precision: fp32}", "+variants.bf16={precision: bf16}",
          "baseline=fp32"]


def _threads(name_part: str) -> list[str]:
    return [t.name for t in threading.enumerate() if name_part in t.name and t.is_alive()]


def test_a_step_past_the_cap_stops_its_trial_and_the_next_variant_runs(tmp_path):
    from speedbench import techniques
    from speedbench.analysis.summary import summarise
    from speedbench.config import build_plan
    from speedbench.measure import flops
    from speedbench.studies.study import measure_plan
    from speedbench.results import TrialWriter

    threads_before = torch.get_num_threads()
    handler = signal.getsignal(signal.SIGALRM)
    # order seed 2: bf16 first in its round, the baseline after it
    plan = build_plan(compose_cfg(*TINY, SLEEPY, *CAPPED, "bench.repeats=1",
                                  "bench.order_seed=2"), "capped")
    writer = TrialWriter(tmp_path / "trials.csv", techniques.column_names())
    book = flops.FlopsBook(torch.device("cpu"))
    book.peaks.update(fp32=1.0, bf16=1.0)  # no matmul peak to measure: the test is the cap
    book.ratios["bf16"] = flops.PeakRatio(1.0, (1.0,))
    measure_plan(plan, None, progress=False, writer=writer, book=book)
    trials = pd.read_csv(tmp_path / "trials.csv")
    assert list(trials["variant"]) == ["bf16", "fp32"]
    status = trials["status"].iloc[0]  # a limit, not evidence: no call, and the key to give
    assert status.startswith("not measured: a step ran past bench.max_trial_s (0.5 s), "
                             "stopped after ")
    assert "; to measure it give bench.max_trial_s=" in status
    stopped_after = float(status.split("stopped after ", 1)[1].split(" s;")[0])
    # 2 x the cap; uncut, the 8 s step alone would take it past 8 s (a loaded machine's lag
    # before and in the step stays well short of that)
    assert 0.95 <= stopped_after < 8
    assert trials["status"].iloc[1] == "ok"  # the trial after it runs as usual
    summary = summarise(writer.frame()).set_index("variant")
    assert summary.loc["bf16", "verdict"] == "not measured"
    # the recipe's global state restored, the samplers and the watchdog gone
    assert torch.get_num_threads() == threads_before
    assert signal.getsignal(signal.SIGALRM) is handler and _no_timer()
    time.sleep(0.1)
    assert not _threads("speedbench-watchdog") and not _threads("(_loop)")


def test_a_trial_of_steps_within_the_cap_runs_past_twice_the_cap():
    """The warm-up's floor of steps may take the trial past 2 x max_trial_s: no step exceeded
    the cap, so it is measured. Each step 0.1 s under a 1 s cap: a loaded machine's lag in a
    step stays short of the cap."""
    from speedbench.config import build_plan
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import dataset_length, measure_trial

    # every forward sleeps 0.1 s (under the 1 s cap): 22 warm-up steps alone take 2.2 s
    model = ("model={_target_: fault_models.Tiny, fail: sleeps_in_autocast, sleep_s: 0.1, "
             f"{IMAGES}}}")
    plan = build_plan(compose_cfg(*TINY, model, *CAPPED, "bench.max_trial_s=1",
                                  "bench.warmup=22"), None)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), None, seed=0)
    started = time.monotonic()
    record = measure_trial(plan, spec, "bf16", plan.variants["bf16"], 0, dataset)
    assert record["status"] == "ok" and time.monotonic() - started > 2.0
    assert record["steps"] >= 1 and record["warmup_steps"] == 22


def test_a_probe_step_past_the_probes_limit_is_stopped_and_says_why():
    from speedbench.config import build_plan
    from speedbench.studies import quality
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import context

    model = ("model={_target_: fault_models.Tiny, fail: sleeps_in_autocast, sleep_s: 5, "
             f"{IMAGES}}}")
    plan = build_plan(compose_cfg(*TINY, model, *CAPPED, "bench.max_trial_s=0.1",
                                  "bench.quality_steps=2"), None)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, 256, None, seed=0)
    import torch._dynamo  # noqa: F401  a run imports it before its first probe (slow, once)
    got = quality.quality_probe(spec, plan.variants["bf16"], context(plan), dataset, 2,
                                seeds=3)
    status = got["quality_status"]
    assert status.startswith("n/a: no held-out loss: a step of the quality probe ran past its "
                             "limit of 10 x bench.max_trial_s (1 s); stopped after ")
    # the 1 s limit (10 x 0.1 s); uncut, the 5 s step alone would take the probe past 5 s (a
    # loaded machine's lag before and in the step stays well short of that)
    assert 1.0 <= float(status.rsplit("after ", 1)[1].removesuffix(" s")) < 5
    assert math.isnan(got["final_loss"]) and "seed_losses" not in got


HANGS = f"""
import sys, time
import torch._dynamo  # what a run imports before its first trial (the techniques' state)
from speedbench.measure import watchdog
watchdog.GRACE_MIN_S = 1.0  # the backstop's grace, short for the test
from conftest import TINY, compose_cfg
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset
from speedbench.measure.trial import dataset_length, measure_trial
cfg = compose_cfg(*TINY, "bench.max_trial_s=0.5",
                  "model={{_target_: fault_models.Tiny, fail: hangs_outside_python, "
                  "sleep_s: 60, {IMAGES}}}")
plan = build_plan(cfg, None)
spec = plan.models[0]
dataset = build_dataset(spec.dataset, dataset_length(plan, spec), None, seed=0)
print("trial starts", flush=True)
measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, dataset)
print("the trial returned", flush=True)
"""


def test_a_step_stuck_outside_python_ends_the_process_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ["PYTHONPATH"]])
           if os.environ.get("PYTHONPATH") else str(TESTS)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HANGS)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "trial starts"
    started = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == watchdog.EXIT_STUCK, err[-2000:]
    assert "the trial returned" not in out
    assert took < 20, took  # deadline 1 s + grace 1 s (and start-up), not the 60 s sleep
    lines = said_lines(err)
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("speedbench: model Tiny, variant ")
    assert "hard limit of 1 s (2 x bench.max_trial_s = 0.5 s) and 1 s of grace" in lines[0]
    assert "exit status 124" in lines[0]
    assert "Current thread" in err or "Thread 0x" in err  # faulthandler's stacks
    assert "fault_models.py" in err  # the stuck frame is named


# --- a stalled window: one step far outside its window's distribution ---------------------------

def test_the_stall_is_the_longest_steps_excess_over_the_median_beyond_five_times_it():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.5 if len(calls) == 4 else 0.01)  # the fourth step stalls

    times = timing.StepTimes(torch.device("cpu"), 8)
    elapsed, n = timing.timed_steps(step, 8, torch.device("cpu"), step_times=times)
    step_s = times.seconds()
    assert n == 8 and len(step_s) == 8
    # each step's time (s) at least its sleep, all of them within the window: on any load
    assert step_s[3] >= 0.5 and min(step_s) >= 0.01 and sum(step_s) <= elapsed
    # the stall: the longest step's excess over the median step (about 10 ms; the longest is
    # over 5 x the median unless a load slowed most of the 10 ms steps ten times)
    median = statistics.median(step_s)
    assert timing.stall_ms(step_s) == pytest.approx(1000 * (max(step_s) - median))
    # a window without a step far outside its own distribution has none
    assert timing.stall_ms([0.010, 0.011, 0.055, 0.012]) == 0.0  # 4.8x the median: not a stall
    assert timing.stall_ms([0.010, 0.011, 0.060, 0.012]) == pytest.approx(1000 * (0.060 - 0.0115))
    assert timing.stall_ms([0.01, 0.5]) == 0.0  # two steps: no median to stand out from
    assert math.isnan(timing.stall_ms(None))  # not measured (an accelerator without events)


@pytest.mark.gpu
def test_on_cuda_a_host_read_is_no_stall_and_a_paused_host_is():
    """The host runs ahead of the device and waits for it at a read (sync=deferred): its clock
    would call that step a stall. The device's own timeline (CUDA events) does not; a host
    pause long enough to leave the device idle shows on it."""
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    total = torch.zeros((), device=device)

    def stepper(pause_at: int):
        calls = []

        def step():
            nonlocal total
            calls.append(1)
            for _ in range(4):
                total = total + (a @ a)[0, 0]  # milliseconds of device work, queued
            if len(calls) % 10 == 0:
                total.item()  # a host read every 10 steps, as sync=deferred does
            if len(calls) == pause_at:
                time.sleep(0.5)  # the host pauses: the device runs dry
        return step

    for pause_at, stalled in ((0, False), (15, True)):
        times = timing.StepTimes(device, 20)
        timing.timed_steps(stepper(pause_at), 20, device, step_times=times)
        stall = timing.stall_ms(times.seconds())
        assert (stall > 300) if stalled else stall == 0.0, (pause_at, stall, times.seconds())


def test_the_report_and_the_console_name_a_stalled_window(tmp_path):
    from test_report import make_run
    from speedbench.report import method
    from speedbench.report.render import write_report

    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    trials = pd.read_csv(run / "trials.csv").assign(elapsed_s=1.25, stall_ms=0.0)
    trials.to_csv(run / "trials.csv", index=False)
    write_report(run)
    assert "stalled" not in (run / "report.md").read_text()
    assert method.stall_note(trials) is None
    # round 2 of fp16 lost 180 ms in one step: 14 % of its 1.25 s window
    hit = (trials["variant"] == "fp16") & (trials["trial"] == 2)
    trials.loc[hit, "stall_ms"] = 180.0
    trials.loc[(trials["variant"] == "bf16") & (trials["trial"] == 0), "stall_ms"] = 100.0  # 8 %
    trials.to_csv(run / "trials.csv", index=False)
    note = method.stall_note(trials)
    assert note.startswith("A window stalled: resnet/fp16 round 2 lost 180 ms in one step "
                           "(14 % of its window); its figures are noisy")
    assert "bf16" not in note and "Measure again" in note
    write_report(run)
    assert note in (run / "report.md").read_text().replace("\n", " ")


def test_a_probe_step_cut_at_the_budgets_limit_leaves_the_variant_not_measured():
    """A variant's probe step that the budget's hard limit cuts took at least that long: too
    slow for the model's rounds, it is `not measured` (no call), not sent on to burn a capped
    trial in every round."""
    from speedbench.config import build_plan
    from speedbench.studies import quality, stopping
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import context

    plan = build_plan(compose_cfg(*TINY, SLEEPY, "bench.too_slow_factor=null",
                                  "+variants.fp32={precision: fp32}",
                                  "+variants.bf16={precision: bf16}", "baseline=fp32"), "cut")
    spec, recipe = plan.models[0], plan.variants["bf16"]
    ref = stopping.Reference([0.01] * 3, 4, None, 0.99, rounds_s=2.0)
    started = time.perf_counter()
    got = quality.quality_probe(spec, recipe, context(plan), build_dataset(
        spec.dataset, 256, None, seed=0), 3, ref, left_s=0.5)
    assert got["status"].startswith("not measured: "), got
    # no figure of its own: what would measure it feeds the run's one figure
    assert got["status"].endswith("give a larger bench.time_budget_s"), got
    assert got["budget_need_s"] > 2.0, got
    assert time.perf_counter() - started < 8  # the 8 s step was cut, not waited for
