"""Data parallelism: torchrun ranks, self-launched DDP, DataParallel's n/a, validation, scaling.

Tests marked `distributed` start real processes (gloo on the CPU, two ranks); the others are
units. Ranks find free ports themselves (`--standalone`, or a port bound to 0 for the
two-"node" test), so parallel test runs do not collide.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import speedbench
from conftest import SMALL_MODELS, TINY, compose_cfg, only_run_dir, run_cli
from speedbench.analysis import claims
from speedbench.analysis.summary import add_efficiency, summarise
from speedbench import distributed, techniques
from speedbench.config import ConfigError, Schema, build_plan
from speedbench.techniques import Context
from speedbench.report import plots
from speedbench.results import schema

TESTS = Path(__file__).resolve().parent
SRC = Path(speedbench.__file__).resolve().parents[1]
# The ranks import speedbench from this checkout and the tiny models from tests/.
ENV = {"PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
TINY_MODEL = ("+models.tiny={_target_:dist_models.TinyLM,loss:cross_entropy,batch_size:4,"
              "dataset:{kind:tokens,seq_len:8,vocab_size:32}}")
FAILING_MODEL = TINY_MODEL.replace("TinyLM", "FailsOnRank").replace("tiny=", "failing=")
FAST = [*TINY, *SMALL_MODELS, "bench.repeats=1", "dist_timeout_s=60"]
TIMEOUT = 300  # seconds: far above what a run takes; a hang fails the test instead of CI


def torchrun(*args: str, cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m speedbench args...`, as a user types it."""
    return run_cli("--standalone", f"--nproc_per_node={nproc}", "-m", "speedbench", *args,
                   cwd=cwd, env=ENV, timeout=TIMEOUT, module="torch.distributed.run")


def trials(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "trials.csv")


# --- units ----------------------------------------------------------------------------------------
def test_from_environ_reads_what_torchrun_sets():
    assert distributed.from_environ({}) is None
    env = distributed.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                    "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job7"})
    assert env == distributed.DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2,
                                      run_id="job7")
    assert not distributed.is_main(env) and distributed.is_main(None)
    assert distributed.rank_device("cpu", env) == torch.device("cpu")
    assert distributed.rank_device("cuda:0", env) == torch.device("cuda", 1)


def test_combine_reports_global_throughput_over_the_slowest_rank():
    rank = {"status": "ok", "steps": 4, "data_wait_frac": 0.1, "peak_mem_mb": 10.0,
            "host_rss_mb": 50.0, "host_rss_main_mb": 40.0, "omp_num_threads": "1",
            "torch_threads": 1}
    combined = distributed.combine([
        {**rank, "samples": 64, "elapsed_s": 2.0, "step_ms": 500.0, "final_loss": 1.0},
        {**rank, "samples": 64, "elapsed_s": 4.0, "step_ms": 1000.0, "final_loss": 3.0,
         "peak_mem_mb": 30.0}])
    assert combined["samples_per_s"] == pytest.approx(128 / 4.0)
    assert combined["step_ms"] == pytest.approx(1000.0)
    assert combined["final_loss"] == pytest.approx(2.0)
    assert combined["peak_mem_mb"] == 30.0
    assert combined["rank_step_ms"] == "500.00;1000.00"
    assert distributed.combine([{**rank, "samples": 1, "elapsed_s": 1.0, "step_ms": 1.0,
                                 "final_loss": 1.0, "status": "diverged"}])["status"] == "diverged"


