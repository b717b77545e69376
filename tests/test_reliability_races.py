"""One run, one directory, one truth: races between runs, rebuilds and comparisons, names that
try to be paths, and signals in every phase of a run and of the report tool.

Race windows are widened the way a loaded machine widens them: a run paused with SIGSTOP, a
folder taken before the second process gets there. Every subprocess is one this test started,
ended by its pid.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import SMALL_MODELS, TINY, default_sigint, run_main, said_lines
from test_reliability import DDP_ENV, _leftovers, _processes_mentioning, snapshot
from test_report import make_run

from speedbench import results
from speedbench.report.__main__ import main as report_main

T = [*TINY, *SMALL_MODELS, "model=transformer", "bench.repeats=1"]


def _start(args: list[str], cwd: Path, tmp: Path, module: str = "speedbench",
           env: dict | None = None) -> subprocess.Popen:
    """`python -m module args` in the background, its temp folders in `tmp`."""
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
        env={**os.environ, **DDP_ENV, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", **(env or {})})


def _wait_for(predicate, proc: subprocess.Popen, seconds: float = 300) -> bool:
    """Poll `predicate` every 5 ms while `proc` runs."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def _rows(run_dir: Path) -> int:
    trials = run_dir / "trials.csv"
    return max(0, trials.read_bytes().count(b"\n") - 1) if trials.is_file() else 0


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# --- F1: a rebuild during a run --------------------------------------------------------------

@pytest.mark.slow
def test_a_report_rebuild_is_refused_while_its_run_is_going(tmp_path, capsys):
    run = tmp_path / "r"
    proc = _start([*T, "bench.repeats=2", f"run_dir={run}"], tmp_path, tmp_path / "tmp")
    try:
        assert _wait_for(lambda: _rows(run) >= 1, proc), _finish(proc)[1][-3000:]
        proc.send_signal(signal.SIGSTOP)  # the run paused mid-way, as on a busy machine
        rc = report_main([str(run)])
    finally:
        proc.send_signal(signal.SIGCONT)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "its run is still going" in err, err
    assert not (run / "report.md").exists()
    _, stderr = _finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert "no summary.csv" not in (run / "report.md").read_text()
    assert report_main([str(run)]) == 0  # once it has ended, the rebuild goes ahead


def test_the_run_dir_lock_lasts_for_the_run_and_ends_with_it(tmp_path):
    run_dir = results.new_run_dir(str(tmp_path), "x")
    assert results.run_in_progress(run_dir)
    results.release_run_dir(run_dir)
    assert not results.run_in_progress(run_dir)


# --- F4: two runs, one explicit run_dir --------------------------------------------------------

@pytest.mark.parametrize("exists", [False, True], ids=["new", "empty_folder"])
def test_two_runs_given_one_run_dir_cannot_both_take_it(tmp_path, exists):
    target = tmp_path / "r"
    if exists:
        target.mkdir()
    first = results.new_run_dir(str(tmp_path), "x", str(target))
    try:  # the first run has made (or taken) it and written nothing yet: the race's window
        with pytest.raises(FileExistsError, match="already holds a run"):
            results.new_run_dir(str(tmp_path), "x", str(target))
    finally:
        results.release_run_dir(first)


def test_a_second_run_into_a_taken_run_dir_is_refused_in_one_line(tmp_path):
    target = tmp_path / "r"
    held = results.new_run_dir(str(tmp_path), "x", str(target))
    try:
        proc = run_main(*T, f"run_dir={target}", cwd=tmp_path)
    finally:
        results.release_run_dir(held)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = proc.stderr.strip().splitlines()  # a busy machine's note may come first
    assert said[-1] == f"speedbench: error: run_dir: '{target}' already holds a run; " \
                       "choose another" and "Traceback" not in proc.stderr
    assert not any(target.iterdir())


# --- F3: comparisons in the same second -------------------------------------------------------

