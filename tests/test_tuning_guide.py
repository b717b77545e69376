"""The Performance Tuning Guide's in-process tips: what a trial record cannot show.

zero_grad frees or keeps the gradients; an eval_mode step trains nothing and keeps no graph
under no_grad; debug APIs are on inside a trial and off after it; oneDNN's precision is set
inside and restored after; a convolution's bias before a batch norm is found, added or dropped
without changing what the model computes, and reported as a finding that is measured.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.nn as nn

from conftest import TINY, compose_cfg
from speedbench.analysis import claims
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset
from speedbench.measure.session import NotApplicable, applied
from speedbench.measure.train import build_model
from speedbench.run import run
from speedbench.techniques import Context, by_name, global_snapshot
from speedbench.techniques import conv_bias, onednn_precision

SMALL = ["scale=small", "device=cpu", "model=transformer", "batch_size=4", "bench.warmup=1",
         "bench.steps=2", "bench.repeats=1", "bench.steady_tol=null",
         "models.transformer.small.vocab_size=32", "models.transformer.small.seq_len=8",
         "models.transformer.small.dim=16", "models.transformer.small.layers=1",
         "models.transformer.small.heads=2", "models.transformer.small.dataset.seq_len=8",
         "models.transformer.small.dataset.vocab_size=32"]

@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


def session(*overrides: str):
    """`applied(...)` for the small transformer under these overrides."""
    plan = build_plan(compose_cfg(*SMALL, *overrides), None)
    spec, recipe = plan.models[0], plan.variants["default"]
    dataset = build_dataset(spec.dataset, 64, seed=0)
    return applied(spec, recipe, Context(torch.device("cpu")), dataset)


# --- zero_grad -----------------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_frees_or_zero_fills_the_gradients(set_to_none):
    with session(f"set_to_none={str(set_to_none).lower()}") as trainer:
        trainer.step()
        grads = [p.grad for p in trainer.model.parameters()]
        held = by_name("zero_grad").columns(trainer.recipe, trainer.ctx)["held_grad_mb"]
    if set_to_none:
        assert all(g is None for g in grads) and held == 0
    else:
        assert all(g is not None and not g.any() for g in grads)
        assert held == pytest.approx(sum(p.numel() * 4 for p in trainer.model.parameters()) / 2**20)


# --- eval_mode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_an_eval_mode_step_trains_nothing(mode):
    with session(f"eval_mode={mode}") as trainer:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.step()
        assert not trainer.model.training
        assert all(p.grad is None for p in trainer.model.parameters())
        assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        assert trainer.meter.count == 1  # the loss was read, as a validation loop reads it


def test_eval_mode_is_na_under_data_parallel():
    with pytest.raises(NotApplicable, match="one process"):
        with session("eval_mode=no_grad", "parallel=dp"):
            pass


# --- debug_apis ----------------------------------------------------------------------------------
def test_debug_apis_are_on_inside_the_trial_and_off_after():
    before = global_snapshot()
    with session("debug_api=anomaly"):
        assert torch.is_anomaly_enabled()
    assert not torch.is_anomaly_enabled() and global_snapshot() == before
    with session("debug_api=profiler"):
        assert torch.autograd.profiler._is_profiler_enabled
    assert not torch.autograd.profiler._is_profiler_enabled


def test_emit_nvtx_is_na_on_a_cpu():
    with pytest.raises(NotApplicable, match="emit_nvtx needs CUDA"):
        with session("debug_api=nvtx"):
            pass


# --- onednn_precision ----------------------------------------------------------------------------
def test_onednn_precision_is_set_inside_and_restored_after():
    """Runs for real on every CPU: the row says what the setting did here, and says it right."""
    if not onednn_precision.HAS_FLAG:
        pytest.skip("this torch has no torch.backends.mkldnn.fp32_precision")
    before = global_snapshot()
    with session("onednn_precision=ieee"):
        assert torch.backends.mkldnn.fp32_precision == "ieee"
    try:
        with session("onednn_precision=bf16") as trainer:
            assert torch.backends.mkldnn.fp32_precision == "bf16"
            assert torch.backends.mkldnn.conv.fp32_precision == "bf16"
            effects = trainer.ctx.extra["onednn_effects"]
            row = by_name("onednn_precision").columns(trainer.recipe, trainer.ctx)
    except NotApplicable as why:  # this CPU changes none of the transformer's matmuls
        assert "changes none of this model's matmul ops" in str(why)
        effects = next(e for key, e in onednn_precision.MEASURED.items() if key[0] == "bf16")
        assert effects["matmul"].math == "unchanged"
    else:
        assert effects["matmul"].math != "unchanged"  # else it would have been n/a
        assert row["onednn_math"] == onednn_precision.math_text(effects)
        assert row["onednn_matmul_rel_err"] == effects["matmul"].rel_err
    assert global_snapshot() == before
    torch.get_float32_matmul_precision()  # readable again: the mixed-API state is undone
    for effect in effects.values():  # the label follows the measured error, whatever the CPU
        assert (effect.math == "reduced") == (effect.rel_err > onednn_precision.REDUCED_ERR)
        assert effect.rel_err < 1e-2  # bf16 inputs: ~1e-3 at worst


def test_op_effect_tells_reduced_math_from_a_kernel_change():
    """The classifier on real arithmetic: bf16 inputs, another fp32 summation order, the same."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    ref, fp32 = a.double() @ b.double(), a @ b
    bf16 = (a.bfloat16() @ b.bfloat16()).float()
    other_order = a[:, :100] @ b[:100] + a[:, 100:] @ b[100:]  # another summation order
    assert onednn_precision.op_effect(fp32, bf16, ref).math == "reduced"
    assert onednn_precision.op_effect(fp32, other_order, ref).math == "fp32, other kernel"
    assert onednn_precision.op_effect(fp32, fp32.clone(), ref).math == "unchanged"