def test_a_cpu_jobs_row_has_its_process_memory_apart_and_every_ranks_flops(monkeypatch):
    """Under torchrun on the CPU there is no tensor peak: the ranks' RSS growth is its own
    column (never a tensor peak to take a ratio of); a step's FLOPs are all ranks', against
    the machine's peak: the parent's where it measured it with every core, a rank's times the
    world size where one rank measured it with its share."""
    from speedbench.measure.flops import FlopsBook

    rank = {"status": "ok", "steps": 4, "data_wait_frac": 0.1, "peak_mem_mb": math.nan,
            "host_rss_mb": 50.0, "host_rss_main_mb": 40.0, "samples": 64, "step_ms": 500.0,
            "final_loss": 1.0, "flops_per_step": 1e9, "world_size": 2, "peak_kind": "fp32"}
    job = distributed.combine([{**rank, "elapsed_s": 2.0, "rss_growth_mb": 120.0},
                               {**rank, "elapsed_s": 2.0, "rss_growth_mb": 150.0}])
    assert math.isnan(job["peak_mem_mb"]) and job["rss_growth_mb"] == 150.0
    assert job["flops_per_step"] == 2e9
    book = FlopsBook(torch.device("cpu"))
    book.peaks["fp32"] = 0.1  # TFLOP/s, as measured
    parent = book.annotate(dict(job))
    assert parent["achieved_tflops"] == pytest.approx(2e9 / 0.5 / 1e12)  # both ranks' work
    assert parent["peak_tflops"] == 0.1  # the parent measured the whole machine
    assert book.annotate({**job, "world_size": 1})["peak_tflops"] == 0.1
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    # measured inside rank 0, with its share of the machine
    assert book.annotate(dict(job))["peak_tflops"] == pytest.approx(0.2)


