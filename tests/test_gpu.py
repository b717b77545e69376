"""The CUDA code paths: fp16 autocast + GradScaler, pinned memory + non_blocking copies, device
peak memory, host vs device tensor creation, FLOPs and the matmul peak, the CLI on a GPU.

Marked `gpu`: skipped without CUDA (tests/conftest.py). scripts/gpu_check.sh runs them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import TINY, compose_cfg, only_run_dir, run_cli

from speedbench.measure import flops
from speedbench import techniques
from speedbench.techniques import Context
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset, build_loader
from speedbench.measure.timing import device_peak_mb, reset_device_peak
from speedbench.measure.train import Trainer
from speedbench.measure.trial import dataset_length, measure_trial

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
TINY_CUDA = [o for o in TINY if not o.startswith("device=")] + ["device=cuda"]


def setup(*overrides: str, model: str = "transformer"):
    """(plan, spec, recipe, dataset) for one model and the default variant on cuda:0."""
    plan = build_plan(compose_cfg(*TINY_CUDA, f"model={model}", *overrides), None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return plan, spec, recipe, dataset


def test_fp16_autocast_and_grad_scaler_on_cuda():
    plan, spec, recipe, dataset = setup("precision=fp16")
    device = torch.device(plan.device)
    loader = build_loader(dataset, recipe.batch_size, _loader_options(recipe), seed=0)
    trainer = Trainer(spec, recipe, device, loader)
    try:
        assert isinstance(trainer.scaler, torch.amp.GradScaler) and trainer.scaler.is_enabled()
        seen = []
        trainer.model.blocks[0].qkv.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        for _ in range(3):
            trainer.step()
        torch.cuda.synchronize()
        assert seen and set(seen) == {torch.float16}  # the matmuls ran in half precision
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 weights
        assert math.isfinite(trainer.scaler.get_scale()) and trainer.scaler.get_scale() > 0
        assert math.isfinite(trainer.meter.mean())
    finally:
        trainer.close()


def _loader_options(recipe) -> dict:
    return techniques.loader_options(recipe, Context(torch.device("cuda:0")))


def test_pinned_memory_and_non_blocking_copies():
    plan, spec, recipe, dataset = setup("data.pin_memory=true", "data.non_blocking=true")
    device = torch.device(plan.device)
    x, y = next(iter(build_loader(dataset, recipe.batch_size, _loader_options(recipe), seed=0)))
    assert x.is_pinned() and y.is_pinned()
    xd, yd = (t.to(device, **techniques.copy_options(recipe, Context(device))) for t in (x, y))
    torch.cuda.synchronize()
    assert xd.is_cuda and torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
    assert techniques.not_applicable(recipe, Context(device)) is None
    record = measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)
    assert record["status"] == "ok", record["status"]


def test_device_peak_memory_is_measured():
    device = torch.device("cuda:0")
    reset_device_peak(device)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MB
    assert device_peak_mb(device) >= 64
    del block
    plan, spec, recipe, dataset = setup()
    record = measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)
    assert record["status"] == "ok", record["status"]
    assert record["peak_mem_mb"] > 0 and math.isfinite(record["peak_mem_mb"])


@pytest.mark.parametrize("where", ["host", "device"])
def test_tensor_creation_host_vs_device(where):
    plan, spec, recipe, dataset = setup(f"tensor_creation={where}", model="vae")
    device = torch.device(plan.device)
    loader = build_loader(dataset, recipe.batch_size, _loader_options(recipe), seed=0)
    trainer = Trainer(spec, recipe, device, loader)
    try:
        trainer.step()
        torch.cuda.synchronize()
        assert (trainer.model.host_creations > 0) == (where == "host")
    finally:
        trainer.close()
    assert techniques.not_applicable(recipe, Context(device)) is None  # it can act on a GPU
    record = measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)
    assert record["status"] == "ok", record["status"]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_matmul_peak_on_cuda(precision):
    peak = flops.matmul_peak_tflops(torch.device("cuda:0"), precision, duration_s=0.05)
    assert math.isfinite(peak) and peak > 0


def test_cli_amp_on_cuda(tmp_path):
    proc = run_cli("+experiment=amp", *TINY_CUDA, f"out_dir={tmp_path}", cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(trials["status"]) == {"ok"}, trials["status"].tolist()
    assert (trials["peak_mem_mb"] > 0).all()
    summary = pd.read_csv(run_dir / "summary.csv")
    assert (summary["peak_fraction"] > 0).all() and (summary["flops_per_step"] > 0).all()
    env = json.loads((run_dir / "env.json").read_text())
    assert env["cuda_device_count"] >= 1 and env["nvidia_driver"]


def test_largest_batch_search_finds_the_out_of_memory_edge():
    from speedbench.studies import capacity

    plan, spec, recipe, dataset = setup(model="resnet")
    device = torch.device(plan.device)
    total = torch.cuda.get_device_properties(device).total_memory
    # A 512 MiB allowance (as a fraction of this GPU) puts the edge within the search's reach:
    # ResNet-18 at 32 px with AdamW needs about 0.2 GB plus 0.5 MB a sample.
    torch.cuda.set_per_process_memory_fraction(min(1.0, 512 * 2**20 / total), device)
    try:
        row = capacity.probe("accumulation", spec, "k1", recipe, device, dataset)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert row["status"] == "ok", row
    assert row["largest_batch"] >= 1 and row["first_oom"] > row["largest_batch"]
    assert row["peak_mem_mb"] <= 512 and row["device_mem_mb"] == total / 2**20
    assert row["stopped"] in ("resolved", "time")
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(device) < 64 * 2**20  # the tries left nothing behind


def test_a_cuda_trial_times_each_step_with_events_and_reads_them_once():
    """Each timed step of a CUDA window is an event pair on the device's timeline (recorded
    after each step, read after the window's final synchronisation): the steps add up to the
    window, and the trial's rate is its typical step's."""
    from speedbench.measure.timing import typical_step_s

    plan, spec, recipe, dataset = setup("bench.steps=8")
    record = measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)
    assert record["status"] == "ok"
    steps = record["step_s"]
    assert len(steps) == record["steps"] == 8 and all(t > 0 for t in steps)
    # the events span the window's steps: their sum is the window's time, less the host's
    # time to the first event and after the last (a few ms at most)
    assert sum(steps) <= record["elapsed_s"] * 1.01
    assert sum(steps) >= 0.5 * record["elapsed_s"]
    per_step = record["samples"] / record["steps"]
    assert record["samples_per_s"] == pytest.approx(per_step / typical_step_s(steps))
    assert record["window_samples_per_s"] == pytest.approx(per_step * 8 / record["elapsed_s"])
