"""Round 5's hostile cases (issue 50) that are not the model's process state
(test_reliability_isolation.py holds those): a fault in the quality probe is its quality row's
status, said once (K2); a write that fails on its open descriptor (a full disk) names its file,
and a run ends in one line naming it (K6); the matmul peaks and the forecast profile's warm-up
keep the run's clock (K4); a huge lazy data set is never permuted whole (K3).

Each asserts what the code decided and recorded, never how fast the machine was.
"""
from __future__ import annotations

import contextlib
import errno
import resource
import signal
from pathlib import Path

import pandas as pd
import pytest
from conftest import SMALL_MODELS, TINY, only_run_dir, run_cli, run_main

from speedbench.results import atomic

TOKENS = "loss: module, batch_size: 4, dataset: {kind: tokens, seq_len: 8, vocab_size: 16}"


def _fails_at(how: str, tag: str, at: int = 3) -> str:
    return f"{{_target_: fault_models.FailsAt, at: {at}, how: {how}, tag: {tag}, {TOKENS}}}"


# --- K2: a fault in the quality probe ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how, said", [
    ("raise", "RuntimeError: fails at call 3"),
    ("exit", "ModelExit: the model's code called sys.exit(7)"),
    ("generator_exit", "ModelExit: the model's code raised GeneratorExit (a BaseException)"),
])
def test_a_fault_in_the_quality_probe_is_its_quality_rows_status_said_once(how, said, tmp_path):
    """Call 3 is the probe's first training step (calls 1 and 2 evaluate the fresh model): the
    probe fails there; the trials after it train."""
    proc = run_main(*TINY, *SMALL_MODELS, "bench.repeats=1", "bench.explain=false",
                    f"model={_fails_at(how, f'{how}-{tmp_path.name}')}", "out_dir=results",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path / "results")
    statuses = pd.read_csv(run / "quality.csv")["status"].tolist()
    assert len(statuses) == 1 and statuses[0].startswith(
        f"error: the quality probe failed: {said}"), statuses
    said_once = " ".join(proc.stderr.split())  # the console wraps its lines at 100 columns
    assert said_once.count(statuses[0]) == 1, proc.stderr[-3000:]
    assert (pd.read_csv(run / "trials.csv")["status"] == "ok").all()


# --- K1 (d): a model closes the process's standard output -----------------------------------------
@pytest.mark.slow
def test_a_model_that_closes_stdout_has_it_put_back_and_said(tmp_path):
    """os.close(1) in forward (call 3, in the probe) made the console's summary raise OSError
    (Errno 9) after every file was written: a traceback, exit 1. A fresh process: descriptor 1
    is the process's, not this test's."""
    proc = run_cli(*TINY, *SMALL_MODELS, "bench.repeats=1", "bench.explain=false",
                   "bench.quality_steps=0", f"model={_fails_at('close_stdout', 'fd')}",
                   "out_dir=results", cwd=tmp_path, timeout=300,
                   env={"PYTHONPATH": str(Path(__file__).resolve().parent)})  # fault_models
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "report:" in proc.stdout  # the summary, written to descriptor 1 after the trials
    said = " ".join(proc.stderr.split())
    assert said.count("its code changes the standard output or error descriptor (to stdout "
                      "closed, stderr as it was)") == 1, proc.stderr[-3000:]
    run = only_run_dir(tmp_path / "results")
    assert (pd.read_csv(run / "trials.csv")["status"] == "ok").all()


# --- K6: a full disk names the file ---------------------------------------------------------------
@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past `limit` bytes fail on their descriptor (EFBIG), as on a full disk (ENOSPC):
    the kernel's error, with no file name."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (its default ends the process)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("write", ["write_text", "append_rows", "append_text"])
