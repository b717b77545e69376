"""speedbench's SLURM path against a real single-node cluster (tests/slurm_cluster.py): the
documented commands, a sweep through `hydra/launcher=slurm_cpu` and the torchrun-in-SLURM script,
checked by their files, SLURM's states, exit statuses and console lines (never timings)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SMALL_MODELS, TINY, default_sigint, run_cli

ROOT = Path(__file__).resolve().parents[1]
# one CPU and 2 GB a job: both jobs of a sweep run at once on CI's two cores
SLURM = ["-m", "hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=20"]
QUICK = [*TINY, *SMALL_MODELS, "bench.explain=false", "bench.find_largest_batch=false"]


def sweep(cluster, tmp_path: Path, *args: str, timeout: int = 400):
    return run_cli(*SLURM, *QUICK, *args, f"out_dir={tmp_path}", cwd=tmp_path, env=cluster.env,
                   timeout=timeout)


def outcomes(tmp_path: Path) -> dict[str, str]:
    """job number -> its outcome.txt"""
    return {p.parent.name: p.read_text().strip()
            for p in (tmp_path / "multirun").glob("*/*/outcome.txt")}


def slurm_states(cluster) -> dict[str, tuple[str, str]]:
    """SLURM job id -> (name, state), from slurmctld's memory"""
    out = cluster.run("squeue", "-h", "-t", "all", "-o", "%i|%j|%T").stdout
    return {i: (n, s) for i, n, s in (line.split("|") for line in out.split())}


@pytest.mark.slow
def test_a_two_job_sweep_says_each_jobs_outcome(slurm_cluster, tmp_path):
    proc = sweep(slurm_cluster, tmp_path, "+experiment=amp", "model=vae,transformer",
                 "precision=fp32")
    err = proc.stderr
    assert proc.returncode == 0, err + slurm_cluster.logs()
    got = outcomes(tmp_path)
    assert sorted(got) == ["0", "1"] and all(t.startswith("ok: ") for t in got.values()), got
    for text in got.values():
        assert (Path(text.split(": ", 1)[1]) / "report.html").is_file()
    lines = err.splitlines()
    assert sum(line.startswith("speedbench: job ") and ": ok:" in line for line in lines) == 2, err
    assert any(line.startswith("speedbench: sweep: all 2 jobs ended well; each job's "
                               "outcome.txt is in ") for line in lines), err
    names = {n for n, _ in slurm_states(slurm_cluster).values()}
    assert {"speedbench-amp-vae", "speedbench-amp-transformer"} <= names, names


@pytest.mark.slow
def test_a_failed_job_is_said_and_the_exit_status_counts_it(slurm_cluster, tmp_path):
    # job 1 is refused inside its SLURM job (no CUDA here): a failure only its outcome.txt knew
    proc = sweep(slurm_cluster, tmp_path, "+experiment=amp", "model=transformer",
                 "precision=fp32", "device=cpu,cuda")
    err = proc.stderr
    assert proc.returncode == 1, err
    got = outcomes(tmp_path)
    assert got["0"].startswith("ok: ") and got["1"].startswith("failed (exit status 2): device:")
    lines = err.splitlines()
    said = [line for line in lines if line.startswith("speedbench: job 1 ")]
    assert len(said) == 1 and ": failed (exit status 2): device:" in said[0], err
    assert any(line.startswith("speedbench: sweep: 1 of 2 jobs did not succeed (job 1 failed); "
                               "each job's outcome.txt is in ") for line in lines), err
    assert "Traceback" not in err
    assert all(len(line) <= 100 for line in lines if line.startswith(("speedbench: job", "  ")))


@pytest.mark.slow
def test_a_refused_submission_is_one_line_naming_the_setting(slurm_cluster, tmp_path):
    # the ready GPU config on a node without GPUs: sbatch refuses the job
    proc = run_cli("-m", "hydra/launcher=slurm", "+experiment=amp", *QUICK, f"out_dir={tmp_path}",
                   cwd=tmp_path, env=slurm_cluster.env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speedbench: error")]
    assert errors == [errors[0]] and "hydra.launcher.gpus_per_node=null" in errors[0] \
        and "sbatch: Invalid generic resource" in errors[0], proc.stderr
    assert slurm_states(slurm_cluster) == {} or all(
        "amp" not in n or s != "RUNNING" for n, s in slurm_states(slurm_cluster).values())
