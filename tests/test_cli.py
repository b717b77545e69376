"""The public contract through the command line: files, columns, errors, exit codes."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import TINY, only_run_dir, run_cli

TRIAL_CONTRACT = ["experiment", "model", "variant", "is_baseline", "trial", "status", "device",
                  "world_size", "samples_per_s", "step_ms", "data_wait_frac", "peak_mem_mb",
                  "final_loss"]
SUMMARY_CONTRACT = ["experiment", "model", "variant", "is_baseline", "status", "samples_per_s",
                    "speedup", "speedup_lo", "speedup_hi", "verdict"]


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp")
    proc = run_cli("+experiment=amp", *TINY, f"out_dir={out}", cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, only_run_dir(out)


def test_amp_writes_the_contract_files(amp_run):
    _, run_dir = amp_run
    for name in ("trials.csv", "summary.csv", "report.md", "report.html", "env.json", "config.yaml",
                 "plots/amp-throughput.png"):
        assert (run_dir / name).is_file(), name
    assert run_dir.parent.name == "amp"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["versions"]["torch"] and env["cpu_count"] >= 1


def test_amp_trials_are_complete_and_consistent(amp_run):
    _, run_dir = amp_run
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(TRIAL_CONTRACT) <= set(trials.columns)
    # 3 models x 3 variants x 2 trials, all measured on the CPU
    assert len(trials) == 18
    assert set(trials["status"]) == {"ok"}, trials[["model", "variant", "status"]]
    assert set(trials["variant"]) == {"fp32", "fp16", "bf16"}
    assert (trials["samples_per_s"] > 0).all() and trials["final_loss"].notna().all()
    assert (trials["data_wait_frac"].between(0, 1)).all()
    # samples/s and step time describe the same window
    per_step = trials["batch_size"] * trials["accumulate"]
    assert ((per_step / (trials["step_ms"] / 1000)) / trials["samples_per_s"]).sub(1).abs().max() < 1e-6
    # rounds: within a model, each round runs every variant once, in an order shuffled per round
    for _, one in trials[trials["model"] == "resnet"].groupby("round"):
        assert sorted(one["variant"]) == ["bf16", "fp16", "fp32"]
        assert sorted(one["position"]) == [0, 1, 2]
    assert (trials["trial"] == trials["round"]).all()


def test_amp_summary_has_speedup_with_ci_and_verdicts(amp_run):
    proc, run_dir = amp_run
    summary = pd.read_csv(run_dir / "summary.csv")
    assert set(SUMMARY_CONTRACT) <= set(summary.columns)
    assert len(summary) == 9
    base = summary[summary["is_baseline"]]
    assert (base["speedup"] == 1).all() and (base["verdict"] == "baseline").all()
    other = summary[~summary["is_baseline"]]
    assert (other["speedup_lo"] <= other["speedup"]).all() and (other["speedup"] <= other["speedup_hi"]).all()
    assert set(other["verdict"]) <= {"faster", "slower", "no significant difference"}
    # the console table names every model and variant
    for word in ("resnet", "vae", "transformer", "bf16", "speed-up"):
        assert word in proc.stdout


def test_amp_report_quotes_the_claims(amp_run):
    _, run_dir = amp_run
    md = (run_dir / "report.md").read_text()
    assert "half the memory" in md and "3-8 times" in md
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()


@pytest.mark.parametrize("override, key", [
    ("precision=fp8", "precision"), ("data.num_workers=-1", "data.num_workers"),
    ("accumulate=0", "accumulate"), ("device=tpu7", "device"), ("model=nosuchmodel", "model"),
    ("+experiment=nosuch", "experiment"), ("foo=1", "foo"), ("accumulate=abc", "accumulate"),
])
def test_bad_input_fails_cleanly_and_writes_nothing(tmp_path, override, key):
    args = [override] if override.startswith("+experiment") else ["+experiment=amp", override]
    proc = run_cli(*args, f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists(), "no run directory for a rejected config"