def _capped_effects(isa: str) -> dict:
    """The setting's effects measured in a fresh process whose oneDNN is capped at `isa`."""
    code = ("import json, torch; from speedbench.techniques import onednn_precision as o\n"
            "torch.set_num_threads(1)\n"
            "e = o.measured_effects(lambda: setattr(torch.backends.mkldnn, 'fp32_precision',"
            " 'bf16'))\n"
            "print(json.dumps({k: [v.math, v.rel_err] for k, v in e.items()}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_onednn_capped_at_avx2_keeps_fp32_math():
    """The AVX2 class for real on any x86 CPU: oneDNN capped at AVX2 has no bf16 math (on this
    torch it does not even take the matmuls), so bf16 reduces nothing."""
    if not onednn_precision.HAS_FLAG or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("oneDNN's x86 ISA cap")
    effects = _capped_effects("AVX2")
    assert {name: math for name, (math, _) in effects.items()} \
        == {"matmul": "unchanged", "conv": "unchanged"}


@pytest.mark.parametrize("effects, na", [
    # AMX: oneDNN down-converts both (faked: no AMX CPU here)
    ({"matmul": (3e-3, True), "conv": (2e-3, True)}, False),
    # AVX-512 bf16 (measured on an EPYC): matmuls to oneDNN's fp32 kernel, convolutions as they were
    ({"matmul": (4e-7, True), "conv": (2e-7, False)}, False),
    # AVX2, or tf32 on either: nothing changes
    ({"matmul": (2e-7, False), "conv": (2e-7, False)}, True),
])
def test_onednn_rows_and_n_a_follow_the_measured_effects(monkeypatch, effects, na):
    """Every CPU class, by the effects it measures (faked here where this CPU cannot show them):
    measured with a row that says what changed, or n/a with the reason."""
    fake = {name: onednn_precision.OpEffect(err, changed)
            for name, (err, changed) in effects.items()}
    monkeypatch.setattr(onednn_precision, "measured_effects", 
                        lambda set_value: (set_value(), fake)[1])
    monkeypatch.setattr(onednn_precision, "MEASURED", {})  # its per-process cache, empty
    tech = by_name("onednn_precision")
    plan = build_plan(compose_cfg(*SMALL, "onednn_precision=bf16"), None)
    ctx = Context(torch.device("cpu"))
    ctx.model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                    torch.nn.Linear(4, 2))
    recipe = plan.variants["default"]
    with tech.global_state(recipe, ctx):
        reason = tech.not_applicable(recipe, ctx)
        row = tech.columns(recipe, ctx)
    assert bool(reason) == na
    if na:
        assert reason.startswith("n/a: on this CPU") and "matmul or conv ops" in reason
    else:
        assert row["onednn_math"] == onednn_precision.math_text(fake)
        assert row["onednn_conv_rel_err"] == effects["conv"][0]
    ieee = plan.variants["default"].copy()
    ieee.onednn_precision = "ieee"  # the baseline is never n/a for changing nothing
    with tech.global_state(ieee, ctx):
        assert tech.not_applicable(ieee, ctx) is None


def test_bf16_hardware_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n")
    assert onednn_precision.bf16_hardware(str(info)) == "avx512_bf16"
    info.write_text("processor : 0\nflags : fpu avx2 amx_bf16 avx512_bf16\n")
    assert onednn_precision.bf16_hardware(str(info)) == "amx_bf16"
    info.write_text("processor : 0\nflags : fpu avx2\n")
    assert onednn_precision.bf16_hardware(str(info)) == "none"
    assert onednn_precision.bf16_hardware(str(tmp_path / "absent")) == "unknown"