def test_a_write_that_fails_on_its_descriptor_names_the_file(write, tmp_path):
    path = tmp_path / "quality.csv"
    if write != "write_text":
        path.write_text("a\n")
    text = "x" * 20_000 + "\n"
    with pytest.raises(OSError) as info, _file_size_limit(4096):
        if write == "write_text":
            atomic.write_text(path, text)
        elif write == "append_rows":
            atomic.append_rows(path, ["a"], [{"a": text}])
        else:
            atomic.append_text(path, text)
    assert info.value.filename == str(path) and info.value.errno == errno.EFBIG, info.value
    # no temp file left, and no half write: the file as it was (none, or its line)
    assert [p.name for p in tmp_path.iterdir()] == ([] if write == "write_text"
                                                    else ["quality.csv"])
    assert write == "write_text" or path.read_text() == "a\n"


@pytest.fixture
def disk_full_at(monkeypatch):
    """disk_full_at(name, nth): the nth whole write of the run directory's file `name` fails on
    its descriptor (every other write as usual)."""
    left, real = {}, atomic.temp_copy_of

    def temp_copy(path, data):
        if path.name in left:
            left[path.name] -= 1
            if not left[path.name]:
                with _file_size_limit(max(1, len(data) // 2)):
                    return real(path, data)
        return real(path, data)

    monkeypatch.setattr(atomic, "temp_copy_of", temp_copy)  # every write's temp file
    return left.__setitem__


@pytest.mark.slow
@pytest.mark.parametrize("name, nth", [("quality.csv", 1), ("forecast.csv", 1),
                                       ("explain.csv", 1), ("planned.json", 2)])
def test_a_full_disk_while_a_table_is_written_ends_the_run_in_one_line_naming_it(
        name, nth, disk_full_at, tmp_path):
    """(planned.json's second write marks the end of measuring)"""
    disk_full_at(name, nth)
    proc = run_main(*TINY, *SMALL_MODELS, "bench.repeats=1", "bench.explain=true",
                    "+variants={a: {precision: fp32}, b: {precision: fp32}}", "baseline=a",
                    "model=transformer", "out_dir=results", cwd=tmp_path)
    run = only_run_dir(tmp_path / "results")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "speedbench: error:" in line]
    assert len(said) == 1 and said[0].startswith(
        f"speedbench: error: out_dir: cannot write {run / name} ("), said
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


# --- K4: every phase keeps the run's clock; the user's data set is built once ------------------
def test_the_matmul_peaks_take_their_share_of_the_runs_budget(monkeypatch):
    import math

    import torch

    from speedbench.measure import flops
    from speedbench.measure.budget import Budget

    asked = []
    monkeypatch.setattr(flops, "matmul_peak_tflops",
                        lambda device, precision, duration_s, **kw: asked.append(duration_s) or 1)
    book = flops.FlopsBook(torch.device("cpu"), peak_s=1e6)  # bench.peak_s far past the budget
    book.measure_peaks(["fp32", "bf16"], Budget(20.0))
    share = flops.PEAK_SHARE * 20.0  # the first kind its half, each layout a quarter
    assert len(asked) == 2 and asked[0] <= share / 4 and asked[1] <= share / 2, asked
    unbounded = flops.FlopsBook(torch.device("cpu"), peak_s=1.5)
    unbounded.measure_peaks(["fp32"], Budget(None))  # no budget: bench.peak_s per layout
    assert asked[-1] == 1.5
    spent = flops.FlopsBook(torch.device("cpu"), peak_s=1.5)
    spent.measure_peaks(["fp32"], Budget(0.0))  # nothing left: not measured
    assert len(asked) == 3 and math.isnan(spent.peaks["fp32"])


class LoadArrives:
    """A matrix product that costs nothing for its first `quiet` calls (the sizing and the
    warm-up), then 50 ms each (a sleep: the machine's own load does not change it); past 50
    slow calls it raises, so a measurement that would not stop fails fast instead of hanging."""

    def __init__(self, quiet: int):
        self.quiet, self.calls = quiet, 0

    def __call__(self, a, b):
        import time

        self.calls += 1
        if self.calls > self.quiet:
            if self.calls > self.quiet + 50:
                raise RuntimeError("still measuring long past its time")
            time.sleep(0.05)
        return a[:1, :1]

    @property
    def slow(self) -> int:
        return self.calls - self.quiet


@pytest.mark.parametrize("measure, quiet", [
    ("peak", 8),    # one layout: sizing 256-1024 (2 calls each), then the 2 warm-up products
    ("ratio", 18),  # two dtypes' sizing (12), each side's layout and window size (6)
])
def test_a_load_that_arrives_after_the_sizing_cannot_stretch_the_peaks(measure, quiet):
    """Beside a load of 10, 2 threads made each product ~100x slower than when its window was
    sized: the peaks took 150 s of their 7 s share (c_skip_noexplain: 170 s of a 140 s
    budget, every row 'not measured'). A window now ends with the measurement's time."""
    import torch

    from speedbench.measure import flops

    product = LoadArrives(quiet)
    if measure == "peak":
        flops.matmul_peak_tflops(torch.device("cpu"), "fp32", duration_s=0.5, products=(product,))
    else:
        flops.paired_peak_ratio(torch.device("cpu"), "bf16", max_s=0.5, products=(product,))
    assert 1 <= product.slow <= 0.5 / 0.05 + 2, product.calls  # not the window's 10^5 reps


def test_the_forecast_profiles_warm_up_is_held_as_a_trials_is(monkeypatch):
    """A step time that never settles: the profile's warm-up past its floor stops at a quarter
    of bench.max_trial_s, as a trial's, not at the end of the budget."""
    from conftest import compose_cfg

    from speedbench.config import build_plan
    from speedbench.measure import explain
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import context, dataset_length

    held = []
    monkeypatch.setattr(explain, "warm_up", lambda *a, budget_s=None: held.append(budget_s)
                        or (1, False))
    plan = build_plan(compose_cfg(*TINY, *SMALL_MODELS, "model=transformer",
                                  "bench.max_trial_s=4", "bench.steady_tol=1e-12",
                                  "bench.warmup_max=100000"), None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    data = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    got = explain.profile_recipe(spec, recipe, context(plan), data, 1, left_s=200.0)
    assert held == [1.0] and got.steps, held
    assert explain.warm_up_s(recipe.bench, 0.5) == 0.5


def test_the_users_data_set_is_built_once_for_its_check_and_its_study():
    from conftest import compose_cfg
    from fault_models import BUILDS

    from speedbench.config import build_plan
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import check_data, dataset_length

    tag = "built-once"
    model = ("{_target_: fault_models.Meddler, loss: module, batch_size: 4, dataset: "
             f"{{_target_: fault_models.counted_tokens, tag: {tag}}}}}")
    plan = build_plan(compose_cfg(*TINY, f"model={model}"), None)
    spec = plan.models[0]
    check_data(plan, spec)
    data = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)  # the study's
    assert BUILDS[tag] == 1 and len(data) == 64


# --- K3: a huge lazy data set is never permuted whole ---------------------------------------------
def test_the_held_out_share_of_a_huge_lazy_data_set_is_drawn_without_listing_it():
    import torch
    from fault_models import Tokens

    from speedbench.measure import held_out
    from speedbench.measure.data import LazyShuffle, build_loader

    class Spec:
        name, loss, dataset = "huge", "module", {}

    n = 2_000_000_000
    train, (x, _), _ = held_out.split(Tokens(n), Spec, 0, 128)
    assert len(train) == n - 128 and not isinstance(train.indices, list)
    assert x.shape == (128, 8)
    loader = build_loader(train, 4, None, seed=0)
    assert isinstance(loader.sampler, LazyShuffle)
    first = next(iter(loader))[0]
    assert first.shape == (4, 8) and torch.equal(first, next(iter(build_loader(
        train, 4, None, seed=0)))[0])  # the same order from the same seed
    assert held_out.calibration(train, 0, 16)[0].shape == (16, 8)


def test_the_indices_kept_are_the_rest_in_order():
    from speedbench.measure.held_out import _Kept

    held = [3, 0, 7, 19]
    kept = _Kept(20, held)
    assert list(kept) == [i for i in range(20) if i not in held]
    assert kept[-1] == 18 and kept[1:3] == [2, 4]
    with pytest.raises(IndexError):
        kept[16]


# --- K9: a data set whose length fails ------------------------------------------------------------
@pytest.mark.parametrize("mode, says", [("raise", "RuntimeError: this data set cannot count"),
                                        ("negative", "ValueError: "),
                                        ("float", "TypeError: ")])
def test_a_data_set_whose_len_fails_is_refused_in_one_line(mode, says):
    from speedbench.errors import ConfigError
    from speedbench.measure.own_data import own_dataset

    with pytest.raises(ConfigError) as info:
        own_dataset({"_target_": "fault_models.Tokens", "len_mode": mode})
    text = str(info.value)
    assert text.startswith("data: _target_ fault_models.Tokens: len() failed: " + says), text
    assert "\n" not in text


# --- K11: sys.exit() in an own data set's items ---------------------------------------------------
def test_a_data_set_that_exits_reading_an_item_is_refused_in_one_line():
    """a_exit_item: sys.exit(6) from item 1 on ended speedbench silently with exit 6 (the check
    reads item 1 to make a batch, outside its guard for item 0)."""
    from speedbench.errors import ConfigError
    from speedbench.measure.own_data import own_dataset

    with pytest.raises(ConfigError) as info:
        own_dataset({"_target_": "fault_models.Tokens", "item_mode": "exit"})
    assert str(info.value) == ("data: _target_ fault_models.Tokens: reading item 1 failed: "
                               "SystemExit: 6")


# --- K12: an option that acts on forecasts says when none is made ---------------------------------
def test_options_that_need_the_forecasts_say_so_where_none_is_made():
    from conftest import compose_cfg

    from speedbench.run import forecast_notes

    off = compose_cfg(*TINY, "bench.skip_by_forecast=true", "bench.explain=false")
    assert forecast_notes(off, None) == [
        "bench.skip_by_forecast needs the forecasts of bench.explain (bench.explain=false): "
        "every variant is measured"]
    assert forecast_notes(compose_cfg(*TINY, "bench.skip_by_forecast=true",
                                      "bench.explain=true"), None) == []
    search = compose_cfg(*TINY, "bench.explain=false", experiment="recipe")
    assert any(n.startswith("recipe.forecasts needs bench.explain") for n in
               forecast_notes(search, None)) == bool(search.recipe.forecasts)
    quick = compose_cfg(*TINY, "bench.skip_by_forecast=true", "bench.mode=quick")
    assert forecast_notes(quick, None) == [  # quick mode explains nothing (was: no word)
        "bench.skip_by_forecast needs the forecasts of bench.explain (bench.mode=quick makes "
        "none): every variant is measured"]


# --- K16: an empty --out ------------------------------------------------------------------------
def test_the_report_tool_refuses_an_empty_out(tmp_path, capsys):
    from speedbench.report.__main__ import main

    with pytest.raises(SystemExit) as info:
        main([str(tmp_path), str(tmp_path), "--out", ""])
    assert info.value.code == 2 and "--out: empty" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# --- K10: a hand-edited planned.json nested past Python's limit -------------------------------
def test_a_planned_json_nested_too_deep_is_read_as_unreadable(tmp_path):
    from speedbench.results import planned

    (tmp_path / planned.FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert planned.unfinished(tmp_path, pd.DataFrame()) is None


# --- K17: the libraries' warnings stay off the report tool's console --------------------------
def test_figures_are_drawn_without_the_libraries_warnings():
    import warnings

    from speedbench.report import plots

    @plots._styled
    def figure():
        warnings.warn("Tight layout not applied", UserWarning)
        warnings.warn("invalid value encountered in subtract", RuntimeWarning)
        return 1

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert figure() == 1
    assert not seen, [str(w.message) for w in seen]



def test_a_trials_table_read_back_is_reported_without_a_pandas_warning(tmp_path):
    """Seen rerunning x_counted, a_len_1e7 and i_skip: every run's console showed pandas'
    'DataFrame is highly fragmented' PerformanceWarning from the report's stall check."""
    import warnings

    from speedbench import techniques
    from speedbench.report import method
    from speedbench.results import load_trials
    from speedbench.results.schema import trial_columns

    row = {c: 1.0 for c in trial_columns(techniques.column_names())}  # as a run writes it
    row.update(experiment="e", model="m", variant="v", is_baseline=True, status="ok",
               device="cpu")
    pd.DataFrame([row, {**row, "variant": "w", "is_baseline": False}]).to_csv(
        tmp_path / "trials.csv", index=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trials = load_trials(tmp_path)
        method.stalled_windows(trials)
    assert len(trials) == 2 and not seen, [str(w.message)[:80] for w in seen]


def test_a_stop_signal_taken_while_a_model_trains_is_not_said_as_the_models_change():
    """i_term_rank0c, rerun: SIGTERM to torchrun's rank 0 in a trial; its handling set the
    handlers (distributed's on_term hands SIGTERM back to the command's), and the note blamed
    the built-in transformer: 'its code changes the stop signals' handlers'."""
    import os
    import time

    from speedbench import errors
    from speedbench.measure import isolation

    command = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # as distributed.outlive_peer_failure's, where no peer failed
        signal.signal(signal.SIGTERM, command)
        raise errors.ask_to_stop(errors.Terminated(signum))

    said = []
    signal.signal(signal.SIGTERM, on_term)
    try:
        with pytest.raises(errors.Terminated), isolation.isolated("m", said.append):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (ended at once by the handler's stop)
        assert not said and signal.getsignal(signal.SIGTERM) is command, said
    finally:
        signal.signal(signal.SIGTERM, command)
        errors.clear_stop()


def test_a_models_change_is_said_within_the_consoles_100_columns(capsys):
    """Rerunning the K1 cases: the note was one console line of 248 columns."""
    import gc

    from speedbench.measure import isolation

    with isolation.isolated("a-model-with-a-long-name"):
        gc.set_threshold(1, 1, 1)
    said = capsys.readouterr().err
    assert "its code changes the garbage collector's thresholds" in " ".join(said.split())
    assert all(len(line) <= 100 for line in said.splitlines()), said

# --- K15: a stale TORCHELASTIC_RUN_ID does not name a sweep's folder --------------------------
def test_a_run_id_left_in_the_shell_does_not_name_the_sweep_folder(monkeypatch):
    from speedbench.config.schema import TORCHRUN_WORKER, sweep_id

    for name in TORCHRUN_WORKER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "stale")
    assert sweep_id("2026-12-04_21-00-00") == "2026-12-04_21-00-00"
    for name, value in zip(TORCHRUN_WORKER, ("0", "1", "1", "2")):
        monkeypatch.setenv(name, value)
    assert sweep_id("2026-12-04_21-00-00") == "stale"  # torchrun's worker: its job's id



def test_a_sweep_started_in_the_same_second_as_another_gets_a_folder_of_its_own(tmp_path,
                                                                                   monkeypatch):
    """e_two_sweeps_same_runid, rerun: two sweeps started together named their folder by the
    same second and shared it (the second's outcome.txt files replaced the first's)."""
    from hydra import compose, initialize_config_dir
    from speedbench.config.schema import TORCHRUN_WORKER, config_dir, register_schema, sweep_id

    for name in TORCHRUN_WORKER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "stale")
    when = "2026-12-05_07-05-00"
    (tmp_path / "multirun" / when).mkdir(parents=True)  # the other sweep's
    mine = sweep_id(when, str(tmp_path))
    assert mine == when + "-1" and (tmp_path / "multirun" / mine).is_dir()
    assert sweep_id(when, str(tmp_path)) == mine  # asked again for each job: the same folder
    register_schema()  # config.yaml's sweep folder is the one made
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=[f"out_dir={tmp_path / 'b'}"])
    got = Path(cfg.hydra.sweep.dir)
    assert got.parent == tmp_path / "b" / "multirun" and got.is_dir()
    assert Path(cfg.hydra.sweep.dir) == got

def test_the_host_out_of_memory_while_data_is_read_is_not_blamed_on_the_model():
    from conftest import compose_cfg

    from speedbench.config import build_plan
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import dataset_length, measure_trial

    model = ("{_target_: fault_models.Meddler, loss: module, batch_size: 4, dataset: "
             "{_target_: fault_models.Tokens, item_mode: memory}}")
    plan = build_plan(compose_cfg(*TINY, "bench.repeats=1", f"model={model}"), None)
    spec = plan.models[0]
    data = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    record = measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, data)
    assert record["status"] == "oom (reading the data, not the model)", record["status"]


