"""The experiment files: the machine-dependent worker sweep, the `tips` suite's composition, and
the experiments through the CLI."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from conftest import TINY, compose_cfg, only_run_dir, run_cli
from speedbench import results
from speedbench.config import ConfigError, build_plan, suite
from speedbench.techniques import loader as loader_technique

TIPS = ["workers", "pinning", "tensor_creation", "sync", "empty_cache", "accumulation"]
# accumulation splits the batch into up to 8 micro-batches: the batch must divide by 8.
TINY8 = [o if o != "batch_size=4" else "batch_size=8" for o in TINY]
# One thread per process: on two cores shared with other jobs, two spinning OpenMP threads per
# process make tiny steps hundreds of times slower. These tests check behaviour, not speed.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


# --- the worker sweep -----------------------------------------------------------------------------
@pytest.mark.parametrize("cpus,gpus,expected", [
    (2, 0, [0, 1, 2]),  # 4, 8 and all CPUs capped at 2; 4 x 0 GPUs = 0
    (16, 1, [0, 1, 2, 4, 8, 16]),
    (16, 8, [0, 1, 2, 4, 8, 16]),  # 4 x 8 GPUs = 32, capped at 16
    (64, 8, [0, 1, 2, 4, 8, 32, 64]),
])
def test_worker_sweep_follows_the_machine(monkeypatch, cpus, gpus, expected):
    monkeypatch.setattr(loader_technique, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    entries = [0, 1, 2, 4, 8, "4xGPU", "CPUs"]
    assert loader_technique.worker_counts(entries) == expected
    variants = loader_technique.worker_variants(entries)
    assert list(variants) == [f"w{n}" for n in expected]
    assert variants["w0"] == {"data.num_workers": 0, "data.persistent_workers": False}
    assert variants[f"w{expected[-1]}"]["data.persistent_workers"] is True
    assert loader_technique.workers_variant("4xGPU") == f"w{min(4 * gpus, cpus)}"


def test_workers_experiment_resolves_on_this_machine():
    plan = build_plan(compose_cfg(*TINY, experiment="workers"), "workers")
    counts = loader_technique.worker_counts([0, 1, 2, 4, 8, "4xGPU", "CPUs"])
    assert plan.baseline == "w0" and list(plan.variants) == [f"w{n}" for n in counts]
    for n in counts:
        data = plan.variants[f"w{n}"].data
        assert data.num_workers == n and data.persistent_workers == (n > 0)
    resnet = next(m for m in plan.models if m.name == "resnet")
    assert resnet.dataset["stored_size"] > 2 * resnet.dataset["image_size"]  # decode-heavy


# --- the tips suite -------------------------------------------------------------------------------
def test_tips_composes_every_other_experiment_with_the_command_line_winning():
    cfg = compose_cfg(*TINY8, experiment="tips")
    names = suite.members(cfg, "tips")
    files = suite.experiment_files()
    assert "tips" not in names and set(TIPS) <= set(names)
    assert set(names) == {n for n in files if n != "tips" and not suite.runs_alone(files[n])}
    assert "recipe" in files and "recipe" not in names
    plans = suite.member_plans(cfg, "tips", TINY8 + ["+experiment=tips"])
    assert [p.experiment for p in plans] == names
    for plan in plans:
        for recipe in plan.variants.values():
            # the command line (bench.steps=2) wins over the member's own settings
            assert recipe.bench.steps == 2 and recipe.batch_size == 8
    acc = next(p for p in plans if p.experiment == "accumulation")
    assert acc.variants["k8"].accumulate_mode == "split"  # the member's own delta is kept
    claims = suite.combined_claims(plans)
    assert {c["experiment"] for c in claims} >= set(TIPS)
    assert "${" not in str(claims)  # machine-dependent variant names are resolved


def test_suite_exclude_and_mistakes():
    cfg = compose_cfg(*TINY, "suite.exclude=[amp,workers]", experiment="tips")
    assert "workers" not in suite.members(cfg, "tips") and "amp" not in suite.members(cfg, "tips")
    with pytest.raises(ConfigError, match="suite.exclude: 'nope' is not an experiment"):
        suite.members(compose_cfg(*TINY, "suite.exclude=[nope]", experiment="tips"), "tips")
    with pytest.raises(ConfigError, match="suites do not nest"):
        suite.members(compose_cfg(*TINY, "suite.experiments=[tips]", experiment="tips"), "tips")
    with pytest.raises(ConfigError, match="suite tips, experiment accumulation: .*accumulate"):
        suite.member_plans(compose_cfg(*TINY, experiment="tips"), "tips", TINY)  # batch 4 vs k8
    assert suite.member_overrides(["+experiment=tips", "suite.exclude=[amp]", "bench.steps=2"]) \
        == ["bench.steps=2"]


# --- through the CLI ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tips_runs_every_experiment_into_one_report(tmp_path):
    proc = run_cli("+experiment=tips", "model=transformer", *TINY8, f"out_dir={tmp_path}",
                   cwd=tmp_path, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = only_run_dir(tmp_path)
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(TIPS) <= set(trials["experiment"])
    bad = trials[~trials["status"].str.match(r"^(ok$|n/a: )")]
    assert bad.empty, bad[["experiment", "variant", "status"]]
    cpu_na = {"pinning": ["pinned", "non_blocking", "pinned_non_blocking"],
              "tensor_creation": ["host", "device"], "empty_cache": ["every_step", "never"]}
    for exp, variants in cpu_na.items():  # reported as n/a rows, not dropped
        rows = trials[trials["experiment"] == exp].set_index("variant")
        assert all(rows.loc[[v], "status"].str.startswith("n/a: ").all() for v in variants)

    # sync: item and numpy read every forward pass, deferred once per 10 (and at the end)
    sync = trials[(trials["experiment"] == "sync") & (trials["status"] == "ok")]
    for r in sync.itertuples():
        want = r.steps if r.variant in ("item", "numpy") else math.ceil(r.steps / 10)
        assert r.host_reads == want, r
    acc = trials[(trials["experiment"] == "accumulation") & (trials["status"] == "ok")]
    pairs = sorted(set(zip(acc["accumulate"], acc["batch_size"])))
    assert pairs == [(1, 8), (2, 4), (4, 2), (8, 1)]  # (k, micro-batch): 8 samples per step
    # The largest batch that fits: searched on CUDA only, an n/a row with its reason elsewhere.
    capacity = pd.read_csv(run_dir / "capacity.csv")
    assert list(capacity[["experiment", "model", "variant"]].itertuples(index=False, name=None)) \
        == [("accumulation", "transformer", "k1")]
    assert capacity["status"].iloc[0].startswith("n/a: the largest batch that fits is searched "
                                                 "on CUDA only")

    summary = pd.read_csv(run_dir / "summary.csv")
    assert set(TIPS) <= set(summary["experiment"])
    report = (run_dir / "report.md").read_text()
    assert "## The articles' claims, measured" in report and "## DataLoader workers" in report
    claims_md = report.split("## The articles' claims, measured")[1]
    for exp in TIPS:
        assert f"| {exp} | transformer |" in claims_md
    assert "| n/a: pin_memory needs CUDA" in claims_md
    assert "| nan |" not in report  # an n/a verdict read back from summary.csv stays "n/a"
    assert "### Largest batch that fits\n\nNot found on this run: the largest batch" in report
    assert (run_dir / "members" / "workers.yaml").exists()

    # The report rebuilds from the run's files alone, with the same claims.
    (run_dir / "report.md").unlink()
    again = run_cli(str(run_dir), cwd=tmp_path, module="speedbench.report", env=ONE_THREAD)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "report.md").read_text() == report


@pytest.mark.slow
def test_workers_experiment_on_images_starts_worker_processes(tmp_path):
    proc = run_cli("+experiment=workers", "model=vae", *TINY, "bench.repeats=1",
                   "models.vae.small.dataset.stored_size=64", f"out_dir={tmp_path}", cwd=tmp_path,
                   env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert (trials["status"] == "ok").all()
    for r in trials.itertuples():
        assert r.num_workers == int(r.variant[1:])
        assert 0 <= r.data_wait_frac <= 1
        if r.num_workers:  # the pages only the workers hold come on top of the main process
            assert r.host_rss_mb > r.host_rss_main_mb
        else:
            assert r.host_rss_mb == r.host_rss_main_mb


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["channels_last", "matmul_precision", "cudnn_benchmark",
                                        "optimizer", "checkpointing", "attention"])
def test_experiment_runs_on_cpu_and_says_why_when_na(experiment, tmp_path):
    out = run_cli(f"+experiment={experiment}", *TINY, "bench.repeats=1", f"out_dir={tmp_path}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    trials = results.load_trials(only_run_dir(tmp_path))
    assert set(trials["status"]) <= {"ok"} | {s for s in trials["status"] if s.startswith("n/a: ")}
    assert (trials["status"] == "ok").any()
    ok = trials[trials["status"] == "ok"]
    assert ok["final_loss"].map(math.isfinite).all() and (ok["samples_per_s"] > 0).all()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_trains_like_ddp_under_torchrun_on_cpu(tmp_path):
    out = run_cli("+experiment=fsdp", *TINY, "bench.repeats=1", f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    trials = results.load_trials(only_run_dir(tmp_path)).set_index("variant")
    assert (trials["status"] == "ok").all(), trials["status"].to_dict()
    assert (trials["world_size"] == 2).all()
    assert trials.loc["fsdp", "final_loss"] == pytest.approx(trials.loc["ddp", "final_loss"],
                                                              rel=1e-4)


# --- on a GPU: the tips that are n/a on the CPU measure -------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["pinning", "tensor_creation", "empty_cache", "sync"])
def test_cuda_only_tips_measure_on_cuda(tmp_path, experiment):
    tiny_cuda = [o for o in TINY if o != "device=cpu"] + ["device=cuda"]
    proc = run_cli(f"+experiment={experiment}", "model=[vae,transformer]", *tiny_cuda,
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert (trials["status"] == "ok").all(), trials[["model", "variant", "status"]]
