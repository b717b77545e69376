"""An answer a user can act on: threads that fit the machine said up front, "undecided" never
"skip", one budget advice for the run, the baseline first where one round fits, and a recipe
search that says when it stopped underpowered."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from conftest import TINY, compose_cfg

from speedbench.config import ConfigError, build_plan
from speedbench.measure import env, flops
from speedbench.measure.budget import Budget
from speedbench.report import recommend
from speedbench.search import selection as S
from speedbench.studies import study


# --- threads that fit the free cores ------------------------------------------------------------
def test_threads_fit_the_cores_other_processes_leave_free():
    assert env.fitting_threads(2, 0.1) == 2
    assert env.fitting_threads(2, 1.2) == 1
    assert env.fitting_threads(2, 3.0) == 1  # one at least
    assert env.fitting_threads(16, 4.4) == 12


@pytest.mark.parametrize("busy, cores, torch_default, fit", [
    (1.6, 2, 2, 1), (2.0, 2, 2, 1),  # the user trial's load 10 on 2 cores: /proc/stat saturates
    (1.0, 2, 2, 1), (4.4, 16, 16, 12), (40.3, 64, 64, 24)])
def test_a_busy_machine_gets_the_threads_that_fit_by_default_in_one_line(busy, cores,
                                                                          torch_default, fit):
    threads, said = env.threads_plan(None, busy, current=torch_default, cores_=cores)
    assert threads == fit  # the default sets them: a run on a busy machine measures something
    assert said == (f"speedbench: {fit} thread{'s' * (fit > 1)}, not torch's {torch_default}: "
                    f"others keep {busy:.1f} of {cores} cores busy (pin: bench.threads=N)")
    assert len(said) <= 100 and "\n" not in said


def test_a_quiet_machine_keeps_torchs_threads_and_a_set_count_is_obeyed():
    assert env.threads_plan(None, 0.1, current=2, cores_=2) == (None, "")  # quiet: nothing
    assert env.threads_plan(None, 0.4, current=2, cores_=2) == (None, "")
    assert env.threads_plan(None, 3.0, current=1, cores_=2) == (None, "")  # one: nothing fewer
    assert env.threads_plan(None, None, current=2, cores_=2) == (None, "")  # no /proc/stat
    threads, said = env.threads_plan("auto", 1.6, current=2, cores_=2)
    assert threads == 1 and said.startswith("bench.threads=auto: 1 thread(s)")
    assert env.threads_plan("2", 1.9, current=2, cores_=2) == (2, "")  # the user's, said or not
    assert env.threads_plan("3", None, current=2, cores_=2) == (3, "")


def test_threads_that_multiply_slower_than_fewer_are_cut_to_the_fastest_count():
    """The second trigger, for what /proc/stat does not show (a CPU quota, stolen time): a
    matrix product that fewer threads run RATE_MARGIN times faster."""
    assert env.thread_counts(2) == [2, 1] and env.thread_counts(12) == [12, 6, 3, 1]
    assert env.thread_counts(1) == [1]
    threads, said = env.threads_by_rates({2: 318.0, 1: 1174.0}, current=2)
    assert threads == 1 and said == ("speedbench: 1 thread, not torch's 2, 3.7x slower at a "
                                     "matrix product here (pin: bench.threads=N)")
    assert env.threads_by_rates({2: 1900.0, 1: 1000.0}, current=2) == (None, "")  # quiet
    assert env.threads_by_rates({2: 1000.0, 1: 1200.0}, current=2) == (None, "")  # in the noise
    assert env.threads_by_rates({8: 100.0, 4: 260.0, 2: 200.0, 1: 120.0}, 8)[0] == 4
    assert env.threads_by_rates({2: 0.0, 1: 0.0}, current=2) == (None, "")


def test_the_matmul_rates_are_measured_at_each_count_and_torchs_threads_put_back():
    import torch

    before = torch.get_num_threads()
    rates = env.matmul_rates([2, 1], seconds=0.05, rounds=2)
    assert set(rates) == {2, 1} and all(r > 0 for r in rates.values())
    assert torch.get_num_threads() == before


def test_bench_threads_is_checked_before_anything_runs():
    with pytest.raises(ConfigError, match=r"bench.threads: 'many' is not allowed; choose auto, "
                                          r"a whole number from 1, or null"):
        build_plan(compose_cfg(*TINY, "model=transformer", "bench.threads=many"), None)
    build_plan(compose_cfg(*TINY, "model=transformer", "bench.threads=auto"), None)


def test_bench_threads_sets_the_runs_threads_records_them_and_puts_them_back(tmp_path):
    import torch

    from speedbench.run import run

    before = torch.get_num_threads()
    cfg = compose_cfg(*TINY, "model=transformer", "bench.threads=1", "bench.repeats=1",
                      "bench.quality_steps=0", "bench.explain=false", f"out_dir={tmp_path}",
                      "+variants={a:{}}", "baseline=a")
    run_dir = run(cfg, None, progress=False)
    machine = json.loads((run_dir / "env.json").read_text())
    assert machine["bench_threads"] == {"setting": "1", "others_busy_cores": None,
                                        "torch_default": before, "matmul_rates": None,
                                        "torch_threads": 1}
    assert machine["torch_threads"] == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("busy, rates", [(1.8, None), (0.0, {2: 1000.0, 1: 2000.0}),
                                         (0.0, {2: 1900.0, 1: 1000.0})])
def test_the_cli_says_the_threads_it_set_first_and_records_them(busy, rates, tmp_path,
                                                                  monkeypatch):
    """The start-up look (env.others_busy_cores) and the matrix products (env.matmul_rates)
    are the seams: a load of 1.8 of 2 cores, a quiet look with products 2x faster on one
    thread, and a quiet machine."""
    import torch
    from conftest import run_main, usable_cores

    if usable_cores() < 2 or torch.get_num_threads() < 2:
        pytest.skip("needs torch's default of 2 threads or more")
    default = torch.get_num_threads()
    monkeypatch.setattr(env, "others_busy_cores", lambda *_: busy)
    monkeypatch.setattr(env, "matmul_rates", lambda counts, *_: {n: rates[min(n, 2)]
                                                                  for n in counts})
    proc = run_main(*TINY, "model=transformer", "bench.repeats=1", "bench.quality_steps=0",
                    "bench.explain=false", "+variants={a:{}}", "baseline=a",
                    f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    machine = json.loads(next((tmp_path / "out").rglob("env.json")).read_text())
    threads = machine["bench_threads"]
    lines = proc.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if "bench.threads=N" in line]
    if busy or rates[1] > rates[2]:  # busy, or one thread multiplied faster
        fit = env.fitting_threads(usable_cores(), busy) if busy else 1
        assert len(said) == 1, proc.stderr  # one line, before anything is measured
        line = lines[said[0]]
        assert line.startswith(f"speedbench: {fit} thread{'s' * (fit > 1)}, not torch's "
                               f"{default}") and line.endswith("(pin: bench.threads=N)")
        assert len(line) <= 100 and not any(
            "transformer" in earlier for earlier in lines[:said[0]]), proc.stderr
        assert threads["torch_threads"] == machine["torch_threads"] == fit
        assert (threads["matmul_rates"] is None) == bool(busy)
        trials = pd.read_csv(next((tmp_path / "out").rglob("trials.csv")))
        assert (trials["torch_threads"] == fit).all()  # every trial, the one count
    else:
        assert "bench.threads" not in proc.stderr
        assert threads["torch_threads"] == machine["torch_threads"] == default
    assert threads["setting"] is None and threads["torch_default"] == default
    assert torch.get_num_threads() == default  # put back after the run


# --- verdict words ------------------------------------------------------------------------------
def _row(variant, verdict, speedup, lo, hi, rounds=3, status="ok", baseline=False):
    return {"experiment": "amp", "model": "m", "variant": variant, "is_baseline": baseline,
            "status": status, "verdict": verdict, "speedup": speedup, "speedup_lo": lo,
            "speedup_hi": hi, "rounds": rounds, "ci_level": 0.99}


def test_measured_faster_but_not_settled_is_undecided_with_how_to_settle_it_never_skip():
    summary = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                            _row("bf16", "inconclusive", 1.5, 0.9, 2.49),
                            _row("fp16", "slower", 0.1, 0.08, 0.12)])
    (advice,) = recommend.advise(summary, budget_s=150)
    lines = recommend.lines(advice)
    # not "use: nothing": an undecided 1.5x may still pay off (user trial 5, run 05)
    assert lines[0] == ("nothing settled yet: nothing was significantly faster than plain "
                        "PyTorch; 1 undecided")
    undecided = next(line for line in lines if line.startswith("undecided: amp: bf16"))
    assert undecided.startswith("undecided: amp: bf16, 1.50x [0.90, 2.49]; measure longer: "
                                "about ")
    figure = recommend.more_budget(summary, 150)
    assert "this run had 3" in undecided and \
        f"(give bench.time_budget_s={figure:g} for the whole run)" in undecided
    assert not any(line.startswith("skip:") and "bf16" in line for line in lines)
    assert any(line.startswith("skip: amp: fp16") for line in lines)


def test_a_model_with_nothing_measured_says_so_not_use_nothing():
    summary = pd.DataFrame([_row("fp32", "", float("nan"), None, None, baseline=True),
                            _row("bf16", "", float("nan"), None, None,
                                 status="not measured: the run's bench.time_budget_s ran out")])
    (advice,) = recommend.advise(summary)
    assert recommend.lines(advice)[0] == ("nothing measured: no technique could be measured for "
                                          "this model (see could not test here)")
    console = recommend.console_lines(summary)  # the same words, not "use nothing was ..."
    said = " ".join(line.strip() for line in console[1:])  # wrapped to the terminal's width
    assert said.startswith("m: nothing measured: no technique could be measured for this model "
                           "(see could not test here)"), console
    only_undecided = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                                   _row("bf16", "inconclusive", 1.2, 0.9, 1.6)])
    (advice,) = recommend.advise(only_undecided)
    assert recommend.lines(advice)[0] == ("nothing settled yet: what was measured is undecided "
                                          "against plain PyTorch")


# --- one budget figure per run ------------------------------------------------------------------
STOPPED = ("not measured: a steady probe step took 8.2 s; two rounds with its trials would need "
           "about 62 s, more than the 27 s of rounds its share of the run holds; to measure it "
           "give a larger bench.time_budget_s")
FIGURE = re.compile(r"bench\.time_budget_s(?:=| about )([0-9][0-9.e+]*)")


def _unsettled_summary(need_s: float) -> pd.DataFrame:
    """fp32 (baseline), bf16 measured faster but not settled, fp16 stopped by its probe for
    time (its need `need_s`); the plan's figure, 390, on every row."""
    from test_report_figures import trials_frame

    from speedbench.analysis.summary import summarise

    trials = trials_frame(variants=("fp32", "bf16", "fp16"), models=("m",),
                          statuses={"fp16": STOPPED})
    trials["budget_need_s"] = [need_s if v == "fp16" else 390.0 for v in trials["variant"]]
    summary = summarise(trials).assign(round_sd=0.9, unsteady=0)
    summary.loc[summary["variant"] == "bf16", ["speedup", "speedup_lo", "speedup_hi",
                                               "verdict"]] = [1.1, 0.6, 2.0, "inconclusive"]
    return summary