def test_comparisons_started_in_the_same_second_get_a_folder_each(tmp_path, monkeypatch):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=1.2, seed=1)
    monkeypatch.chdir(tmp_path)
    now = dt.datetime.now()
    taken = []  # another comparison's folders for the seconds to come: the same-second case
    for s in range(30):
        stamp = (now + dt.timedelta(seconds=s)).strftime("%Y-%m-%d_%H-%M-%S")
        folder = tmp_path / "results" / "compare" / stamp
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.md").write_text("another comparison\n")
        taken.append(folder)
    before = {f: snapshot(f) for f in taken}
    assert report_main([str(a), str(b)]) == 0
    assert report_main([str(b), str(a)]) == 0
    assert {f: snapshot(f) for f in taken} == before, "a comparison wrote into another's folder"
    made = [p for p in (tmp_path / "results" / "compare").iterdir() if p not in taken]
    assert len(made) == 2 and all((p / "report.html").is_file() for p in made), made


# --- F2: names are data, never paths ------------------------------------------------------------

HOSTILE_NAMES = ["..", ".", "../../../../escaped", "/abs/escape", "a/b", "a\\b", "a\0b",
                 "-x", "x" * 300, "ünï😀", "", " ", "a\nb", "~", "$HOME", "con", ".hidden"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_a_name_becomes_one_plain_file_name(name, tmp_path):
    safe = results.file_name(name)
    assert safe not in ("", ".", "..") and not safe.startswith(".")
    assert "/" not in safe and "\\" not in safe and "\0" not in safe and len(safe) <= 80
    assert (tmp_path / safe).resolve().parent == tmp_path.resolve()
    assert safe.isascii() and safe.isprintable() and " " not in safe
    others = [n for n in HOSTILE_NAMES if n != name]
    assert safe not in {results.file_name(n) for n in others}, "two names share a file name"


def test_plain_names_keep_their_file_names():
    for name in ("fp32", "amp_bf16", "ddp-2", "lr=0.1", "a.b+c"):
        assert results.file_name(name) == name


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["advanced", "pytorch"])
def test_variant_names_that_look_like_paths_stay_inside_the_run_dir(tmp_path, profile):
    work = tmp_path / "work" / "a" / "b" / "c"  # room for `..` to climb inside tmp_path
    work.mkdir(parents=True)
    outside = tmp_path / "victim"
    outside.mkdir()
    names = ["../../../../../../escaped", str(outside / "abs"), "x" * 300, ".."]
    variants = ", ".join(f"{n}: {{precision: fp32}}" for n in names)
    before = set(tmp_path.rglob("*"))
    proc = run_main(*T, f"profile={profile}", f"+variants={{{variants}}}", f"baseline={names[0]}",
                    "bench.quality_steps=0", f"out_dir={work / 'out'}", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((work / "out").rglob("trials.csv")).parent
    escaped = [p for p in set(tmp_path.rglob("*")) - before if not p.is_relative_to(work / "out")]
    assert not escaped, escaped
    folders = sorted(p.name for p in (run_dir / "profile" / "transformer").iterdir())
    assert len(folders) == len(names) and all(results.file_name(n) in folders for n in names)
    trials = pd.read_csv(run_dir / "trials.csv", keep_default_na=False)
    own = trials[~trials["experiment"].str.startswith("check-")]  # not a finding's check rows
    assert set(own["variant"]) == set(names)  # the names themselves are kept as data


# --- signals in every phase: one line, nothing left (F5, F7, F8, F18) ---------------------------

DDP = ["+experiment=dp_vs_ddp", "bench.repeats=1"]


def _maps(pid: int, library: str) -> bool:
    """Whether process `pid` has `library` mapped (/proc/PID/maps)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _in_startup(proc: subprocess.Popen, run: Path, tmp: Path) -> bool:
    # torch's import has begun (its library is mapped): seconds before anything is written.
    # speedbench takes the signals before it; a fixed sleep instead could land before the
    # handlers on a loaded machine, or after the first write on a fast one.
    return _maps(proc.pid, "libtorch") and not run.exists()


def _in_trial(proc: subprocess.Popen, run: Path, tmp: Path) -> bool:
    return (run / "trials.csv").is_file()


def _in_ddp_start(proc: subprocess.Popen, run: Path, tmp: Path) -> bool:
    return any(p.name.startswith("speedbench-launch-") for p in tmp.iterdir())


def _in_report(proc: subprocess.Popen, run: Path, tmp: Path) -> bool:
    return (run / "summary.csv").is_file()


# phase -> (extra overrides, when to send, what the line says)
PHASES = {
    "startup": ([], _in_startup, "nothing was written"),
    "trial": ([], _in_trial, None),
    "ddp_start": (DDP, _in_ddp_start, None),
    "report": ([], _in_report, "and summary.csv in"),
}
STOPPING = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def _stopped_run(tmp_path: Path, phase: str, signals: list[int]) -> dict:
    """A run in its own out_dir, sent `signals` (50 ms apart) once in `phase`; a decoy run
    directory, newer than the run's own, shares the out_dir."""
    extra, ready, _ = PHASES[phase]
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    proc = _start([*T, *extra, f"out_dir={out}"], tmp_path, tmp)
    own = lambda: next((p.parent for p in out.rglob("config.yaml")), None)  # noqa: E731
    try:
        assert _wait_for(lambda: ready(proc, own() or out / "none", tmp), proc), \
            _finish(proc)[1]
        decoy = out / "default" / "9999-12-31_23-59-59"
        if phase != "startup":
            decoy.mkdir(parents=True)
            (decoy / "trials.csv").write_text("experiment\nx\nx\nx\n")
        for i, sig in enumerate(signals):
            time.sleep(0.05 * bool(i))
            proc.send_signal(sig)
        _, err = _finish(proc, timeout=120)
        ranks_gone = _wait_for_true(lambda: not _processes_mentioning(str(tmp)), 30)
        return {"rc": proc.returncode, "err": err, "run": own(), "out": out, "tmp": tmp,
                "ranks_gone": ranks_gone, "decoy": decoy}
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in _processes_mentioning(str(tmp)):  # only what this test started
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _wait_for_true(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not predicate():
        time.sleep(0.2)
    return predicate()


def _check_stopped(result: dict, phase: str, sig: int) -> None:
    err, run = result["err"], result["run"]
    assert result["rc"] == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    said = said_lines(err)
    assert len(said) == 1 and said[0].startswith("speedbench: interrupted"), err[-3000:]
    last = said[0]  # (the progress bar may redraw its last state after it)
    assert result["ranks_gone"], _processes_mentioning(str(result["tmp"]))
    assert _wait_for_true(lambda: not _leftovers(result["tmp"]), 10), _leftovers(result["tmp"])
    assert not [p for p in result["out"].rglob("*") if p.name.endswith(".tmp")]
    text = PHASES[phase][2]
    if text:
        assert text in last, last
    if run is not None and phase != "startup":
        assert str(run.resolve()) in last and str(result["decoy"]) not in last, last


@pytest.mark.slow
@pytest.mark.parametrize("sig", STOPPING, ids=lambda s: s.name)
@pytest.mark.parametrize("phase", [p for p in PHASES if p != "ddp_start"])
def test_a_signal_in_any_phase_gives_one_line_and_leaves_nothing(tmp_path, phase, sig):
    _check_stopped(_stopped_run(tmp_path, phase, [sig]), phase, sig)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM], [signal.SIGHUP],
                                     [signal.SIGTERM, signal.SIGTERM],
                                     [signal.SIGHUP, signal.SIGINT]],
                         ids=lambda s: "-".join(x.name for x in s))
