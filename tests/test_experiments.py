"""The experiment files: the machine-dependent worker sweep, the `tips` suite's composition, and
the experiments through the CLI."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_MODELS, TINY, compose_cfg, only_run_dir, run_cli
from speedbench.config import ConfigError, build_plan, suite
from speedbench.techniques import loader as loader_technique

TIPS = ["workers", "pinning", "tensor_creation", "sync", "empty_cache", "accumulation"]
# accumulation splits the batch into up to 8 micro-batches: the batch must divide by 8.
TINY8 = [o if o != "batch_size=4" else "batch_size=8" for o in TINY]
# One thread per process: on two cores shared with other jobs, two spinning OpenMP threads per
# process make tiny steps hundreds of times slower. These tests check behaviour, not speed.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
FILES = suite.experiment_files()
# Every experiment that a suite may hold runs in the tips suite's one run, and is checked there;
# those that run alone are tested where named.
# ... less those the tips suite leaves out by default (its suite.exclude): run alone, tested where
# RUN_ALONE names
TIPS_EXCLUDE = ["compile_regional", "comm_hook", "fsdp_reshard"]
MEMBERS = [n for n, path in FILES.items() if not suite.runs_alone(path) and n not in TIPS_EXCLUDE]
# Experiments of which no variant can act on a CPU (each technique says why).
NOTHING_ACTS_ON_CPU = {"tensor_creation", "empty_cache"}
RUN_ALONE = {"tips": "test_tips_runs_every_experiment_into_one_report (below)",
             "recipe": "tests/test_recipe_cli.py::test_recipe_run_end_to_end",
             "time_to_target": "tests/test_to_target.py::test_the_experiment_file_runs_every_"
                               "variant_to_the_target",
             "compile_regional": "tests/test_compile_scope.py (its variants' trials, the "
                                 "experiment file's plan)",
             "comm_hook": "tests/test_comm_hooks.py (torchrun trials, the experiments' plans)",
             "fsdp_reshard": "tests/test_comm_hooks.py (torchrun trials, the experiments' plans)"}


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
    assert list(cfg.suite.exclude) == TIPS_EXCLUDE  # the suite's default
    assert set(names) == {n for n in files if n != "tips" and not suite.runs_alone(files[n])
                          and n not in TIPS_EXCLUDE}
    assert "recipe" in files and "recipe" not in names
    plans = suite.member_plans(cfg, "tips", TINY8 + ["+experiment=tips"])
    assert [p.experiment for p in plans] == names
    for plan in plans:
        for recipe in plan.variants.values():
            # the command line (bench.steps=2) wins over the member's own settings
            assert recipe.bench.steps == 2 and recipe.batch_size == 8
    acc = next(p for p in plans if p.experiment == "accumulation")
    assert acc.variants["k8"].accumulate_mode == "split"  # the member's own delta is kept
    # the suite's own bench.skip_by_forecast reaches every member; the command line's wins
    assert all(r.bench.skip_by_forecast for p in plans for r in p.variants.values())
    off = ["bench.skip_by_forecast=false"]
    plans = suite.member_plans(compose_cfg(*TINY8, *off, experiment="tips"), "tips",
                               TINY8 + off)
    assert not any(r.bench.skip_by_forecast for p in plans for r in p.variants.values())
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
def tips_cli(*overrides: str, out: Path) -> tuple[pd.DataFrame, Path]:
    """`python -m speedbench +experiment=tips` on the transformer, one round: its trials and run
    dir. The longest run of the suite (compile, torchrun launches): minutes on two busy cores."""
    proc = run_cli("+experiment=tips", "model=transformer", *TINY8, *SMALL_MODELS,
                   "bench.repeats=1", *overrides, f"out_dir={out}", cwd=out, env=ONE_THREAD,
                   timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = only_run_dir(out)
    return pd.read_csv(run_dir / "trials.csv"), run_dir


@pytest.fixture(scope="module")
def tips_run(tmp_path_factory):
    """One run of every experiment a suite holds, on the CPU, shared by the tests below; every
    variant measured (the suite's bench.skip_by_forecast off: these tests check that each
    experiment runs; test_explain.py checks the skipping)."""
    return tips_cli("bench.skip_by_forecast=false", out=tmp_path_factory.mktemp("tips"))


def test_every_experiment_file_is_run_by_a_test():
    alone = {n for n in FILES if n not in MEMBERS}
    assert alone == set(RUN_ALONE), f"experiments that run alone need a test: {alone}"


@pytest.mark.slow
@pytest.mark.parametrize("experiment", MEMBERS)
def test_experiment_runs_on_cpu_and_says_why_when_na(experiment, tips_run):
    trials = tips_run[0].query("experiment == @experiment")
    plan = build_plan(compose_cfg(*TINY8, "model=transformer", experiment=experiment), experiment)
    assert set(trials["variant"]) == set(plan.variants)  # n/a variants are rows, not dropped
    na = trials[trials["status"] != "ok"]
    # n/a with its reason; or, on a CPU where a variant (fp16) is 4x slower or more, stopped
    # by the far-slower test with its interval
    assert na["status"].str.match(r"^(n/a: \S|too slow: \S.*x slower \[)").all(), \
        na[["variant", "status"]]
    ok = trials[trials["status"] == "ok"]
    assert ok.empty == (experiment in NOTHING_ACTS_ON_CPU), trials[["variant", "status"]]
    assert ok["final_loss"].map(math.isfinite).all()
    # samples/s and step time describe the same window (one process: torchrun's ranks differ)
    one = ok[ok["world_size"] == 1]
    # batch_scale_by=accumulate takes batch_scale micro-batches of batch_size per step
    by_accumulation = one["batch_scale"].where(one["batch_scale_by"] == "accumulate", 1)
    per_step = one["batch_size"] * one["accumulate"] * by_accumulation
    ratio = (per_step / (one["step_ms"] / 1000)) / one["samples_per_s"]
    assert (ratio.sub(1).abs() < 1e-6).all(), ratio


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_trains_like_ddp_under_torchrun_on_cpu(tips_run):
    trials = tips_run[0].query("experiment == 'fsdp'").set_index("variant")
    assert (trials["status"] == "ok").all(), trials["status"].to_dict()
    assert (trials["world_size"] == 2).all()
    assert trials.loc["fsdp", "final_loss"] == pytest.approx(trials.loc["ddp", "final_loss"],
                                                              rel=1e-4)


@pytest.mark.slow
def test_tips_runs_every_experiment_into_one_report(tips_run):
    trials, run_dir = tips_run
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
    again = run_cli(str(run_dir), cwd=run_dir, module="speedbench.report", env=ONE_THREAD)
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


# --- on a GPU: what is n/a on the CPU measures ----------------------------------------------------
# The reasons techniques give where CUDA is missing: none may appear on a CUDA device.
WANTS_CUDA = re.compile(r"needs CUDA|needs an accelerator|only CUDA devices have")
# Left out of the CUDA run, to keep the GPU tests within scripts/gpu_check.sh's few minutes.
CUDA_ELSEWHERE = {
    "compile": "max-autotune autotunes for minutes; scripts/gpu_check.sh measures compile",
    "fsdp": "a torchrun launch per trial; the CPU run above checks it against DDP",
    "dp_vs_ddp": "needs two GPUs: tests/test_distributed.py::test_dp_and_ddp_run_on_two_gpus",
}


@pytest.fixture(scope="module")
def cuda_tips_run(tmp_path_factory):
    return tips_cli("device=cuda", f"suite.exclude=[{','.join(CUDA_ELSEWHERE)}]",
                    out=tmp_path_factory.mktemp("cuda_tips"))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("experiment", MEMBERS)
def test_experiment_measures_on_cuda(experiment, request):
    if experiment in CUDA_ELSEWHERE:
        pytest.skip(CUDA_ELSEWHERE[experiment])
    trials = request.getfixturevalue("cuda_tips_run")[0].query("experiment == @experiment")
    assert (trials["status"] == "ok").any(), trials[["variant", "status"]]
    na = trials[trials["status"] != "ok"]
    assert na["status"].str.match(r"^n/a: \S").all(), na[["variant", "status"]]
    assert not na["status"].str.contains(WANTS_CUDA).any(), na[["variant", "status"]]
