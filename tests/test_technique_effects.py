"""The techniques people tune today, on the CPU: each knob acts, the model still trains, and
what cannot act here says why. (tests/test_registry.py runs the generic checks over them.)"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tvm

from conftest import TINY, compose_cfg, only_run_dir, run_cli
from speedbench import results
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset
from speedbench.models import resnet, transformer, vae
from speedbench.techniques import Context, by_name, global_snapshot, global_state, \
    optimizer_options
from speedbench.techniques import compile as compile_technique
from speedbench.techniques.attention import BACKENDS
from speedbench.measure.trial import dataset_length, measure_trial

CPU = torch.device("cpu")
SMALL_LM = [
    "scale=small", "device=cpu", "model=transformer", "batch_size=4", "bench.repeats=1",
    "bench.max_trial_s=60", "bench.steady_tol=null", "models.transformer.small.vocab_size=32",
    "models.transformer.small.seq_len=8", "models.transformer.small.dim=16",
    "models.transformer.small.layers=1", "models.transformer.small.heads=2",
    "models.transformer.small.dataset.seq_len=8", "models.transformer.small.dataset.vocab_size=32",
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # two OpenMP threads crawl on a busy 2-core machine; conftest restores


def tiny_models() -> dict:
    torch.manual_seed(0)
    return {"resnet": resnet.build("resnet18", 10), "vae": vae.build(32, 8, 8),
            "transformer": transformer.build(32, 8, 16, 2, 2)}


def batch_for(name: str):
    g = torch.Generator().manual_seed(1)
    if name == "transformer":
        tokens = torch.randint(0, 32, (4, 8), generator=g)
        return tokens, tokens
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def loss_of(name: str, model: nn.Module, x, y) -> torch.Tensor:
    torch.manual_seed(2)  # the VAE's noise
    return F.cross_entropy(model(x), y) if name == "resnet" else model(x, y)


def recipe(*overrides: str):
    plan = build_plan(compose_cfg(*SMALL_LM, *overrides), None)
    return plan.variants[plan.baseline]


def trial(*overrides: str) -> dict:
    plan = build_plan(compose_cfg(*SMALL_LM, *overrides), None)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, dataset)


# --- the models: defaults unchanged ---------------------------------------------------------------
def test_resnet_has_torchvisions_parameters_and_same_seed_values():
    torch.manual_seed(0)
    ours = resnet.build("resnet18", 10).state_dict()
    torch.manual_seed(0)
    theirs = tvm.resnet18(weights=None, num_classes=10).state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_transformer_is_causal_mode_gives_the_masks_result():
    model = tiny_models()["transformer"]
    x, y = batch_for("transformer")
    with_mask = model(x, y)
    model.causal = "is_causal"
    assert torch.allclose(model(x, y), with_mask, atol=1e-6)


# --- checkpointing --------------------------------------------------------------------------------
# Layers inside the blocks: a block's own forward hook may not fire on recomputation (it stops
# as soon as the saved tensors backward needs are back), its first layers' hooks do.
LAYER_TYPES = {"resnet": nn.Conv2d, "vae": nn.Conv2d, "transformer": nn.Linear}


@pytest.mark.parametrize("name", ["resnet", "vae", "transformer"])
def test_checkpointing_recomputes_blocks_with_the_same_loss_and_gradients(name):
    runs = {}
    for setting in ("off", "blocks"):
        model = tiny_models()[name]
        model = by_name("checkpointing").prepare_model(model, recipe(f"checkpointing={setting}"),
                                                       Context(CPU))
        calls = []
        for m in model.modules():
            if isinstance(m, LAYER_TYPES[name]):
                m.register_forward_hook(lambda *_: calls.append(1))
        loss = loss_of(name, model, *batch_for(name))
        forward_calls = len(calls)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs[setting] = (loss.item(), grads, forward_calls, len(calls))
    (loss_off, grads_off, fwd_off, total_off), (loss_on, grads_on, fwd_on, total_on) = \
        runs["off"], runs["blocks"]
    assert total_off == fwd_off  # without checkpointing backward runs no forward
    assert fwd_on == fwd_off and total_on > fwd_on  # with it, backward recomputes layers
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert torch.allclose(grads_on, grads_off, rtol=1e-4, atol=1e-6)


def test_checkpointing_is_na_for_a_model_without_blocks():
    reason = by_name("checkpointing").not_applicable(
        recipe("checkpointing=blocks"), Context(CPU, model=nn.Sequential(nn.Linear(2, 2))))
    assert reason.startswith("n/a: ") and "checkpoint_blocks" in reason
    assert by_name("checkpointing").not_applicable(
        recipe(), Context(CPU, model=nn.Sequential(nn.Linear(2, 2)))) is None


# --- channels_last -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet", "vae"])
def test_channels_last_converts_weights_and_inputs_and_keeps_the_loss(name):
    x, y = batch_for(name)
    plain = loss_of(name, tiny_models()[name], x, y)
    tech = by_name("memory_format")
    model = tiny_models()[name]
    assert tech.not_applicable(recipe("memory_format=channels_last"), Context(CPU, model=model)) \
        is None
    model = tech.prepare_model(model, recipe("memory_format=channels_last"), Context(CPU))
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    seen = []
    conv.register_forward_pre_hook(lambda m, args: seen.append(
        args[0].is_contiguous(memory_format=torch.channels_last)))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    loss = loss_of(name, model, x, y)  # x itself is contiguous: the model converts it
    assert seen == [True]
    assert loss.item() == pytest.approx(plain.item(), rel=1e-4)


def test_channels_last_is_na_for_the_transformer():
    reason = by_name("memory_format").not_applicable(
        recipe("memory_format=channels_last"), Context(CPU, model=tiny_models()["transformer"]))
    assert reason.startswith("n/a: ") and "convolution" in reason


# --- attention kernels ----------------------------------------------------------------------------
def sdpa_ops(model, x, y) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x, y).backward()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


def test_attention_backend_acts_on_cpu_and_restores_the_flags():
    tech, x, y = by_name("attention"), *batch_for("transformer")
    before = global_snapshot()
    losses, ops = {}, {}
    for backend in ("math", "flash"):
        r = recipe(f"attention={backend}")
        model = tiny_models()["transformer"]
        assert tech.not_applicable(r, Context(CPU, model=model)) is None
        model = tech.prepare_model(model, r, Context(CPU))
        assert model.causal == "is_causal"
        with global_state(r, Context(CPU)):
            assert torch.backends.cuda.math_sdp_enabled() == (backend == "math")
            assert torch.backends.cuda.flash_sdp_enabled() == (backend == "flash")
            losses[backend] = model(x, y).item()
            ops[backend] = sdpa_ops(model, x, y)
        assert global_snapshot() == before
    assert any("flash" in op for op in ops["flash"])
    assert not any("flash" in op for op in ops["math"])
    assert losses["flash"] == pytest.approx(losses["math"], rel=1e-5)


@pytest.mark.parametrize("backend", ["math", "flash", "efficient", "cudnn"])
def test_attention_backend_without_a_kernel_here_is_na_with_a_reason(backend):
    r = recipe(f"attention={backend}")
    model = tiny_models()["transformer"]
    reason = by_name("attention").not_applicable(r, Context(CPU, model=model))
    q = torch.randn(1, 2, 8, model.head_dim)
    try:  # torch decides; the technique must agree with it
        with torch.nn.attention.sdpa_kernel(BACKENDS[backend]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        runs = True
    except RuntimeError:
        runs = False
    assert (reason is None) == runs
    if reason:
        assert reason.startswith("n/a: torch ") and backend in reason


def test_attention_is_na_for_models_without_attention():
    reason = by_name("attention").not_applicable(recipe("attention=math"),
                                                 Context(CPU, model=tiny_models()["resnet"]))
    assert reason.startswith("n/a: ") and "transformer" in reason


# --- matmul precision, cudnn.benchmark ------------------------------------------------------------
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_matmul_precision_is_set_for_the_trial_and_restored(precision):
    before = global_snapshot()
    with global_state(recipe(f"matmul_precision={precision}"), Context(CPU)):
        assert torch.get_float32_matmul_precision() == precision
        assert torch.backends.cudnn.allow_tf32 == (precision != "highest")
        a = torch.randn(64, 64)
        assert torch.isfinite(a @ a).all()
    assert global_snapshot() == before


def test_matmul_precision_default_touches_nothing():
    before = global_snapshot()
    with global_state(recipe(), Context(CPU)):
        assert global_snapshot() == before


def test_cudnn_benchmark_is_na_on_cpu_only_when_asked_for():
    tech = by_name("cudnn_benchmark")
    assert tech.not_applicable(recipe("cudnn_benchmark=true"), Context(CPU)).startswith("n/a: ")
    assert tech.not_applicable(recipe("cudnn_benchmark=false"), Context(CPU)) is None


# --- optimizer implementations --------------------------------------------------------------------
def test_optimizer_implementations_take_the_same_step():
    from speedbench.techniques.optimizer import fused_unsupported

    steps = {}
    for impl in ("default", "for-loop", "foreach", "fused"):
        r = recipe(f"optimizer.impl={impl}")
        if by_name("optimizer").not_applicable(r, Context(CPU)):
            assert impl == "fused" and fused_unsupported(CPU)
            continue
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        opts = optimizer_options(r, Context(CPU))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opts)
        assert {k: opt.defaults[k] for k in opts} == opts
        for _ in range(3):
            model(torch.ones(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        steps[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    for impl, params in steps.items():
        assert torch.allclose(params, steps["for-loop"], atol=1e-6), impl


def test_optimizer_phase_time_is_recorded():
    record = trial("optimizer.impl=foreach", "bench.warmup=1", "bench.steps=2")
    assert record["status"] == "ok" and record["optimizer_impl"] == "foreach"
    assert record["optimizer_ms"] > 0


# --- torch.compile --------------------------------------------------------------------------------
def test_compile_is_na_for_cuda_graphs_on_cpu():
    reason = by_name("compile").not_applicable(recipe("compile=reduce-overhead"), Context(CPU))
    assert reason.startswith("n/a: ") and "CUDA" in reason
    assert by_name("compile").not_applicable(recipe("compile=default"), Context(CPU)) is None


def test_compiled_trial_is_uncapped_so_compilation_stays_in_the_warm_up():
    assert recipe("compile=default").bench.max_trial_s is None
    assert recipe().bench.max_trial_s == 60


def test_compile_reports_its_timeline_and_matches_eager_loss(monkeypatch):
    """Dynamo capture and AOTAutograd (the aot_eager backend: Inductor's codegen is the slow
    part, tested below): two eager reference steps, one compiling step, then compiled ones."""
    monkeypatch.setattr(compile_technique, "BACKEND", "aot_eager")
    before = global_snapshot()
    common = ["bench.warmup=3", "bench.steps=3"]
    eager, compiled = trial(*common), trial("compile=default", *common)
    assert global_snapshot() == before  # the stance is back to default
    assert eager["status"] == compiled["status"] == "ok"
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert compiled["warmup_steps"] == 3  # compilation happened there, not in the window
    for col in ("compile_s", "compile_eager_step_ms", "compile_step_ms"):
        assert math.isfinite(compiled[col]) and compiled[col] >= 0, col
    assert compiled["compile_breakeven_steps"] >= 0  # inf when the compiled step is not faster
    assert compiled["recompiles"] == 0 and compiled["graph_breaks"] == 0
    assert math.isnan(eager["compile_s"]) and eager["compile"] == "off"


@pytest.mark.slow
def test_inductor_compiled_model_gives_the_eager_loss():
    common = ["bench.warmup=3", "bench.steps=3"]
    eager, compiled = trial(*common), trial("compile=default", *common)
    assert compiled["status"] == "ok", compiled["status"]
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert compiled["compile_s"] > 0 and compiled["compile_cache"] in ("hit", "miss", "partial")


# --- the experiments run on a CPU, end to end -----------------------------------------------------
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


# --- on a GPU (scripts/gpu_check.sh runs these; skipped without CUDA) -----------------------------
def cuda_trial(*overrides: str, model: str = "transformer") -> dict:
    args = [o for o in SMALL_LM if not o.startswith(("device=", "model="))]
    plan = build_plan(compose_cfg(*args, "device=cuda", f"model={model}",
                                  "models.resnet.small.dataset.image_size=32", *overrides), None)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, dataset)


@pytest.mark.gpu
def test_gpu_cudnn_benchmark_and_tf32_flags_are_set_for_the_trial_and_restored():
    cuda = Context(torch.device("cuda:0"))
    before = global_snapshot()
    with global_state(recipe("cudnn_benchmark=true", "matmul_precision=high"), cuda):
        assert torch.backends.cudnn.benchmark and torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32
    with global_state(recipe("matmul_precision=highest"), cuda):
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert global_snapshot() == before
    record = cuda_trial("cudnn_benchmark=true", "bench.warmup=2", "bench.steps=2", model="resnet")
    assert record["status"] == "ok", record["status"]
    assert record["first_step_s"] > 0  # the autotuning's step, in the warm-up


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["optimizer.impl=fused", "optimizer.impl=foreach",
                                     "memory_format=channels_last", "checkpointing=blocks"])
def test_gpu_technique_trains(setting):
    model = "resnet" if setting.startswith(("memory_format", "checkpointing")) else "transformer"
    record = cuda_trial(setting, "bench.warmup=1", "bench.steps=2", model=model)
    assert record["status"] == "ok", record["status"]
    assert math.isfinite(record["final_loss"]) and record["peak_mem_mb"] > 0


@pytest.mark.gpu
def test_gpu_attention_kernels_agree_with_math():
    cuda = torch.device("cuda:0")
    x, y = (t.to(cuda) for t in batch_for("transformer"))
    losses = {}
    for backend in BACKENDS:
        r = recipe(f"attention={backend}", "precision=bf16")
        model = tiny_models()["transformer"].to(cuda)
        reason = by_name("attention").not_applicable(r, Context(cuda, model=model))
        if reason:
            assert reason.startswith("n/a: torch ")
            continue
        model = by_name("attention").prepare_model(model, r, Context(cuda))
        with global_state(r, Context(cuda)), torch.autocast("cuda", dtype=torch.bfloat16):
            losses[backend] = model(x, y).item()
    assert "math" in losses
    if torch.cuda.get_device_capability() >= (8, 0):
        assert "flash" in losses  # FlashAttention runs bf16 on Ampere and later
    for backend, loss in losses.items():
        assert loss == pytest.approx(losses["math"], rel=2e-2), backend


# --- FSDP2 ----------------------------------------------------------------------------------------
def test_fsdp_shards_each_block_and_the_root():
    from speedbench.techniques.parallel import _blocks

    model = tiny_models()
    assert [type(b) for b in _blocks(model["transformer"])] == [transformer.Block] * 2
    assert {type(b) for b in _blocks(model["resnet"])} == {tvm.resnet.BasicBlock}
    assert len(list(_blocks(model["resnet"]))) == 8


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
