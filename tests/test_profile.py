"""The `profile` knob and the diagnosis: phase table, profilers' files, overhead, findings.

Runs are tiny (TINY settings, one trial). The poor recipe uses a tiny model of this file on
decode-heavy images, so that the data wait dominates however loaded the CPU is.
"""
from __future__ import annotations

import json
import pstats
from typing import Optional

import pandas as pd
import pytest
import torch
import torch.nn as nn

from conftest import TINY, compose_cfg, only_run_dir, run_cli
from speedbench.measure import diagnosis
from speedbench.techniques import parallel
from speedbench.config import ConfigError, build_plan
from speedbench.results import schema
from speedbench.run import run

PHASES = ["data", "h2d", "forward", "backward", "optimizer", "other"]


class CacheEmptyingNet(nn.Module):
    """A tiny classifier that empties the CUDA cache in its forward, as some user code does."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        torch.cuda.empty_cache()
        return self.body(x)


def poor_net() -> nn.Module:
    """The tiny net behind DataParallel (on a CPU it just calls the module)."""
    return nn.DataParallel(CacheEmptyingNet())


POOR_MODEL = {"_target_": "test_profile.poor_net", "loss": "cross_entropy", "batch_size": 4,
              # Pictures stored at 512 px and decoded per sample: the loop is data-bound.
              "dataset": {"kind": "images", "image_size": 32, "num_classes": 10,
                          "stored_size": 512}}


def run_in_process(tmp_path, *overrides, model=None, variants=None):
    cfg = compose_cfg(*TINY, "bench.repeats=1", f"run_dir={tmp_path / 'run'}", *overrides)
    if model is not None:
        cfg.model = model
    if variants is not None:
        cfg.variants = variants
    return run(cfg, "profile-test", progress=False)


def read(run_dir, name):
    if name == "findings.csv":  # all text; an empty figure stays ""
        return pd.read_csv(run_dir / name, dtype=str, keep_default_na=False)
    return pd.read_csv(run_dir / name)


@pytest.fixture(scope="module")
def poor_run(tmp_path_factory):
    return run_in_process(tmp_path_factory.mktemp("poor"), "profile=simple", "sync=item",
                          "data.num_workers=0", model=POOR_MODEL,
                          variants={"poor": {}, "host_tensors": {"tensor_creation": "host"}})


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    return run_in_process(tmp_path_factory.mktemp("good"), "model=resnet", "profile=advanced",
                          "sync=deferred", "data.num_workers=1", "data.persistent_workers=true")


@pytest.mark.slow
def test_poor_recipe_gets_the_findings_that_apply_on_cpu(poor_run):
    f = read(poor_run, "findings.csv")
    # the contract's columns, then `check` when a suggestion was measured (recipe.check_findings)
    assert list(f.columns) in (schema.FINDING_COLUMNS, schema.FINDING_COLUMNS + ["check"])
    poor = f[f["variant"] == "poor"]
    knobs = " ".join(poor["knob"])
    assert "data.num_workers=" in knobs  # workers 0 on decode-heavy data
    assert "sync=deferred" in knobs  # .item() every step
    assert "empty_cache=false" in knobs  # the model empties the cache
    assert "parallel=ddp" in knobs  # DataParallel wrapper
    # Each names its measured figure.
    data = poor[poor["knob"].str.contains("num_workers")].iloc[0]
    assert "% of the step" in data["figure"] and "num_workers=0" in data["figure"]
    reads = poor[poor["knob"] == "sync=deferred"].iloc[0]
    assert reads["figure"].startswith("1.0 host reads of the loss per step")
    cache = poor[poor["knob"] == "empty_cache=false"].iloc[0]
    assert "called 2 times in 2 steps" in cache["figure"]
    # every suggestion was measured (a refused check plan says "not checked: <why>")
    assert not poor["check"].str.startswith("not checked").any(), list(poor["check"])


@pytest.mark.slow
def test_host_tensors_are_na_on_cpu_and_yield_no_finding(poor_run):
    trials = read(poor_run, "trials.csv")
    status = trials.loc[trials["variant"] == "host_tensors", "status"].iloc[0]
    assert status.startswith("n/a")
    assert (read(poor_run, "findings.csv")["variant"] != "host_tensors").all()


@pytest.mark.slow
def test_good_recipe_has_no_finding(good_run):
    f = read(good_run, "findings.csv")
    assert list(f.columns) == schema.FINDING_COLUMNS
    assert f.empty, f.to_dict("records")
    assert "no finding" in (good_run / "report.md").read_text()


@pytest.mark.slow
def test_phase_shares_add_up_to_the_step(good_run):
    phases = read(good_run, "phases.csv")
    assert list(phases.columns) == schema.PHASE_COLUMNS
    assert list(phases["phase"]) == PHASES
    assert (phases["mean_ms"] >= 0).all() and (phases["share"] >= 0).all()
    # The phases are timed separately from the step: together they must cover it.
    assert phases["share"].sum() == pytest.approx(1.0, abs=0.05)
    # mean / share is the step time of the phase window that trials.csv reports.
    trial = read(good_run, "trials.csv").iloc[0]
    top = phases.loc[phases["share"].idxmax()]
    assert top["mean_ms"] / top["share"] == pytest.approx(trial["phase_step_ms"], rel=1e-6)


@pytest.mark.slow
def test_overhead_is_recorded(good_run):
    trial = read(good_run, "trials.csv").iloc[0]
    assert trial["profile"] == "advanced"
    for col in ("reference_step_ms", "phase_step_ms", "profiled_step_ms"):
        assert trial[col] > 0
    assert trial["profile_overhead"] == pytest.approx(
        trial["profiled_step_ms"] / trial["reference_step_ms"] - 1)
    report = (good_run / "report.md").read_text()
    assert "### Profiler overhead" in report and "synchronised at the end of every phase" in report


@pytest.mark.slow
def test_cprofile_per_phase(good_run):
    out = good_run / "profile" / "resnet" / "default"
    text = (out / "cprofile.txt").read_text()
    for phase in ("data", "forward", "backward", "optimizer"):
        assert f"=== phase {phase}:" in text
        assert pstats.Stats(str(out / f"cprofile_{phase}.prof")).total_tt > 0


def test_torch_profiler_trace_is_valid_json_with_events(tmp_path):
    run_dir = run_in_process(tmp_path, "model=transformer", "profile=pytorch")
    out = run_dir / "profile" / "transformer" / "default"
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert len(trace["traceEvents"]) > 10
    assert {"speedbench.forward", "speedbench.backward", "speedbench.optimizer"} <= names
    tensorboard = list((out / "tensorboard").glob("*.pt.trace.json"))
    assert len(tensorboard) == 1 and json.loads(tensorboard[0].read_text())["traceEvents"]
    ops = (out / "torch_ops.txt").read_text()
    assert "Self CPU" in ops and "CPU Mem" in ops  # time and memory tables


def test_profile_knob_is_validated():
    cfg = compose_cfg(*TINY, "profile=fast")
    with pytest.raises(ConfigError, match=r"profile: 'fast' is not allowed; choose one of off, "
                                          r"simple, advanced, pytorch"):
        build_plan(cfg, None)


@pytest.mark.slow
def test_profile_off_writes_no_profile_tables(tmp_path):
    run_dir = run_in_process(tmp_path, "model=transformer")
    assert not (run_dir / "phases.csv").exists() and not (run_dir / "profile").exists()
    assert pd.read_csv(run_dir / "trials.csv")["profile_overhead"].isna().all()


@pytest.mark.slow
def test_cli_profile_experiment_on_resnet(tmp_path):
    """The issue's acceptance: `python -m speedbench +experiment=profile model=resnet`."""
    proc = run_cli("+experiment=profile", "model=resnet", *TINY, "bench.repeats=1",
                   "bench.warmup=0", "bench.steps=1",
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = only_run_dir(tmp_path)
    phases = read(run_dir, "phases.csv")
    assert set(phases["variant"]) == {"simple", "advanced", "pytorch"}
    assert (run_dir / "profile/resnet/advanced/cprofile.txt").read_text().count("=== phase") == 6
    assert json.loads((run_dir / "profile/resnet/pytorch/trace.json").read_text())["traceEvents"]
    assert list(read(run_dir, "findings.csv").columns) == schema.FINDING_COLUMNS
    assert "Findings:" in proc.stdout and "resnet / pytorch" in proc.stdout
    assert "## Where the time goes (profile)" in (run_dir / "report.md").read_text()


# --- measurements and rules that need what a CPU test cannot make ------------------------------
def test_ddp_forwards_outside_no_sync_are_counted(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, x = DistributedDataParallel(nn.Linear(4, 2)), torch.randn(3, 4)
        with parallel.counting_synced_forwards(model) as synced:
            with model.no_sync():
                model(x).sum().backward()
            model(x).sum().backward()
            model(x).sum().backward()
        assert synced[0] == 2
    finally:
        dist.destroy_process_group()


SETTINGS = {"precision": "bf16", "matmul_precision": "default", "sync": "deferred",
            "accumulate": 1, "num_workers": 4, "parallel": "none"}


def measured(settings: Optional[dict] = None, counters: Optional[dict] = None,
             **kw) -> diagnosis.TrialProfile:
    """A clean measurement on a GPU with tensor cores, changed by `kw`, with `settings` (the
    techniques' columns) and `counters` (theirs) over a clean recipe's."""
    base = dict(mode="simple", steps=10, window_s=1.0, device="cuda", device_name="GPU",
                capability=(9, 0), batch_pinned=True, cpus=8, cuda_syncs=0, model_syncs=0,
                phase_s={"data": 0.01, "h2d": 0.05, "forward": 0.3, "backward": 0.5,
                         "optimizer": 0.1, "other": 0.01},
                settings={**SETTINGS, **(settings or {})},
                counters={"empty_cache_calls": 0, **(counters or {})})
    return diagnosis.TrialProfile(**{**base, **kw})


@pytest.mark.parametrize("change, knob", [
    ({"settings": {"precision": "fp32"}}, "precision=bf16"),
    ({"settings": {"precision": "fp32"}, "capability": (7, 0)}, "precision=fp16"),
    ({"batch_pinned": False}, "data.pin_memory=true data.non_blocking=true"),
    ({"host_creations": 20, "model_syncs": 20}, "tensor_creation=device"),
    ({"model_syncs": 10}, "-"),
    ({"counters": {"synced_forwards": 20}, "settings": {"accumulate": 2}}, "-"),
    ({"counters": {"empty_cache_calls": 10}}, "empty_cache=false"),
    ({"counters": {"data_parallel": "parallel=dp"}}, "parallel=ddp"),
    ({"host_reads": 10}, "sync=deferred"),
])
def test_diagnosis_rules(change, knob):
    assert diagnosis.diagnose(measured()) == []
    found = diagnosis.diagnose(measured(**change))
    assert [f.knob for f in found] == [knob]


def test_accumulation_with_no_sync_is_clean():
    assert diagnosis.diagnose(measured(counters={"synced_forwards": 10},
                                       settings={"accumulate": 4})) == []


def test_fp32_finding_says_whether_tf32_was_on():
    fp32 = {"precision": "fp32"}
    for matmul, tf32 in (("default", "off"), ("highest", "off"), ("high", "on")):
        found = diagnosis.diagnose(measured(settings={**fp32, "matmul_precision": matmul}))
        assert f"TF32 matmuls {tf32}" in found[0].figure


def test_pooling_adds_counts_and_keeps_descriptions():
    one = measured(host_reads=3, model_syncs=None,
                   counters={"empty_cache_calls": 2, "data_parallel": "parallel=dp"})
    pooled = diagnosis.pool([one, measured(host_reads=4, model_syncs=None,
                                           counters={"empty_cache_calls": 5})])
    assert (pooled.steps, pooled.host_reads, pooled.model_syncs) == (20, 7, None)
    assert pooled.counters == {"empty_cache_calls": 7, "data_parallel": "parallel=dp"}
    assert one.counters["empty_cache_calls"] == 2  # the trial's own figures are left as they were


@pytest.mark.gpu
def test_poor_recipe_on_cuda(tmp_path):
    run_dir = run_in_process(tmp_path, "device=cuda", "model=vae", "profile=simple", "sync=item",
                             "tensor_creation=host", "empty_cache=true", "precision=fp32")
    knobs = " ".join(read(run_dir, "findings.csv")["knob"])
    for knob in ("sync=deferred", "tensor_creation=device", "empty_cache=false"):
        assert knob in knobs
    figure = read(run_dir, "findings.csv").query("knob == 'sync=deferred'")["figure"].iloc[0]
    assert "synchronising CUDA calls per step" in figure


@pytest.mark.gpu
def test_good_recipe_on_cuda_has_none_of_the_loop_findings(tmp_path):
    run_dir = run_in_process(tmp_path, "device=cuda", "model=vae", "profile=pytorch",
                             "sync=deferred", "tensor_creation=device", "precision=bf16",
                             "data.pin_memory=true", "data.non_blocking=true")
    knobs = " ".join(read(run_dir, "findings.csv")["knob"])
    for knob in ("sync=", "tensor_creation", "empty_cache", "precision", "pin_memory"):
        assert knob not in knobs
    assert (run_dir / "profile/vae/default/cuda_memory_snapshot.pickle").exists()


def test_the_phase_table_keeps_experiments_apart():
    """A recipe search profiles `current` in every step: one row per experiment's variant, not
    one ambiguous group (the console crashed on a recipe run with profile=simple)."""
    from speedbench.report.profile_section import phase_table

    rows = [{"experiment": e, "model": "m", "variant": "current", "phase": phase,
             "mean_ms": ms, "total_ms": 5 * ms, "share": ms / 10}
            for e in ("recipe-pilot", "recipe-step1") for phase, ms in (("forward", 4.0),
                                                                       ("backward", 5.0))]
    table = phase_table(pd.DataFrame(rows))
    assert table["variant"].tolist() == ["recipe-pilot/current", "recipe-step1/current"]
    assert table["step ms"].tolist() == ["10.0", "10.0"]
    one = phase_table(pd.DataFrame(rows[:2]))
    assert one["variant"].tolist() == ["current"]