@pytest.mark.parametrize("need_s, noise", [(660.0, {"round_sd": 0.9}), (200.0, {}),
                                           (660.0, {"round_sd": 0.0, "unsteady": 1})])
def test_a_runs_outputs_give_one_budget_figure(need_s, noise, tmp_path):
    """The console's table and footnotes, its "measure again" and recommendation, the report's
    recommendation and summary table (Markdown and HTML) all give the run's one figure
    (recommend.more_budget): the largest of the plan's, a stopped variant's need and what
    settles the undecided comparison."""
    from speedbench.report import document
    from speedbench.report.render import console_table, console_warnings, summary_table

    summary = _unsettled_summary(need_s).assign(**noise)
    figure = recommend.more_budget(summary, 150)
    factor = recommend.budget_factor(summary[summary["variant"] == "bf16"].iloc[0].to_dict())
    assert figure == float(f"{max(390.0, need_s, 150 * factor):.2g}")
    console = "\n".join([console_table(summary)]
                        + console_warnings(summary, "amp", ["bench.time_budget_s=150"],
                                           budget_s=150)
                        + recommend.console_lines(summary, budget_s=150))
    doc = document.Document(title="t")
    recommend.add_section(doc, summary, budget_s=150)
    doc.table(summary_table(summary))
    report = document.to_markdown(doc) + document.to_html(doc, tmp_path, 100)
    for text in (console, report):
        assert {float(f) for f in FIGURE.findall(text)} == {figure}, FIGURE.findall(text)
        assert "says how much" not in text and "this run's)" not in text
    assert f"budget: bench.time_budget_s={figure:g} for the whole run (this run had 150 s)" \
        in " ".join(line.strip() for line in console.splitlines())
    if "measure again:" in console:  # noisy or unsteady: the command carries the one figure
        assert f"bench.time_budget_s={figure:g}" in console.split("measure again:")[1]
    assert max(map(len, console.splitlines())) <= 100