def test_signals_as_a_ddp_trial_starts_leave_no_temp_folder(tmp_path, signals):
    _check_stopped(_stopped_run(tmp_path, "ddp_start", signals), "ddp_start", signals[0])


@pytest.mark.slow
def test_a_second_signal_during_the_cleanup_is_ignored(tmp_path):
    proc = _start([*T, f"out_dir={tmp_path / 'out'}"], tmp_path, tmp_path / "tmp")
    assert _wait_for(lambda: (tmp_path / "out").exists(), proc), _finish(proc)[1]
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        proc.send_signal(sig)
        time.sleep(0.02)
    _, err = _finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    said = said_lines(err)
    assert "Traceback" not in err and len(said) == 1 and said[0].startswith(
        "speedbench: interrupted"), err[-3000:]


# --- the report tool's Ctrl-C and SIGTERM (F12, F16) -------------------------------------------

@pytest.mark.parametrize("sig", STOPPING, ids=lambda s: s.name)
def test_a_signal_to_the_report_tool_gives_one_line_and_no_temp_file(tmp_path, sig):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    proc = _start([str(run)], tmp_path, tmp_path / "tmp", module="speedbench.report")
    assert _wait_for(lambda: (run / "plots").is_dir(), proc, 120), _finish(proc)
    proc.send_signal(sig)  # the plots are being drawn and written
    _, err = _finish(proc, timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert err.strip() == "speedbench.report: interrupted; no file was left half-written (run " \
                          "it again for the whole report)", err[-3000:]
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]



