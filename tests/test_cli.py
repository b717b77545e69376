"""The public contract through the command line: files, columns, errors, exit codes."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import torch

from conftest import SMALL_MODELS, TINY, default_sigint, only_run_dir, run_cli, run_main
from speedbench.results.schema import REQUIRED_TRIAL_COLUMNS

SUMMARY_CONTRACT = ["experiment", "model", "variant", "is_baseline", "status", "samples_per_s",
                    "speedup", "speedup_lo", "speedup_hi", "verdict"]


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory):
    """One run of the amp experiment through the command line, shared by the tests of its files.
    Two models, given out of the config's (and alphabetical) order, keep the ordering checks
    meaningful; ResNet-18's bf16 steps would take seconds each on a CPU."""
    out = tmp_path_factory.mktemp("amp")
    proc = run_cli("+experiment=amp", *TINY, *SMALL_MODELS, "model=[vae,transformer]",
                   f"out_dir={out}", cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, only_run_dir(out)


def test_amp_writes_the_contract_files(amp_run):
    _, run_dir = amp_run
    for name in ("trials.csv", "summary.csv", "report.md", "report.html", "env.json", "config.yaml",
                 "plots/amp-throughput.png"):
        assert (run_dir / name).is_file(), name
    assert run_dir.parent.name == "amp"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["versions"]["torch"] == torch.__version__.split("+")[0]  # without the local tag
    assert env["cpu_count"] == os.cpu_count()
    written = json.loads((run_dir / "techniques.json").read_text())["techniques"]
    assert [t["name"] for t in written][0] == "precision" and written[0]["snippets"]


def test_amp_trials_are_complete_and_consistent(amp_run):
    _, run_dir = amp_run
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(REQUIRED_TRIAL_COLUMNS) <= set(trials.columns)
    # 2 models x 3 variants x 2 trials, measured on the CPU; fp16, tens of times slower than fp32
    # on most CPUs, may be stopped as too slow after its probe's first steps: then one row
    ok = trials[trials["variant"] != "fp16"]
    assert len(ok) == 8 and set(ok["status"]) == {"ok"}, trials[["model", "variant", "status"]]
    for _, fp16 in trials[trials["variant"] == "fp16"].groupby("model"):
        assert list(fp16["status"]) == ["ok", "ok"] or \
            (len(fp16) == 1 and fp16["status"].iloc[0].startswith("too slow: ")), fp16["status"]
    trials = trials[trials["status"] == "ok"]
    assert set(trials["variant"]) == {"fp32", "fp16", "bf16"}
    assert (trials["samples_per_s"] > 0).all() and trials["final_loss"].notna().all()
    assert (trials["data_wait_frac"].between(0, 1)).all()
    # samples/s and step time describe the same window
    per_step = trials["batch_size"] * trials["accumulate"]
    assert ((per_step / (trials["step_ms"] / 1000)) / trials["samples_per_s"]).sub(1).abs().max() < 1e-6
    # rounds: within a model, each round runs every variant once, in an order shuffled per round
    for _, model in trials.groupby("model"):
        names = sorted(set(model["variant"]))
        assert {"bf16", "fp32"} <= set(names)
        for _, one in model.groupby("round"):
            assert sorted(one["variant"]) == names and one["position"].is_unique
    assert (trials["trial"] == trials["round"]).all()


def test_amp_summary_has_speedup_with_ci_and_verdicts(amp_run):
    proc, run_dir = amp_run
    summary = pd.read_csv(run_dir / "summary.csv")
    assert set(SUMMARY_CONTRACT) <= set(summary.columns)
    assert len(summary) == 6
    base = summary[summary["is_baseline"]]
    assert (base["speedup"] == 1).all() and (base["verdict"] == "baseline").all()
    other = summary[~summary["is_baseline"] & (summary["verdict"] != "slower (stopped early)")]
    assert (other["speedup_lo"] <= other["speedup"]).all() and (other["speedup"] <= other["speedup_hi"]).all()
    assert set(other["verdict"]) <= {"faster", "slower", "equivalent", "inconclusive"}
    assert len(other) >= 2  # bf16 on every model at least
    # whatever order the rounds ran in, each model lists its baseline first, then the file's order
    for _, one in summary.groupby("model", sort=False):
        assert list(one["variant"]) == ["fp32", "fp16", "bf16"]
    assert list(summary["model"].drop_duplicates()) == ["vae", "transformer"]
    # the console table names every model and variant
    for word in ("vae", "transformer", "fp16", "bf16", "speed-up"):
        assert word in proc.stdout


def test_amp_report_quotes_the_claims(amp_run):
    _, run_dir = amp_run
    md = (run_dir / "report.md").read_text()
    assert "half the memory" in md and "3-8 times" in md
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()


# --- a newcomer's mistakes and the console -------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["bench.repets=5"], "unknown key bench.repets; did you mean bench.repeats?"),
    (["+experiment=amp", "modle=resnet"], "unknown key modle; did you mean model?"),
    (["+bench.repets=5"], "did you mean bench.repeats?"),
    (["+experiment=ampp"], "unknown experiment ampp; did you mean amp?"),
    (["experiment=amp"], "write +experiment=amp"),
])
def test_typos_get_a_suggestion_exit_2_and_no_hydra_advice(tmp_path, args, expected):
    proc = run_main(*args, f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "To append to your config use" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_help_names_speedbench_and_lists_experiments_and_knobs(tmp_path):
    from speedbench.__main__ import experiment_names

    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("speedbench") and "__main__" not in text
    assert "is powered by Hydra" not in text
    for name in experiment_names():
        assert name in text, name
    for knob in ("precision=", "model=", "bench.repeats=", "data.num_workers=", "device="):
        assert knob in text, knob


def test_console_ends_with_the_table_within_100_columns_and_the_report_path(amp_run):
    proc, run_dir = amp_run
    assert "generated new fontManager" not in proc.stdout + proc.stderr
    lines = proc.stdout.rstrip().splitlines()
    table = lines[lines.index(next(l for l in lines if l.lstrip().startswith("model"))):]
    assert all(len(line) <= 100 for line in table), max(table, key=len)
    report_lines = [l for l in lines if "report.html" in l]
    assert report_lines, proc.stdout[-2000:]
    path = report_lines[-1].split()[-1]
    assert path.startswith("/") and path.endswith("report.html")


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_trials_in_one_line_exit_130(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedbench", "+experiment=amp", *TINY, "model=transformer",
         "bench.repeats=50", f"out_dir={out}"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            len(p.read_text().splitlines()) > 1 for p in out.rglob("trials.csv")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    said = [l for l in stderr.splitlines() if l.startswith("speedbench: interrupted")]
    assert len(said) == 1 and "finished trial" in said[0], stderr[-2000:]
    run_dir = only_run_dir(out)
    assert str(run_dir.resolve()) in said[0]
    assert len(pd.read_csv(run_dir / "trials.csv")) >= 1
