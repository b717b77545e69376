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
    for num, text in got.items():  # the two folders, made in the same second, say their job
        run_dir = Path(text.split(": ", 1)[1])
        assert (run_dir / "report.html").is_file() and run_dir.name.endswith(f"_job{num}")
    lines = err.splitlines()
    assert sum(line.startswith("speedbench: job ") and ": ok:" in line for line in lines) == 2, err
    said = " ".join(line.strip() for line in lines)
    assert "speedbench: sweep: all 2 jobs ended well; each job's outcome.txt is in " in said, err
    assert all(len(line) <= 100 for line in lines)
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
    said = " ".join(line.strip() for line in lines)
    assert ("speedbench: sweep: 1 of 2 jobs did not succeed (job 1 failed); each job's "
            "outcome.txt is in ") in said, err
    assert "Traceback" not in err
    assert all(len(line) <= 100 for line in lines)


@pytest.mark.slow
def test_a_refused_submission_is_one_line_naming_the_setting(slurm_cluster, tmp_path):
    # the ready GPU config on a node without GPUs: sbatch refuses the job
    proc = run_cli("-m", "hydra/launcher=slurm", "+experiment=amp", *QUICK, f"out_dir={tmp_path}",
                   cwd=tmp_path, env=slurm_cluster.env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    error = " ".join(line.strip() for line in lines[next(
        i for i, line in enumerate(lines) if line.startswith("speedbench: error")):])
    assert "hydra.launcher.gpus_per_node=null" in error \
        and "sbatch: Invalid generic resource" in error, proc.stderr
    assert sum("Invalid generic resource" in line for line in lines) == 1, proc.stderr
    assert all(len(line) <= 100 for line in lines)
    assert slurm_states(slurm_cluster) == {} or all(
        "amp" not in n or s != "RUNNING" for n, s in slurm_states(slurm_cluster).values())


# One job that runs long enough to be stopped while it measures (many rounds of a tiny model).
LONG = ["+experiment=amp", "model=transformer", "bench.repeats=400", "bench.time_budget_s=900"]


def start_sweep(cluster, tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **cluster.env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "speedbench", *SLURM, *QUICK, *args,
                             f"out_dir={tmp_path}"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint)


def wait_for_trials(tmp_path: Path, proc: subprocess.Popen, rows: int = 2) -> Path:
    """The job's run directory once its trials.csv has `rows` rows (the job measures)."""
    end = time.monotonic() + 240
    while time.monotonic() < end:
        for trials in tmp_path.glob("amp/*/trials.csv"):
            if trials.read_text().count("\n") > rows:
                return trials.parent
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"no trial finished in time: {proc.communicate()}")