def test_a_signal_inside_an_import_is_still_an_interruption(tmp_path, capsys):
    """A stop raised while matplotlib's Agg backend loads comes back as "ImportError:
    initialization failed" (its cause: the stop): still one line and the signal's status."""
    from speedbench import errors
    from speedbench.report import __main__ as tool

    def write_interrupted_in_an_import(run_dirs, out):
        stop = errors.ask_to_stop(tool.Stopped(signal.SIGHUP))  # what the handler does
        raise ImportError("initialization failed") from stop

    def write_failing_in_an_import(run_dirs, out):
        raise ImportError("a real one")

    run = str(make_run(tmp_path / "run", models=("resnet",)))
    assert report_main([run], write=write_interrupted_in_an_import) == 128 + 1
    assert capsys.readouterr().err.strip().startswith("speedbench.report: interrupted")
    errors.clear_stop()
    with pytest.raises(ImportError, match="a real one"):  # no stop asked: not hidden
        report_main([run], write=write_failing_in_an_import)


def test_a_signal_inside_the_runs_last_import_is_still_an_interruption(tmp_path, monkeypatch):
    """The same for a run: a SIGTERM landing in the report's first figure's import."""
    from speedbench import errors
    from speedbench.report import render

    def report_interrupted_in_an_import(run_dir, cfg=None):
        stop = errors.ask_to_stop(errors.Terminated(signal.SIGTERM))  # what the handler does
        raise ImportError("initialization failed") from stop

    monkeypatch.setattr(render, "write_report", report_interrupted_in_an_import)
    try:
        got = run_main(*T, f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    finally:
        errors.clear_stop()
    assert got.returncode == 128 + signal.SIGTERM, got.stderr[-3000:]
    said = said_lines(got.stderr)
    assert "Traceback" not in got.stderr and len(said) == 1, got.stderr[-3000:]
    assert said[0].startswith("speedbench: interrupted") and "out" in said[0], said

# --- F15: a dead rank is named as the cause ---------------------------------------------------

TORCHRUN_SUMMARY = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_14:30:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
"""
RESET = "error: RuntimeError: Read error [127.0.0.1]:14573: Connection reset by peer"


def test_a_rank_that_died_is_blamed_not_the_one_that_lost_it():
    from speedbench.distributed import blame
    from speedbench.measure.launch import killed_ranks

    assert killed_ranks(TORCHRUN_SUMMARY) == {1: "SIGKILL"}
    assert blame(RESET, 0, {0}, 2, killed_ranks(TORCHRUN_SUMMARY)) == \
        "error: rank 1 died: SIGKILL (rank 0: RuntimeError: Read error [127.0.0.1]:14573: " \
        "Connection reset by peer)"
    assert blame(RESET, 0, {0}, 2).startswith("error: rank 1 died: its connection was lost (")
    assert blame(RESET, 0, {0, 1}, 2).startswith("error: rank 0: RuntimeError")  # both said


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sigkilled_torchrun_rank_is_named_and_the_survivor_says_one_line(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    variants = "+variants={a: {precision: fp32}, b: {precision: fp32}}"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         # A fixed order: no broadcast of a fresh one, so the first collective after the
         # kill is inside a trial, whatever the machine's load
         "-m", "speedbench", *T, "bench.steps=400", "bench.max_trial_s=60", variants,
         "bench.repeats=40",  # rounds enough to be running still when the signal comes
         "bench.order_seed=1",
         "baseline=a", f"out_dir={out}"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **DDP_ENV, "TMPDIR": str(tmp)})
    try:
        assert _wait_for(lambda: any(out.rglob("trials.csv")), proc)
        time.sleep(3)  # into the first trial's window
        # rank 1 by its RANK variable (not the larger pid: pids wrap at pid_max)
        os.kill(_rank_pid(1, str(out)), signal.SIGKILL)
        output, _ = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "Error executing job" not in output, output[-3000:]  # Hydra's traceback on rank 0
    assert "speedbench: rank 0 of 2 failed" in output, output[-3000:]
    # the trial the kill fell in (the first on a slow machine, a later one on a fast one) is
    # the last row, and the rank is named; the trials before it are kept as measured
    statuses = list(pd.read_csv(next(out.rglob("trials.csv")))["status"])
    assert statuses[-1].startswith("error: rank 1 died"), statuses
    assert all(s == "ok" for s in statuses[:-1]), statuses


# --- F9, F19: huge or hostile inputs to a comparison ------------------------------------------

def test_a_comparison_shortens_huge_values_and_reads_no_yaml_alias(tmp_path):
    from test_reliability import _alias_bomb, _env_value

    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=1.2, seed=1)
    _env_value(a, "a" * 2_000_000)
    _env_value(b, "b" * 2_000_000)
    for run in (a, b):
        _alias_bomb(run / "config.yaml")
    assert report_main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert (tmp_path / "cmp" / "report.html").stat().st_size < 2_000_000
    assert "(2,000,000 characters)" in md and "uses YAML aliases" in md


# --- F17: an ASCII-only locale -----------------------------------------------------------------

@pytest.mark.slow
def test_an_ascii_locale_reads_runs_as_utf8_and_prints_what_it_can(tmp_path):
    run = make_run(tmp_path / "run")
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(cfg + "note: ünï 😀\n", encoding="utf-8")
    ascii_only = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
                  "PYTHONIOENCODING": ""}
    proc = subprocess.run([sys.executable, "-m", "speedbench.report", str(run)],
                          capture_output=True, env={**os.environ, **ascii_only}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not valid YAML" not in (run / "report.md").read_text(encoding="utf-8")
    said = subprocess.run(  # what a run prints at its end: variant names in any script
        [sys.executable, "-c", "from speedbench.__main__ import console_never_fails; "
         r"console_never_fails(); print('fp32 vs \u00fcn\u00ef\U0001f600')"],
        capture_output=True, env={**os.environ, **ascii_only}, timeout=300)
    assert said.returncode == 0 and said.stdout == b"fp32 vs ?n??\n", said.stderr[-3000:]


# --- F11: threads the model's code left behind ----------------------------------------------

@pytest.mark.slow
def test_a_run_ends_after_its_report_though_the_model_left_a_thread_running(tmp_path):
    """The model's thread is said; a library's idle worker pool (ThreadPoolExecutor-N_M) is
    not news, and not counted; atexit's handlers (a library's clean-up) still run though the
    interpreter's finalization is skipped."""
    model = ("model={_target_: fault_models.Tiny, fail: leaves_a_thread, "
             "dataset: {kind: images, image_size: 16, num_classes: 10}}")
    marker = tmp_path / "atexit-ran"
    proc = subprocess.run([sys.executable, "-m", "speedbench", *TINY, "bench.repeats=1", model,
                           f"out_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, **DDP_ENV, "ATEXIT_MARKER": str(marker)})
    assert marker.read_text() == "ran"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "speedbench: 1 thread(s) the run started are still running (left-behind: the model's "
        "code or a library it used); exiting without waiting for them"), proc.stderr[-3000:]
    assert "report.html" in proc.stdout


# --- a busy machine ----------------------------------------------------------------------------

BUSY = {"cores": 2, "load_start": 4.1, "load_highest": 4.9, "load_end": 4.4, "cpu_steal": 0.0,
        "own_cpu_share": 0.31, "others_cpu_share": 0.62, "busy": True}


def test_busy_means_other_processes_took_the_cores_not_a_lagging_load_average():
    from speedbench.measure.env import is_busy

    assert not is_busy(4.9, 2, 0.0, 0.05)  # a job that ended just before: the load lags
    assert is_busy(1.0, 2, 0.0, 0.6) and is_busy(1.0, 2, 0.2, 0.0)  # others; the hypervisor
    assert is_busy(4.9, 2, None, None) and not is_busy(2.5, 2, None, None)  # no /proc/stat


def test_other_processes_cpu_time_is_told_apart_from_the_runs_own():
    """Another process's CPU time is others'; this run's own children's, reaped or still
    running (a DataLoader worker, a launched trial), is the run's own."""
    from speedbench.measure import env

    if env._cpu_jiffies() is None:
        pytest.skip("no /proc/stat here")
    spin = "import time\nt = time.time()\nwhile time.time() - t < 5: pass"

    def watched(start):
        """The watch's summary over a spinner's life, and the spinner's own share of the
        machine's CPU meanwhile (what a loaded machine left it: the figure to compare with)."""
        watch = env._LoadWatch()
        watch.thread = True  # no sampler thread: the load average is not what this test reads
        began = time.monotonic()
        watch.start()
        pid = start()
        try:
            time.sleep(1.5)
            got = watch.summary()
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            spun_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return got, spun_s / ((time.monotonic() - began) * os.cpu_count())
        finally:
            os.kill(pid, signal.SIGKILL)

    def other() -> int:  # a spinner that is not this process's descendant (its parent exited)
        out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 & "
                              "echo $!"], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    def child() -> int:
        return subprocess.Popen([sys.executable, "-c", spin]).pid

    # the spinner's share is whatever the machine's other load left it: compared with that
    got, spun = watched(other)
    assert spun > 0.01, "the spinner got no CPU at all: nothing to tell apart"
    assert got["others_cpu_share"] >= 0.6 * spun, (got, spun)
    assert got["own_cpu_share"] < 0.2, got  # this process slept
    got, spun = watched(child)
    assert got["own_cpu_share"] >= 0.6 * spun, (got, spun)  # the live child is the run's