def test_the_plan_says_the_runs_figure_with_the_probes_needs():
    from speedbench.studies import costs

    assert costs.run_budget_figure([390.0, None, 661.0], 150) == 660.0
    assert costs.run_budget_figure([120.0, None], 150) is None  # enough: nothing to advise
    assert costs.run_budget_figure([None], 150) is None and \
        costs.run_budget_figure([390.0], None) is None
    line = costs.run_budget_line([390.0, 661.0], 150)
    assert line.startswith("speedbench: budget: about bench.time_budget_s=660 for the whole run "
                           "(this run has 150 s)")


# --- where one round fits, the baseline runs first in it -----------------------------------------
@pytest.mark.parametrize("order_seed", range(4))
def test_where_one_round_fits_the_baseline_runs_first(order_seed, tmp_path, monkeypatch):
    monkeypatch.setattr(flops, "matmul_peak_tflops", lambda device, precision, **_: 1.0)
    plan = build_plan(compose_cfg(*TINY, "model=transformer", f"bench.order_seed={order_seed}",
                                  "bench.explain=false", experiment="amp"), "amp")
    now, ran = [0.0], []

    def probe(mc, name, dataset, ref, steps, left_s):  # 3 s a step: a round of about 45 s
        return {"probe_samples_per_s": 4 / 3.0, "quality_steps": 0}

    def trial(mc, name, round_, position, *_):
        now[0] += 15.0
        ran.append(name)
        return {**mc.header(name, round_, position), "status": "ok", "samples_per_s": 1.0,
                "step_ms": 3000.0}
    study.measure_plan(plan, tmp_path, progress=False, budget=Budget(60, clock=lambda: now[0]),
                       instruments=study.Instruments(trial=trial, probe=probe))
    assert ran[0] == "fp32"