def wait_until_gone(cluster, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while any(s in ("RUNNING", "PENDING", "COMPLETING") for _, s in
              slurm_states(cluster).values()):
        assert time.monotonic() < end, slurm_states(cluster)
        time.sleep(0.5)


@pytest.mark.slow
def test_scancel_reaches_the_jobs_stop_handling_and_is_said(slurm_cluster, tmp_path):
    proc = start_sweep(slurm_cluster, tmp_path, *LONG)
    run_dir = wait_for_trials(tmp_path, proc)
    ids = [i for i, (n, s) in slurm_states(slurm_cluster).items()
           if n == "speedbench-amp-transformer" and s == "RUNNING"]
    assert len(ids) == 1
    slurm_cluster.run("scancel", ids[0])
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    outcome = outcomes(tmp_path)["0"]
    assert outcome.startswith("interrupted (SIGTERM: scancel") and str(run_dir) in outcome
    kept = int(outcome.split("kept ")[1].split()[0])
    assert kept >= 2 and (run_dir / "trials.csv").read_text().count("\n") - 1 == kept
    said = " ".join(line.strip() for line in err.splitlines())
    assert f"speedbench: job 0 (SLURM job {ids[0]}): cancelled: interrupted (SIGTERM" in said, err
    assert "speedbench: sweep: 1 of 1 jobs did not succeed (job 0 cancelled)" in said
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_on_the_submitting_command_cancels_the_jobs_and_says_so(slurm_cluster, tmp_path):
    proc = start_sweep(slurm_cluster, tmp_path, *LONG)
    wait_for_trials(tmp_path, proc, rows=1)
    ids = [i for i, (n, s) in slurm_states(slurm_cluster).items() if s == "RUNNING"]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = " ".join(line.strip() for line in err.splitlines())
    assert (f"speedbench: interrupted; cancelled the sweep's SLURM job still "
                           f"queued or running ({ids[0]}); a running job keeps its finished "
                           "trials and says so in its outcome.txt in ") in said, err
    assert "before the run started" not in err and "Traceback" not in err
    wait_until_gone(slurm_cluster)
    assert outcomes(tmp_path)["0"].startswith("interrupted (SIGTERM")


@pytest.mark.slow
def test_the_docs_torchrun_script_runs_as_two_tasks(slurm_cluster, tmp_path):
    # docs/distributed.md's sbatch script, with 2 tasks of 1 CPU standing in for 2 nodes
    script = tmp_path / "speedbench.sbatch"
    overrides = " ".join([*QUICK, "bench.repeats=2"])
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2 --cpus-per-task=1 --mem=4G --output={tmp_path}/slurm-%j.out
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes="$SLURM_NTASKS" --nproc_per_node=1 \\
    --rdzv_backend=c10d --rdzv_endpoint="$head:29511" --rdzv_id="$SLURM_JOB_ID" \\
    -m speedbench +experiment=sync model=transformer {overrides} out_dir="{tmp_path}/results"
""")
    env = {**os.environ, **slurm_cluster.env, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=400)
    job = proc.stdout.strip().split(";")[0]
    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, proc.stderr + log
    assert slurm_states(slurm_cluster)[job][1] == "COMPLETED"
    run_dirs = [p.parent for p in (tmp_path / "results").rglob("trials.csv")]
    assert len(run_dirs) == 1, log  # global rank 0 alone writes
    import pandas as pd

    rows = pd.read_csv(run_dirs[0] / "trials.csv")
    assert (rows["world_size"] == 2).all() and (rows["status"] == "ok").all()
    assert rows["rank_step_ms"].astype(str).str.count(";").eq(1).all()
    import json

    dist = json.loads((run_dirs[0] / "env.json").read_text())["distributed"]
    assert dist["nnodes"] == 2 and str(dist["run_id"]) == job


def test_measure_again_inside_a_slurm_torchrun_job_is_srun_without_the_old_job_id(monkeypatch):
    from speedbench.distributed import DistEnv, launcher

    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=1, run_id="12")
    parent = ["/v/bin/python3", "/v/bin/torchrun", "--nnodes=2", "--nproc_per_node=1",
              "--rdzv_backend=c10d", "--rdzv_endpoint=vm:29501", "--rdzv_id=12", "-m",
              "speedbench", "+experiment=sync"]
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launcher(env, parent)[0] == "torchrun" and "--rdzv_id=12" in launcher(env, parent)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert launcher(env, parent) == ["srun", "torchrun", "--nnodes=2", "--nproc_per_node=1",
                                     "--rdzv_backend=c10d", "--rdzv_endpoint=vm:29501", "-m",
                                     "speedbench"]


def test_measure_again_inside_a_sweeps_slurm_job_submits_again(monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from speedbench.config import config_dir, register_schema
    from speedbench.distributed import launcher

    register_schema()
    given = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*given, "+experiment=amp"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
        assert launcher(None) == ["speedbench"]  # not in a SLURM job: runs here
        monkeypatch.setenv("SUBMITIT_FOLDER", "/x/.submitit/3")
        assert launcher(None) == ["speedbench", "-m", *given]
    finally:
        HydraConfig.instance().cfg = None  # no Hydra run left behind for the next tests


# --- a SLURM job's CPU mask (task/affinity, cgroups, taskset) -----------------------------
def test_under_a_cpu_mask_the_cpu_shares_are_of_the_cores_the_run_may_use():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores to pin a process to one of them")
    code = """
import os
from pathlib import Path
from speedbench.measure import env
os.sched_setaffinity(0, {0})
def cpu(name):
    line = next(l for l in Path("/proc/stat").read_text().splitlines() if l.split()[0] == name)
    return sum(int(x) for x in line.split()[1:9])
before, machine = cpu("cpu0"), cpu("cpu")
ours = env._cpu_jiffies()[1]
after = cpu("cpu0")
print(before <= ours <= after, ours < 0.75 * machine)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_the_busy_line_under_a_cpu_mask_names_the_machines_cores_and_the_runs():
    from speedbench.report.render import busy_note

    load = {"busy": True, "cores": 1, "machine_cores": 2, "load_highest": 14.43,
            "own_cpu_share": 0.31, "others_cpu_share": 0.6}
    assert busy_note({"machine_load": load}).startswith(
        "The machine was busy: load 14.43 on the machine's 2 cores, of which this run may use "
        "1 (this run got 31 % of them; other processes 60 %)")
    load.update(cores=2)  # no mask: as before
    assert busy_note({"machine_load": load}).startswith(
        "The machine was busy: load 14.43 on 2 cores (this run got 31 % of them; other")


@pytest.mark.slow
def test_a_job_near_its_time_limit_stops_keeps_its_trials_and_is_said_timed_out(
        slurm_cluster, tmp_path):
    # a 1-minute limit, warned 50 s ahead (submitit's --signal=USR2@50): stopped at about 10 s
    proc = sweep(slurm_cluster, tmp_path, *LONG[:2], "bench.repeats=400",
                 "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=50")
    err = proc.stderr
    assert proc.returncode == 1, err
    outcome = outcomes(tmp_path)["0"]
    assert outcome.startswith("interrupted (SIGUSR2: SLURM's time limit is near)"), outcome
    said = " ".join(line.strip() for line in err.splitlines())
    assert "speedbench: job 0 (SLURM job " in said and "): timed out: interrupted (SIGUSR2" in said
    assert "(job 0 timed out)" in said and "Traceback" not in err


@pytest.mark.parametrize("sbatch, setting", [
    ("sbatch: error: Invalid generic resource (gres) specification",
     "hydra.launcher.gpus_per_node=null"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available",
     "hydra.launcher.cpus_per_task and hydra.launcher.mem_gb"),
    ("sbatch: error: invalid partition specified: gpu", "hydra.launcher.partition"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid",
     "hydra.launcher.timeout_min"),
])
def test_each_refusal_names_the_launcher_setting_to_change(sbatch, setting):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from speedbench.slurm import refusal_line

    line = refusal_line(sbatch + "\n")
    assert line.startswith("SLURM refused the sweep's job (sbatch: ") and setting in line
    assert "\n" not in line