def test_a_claim_scoped_to_cpu_features():
    claim = {"kind": "faster", "cpu_flags": ["amx_bf16", "avx512_bf16"]}
    assert claims.out_of_scope(claim, "cpu", {"cpu_flags": ["avx2"]}) \
        == "n/a: the claim is stated for CPUs with amx_bf16 or avx512_bf16; this CPU has neither"
    assert claims.out_of_scope(claim, "cpu", {"cpu_flags": ["avx2", "avx512_bf16"]}) is None
    assert claims.out_of_scope(claim, "cpu", {}) is None  # unknown: judged
    assert claims.out_of_scope(claim, "cuda:0", {}).startswith("n/a: the claim is stated for CPUs")


# --- conv_bias -----------------------------------------------------------------------------------
class ConvBiasNet(nn.Module):
    """A hand-written classifier: convolutions with a bias, each followed by a batch norm, one
    of them behind data-dependent control flow when `branchy` (torch.fx cannot trace it)."""

    def __init__(self, num_classes: int = 10, branchy: bool = False):
        super().__init__()
        self.branchy = branchy
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        if self.branchy and x.sum() > 0:
            x = x * 1.0
        return self.head(self.body(x))


@pytest.mark.parametrize("branchy", [False, True], ids=["traced", "sequential"])
def test_conv_bias_pairs_are_found_and_dropping_them_changes_nothing_computed(branchy):
    torch.manual_seed(0)
    model = ConvBiasNet(branchy=branchy)
    pairs = conv_bias.conv_norm_pairs(model)
    assert len(pairs) == 2 and len(conv_bias.biased(pairs)) == 2
    with torch.no_grad():
        for conv in conv_bias.biased(pairs):
            conv.bias.uniform_(-1, 1)
        for _, norm in pairs:
            norm.running_mean.uniform_(-1, 1)
    x = torch.randn(4, 3, 8, 8)
    trained = model(x)  # batch statistics (this also moves the running ones)
    model.eval()
    evaluated = model(x)  # running statistics
    for conv, norm in pairs:
        conv_bias.drop_bias(conv, norm)
    assert not conv_bias.biased(conv_bias.conv_norm_pairs(model))
    assert torch.allclose(model(x), evaluated, atol=1e-5)
    model.train()
    assert torch.allclose(model(x), trained, atol=1e-5)


def test_conv_bias_acts_on_resnet_and_is_na_without_a_pair():
    resnet = build_model(build_plan(compose_cfg("scale=small", "model=resnet"), None).models[0], 0)
    assert len(conv_bias.conv_norm_pairs(resnet)) == 20 and not conv_bias.biased(
        conv_bias.conv_norm_pairs(resnet))  # torchvision builds them without
    with session("conv_bias=keep"):
        pass  # the default never makes a recipe n/a
    with pytest.raises(NotApplicable, match="no convolution directly followed by a batch norm"):
        with session("conv_bias=drop"):
            pass


CONV_BIAS_MODEL = {"_target_": "test_tuning_guide.ConvBiasNet", "loss": "cross_entropy",
                   "batch_size": 4, "dataset": {"kind": "images", "image_size": 16,
                                                "num_classes": 10}}


@pytest.mark.slow
def test_a_user_models_conv_bias_is_a_finding_measured_before_it_is_recommended(tmp_path):
    cfg = compose_cfg(*TINY, "bench.repeats=1", "profile=simple", f"run_dir={tmp_path / 'run'}")
    cfg.model = CONV_BIAS_MODEL
    run_dir = run(cfg, "conv-bias-test", progress=False)
    findings = pd.read_csv(run_dir / "findings.csv", dtype=str, keep_default_na=False)
    found = findings[findings["knob"] == "conv_bias=drop"]
    assert len(found) == 1, findings[["symptom", "knob"]]
    assert found["figure"].iloc[0].startswith("2 convolution(s) with a bias feed a batch norm")
    assert found["check"].iloc[0].startswith("measured ")  # the suggestion was measured
    trials = pd.read_csv(run_dir / "trials.csv")
    checked = trials[trials["experiment"].str.startswith("check-")]
    assert (checked["status"] == "ok").all()
    # the run's model as it ran (its biases kept), and the suggestion, with them dropped
    assert set(zip(checked["conv_bias"], checked["conv_bias_convs"])) == {("keep", 2), ("drop", 0)}