def test_a_busy_machine_is_said_first_and_no_share_of_peak_exceeds_100(tmp_path):
    run = make_run(tmp_path / "run", models=("resnet",))
    env = json.loads((run / "env.json").read_text())
    (run / "env.json").write_text(json.dumps({**env, "machine_load": BUSY}))
    summary = pd.read_csv(run / "summary.csv")
    summary["peak_fraction"] = [4.47, 0.5, 23.48][:len(summary)]
    summary.to_csv(run / "summary.csv", index=False)
    assert report_main([str(run)]) == 0
    md = (run / "report.md").read_text()
    body = [ln for ln in md.splitlines()[1:] if ln.strip()]
    assert body[1].startswith("> The machine was busy: load 4.9 on 2 cores (CPU steal 0 %; this "
                              "run got 31 % of them; other processes 62 %); figures are noisy"), \
        body[:3]
    assert "447" not in md and "2,348" not in md and "over 100 (peak measured low)" in md
    assert "4.1 at the start, 4.9 at most, 4.4 at the end, on 2 cores" in md


@pytest.mark.slow
def test_a_run_beside_a_cpu_bound_process_starts_with_the_busy_note(tmp_path):
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(4 * cores)]  # 4 x the cores: the 1-minute load climbs within a run
    try:
        time.sleep(20)
        proc = subprocess.run([sys.executable, "-m", "speedbench", *T, "bench.repeats=2",
                               f"out_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=900, env={**os.environ, **DDP_ENV})
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("The machine was busy: load "), proc.stdout[:500]
    md = next((tmp_path / "out").rglob("report.md")).read_text()
    assert [ln for ln in md.splitlines()[1:] if ln.strip()][1].startswith(
        "> The machine was busy: load "), md[:800]


# --- round 4: signals the model's code swallows, writes a signal cannot cut, locks a fork keeps

def test_a_stop_signal_during_a_write_waits_for_it_and_leaves_no_temp_file(tmp_path,
                                                                           monkeypatch):
    """G19: the KeyboardInterrupt of a signal that comes while a file is written is raised once
    the write is done; the temp file is never left behind."""
    import tempfile

    from speedbench import errors
    from speedbench.results import atomic

    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_signal(*args, **kwargs):  # a signal right after the temp file exists
        made = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    def handler(signum, frame):
        def stop():
            raise KeyboardInterrupt
        errors.when_free(stop)

    old = signal.signal(signal.SIGTERM, handler)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_signal)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic.write_text(tmp_path / "report.md", "whole")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert (tmp_path / "report.md").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_a_second_stop_signal_ends_a_run_whose_first_was_swallowed():
    """G17: a signal within CLEANUP_S of the first is part of it; a later one ends the process
    (here: the handler's stop_now is called with it) whatever became of the first's
    KeyboardInterrupt."""
    import speedbench.__main__ as cli

    ended, clock = [], [100.0]
    stops = cli.StopSignals(clock=lambda: clock[0], stop_now=ended.append, importing=False)
    cli.errors.clear_stop()
    try:
        with pytest.raises(KeyboardInterrupt):
            stops(signal.SIGINT, None)
        try:  # the model's code swallows it ...
            pass
        except BaseException:
            pass
        clock[0] += cli.CLEANUP_S / 2
        stops(signal.SIGTERM, None)  # a double Ctrl-C: part of the first
        assert ended == []
        clock[0] += cli.CLEANUP_S
        stops(signal.SIGINT, None)  # ... so a later one ends the run at once
        assert ended == [signal.SIGINT]
    finally:
        cli.errors.clear_stop()


def test_the_run_lock_ends_with_the_run_though_the_models_code_forked(tmp_path):
    """G20: a process forked during the run (multiprocessing's fork) does not keep the run
    directory 'still going' once the run has ended."""
    run_dir = results.new_run_dir(str(tmp_path), "x")
    child = os.fork()
    if child == 0:  # the model's helper, living on
        time.sleep(30)
        os._exit(0)
    try:
        results.release_run_dir(run_dir)
        assert not results.run_in_progress(run_dir)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_child_forked_from_a_run_does_not_hold_its_lock_after_the_run_dies(tmp_path):
    """The lock ends with the run's process, not with the last process forked from it."""
    script = ("import os, sys, time\nfrom speedbench import results\n"
              f"d = results.new_run_dir({str(tmp_path)!r}, 'x')\nprint(d, flush=True)\n"
              "if os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\nos._exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    run_dir = Path(proc.stdout.strip())
    assert proc.returncode == 0 and run_dir.is_dir(), proc.stderr
    assert not results.run_in_progress(run_dir)  # its parent is gone; its child lives on


def test_a_signal_after_the_report_is_written_changes_nothing(tmp_path, monkeypatch, capsys):
    """G16: once the report is written, a signal neither makes a traceback nor a failed exit."""
    import speedbench.report.__main__ as tool

    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    handlers = {sig: signal.getsignal(sig) for sig in tool.STOPPING}

    def say_then_signal(line):
        print(line)
        os.kill(os.getpid(), signal.SIGTERM)  # as the success line is printed

    monkeypatch.setattr(sys, "argv", ["speedbench.report", str(run)])
    try:
        rc = tool.main(say=say_then_signal)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert rc == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("report: ")


HANG_SWALLOW = ("model={_target_: fault_models.Tiny, fail: swallows_stops, sleep_s: 60, "
                "dataset: {kind: images, image_size: 16, num_classes: 10}}")


@pytest.mark.slow
def test_a_run_whose_model_swallows_the_first_ctrl_c_ends_at_the_second(tmp_path):
    marker = tmp_path / "swallowing"
    proc = _start([*TINY, "bench.repeats=1", "bench.max_trial_s=null", "bench.quality_steps=0",
                   HANG_SWALLOW, f"out_dir={tmp_path / 'out'}"], tmp_path, tmp_path / "tmp",
                  env={"FAULT_MARKER": str(marker)})
    try:
        assert _wait_for(marker.exists, proc), _finish(proc)[1][-3000:]
        proc.send_signal(signal.SIGINT)  # swallowed by the model's bare except
        time.sleep(2)  # past CLEANUP_S: a second Ctrl-C is not part of the first
        assert proc.poll() is None, "the first Ctrl-C was not swallowed: the test is void"
        proc.send_signal(signal.SIGINT)
        _, err = _finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    said = said_lines(err)
    assert "Traceback" not in err and len(said) == 1, err[-3000:]
    assert said[0].startswith("speedbench: interrupted at a second signal"), said
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.endswith(".tmp")]


# --- torchrun: a stop is 'interrupted', not a dead rank (G2), and no wait at exit (G18) -------

def _torchrun_job(out: Path, tmp: Path, cwd: Path) -> subprocess.Popen:
    """A 2-rank torchrun job of two identical variants with rounds enough to be running still
    when a test's signal comes, its console (stdout and stderr) on stdout."""
    tmp.mkdir()
    variants = "+variants={a: {precision: fp32}, b: {precision: fp32}}"
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "speedbench", *T, "bench.steps=400", "bench.max_trial_s=60", variants,
         "bench.repeats=40", "bench.order_seed=1", "baseline=a", f"out_dir={out}"], cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint,
        env={**os.environ, **DDP_ENV, "TMPDIR": str(tmp)})