# --- the recipe search says when it stopped underpowered -----------------------------------------
def test_an_open_confirmation_is_measured_again_and_else_the_search_is_not_decided():
    """A 1.3x option measured in 3 noisy rounds: a confirmation that neither settles nor rules
    it out is measured again, afresh, as the next step, where the budget fits; a search that
    still chose nothing with an option open says it is not decided (recipe.yaml: decided
    false)."""
    from test_search import NAIVE, World, groups

    again = undecided = 0
    for seed in range(40):
        world = World({("precision", "bf16"): 1.3}, seed, rounds=3, sigma=0.25, stall_p=0.0)
        r = S.search(groups()[:1], NAIVE, world, budget=Budget(None, world.clock),
                     min_rounds=3, screen_rounds=3)
        for first, second in zip(r.steps, r.steps[1:]):
            if not second.comparisons:  # a re-confirmation: no screen, its own level
                again += 1
                assert set(second.confirmations) == {c.label for c in S.open_options(
                    first.confirmations.values(), 1.02)}
                assert f"step {second.index} confirm" in r.levels
        open_ = S.open_options(r.steps[-1].confirmations.values(), 1.02) if r.steps else []
        if r.chosen or not open_:
            assert r.chosen or not r.undecided.startswith("not decided: ") or not r.steps
            continue
        undecided += 1
        assert r.undecided.startswith("not decided: "), r.undecided
        assert all(c.label in r.undecided for c in open_), r.undecided
        assert "measured faster in its confirmation but not settled in 3 rounds" in r.undecided
    assert again >= 1 and undecided >= 1  # the noise makes some of the 40 end each way


def test_the_busy_note_never_asks_for_fewer_than_one_thread():
    """User trial, after round 5: with bench.threads=auto at 1 thread the report said 'give
    fewer threads than this run's 1'."""
    from speedbench.report.render import busy_note

    load = {"busy": True, "load_highest": 9.9, "cores": 2, "own_cpu_share": 0.16}
    one = busy_note({"machine_load": load,
                     "bench_threads": {"setting": "auto", "torch_threads": 1}})
    assert one.endswith("Measure again on a quiet machine.") and "fewer" not in one
    two = busy_note({"machine_load": load,
                     "bench_threads": {"setting": "auto", "torch_threads": 2}})
    assert "give fewer threads than this run's 2 (bench.threads=N)" in two


def test_the_headline_counts_each_unsettled_row_by_its_own_word():
    """m1: rows with one round (`no CI`) were counted as `not measured`."""
    from speedbench.report.render import at_a_glance

    summary = pd.DataFrame([_row("fp32", "", 1.0, 1.0, 1.0, baseline=True),
                            _row("bf16", "no CI", 1.21, None, None, rounds=1),
                            _row("fp16", "not measured [1]", float("nan"), None, None),
                            _row("tf32", "inconclusive", 1.1, 0.9, 1.3)])
    assert at_a_glance(summary).startswith(
        "Of 3 (model, variant) pairs: 1 inconclusive, 1 no CI, 1 not measured.")
