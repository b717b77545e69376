"""The Performance Tuning Guide's in-process tips: what a trial record cannot show.

zero_grad frees or keeps the gradients; an eval_mode step trains nothing and keeps no graph
under no_grad; debug APIs are on inside a trial and off after it; oneDNN's precision is set
inside and restored after; a convolution's bias before a batch norm is found, added or dropped
without changing what the model computes, and reported as a finding that is measured.
"""
from __future__ import annotations

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
    if not onednn_precision.HAS_FLAG:
        pytest.skip("this torch has no torch.backends.mkldnn.fp32_precision")
    before = global_snapshot()
    with session("onednn_precision=bf16") as trainer:
        assert torch.backends.mkldnn.fp32_precision == "bf16"
        assert torch.backends.mkldnn.conv.fp32_precision == "bf16"
        error = trainer.ctx.extra["onednn_rel_err"]
    assert global_snapshot() == before
    torch.get_float32_matmul_precision()  # readable again: the mixed-API state is undone
    if onednn_precision.bf16_hardware() == "none":  # oneDNN keeps fp32 arithmetic
        assert error < 1e-5
    else:  # bf16 inputs: about 1e-3 (fp32 gives 1e-7)
        assert error > 1e-5


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