@pytest.fixture
def under_torchrun(monkeypatch):
    """This process looks like rank 0 of a 2-process torchrun job, one process per node (two
    on one node would be refused on a 1-core machine before what the test checks)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(key, value)


def test_dp_under_torchrun_is_a_config_error(under_torchrun):
    with pytest.raises(ConfigError, match=r"variants\.dp\.parallel: 'dp' cannot run under torch"):
        build_plan(compose_cfg(*TINY, experiment="dp_vs_ddp"), "dp_vs_ddp")
    build_plan(compose_cfg(*TINY, experiment="amp"), "amp")  # every other variant runs as DDP


def test_more_processes_than_devices_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match=r"nproc: 999 processes asked for, but this machine has"):
        build_plan(compose_cfg(*TINY, "parallel=ddp", "nproc=999"), None)
    for key, value in {"RANK": "0", "WORLD_SIZE": "999", "LOCAL_WORLD_SIZE": "999"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"torchrun started 999 processes on this node"):
        build_plan(compose_cfg(*TINY), None)


def test_ddp_without_a_launcher_is_a_config_error(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"variants\.ddp\.parallel: 'ddp' needs a launcher"):
        build_plan(compose_cfg(*TINY, experiment="dp_vs_ddp"), "dp_vs_ddp")
    build_plan(compose_cfg(*TINY, experiment="amp"), "amp")  # no ddp variant: nothing to launch


def test_dataparallel_is_na_without_two_gpus():
    recipe = OmegaConf.structured(Schema)
    recipe.parallel = "dp"
    reason = techniques.not_applicable(recipe, Context(torch.device("cpu")))
    assert reason == "n/a: DataParallel needs at least two CUDA devices (this run has 0)"
    recipe.parallel = "none"
    assert techniques.not_applicable(recipe, Context(torch.device("cpu"))) is None


def _fake_trials() -> pd.DataFrame:
    rows = []
    for trial in range(3):
        for variant, parallel, devices, tp in (("single", "none", 1, 100.0), ("dp", "dp", 2, 120.0),
                                               ("ddp", "ddp", 2, 180.0)):
            rows.append({"experiment": "dp_vs_ddp", "model": "m", "variant": variant,
                         "is_baseline": variant == "single", "trial": trial, "status": "ok",
                         "samples_per_s": tp + trial, "step_ms": 1.0, "data_wait_frac": 0.0,
                         "peak_mem_mb": 1.0, "host_rss_mb": 1.0, "final_loss": 1.0,
                         "parallel": parallel, "devices": devices, "world_size": 1})
    return pd.DataFrame(rows)


def test_scaling_efficiency_is_speedup_over_devices_and_is_plotted():
    trials_df = _fake_trials()
    summary = add_efficiency(summarise(trials_df), trials_df).set_index("variant")
    assert summary.loc["single", "scaling_efficiency"] == pytest.approx(1.0)
    assert summary.loc["ddp", "devices"] == 2
    assert summary.loc["ddp", "scaling_efficiency"] == pytest.approx(181 / (2 * 101), rel=1e-3)
    assert summary.loc["ddp", "scaling_efficiency_lo"] == pytest.approx(
        summary.loc["ddp", "speedup_lo"] / 2)
    fig = plots.scaling(summary.reset_index())
    assert len(fig.axes) == 2 and len(fig.axes[1].lines) >= 1
    # No variant on more devices than the baseline: the summary is left alone.
    plain = trials_df[trials_df["parallel"] == "none"]
    assert "scaling_efficiency" not in add_efficiency(summarise(plain), plain)
    under_torchrun = trials_df.assign(devices=2, parallel="ddp")  # no single-device reference
    assert "scaling_efficiency" not in add_efficiency(summarise(under_torchrun), under_torchrun)


def test_claim_versus_compares_with_another_variant():
    trials_df = _fake_trials()
    summary = summarise(trials_df)
    claim = {"kind": "faster", "versus": "dp", "variants": ["ddp"]}
    row = claims.evaluate([claim], summary, trials_df).iloc[0]
    assert row["measured"].startswith("speed-up 1.50x") and row["measured"].endswith("vs dp")
    assert row["verdict"] == claims.HOLDS
    summary.loc[summary["variant"] == "dp", "status"] = "n/a: DataParallel needs two GPUs"
    row = claims.evaluate([claim], summary, trials_df).iloc[0]
    assert row["verdict"].startswith("n/a") and "DataParallel needs two GPUs" in row["verdict"]


def test_slurm_launcher_config_composes_when_the_plugin_is_installed():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from speedbench.config import config_dir, register_schema

    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "+experiment=amp"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.speedbench_slurm.SweepLauncher"
    assert launcher.tasks_per_node == 1 and launcher.timeout_min > 0


# --- real processes ------------------------------------------------------------------------
@pytest.mark.distributed
def test_torchrun_cli_writes_one_run_dir_with_world_size_2(tmp_path):
    out = torchrun(*FAST, "bench.repeats=2", "model=transformer", f"out_dir={tmp_path}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = only_run_dir(tmp_path)  # rank 0 alone wrote, whatever the ranks' clocks said
    df = trials(run_dir)
    assert len(df) == 2 and (df["status"] == "ok").all()
    assert (df["world_size"] == 2).all() and (df["parallel"] == "ddp").all()
    assert (df["omp_num_threads"] == 1).all() and (df["torch_threads"] >= 1).all()
    assert df["rank_step_ms"].str.count(";").eq(1).all()  # both ranks' timings gathered
    assert json.loads((run_dir / "env.json").read_text())["distributed"]["world_size"] == 2
    assert (run_dir / "summary.csv").exists() and (run_dir / "report.md").exists()


HUGE_DATA = ("+models.huge={_target_:dist_models.TinyLM,loss:cross_entropy,batch_size:4,"
             "dataset:{_target_:fault_models.Tokens,n:1000000000}}")  # items made, not stored


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lazy_data_set_of_a_billion_items_is_sharded_without_listing_it(tmp_path):
    """Each rank reads its shard in an order drawn as it is read: DistributedSampler's
    permutation of 10^9 indices would take 8 GB a rank (and its list far more)."""
    out = torchrun(*FAST, HUGE_DATA, "model=huge", "bench.quality_steps=0",
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    df = trials(only_run_dir(tmp_path))
    assert (df["status"] == "ok").all() and (df["world_size"] == 2).all(), df["status"]
    assert (df["host_rss_mb"] < 2000).all(), df["host_rss_mb"]  # the largest rank's


def test_the_ranks_shards_of_a_huge_data_set_are_disjoint_and_drawn_alike():
    import torch
    from fault_models import Tokens

    from speedbench.distributed import DistEnv
    from speedbench.measure.data import LazyShuffle, rank_sampler

    shards = [list(LazyShuffle(100, torch.Generator().manual_seed(3), r, 3)) for r in range(3)]
    assert [len(s) for s in shards] == [33] * 3 and len(set(sum(shards, []))) == 99
    whole = list(LazyShuffle(100, torch.Generator().manual_seed(3)))  # one process's order
    assert [i for trio in zip(*shards) for i in trio] == whole[:99]  # dealt out in turn
    envs = [DistEnv(rank=r, world_size=2, local_rank=r, local_world_size=2, run_id="x")
            for r in (0, 1)]
    huge = [rank_sampler(Tokens(10**9), env, seed=0) for env in envs]
    assert all(isinstance(s, LazyShuffle) and len(s) == 5 * 10**8 for s in huge)
    firsts = [[i for i, _ in zip(s, range(1000))] for s in huge]
    assert not set(firsts[0]) & set(firsts[1])
    assert type(rank_sampler(Tokens(64), envs[0], seed=0)).__name__ == "DistributedSampler"
    assert rank_sampler(Tokens(10**9), None, seed=0) is None  # on its own: build_loader's


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_matches_one_process_and_skips_allreduce_when_accumulating(tmp_path):
    out = run_cli("--standalone", "--nproc_per_node=2", str(TESTS / "ddp_worker.py"), str(tmp_path),
                  cwd=tmp_path, env=ENV, timeout=TIMEOUT, module="torch.distributed.run")
    assert out.returncode == 0, out.stdout + out.stderr
    import ddp_worker  # noqa: E402  (tests/ is on sys.path under pytest)

    # One process on the same global batch: both ranks' shards (the same permutation).
    one = distributed.DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, run_id="")
    single = ddp_worker.train(one, "none", batch=8, steps=3).state_dict()
    ddp = torch.load(tmp_path / "ddp.pt")
    initial = ddp_worker.build_model(ddp_worker.SPEC, seed=0).state_dict()
    for name, weight in single.items():
        assert not torch.allclose(weight, initial[name]), f"{name} did not train"
        torch.testing.assert_close(ddp[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    # accumulate=3: only the last micro-batch of each step all-reduces (no_sync on the others).
    # The model is far below DDP's 25 MB bucket: one all-reduce per optimizer step, 2 steps.
    calls = json.loads((tmp_path / "allreduce_calls.json").read_text())
    assert calls == {"1": 2, "3": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_of_two_processes_over_loopback(tmp_path):
    """The documented two-node command with both agents on 127.0.0.1: world size 4, one run
    directory, and rows in the single-node format."""
    port = _free_port()
    nodes = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               f"--node_rank={node_rank}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=speedbench-test-{port}", "-m", "speedbench", *FAST, "model=transformer",
               f"out_dir={tmp_path}"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, **ENV},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [node.communicate(timeout=TIMEOUT)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    run_dir = only_run_dir(tmp_path)
    df = trials(run_dir)
    assert (df["world_size"] == 4).all() and (df["status"] == "ok").all()
    assert df["rank_step_ms"].str.count(";").eq(3).all()  # all four ranks' timings gathered
    assert list(df.columns) == schema.trial_columns(techniques.column_names())
    described = json.loads((run_dir / "env.json").read_text())["distributed"]
    assert described["nnodes"] == 2 and described["local_world_size"] == 2
    assert described["world_size"] == 4


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_rank_fails_the_torchrun_job_with_a_record(tmp_path):
    # Rank 0 is mid-step (busy 2 s) when rank 1 fails and torchrun sends it SIGTERM: it must
    # still reach the failed collective and write the row.
    busy = FAILING_MODEL.replace("FailsOnRank,", "FailsOnRank,others_busy_s:2.0,")
    out = torchrun(*FAST, busy, "model=failing", f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "speedbench: rank 1 of 2 failed" in log and "injected failure on rank 1" in log
    df = trials(only_run_dir(tmp_path))  # rank 0 wrote the root cause before the job ended
    assert df["status"].iloc[-1] == "error: rank 1: RuntimeError: injected failure on rank 1"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hung_rank_fails_the_job_after_dist_timeout_s(tmp_path):
    hanging = FAILING_MODEL.replace("FailsOnRank,", "FailsOnRank,hang:true,")
    out = torchrun(*FAST, hanging, "model=failing", "dist_timeout_s=15", f"out_dir={tmp_path}",
                   cwd=tmp_path)
    assert out.returncode != 0
    status = trials(only_run_dir(tmp_path))["status"].iloc[-1]
    # rank 0 timed out waiting; rank 1, which reported nothing, is the one that hung
    assert status.startswith("error: rank 1 hung: ") and "Timed out" in status, status


@pytest.fixture(scope="module")
def dp_vs_ddp_run(tmp_path_factory) -> Path:
    """One `python -m speedbench +experiment=dp_vs_ddp` over two tiny models, the second of which
    fails on rank 1 (the run launches torchrun itself for each DDP trial)."""
    tmp = tmp_path_factory.mktemp("dp_vs_ddp")
    out = run_cli("+experiment=dp_vs_ddp", *FAST, TINY_MODEL, FAILING_MODEL, "model=[tiny,failing]",
                  f"out_dir={tmp}", cwd=tmp, env=ENV, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr  # a failed trial is a row, not a crash
    return only_run_dir(tmp)


@pytest.mark.slow
@pytest.mark.distributed
def test_dp_vs_ddp_measures_ddp_and_reports_scaling(dp_vs_ddp_run):
    run_dir = dp_vs_ddp_run
    df = trials(run_dir).query("model == 'tiny'").set_index("variant")
    assert df.loc["single", "status"] == "ok" and df.loc["single", "world_size"] == 1
    if torch.cuda.device_count() < 2:
        assert df.loc["dp", "status"].startswith("n/a: DataParallel needs at least two CUDA")
    ddp = df.loc["ddp"]
    assert ddp["status"] == "ok" and ddp["world_size"] == 2 and ddp["parallel"] == "ddp"
    assert ddp["samples_per_s"] > 0 and math.isfinite(ddp["final_loss"])
    summary = pd.read_csv(run_dir / "summary.csv").query("model == 'tiny'").set_index("variant")
    ddp_row = summary.loc["ddp"]
    assert ddp_row["scaling_efficiency"] == pytest.approx(ddp_row["speedup"] / 2)
    if not torch.cuda.is_available():  # no tensor peak: RSS growth apart, never a memory ratio
        assert math.isnan(ddp_row["peak_mem_mb"]) and math.isnan(ddp_row["mem_ratio"])
        assert ddp_row["rss_growth_mb"] > 0 and math.isnan(summary.loc["single", "rss_growth_mb"])
    # both ranks' FLOPs: the job's FLOP/s is its samples/s times a sample's FLOPs
    single = summary.loc["single"]
    per_sample = single["flops_per_step"] / (single["samples_per_s"] * single["step_ms"] / 1000)
    assert ddp_row["achieved_tflops"] * 1e12 == pytest.approx(
        ddp_row["samples_per_s"] * per_sample, rel=0.05)
    assert (run_dir / "plots" / "dp_vs_ddp-scaling.png").exists()
    assert "scaling eff." in (run_dir / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_rank_in_a_launched_ddp_trial_is_its_row_status(dp_vs_ddp_run):
    df = trials(dp_vs_ddp_run).query("model == 'failing'").set_index("variant")
    assert df.loc["ddp", "status"] == "error: rank 1: RuntimeError: injected failure on rank 1"
    assert df.loc["single", "status"] == "ok"  # RANK is unset there: the model does not fail


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dp_and_ddp_run_on_two_gpus(tmp_path):
    out = run_cli("+experiment=dp_vs_ddp", "device=cuda", "scale=small", "model=resnet",
                  "bench.warmup=1", "bench.steps=3", "bench.repeats=1", "nproc=2",
                  f"out_dir={tmp_path}", cwd=tmp_path, env=ENV, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    df = trials(only_run_dir(tmp_path)).set_index("variant")
    assert (df["status"] == "ok").all(), df["status"]
    assert df.loc["dp", "devices"] == 2 and df.loc["ddp", "world_size"] == 2
    assert df.loc["ddp", "device"] == "cuda:0"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_multirun_under_torchrun_writes_one_run_dir_per_job(tmp_path):
    out = torchrun("-m", *FAST, TINY_MODEL, "model=tiny", "precision=fp32,bf16",
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr  # the process group is reused, not remade
    run_dirs = sorted(p.parent for p in tmp_path.rglob("trials.csv"))
    assert len(run_dirs) == 2
    assert sorted(trials(d)["precision"].iloc[0] for d in run_dirs) == ["bf16", "fp32"]
    assert len(list((tmp_path / "multirun").iterdir())) == 1  # named by the job's run id


def test_slurm_launcher_without_the_plugin_names_the_plugin(tmp_path):
    # the plugin hidden from this one process (CI installs it for the SLURM tests)
    hide = ("import sys\n"
            "class Hidden:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.startswith('hydra_plugins.hydra_submitit_launcher'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hidden())\n"
            "sys.argv = ['speedbench', '-m', 'hydra/launcher=slurm', '+experiment=amp']\n"
            "from speedbench.__main__ import cli\n"
            "cli()\n")
    out = subprocess.run([sys.executable, "-c", hide], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("speedbench: error: hydra/launcher=slurm needs Hydra's submitit "
                                  "launcher plugin: pip install hydra-submitit-launcher")