# --- K8: hand-edited explain.csv values ----------------------------------------------------------
def _explain_csv(path, edit=None):
    from speedbench.results.schema import EXPLAIN_CATEGORIES

    rows = [{"experiment": "e", "model": "m", "variant": v, "is_baseline": v == "a",
             "stage": "paired", "category": c, "steps": 3, "mean_ms": 1.0, "sd_ms": 0.1,
             "per_step": 4, "status": "ok"}
            for v in ("a", "b") for c in (*EXPLAIN_CATEGORIES, "step")]
    frame = pd.DataFrame(rows)
    if edit:
        frame = edit(frame)
    frame.to_csv(path / "explain.csv", index=False)


@pytest.mark.parametrize("case, edit", [
    ("inf", lambda f: f.assign(mean_ms=f["mean_ms"].where(f.index != 3, float("inf")))),
    ("huge", lambda f: f.assign(sd_ms=1e308)),
    ("text", lambda f: f.assign(mean_ms=f["mean_ms"].astype(object).where(f.index != 2, "x"))),
    ("per_step_0", lambda f: f.assign(per_step=0)),
    ("unknown", lambda f: f.assign(category=f["category"].replace("matmul", "gemm"))),
    ("dropped", lambda f: f.drop(index=[0])),
])
def test_an_explain_csv_with_unusable_values_is_left_out_with_a_note(case, edit, tmp_path):
    from speedbench.results import runs

    _explain_csv(tmp_path)
    assert runs._explain_table(tmp_path / "explain.csv", []) is not None  # as written: used
    _explain_csv(tmp_path, edit)
    notes = []
    assert runs._explain_table(tmp_path / "explain.csv", notes) is None
    assert len(notes) == 1 and notes[0].startswith("explain.csv left out: "), notes