def _end_job(proc: subprocess.Popen, out: Path) -> str:
    """The job's console once it ended; what this test started and left is killed."""
    try:
        output, _ = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in _processes_mentioning(str(out)):  # only what this test started
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    return output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_torchrun_job_is_interrupted_not_a_failed_rank(tmp_path, sig):
    out = tmp_path / "out"
    proc = _torchrun_job(out, tmp_path / "tmp", tmp_path)
    try:
        assert _wait_for(lambda: any(out.rglob("trials.csv")), proc)
        time.sleep(3)  # into a trial's window
        proc.send_signal(sig)  # what `docker stop`, `scancel` or Ctrl-C do to torchrun
    finally:
        output = _end_job(proc, out)
    said = said_lines(output)
    assert said and said[-1].startswith("speedbench: interrupted"), output[-3000:]
    assert not any("failed" in ln for ln in said), said
    assert "_destroy_process_group" not in output and "Exception ignored" not in output, \
        output[-3000:]
    statuses = list(pd.read_csv(next(out.rglob("trials.csv")))["status"])
    assert all(s == "ok" for s in statuses), statuses  # no row blames a rank


def _rank_pid(rank: int, mentioning: str) -> int:
    """The pid of torchrun's worker of `rank` among the processes mentioning `mentioning`."""
    for line in _processes_mentioning(mentioning):
        pid = int(line.split(":")[0])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and "torch.distributed.run" not in line:
            return pid
    raise AssertionError(f"no rank {rank} among {_processes_mentioning(mentioning)}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sigterm_to_torchruns_rank_0_alone_is_a_stop_not_a_failed_peer(tmp_path):
    """K5: a `kill` of rank 0's worker (not of torchrun) was taken as notice of a peer's
    failure: lost where the run ended within 20 s, else rank 0 left after 20 s with no word and
    rank 1 was blamed ("Connection closed by peer"). It is a stop: rank 0 says so, keeps the
    finished trials and ends with the signal's status (torchrun's summary names it)."""
    out = tmp_path / "out"
    proc = _torchrun_job(out, tmp_path / "tmp", tmp_path)
    try:
        assert _wait_for(lambda: any(out.rglob("trials.csv")), proc)
        time.sleep(3)  # into a trial's window
        os.kill(_rank_pid(0, str(out)), signal.SIGTERM)
    finally:
        output = _end_job(proc, out)
    said = said_lines(output)
    assert said and said[-1].startswith("speedbench: interrupted by SIGTERM to rank 0; "), \
        output[-3000:]
    assert not any("failed" in ln for ln in said), said
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: 143 ", output), output[-3000:]
    statuses = list(pd.read_csv(next(out.rglob("trials.csv")))["status"])
    assert all(s == "ok" for s in statuses), statuses  # no row blames a rank
