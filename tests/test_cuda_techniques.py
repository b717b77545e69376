"""The techniques written against the docs that act on a GPU only: float8 (torchao), CUDA graphs
(make_graphed_callables), activation offloading (save_on_cpu), FlexAttention, Liger's fused
linear cross-entropy. On a CPU: each is n/a with its reason, and the parts that do not need a
GPU (the float8 layer filter and forecast, the FlexAttention mask, the model's fused-loss seam)
are checked for real; `gpu`-marked tests train each on CUDA (scripts/gpu_check.sh runs them)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from conftest import SMALL_MODELS, TINY, compose_cfg
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.models import transformer
from speedbench.techniques import Context, by_name
from speedbench.techniques.cuda_graphs import GraphedOnFirstCall, obstacle
from speedbench.techniques.flex_attention import cannot_train
from speedbench.techniques.float8 import (SHAPES, converted_share, have_torchao, large_enough,
                                          linear_shapes)
from speedbench.techniques.fused_ce import import_problem

CPU = Context(torch.device("cpu"))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def recipe_of(*overrides: str, experiment: str | None = None):
    plan = build_plan(compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", *overrides,
                                  experiment=experiment), experiment)
    return plan.variants[plan.baseline]


def cpu_model():
    torch.manual_seed(0)
    return transformer.build(64, 16, 32, 2, 2)


def na_on_cpu(name: str, *overrides: str) -> str:
    return by_name(name).not_applicable(recipe_of(*overrides), Context(CPU.device,
                                                                       model=cpu_model()))


# --- float8 -----------------------------------------------------------------------------------
def test_float8_is_na_on_a_cpu_and_says_how_to_install_torchao():
    reason = na_on_cpu("float8", "float8=rowwise")
    assert reason.startswith("n/a: float8 training runs its matmuls with torch._scaled_mm, "
                             "which needs a CUDA GPU of compute capability 8.9")
    assert ("pip install 'speedbench[float8]'" in reason) == (not have_torchao())
    assert na_on_cpu("float8") is None


@pytest.mark.parametrize("shape,recipe,converted", [
    ((4096, 1024), "tensorwise", False),   # out <= 4096 and in <= 1024: too small
    ((4096, 2048), "tensorwise", True),
    ((8192, 512), "tensorwise", True),
    ((4096, 4096), "rowwise", True),       # in <= 4096 but out 4096 > 2048
    ((2048, 4096), "rowwise", False),      # in <= 4096 and out <= 2048
    ((8192, 2048), "rowwise", False),      # in <= 2048
    ((1024, 8192), "rowwise", False),      # out <= 1024
    ((4096, 8192), "rowwise", True),
    ((8200, 8192), "tensorwise", False),   # not a multiple of 16
])
def test_float8_converts_only_layers_large_enough_for_the_recipe(shape, recipe, converted):
    assert large_enough(*shape, recipe) is converted
    assert large_enough(*shape, recipe, "all") is (shape[0] % 16 == 0 and shape[1] % 16 == 0)


def test_float8_forecast_comes_from_the_layers_shapes():
    shapes = [(8192, 2048), (2048, 8192), (512, 512)]  # two large MLP layers, one small
    share = converted_share(shapes, "tensorwise", "large")
    assert share == pytest.approx(2 * 8192 * 2048 / (2 * 8192 * 2048 + 512 * 512))
    assert converted_share(linear_shapes(cpu_model()), "tensorwise", "large") == 0.0

    class Profile:
        counters = {SHAPES: shapes}

        def share(self, category):
            return 0.6 if category == "matmul" else 0.0

    base, fp8 = recipe_of("precision=bf16"), recipe_of("precision=bf16", "float8=tensorwise")
    got = by_name("float8").bound(fp8, base, Profile(), {})
    assert got.sound and got.share == pytest.approx(0.6 * share)
    assert got.speedup == pytest.approx(1 / (1 - 0.6 * share / 2))
    Profile.counters = {SHAPES: [(512, 512)]}  # nothing large enough: no gain, set aside
    assert by_name("float8").bound(fp8, base, Profile(), {}).speedup == 1.0


# --- CUDA graphs ------------------------------------------------------------------------------
def test_cuda_graphs_are_na_on_a_cpu_and_where_capture_cannot_go():
    assert na_on_cpu("cuda_graphs", "cuda_graphs=true") == \
        "n/a: CUDA graphs capture CUDA kernels (this run is on cpu)"
    assert "autocast(cache_enabled=False)" in obstacle(recipe_of("precision=bf16"))
    assert "hooks" in obstacle(recipe_of("parallel=ddp"))
    assert "reduce-overhead" in obstacle(recipe_of("compile=default"))
    assert "change shape" in obstacle(recipe_of("data.packing=pack"))
    assert "pageable" in obstacle(recipe_of("tensor_creation=host"))
    assert obstacle(recipe_of()) is None


def test_the_graphed_wrapper_runs_the_model_eagerly_in_eval_mode():
    model = cpu_model()
    x = torch.randint(0, 64, (2, 16))
    wrapped = GraphedOnFirstCall(model).eval()
    with torch.no_grad():
        assert torch.equal(wrapped(x, x), model.eval()(x, x))
    assert wrapped.graphed is None  # nothing captured outside training


# --- activation offloading --------------------------------------------------------------------
def test_offloading_is_na_on_a_cpu_and_leaves_the_step_alone():
    reason = na_on_cpu("offload", "offload_activations=true")
    assert reason.startswith("n/a: activation offloading moves saved activations from GPU "
                             "memory to the host; on cpu they are in host memory already")
    with by_name("offload").step_context(recipe_of("offload_activations=true"), CPU) as got:
        assert got is None  # nullcontext: no saved-tensor hooks on a CPU
    assert isinstance(by_name("offload").bound(recipe_of("offload_activations=true"),
                                               recipe_of(), None, {}), str)


# --- FlexAttention ----------------------------------------------------------------------------
def test_flex_attention_is_na_on_a_cpu_in_torchs_own_words():
    why = cannot_train("cpu")
    assert why and "FlexAttention does not support backward on CPU" in why
    reason = na_on_cpu("flex_attention", "flex_attention=true")
    assert reason == f"n/a: FlexAttention cannot train here: torch says \"{why}\""
    assert "set attention=auto" in na_on_cpu("flex_attention", "flex_attention=true",
                                             "attention=math")


# eager flex_attention on a CPU is the unfused reference path; torch warns so, which is expected
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("packed", [False, True])
def test_the_flex_block_mask_attends_as_the_boolean_mask_does(packed):
    torch.manual_seed(0)
    rows, t = 2, 256  # two of FlexAttention's 128-token blocks a side
    q, k, v = (torch.randn(rows, 2, t, 16) for _ in range(3))
    doc = torch.cat([torch.zeros(rows, 100), torch.ones(rows, 80), torch.full((rows, 76), 2)],
                    1).long() if packed else None
    model = transformer.TransformerLM(64, t, 32, 1, 2)
    model.flex = True
    block = model._mask(doc, rows, t, "cpu")
    model.flex = False
    dense = model._mask(doc, rows, t, "cpu")
    with torch.no_grad():  # forward only: torch 2.14 has no FlexAttention backward on a CPU
        got = flex_attention(q, k, v, block_mask=block)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                              is_causal=dense is None)
    assert torch.allclose(got, want, atol=1e-5)
    assert block.sparsity() > 0  # the blocks above the diagonal (and across documents) skipped


# --- Liger's fused linear cross-entropy ---------------------------------------------------------
def test_fused_ce_is_na_on_a_cpu():
    assert na_on_cpu("fused_ce", "fused_linear_ce=true") == \
        "n/a: Liger's fused linear cross-entropy is a Triton GPU kernel (this run is on cpu)"
    assert na_on_cpu("fused_ce") is None
    assert import_problem() is None or "liger" in import_problem().lower() or \
        "triton" in import_problem().lower()


def test_the_models_fused_loss_seam_gets_the_head_weight_and_hidden_states():
    """The transformer hands (head weight, hidden (N*T, D), targets (N*T)) to `fused_loss`:
    a plain-PyTorch loss through it gives the model's own loss and gradients."""
    model = cpu_model()
    x = torch.randint(0, 64, (2, 16))
    y = torch.roll(x, -1, 1)
    plain = model(x, y)
    plain.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.fused_loss = lambda w, h, t: F.cross_entropy(F.linear(h, w).float(), t)
    fused = model(x, y)
    fused.backward()
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(want, model.parameters()))


