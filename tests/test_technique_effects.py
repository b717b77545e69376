"""What each technique does to a model and a trial, on the CPU: each knob acts, the model still
trains, and what cannot act here says why; on a GPU (skipped without CUDA), the knobs that are
n/a on the CPU. (tests/test_registry.py runs the generic checks over every technique.)"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tvm
from torch.utils.data import Dataset, get_worker_info

from conftest import TINY, compose_cfg
from speedbench import techniques
from speedbench.config import ConfigError, build_plan
from speedbench.measure.data import build_dataset, build_loader
from speedbench.measure.session import batching
from speedbench.measure.train import Trainer
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.models import resnet, transformer, vae
from speedbench.models.transformer import TransformerLM
from speedbench.models.vae import ConvVAE
from speedbench.techniques import Context, by_name, global_snapshot, global_state, \
    optimizer_options
from speedbench.techniques import compile as compile_technique
from speedbench.techniques.attention import BACKENDS
from speedbench.techniques.sync import LossMeter
from speedbench.techniques.tensor_creation import set_tensor_creation

CPU = torch.device("cpu")
SMALL_LM = [
    "scale=small", "device=cpu", "model=transformer", "batch_size=4", "bench.repeats=1",
    "bench.max_trial_s=60", "bench.steady_tol=null", "models.transformer.small.vocab_size=32",
    "models.transformer.small.seq_len=8", "models.transformer.small.dim=16",
    "models.transformer.small.layers=1", "models.transformer.small.heads=2",
    "models.transformer.small.dataset.seq_len=8", "models.transformer.small.dataset.vocab_size=32",
]
# accumulation splits the batch into up to 8 micro-batches: the batch must divide by 8.
TINY8 = [o if o != "batch_size=4" else "batch_size=8" for o in TINY]


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


# --- sync points ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["item", "numpy"])
def test_item_and_numpy_read_the_host_every_forward_pass(mode):
    meter = LossMeter(mode, every=10, device=torch.device("cpu"))
    losses = [torch.tensor(float(i)) for i in range(7)]
    for i, loss in enumerate(losses, 1):
        meter.add(loss)
        assert meter.host_reads == i
    assert meter.mean() == pytest.approx(3.0)
    assert meter.host_reads == 7  # mean() has nothing left to read


@pytest.mark.parametrize("every,adds", [(3, 7), (3, 9), (10, 4), (1, 5)])
def test_deferred_reads_the_host_once_every_k_forward_passes(every, adds):
    meter = LossMeter("deferred", every=every, device=torch.device("cpu"))
    for i in range(adds):
        meter.add(torch.tensor(float(i), requires_grad=True) * 1)
    assert meter.host_reads == adds // every
    assert meter.pending.requires_grad is False  # detached: no graph kept alive
    assert meter.mean() == pytest.approx(sum(range(adds)) / adds)
    assert meter.host_reads == math.ceil(adds / every)


# --- tensor creation ------------------------------------------------------------------------------
class Recorder:
    """A tensor factory that notes the device it was asked for (None: the host's default)."""

    def __init__(self):
        self.devices = []

    def __call__(self, *size, device=None, **kwargs):
        self.devices.append(device)
        return torch.zeros(*size, device=device, **kwargs)


@pytest.mark.parametrize("where,born", [("host", None), ("device", torch.device("meta"))])
def test_per_step_tensors_are_born_where_the_knob_says(where, born):
    model = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    assert set_tensor_creation(model, where) == 1
    factory = Recorder()
    # 'meta' stands in for an accelerator: a device that is not the host.
    t = model.new_tensor(factory, 2, 3, device=torch.device("meta"))
    assert factory.devices == [born]
    assert t.device.type == "meta"  # either way the tensor ends up where it is used
    assert model.host_creations == (1 if where == "host" else 0)


def test_the_models_make_their_per_step_tensors_through_the_knob():
    vae = ConvVAE(image_size=16, width=4, latent=4)
    lm = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    made = {vae: [], lm: []}
    for m in made:
        real = m.new_tensor

        def counting(factory, *args, _m=m, _real=real, **kwargs):
            made[_m].append(factory.__name__)
            return _real(factory, *args, **kwargs)

        m.new_tensor = counting  # every per-step tensor the model makes passes here
    vae(torch.randn(2, 3, 16, 16))
    lm(torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    assert made[vae] == ["randn"]  # the noise
    assert made[lm] == ["arange", "ones"]  # positions and the causal mask


def test_host_creation_is_na_where_host_and_device_are_one():
    recipe = compose_cfg(*TINY, "tensor_creation=host")
    makes = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    plain = torch.nn.Linear(2, 2)  # makes no per-step tensors

    def why(device, model):
        return techniques.not_applicable(recipe, Context(device=torch.device(device), model=model))

    assert why("cpu", makes).startswith("n/a:")
    assert why("meta", plain).startswith("n/a:")
    assert why("meta", makes) is None


# --- DataLoader workers ---------------------------------------------------------------------------
class WhoLoads(Dataset):
    """Each sample says which process and worker made it."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([os.getpid(), -1 if info is None else info.id]), torch.tensor(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_processes_really_load_the_data(workers):
    cfg = compose_cfg(*TINY, f"data.num_workers={workers}", "data.persistent_workers=true")
    plan = build_plan(cfg, None)
    options = techniques.loader_options(plan.variants["default"], Context(torch.device("cpu")))
    loader = build_loader(WhoLoads(), 2, options, seed=0)
    who = torch.cat([x for x, _ in loader])
    pids, ids = set(who[:, 0].tolist()), set(who[:, 1].tolist())
    if workers:
        assert os.getpid() not in pids and len(pids) == workers
        assert ids == {0, 1}
    else:
        assert pids == {os.getpid()} and ids == {-1}


# --- gradient accumulation ------------------------------------------------------------------------
def _trainer(variant: str, *extra: str) -> Trainer:
    cfg = compose_cfg(*TINY8, "model=transformer", *extra, experiment="accumulation")
    plan = build_plan(cfg, "accumulation")
    spec, recipe = plan.models[0], plan.variants[variant]
    data = build_dataset(spec.dataset, 64, seed=0)
    ctx = Context(torch.device("cpu"))
    loader = build_loader(data, batching(spec, recipe, ctx).micro,
                          techniques.loader_options(recipe, ctx), seed=0)
    return Trainer(spec, recipe, torch.device("cpu"), loader)


@pytest.mark.parametrize("variant,k", [("k1", 1), ("k4", 4)])
def test_accumulation_steps_the_optimizer_once_per_k_micro_batches(variant, k):
    trainer = _trainer(variant)
    assert trainer.loader.batch_size == 8 // k  # the effective batch stays 8
    calls = []
    real_step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **kw: (calls.append(1), real_step(*a, **kw))
    for _ in range(3):
        trainer.step()
    assert len(calls) == 3 and trainer.optimizer_steps == 3
    assert trainer.meter.count == 3 * k  # k forward passes per optimizer step
    trainer.close()


def _first_update_grads(variant: str) -> list[torch.Tensor]:
    trainer = _trainer(variant)
    grads = []
    real_step = trainer.optimizer.step

    def step(*a, **kw):
        grads.extend(p.grad.detach().clone() for p in trainer.model.parameters())
        return real_step(*a, **kw)

    trainer.optimizer.step = step
    trainer.step()
    trainer.close()
    return grads


def test_k_micro_batches_give_the_update_of_one_k_times_larger_batch():
    one = _first_update_grads("k1")
    for variant in ("k2", "k8"):
        split = _first_update_grads(variant)
        assert len(split) == len(one)
        for a, b in zip(one, split):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_split_needs_a_batch_that_divides():
    cfg = compose_cfg(*TINY, "batch_size=6", experiment="accumulation")
    with pytest.raises(ConfigError, match="accumulate: 4 does not divide the batch"):
        build_plan(cfg, "accumulation")
    with pytest.raises(ConfigError, match="accumulate_mode: 'sum' is not allowed; choose one of "
                                          "add, split"):
        build_plan(compose_cfg(*TINY, "accumulate_mode=sum"), None)


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
    assert 0 < record["optimizer_ms"] < record["step_ms"]  # one phase of the step


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
    # Dynamo's capture makes the compiling step longer than a compiled one: compile_s > 0.
    assert 0 < compiled["compile_s"] < 60, compiled["compile_s"]
    eager_ms, step_ms = compiled["compile_eager_step_ms"], compiled["compile_step_ms"]
    assert 0 < eager_ms < 10_000 and 0 < step_ms < 10_000, (eager_ms, step_ms)
    breakeven = 1000 * compiled["compile_s"] / (eager_ms - step_ms) if eager_ms > step_ms \
        else math.inf
    assert compiled["compile_breakeven_steps"] == pytest.approx(breakeven, rel=1e-6)
    assert compiled["recompiles"] == 0 and compiled["graph_breaks"] == 0
    assert math.isnan(eager["compile_s"]) and eager["compile"] == "off"


def test_inductor_compiled_model_gives_the_eager_loss():
    common = ["bench.warmup=3", "bench.steps=3"]
    eager, compiled = trial(*common), trial("compile=default", *common)
    assert compiled["status"] == "ok", compiled["status"]
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert compiled["compile_s"] > 0 and compiled["compile_cache"] in ("hit", "miss", "partial")


# --- FSDP2 ----------------------------------------------------------------------------------------
def test_fsdp_shards_each_block_and_the_root():
    from speedbench.techniques.parallel import _blocks

    model = tiny_models()
    assert [type(b) for b in _blocks(model["transformer"])] == [transformer.Block] * 2
    assert {type(b) for b in _blocks(model["resnet"])} == {tvm.resnet.BasicBlock}
    assert len(list(_blocks(model["resnet"]))) == 8


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


@pytest.mark.gpu
def test_host_creation_on_cuda_creates_on_the_host_then_moves():
    vae = ConvVAE(image_size=16, width=4, latent=4).cuda()
    set_tensor_creation(vae, "host")
    vae(torch.randn(2, 3, 16, 16, device="cuda"))
    assert vae.host_creations == 1
    set_tensor_creation(vae, "device")
    vae(torch.randn(2, 3, 16, 16, device="cuda"))
    assert vae.host_creations == 1