@pytest.mark.parametrize("forecast, share", [
    ("-1", 0.3), ("0", 0.3), ("nan", 0.3), ("x", 0.3), ("1.5", 5), ("1.5", -1)])
def test_a_forecast_no_run_writes_is_n_a_with_a_note_not_shown_as_measured(forecast, share,
                                                                            tmp_path):
    """K8's rest: forecast.csv's values. An `ok` forecast of -1x or 0x was shown in the table
    as measured ('above the forecast'), with no note."""
    from speedbench.report import explain_section
    from speedbench.results import runs
    from test_report import make_run

    path = make_run(tmp_path / "run", models=("resnet",))
    rows = [{"experiment": "amp", "model": "resnet", "variant": v, "technique": "precision",
             "forecast": f, "share": s, "reason": "matmul is 30 % of the step",
             "status": "ok", "is_bound": True}
            for v, f, s in (("fp16", forecast, share), ("bf16", "1.43", 0.3))]
    pd.DataFrame(rows).to_csv(path / "forecast.csv", index=False)
    run = runs.load_run(path)
    assert [n for n in run.notes if n.startswith("forecast.csv")] == [
        "forecast.csv: 1 forecast(s) not a positive number, or with a share of the step outside "
        "[0, 1], shown as n/a"]
    loaded = runs.load_explain(path)[1]
    assert loaded["forecast"].isna().tolist() == [True, False]  # no -1x in a "Why" sentence
    table = explain_section.forecast_table(loaded, run.summary)
    fp16, bf16 = table.iloc[0], table.iloc[1]
    assert fp16["forecast"] == "n/a" and "not a usable number" in fp16["why"]
    assert "above the forecast" not in fp16["measured [CI]"]
    assert bf16["forecast"] == "1.43x" and bf16["why"] == "matmul is 30 % of the step"