def test_the_experiments_plan_their_variants():
    assert recipe_of(experiment="float8").precision == "bf16"
    for name, key in (("cuda_graphs", "eager"), ("offload", "kept"),
                      ("flex_attention", "sdpa_packed"), ("fused_ce", "whole")):
        plan = build_plan(compose_cfg(*TINY, *SMALL_MODELS, experiment=name), name)
        assert plan.baseline == key and len(plan.variants) >= 2


# --- on a GPU ---------------------------------------------------------------------------------
def cuda_record(*overrides: str) -> dict:
    plan = build_plan(compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", "device=cuda",
                                  "bench.warmup=2", "bench.steps=3", *overrides), None)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, dataset)


@pytest.mark.gpu
@needs_cuda
def test_gpu_float8_converts_the_layers_and_trains():
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9")
    record = cuda_record("precision=bf16", "float8=tensorwise", "float8_layers=all",
                         "models.transformer.small.dim=64")
    assert record["status"] == "ok", record["status"]
    assert record["float8_converted"] > 0 and math.isfinite(record["final_loss"])


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graphs_capture_and_train_like_eager():
    eager, graphed = cuda_record(), cuda_record("cuda_graphs=true")
    assert graphed["status"] == "ok", graphed["status"]
    assert graphed["graph_captured"] is True
    assert graphed["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_offloading_moves_the_activations_off_the_gpu():
    kept, offloaded = cuda_record(), cuda_record("offload_activations=true")
    assert offloaded["status"] == "ok", offloaded["status"]
    assert offloaded["activation_mem_mb"] < kept["activation_mem_mb"]
    assert offloaded["final_loss"] == pytest.approx(kept["final_loss"], rel=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_gpu_flex_attention_trains_packed_documents_like_sdpa():
    assert cannot_train("cuda") is None
    common = ("data.packing=pack_reset", "models.transformer.small.dataset.documents=16")
    sdpa, flex = cuda_record(*common), cuda_record(*common, "flex_attention=true")
    assert flex["status"] == "ok", flex["status"]
    assert flex["final_loss"] == pytest.approx(sdpa["final_loss"], rel=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_liger_fused_loss_trains_like_the_plain_loss():
    pytest.importorskip("liger_kernel")
    assert import_problem() is None
    plain, fused = cuda_record(), cuda_record("fused_linear_ce=true")
    assert fused["status"] == "ok", fused["status"]
    assert fused["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-3)
