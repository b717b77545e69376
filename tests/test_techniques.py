"""Every technique of the registry acts where its `acts_on` says it can: one trial of
its example setting on that model and device runs, shows the setting in its record, does what
the technique is for (EFFECTS: something the trial observed, not the setting echoed back), and
leaves the global state as it was. On a machine without that device it is skipped, and the
technique must still say why it cannot act here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

from conftest import compose_cfg
from speedbench import techniques
from speedbench.config import build_plan
from speedbench.measure import trial
from speedbench.studies import arms
from speedbench.measure.batches import first_tensor
from speedbench.measure.data import build_dataset
from speedbench.measure.profile import host_creations
from speedbench.measure.train import Trainer, build_model
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.techniques import REGISTRY, Context, Technique
from speedbench.techniques.base import ActsOn, global_snapshot
from speedbench.techniques.packing import pack_documents

IDS = [t.name for t in REGISTRY]
CUDA_ONLY = "cuda"
# Models small enough that a trial takes about a second of compute on one CPU thread.
TINY_MODELS = [
    "scale=small", "batch_size=4", "bench.warmup=1", "bench.steps=2", "bench.repeats=1",
    "bench.max_trial_s=20", "bench.steady_tol=null",
    "models.transformer.small.vocab_size=32", "models.transformer.small.seq_len=8",
    "models.transformer.small.dim=16", "models.transformer.small.layers=1",
    "models.transformer.small.heads=2", "models.transformer.small.dataset.seq_len=8",
    "models.transformer.small.dataset.vocab_size=32", "models.resnet.small.dataset.image_size=32",
]


def overrides(example: dict) -> list[str]:
    def text(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return [f"{k}={text(v)}" for k, v in example.items()]


def plan_for(setting: ActsOn, example: dict, device: str | None = None):
    return build_plan(compose_cfg(*TINY_MODELS, f"model={setting.model}",
                                  f"device={device or setting.device}", *overrides(example)), None)


@dataclass
class Trial:
    """One trial as the test saw it: its record and, for one run in this process, what its
    warm-up and timed window saw."""
    record: dict
    before: dict = field(default_factory=dict)  # the global flags before the trial
    flags: Optional[dict] = None  # ... and while its window ran
    trainer: Optional[Trainer] = None  # the model, optimizer and loader it trained
    counters: dict = field(default_factory=dict)  # the techniques' own (profile_counters)
    batches: list = field(default_factory=list)  # (samples, in shared memory) per batch
    optimizer_steps: int = 0

    @property
    def flags_set(self) -> set:
        """The registered global flags the trial's window ran with that the process had not."""
        return {k for k, v in (self.flags or {}).items() if v != self.before[k]}

    @property
    def batches_per_step(self) -> float:
        return len(self.batches) / self.optimizer_steps

    @property
    def samples_per_batch(self) -> set:
        return {n for n, _ in self.batches}

    @property
    def shared_batches(self) -> bool:
        """Every batch reached the model in shared memory: a DataLoader worker made it."""
        return all(shared for _, shared in self.batches)


def _watched(seen: Trial) -> Callable:
    """trial.timed_window (the warm-up and the timed steps), noting what it ran with: the
    trial's `window`."""
    window = trial.timed_window

    def watched(trainer, bench, ctx, run):
        seen.flags, seen.trainer, steps = global_snapshot(), trainer, trainer.optimizer_steps
        drawn, batches = [], trainer.batches

        def counted():
            try:
                for batch in batches:
                    x = first_tensor(batch[0])  # packed documents: (tokens, ids, positions)
                    drawn.append((len(x), x.is_shared()))
                    yield batch
            finally:
                batches.close()
        trainer.batches = counted()
        with techniques.profile_counters(trainer, ctx) as seen.counters:
            got = window(trainer, bench, ctx, run)
        seen.batches, seen.optimizer_steps = list(drawn), trainer.optimizer_steps - steps
        return got
    return watched


def one_trial(setting: ActsOn, example: dict) -> Trial:
    """The trial of the example's recipe, run the way the rounds run it: in this process, or
    in a fresh one started with the variables a technique needs at start-up (LD_PRELOAD)."""
    plan = plan_for(setting, example)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    seen = Trial({}, before=global_snapshot())
    arm = arms.variant_arm(plan, plan.baseline, Context(torch.device(setting.device)))
    if arm is not None:  # a fresh process with its start-up variables
        seen.record = arms.trial(plan, spec, arm, plan.baseline, 0)
        return seen
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    seen.record = measure_trial(plan, spec, plan.baseline, recipe, 0, dataset,
                                window=_watched(seen))
    return seen


def channels_last(model) -> bool:
    weights = [p for p in model.parameters() if p.dim() == 4]
    return bool(weights) and all(w.is_contiguous(memory_format=torch.channels_last)
                                 for w in weights)


# What each technique's example does in its trial that the test can see besides the setting
# its own columns echo: a figure the trial observed, a flag set while its window ran, the
# batches the model was fed, the model or optimizer it trained. `ex` is the example's trial,
# `de` the default recipe's on the same model and device.
EFFECTS: dict[str, Callable[[Trial, Trial], bool]] = {
    # bf16 autocast: the activations kept for backward take half the bytes
    "precision": lambda ex, de: ex.record["activation_mem_mb"] < de.record["activation_mem_mb"],
    "accumulation": lambda ex, de: ex.batches_per_step == 2 * de.batches_per_step == 2,
    "batch_scale": lambda ex, de: ex.samples_per_batch == {2 * n for n in de.samples_per_batch},
    "loader": lambda ex, de: ex.shared_batches and not de.shared_batches,
    # the loader packs documents: x comes as (tokens, document ids, positions)
    "packing": lambda ex, de: getattr(ex.trainer.loader.collate_fn, "func", None)
    is pack_documents and not hasattr(de.trainer.loader.collate_fn, "func"),
    "sync": lambda ex, de: ex.record["host_reads"] > de.record["host_reads"],
    "conv_bias": lambda ex, de: ex.record["conv_bias_convs"] > de.record["conv_bias_convs"] == 0,
    "memory_format": lambda ex, de: channels_last(ex.trainer.model)
    and not channels_last(de.trainer.model),
    # the blocks' activations are recomputed in backward, not kept
    "checkpointing": lambda ex, de: ex.record["activation_mem_mb"]
    < de.record["activation_mem_mb"],
    "attention": lambda ex, de: "sdp.flash" in ex.flags_set,
    # the loss in slices: the model trained with them (the logits forecast in its column)
    "chunked_ce": lambda ex, de: ex.trainer.model.loss_chunks == 4 > de.trainer.model.loss_chunks
    and ex.record["logits_mb"] > 0,
    "matmul_precision": lambda ex, de: "float32_matmul_precision" in ex.flags_set,
    "optimizer": lambda ex, de: ex.trainer.optimizer.defaults.get("fused") is True
    and not de.trainer.optimizer.defaults.get("fused"),
    # the test starts it with AMBIENT_THREADS: the window ran with the example's one thread
    "threads": lambda ex, de: ex.flags["torch_threads"] == 1 < ex.before["torch_threads"],
    # fresh processes: what the trial's own process mapped. The malloc differs from this
    # process's only where this one preloads another (jemalloc, tcmalloc); the GNU runtime's
    # binding (OMP_PROC_BIND) shows in no column.
    "allocator": lambda ex, de: ex.record["allocator_loaded"] == "system",
    "openmp": lambda ex, de: ex.record["openmp_loaded"].startswith("libgomp"),
    "zero_grad": lambda ex, de: ex.record["held_grad_mb"] > de.record["held_grad_mb"] == 0,
    # an evaluation pass: the optimizer never stepped, so it holds no state
    "eval_mode": lambda ex, de: not ex.trainer.optimizer.state and bool(de.trainer.optimizer.state),
    "debug_apis": lambda ex, de: "autograd.detect_anomaly" in ex.flags_set,
    "onednn_precision": lambda ex, de: "mkldnn.fp32_precision" in ex.flags_set,
    "compile": lambda ex, de: ex.record["compile_s"] > 0,  # NaN when nothing was compiled
    # CUDA only (not run on a machine without CUDA devices)
    "tensor_creation": lambda ex, de: host_creations(ex.trainer.model) > 0,
    "empty_cache": lambda ex, de: ex.counters.get("empty_cache_calls", 0) > 0,
    # the trial's own process started with the allocator setting
    "expandable_segments": lambda ex, de: "expandable_segments:True" in ex.record[
        "cuda_alloc_conf"] and "expandable_segments:True" not in str(de.record["cuda_alloc_conf"]),
    "cudnn_benchmark": lambda ex, de: "cudnn.benchmark" in ex.flags_set,
    "ddp_tuning": lambda ex, de: getattr(ex.trainer.model, "static_graph", False),
    "float8": lambda ex, de: ex.record["float8_converted"] > 0 == de.record["float8_converted"],
    "cuda_graphs": lambda ex, de: ex.record["graph_captured"] is True,
    # the saved activations went to the host
    "offload": lambda ex, de: ex.record["activation_mem_mb"] < de.record["activation_mem_mb"],
    "flex_attention": lambda ex, de: ex.trainer.model.flex and not de.trainer.model.flex,
    "fused_ce": lambda ex, de: ex.trainer.model.fused_loss is not None,
    "comm_hook": lambda ex, de: "fp16_compress_hook" in ex.record["comm_hooks_registered"],
    "fsdp_reshard": lambda ex, de: ex.record["fsdp_after_forward"].startswith("keep"),
    "parallel": lambda ex, de: bool(ex.counters.get("data_parallel")),
}
# Optional extras a technique's example needs (the GPU check's machine may lack them: skipped)
OPTIONAL_PACKAGES = {"float8": "torchao", "fused_ce": "liger_kernel"}
# The threads a test process has when an example's trial starts (else one): the example must
# ask for something other than what the process already has.
AMBIENT_THREADS = {"threads": 2}


def skip_without_its_device(setting: ActsOn) -> None:
    gpus = torch.cuda.device_count()
    if setting.device == CUDA_ONLY and gpus < max(1, setting.gpus):
        pytest.skip(f"acts on {max(1, setting.gpus)} CUDA device(s), this machine has {gpus}: "
                    f"{setting.why}")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


@pytest.fixture(scope="module")
def default_trials() -> Callable[[ActsOn], Trial]:
    """The default recipe's trial per (model, device), measured once for the whole module."""
    trials = {}

    def get(setting: ActsOn) -> Trial:
        key = (setting.model, setting.device)
        if key not in trials:
            trials[key] = one_trial(setting, {})
        return trials[key]
    return get


def test_every_technique_says_where_it_acts():
    missing = [t.name for t in REGISTRY if not isinstance(t.acts_on, ActsOn)]
    assert not missing, f"set `acts_on = ActsOn(...)` in these techniques: {missing}"


def test_every_technique_says_what_its_example_does():
    assert not {t.name for t in REGISTRY} ^ set(EFFECTS), \
        "EFFECTS names each technique once: what its example does that a trial shows"


@pytest.mark.parametrize("tech", REGISTRY, ids=IDS)
def test_acts_where_its_settings_say_and_leaves_global_state_as_it_was(tech: Technique,
                                                                        default_trials):
    setting = tech.acts_on
    skip_without_its_device(setting)
    if tech.name in OPTIONAL_PACKAGES:
        pytest.importorskip(OPTIONAL_PACKAGES[tech.name])
    default = default_trials(setting)
    torch.set_num_threads(AMBIENT_THREADS.get(tech.name, 1))
    before = global_snapshot()
    got = one_trial(setting, tech.example)
    record = got.record
    assert global_snapshot() == before
    assert record["status"] == "ok", record["status"]
    assert record["steps"] == 2 and record["samples_per_s"] > 0
    recipe = plan_for(setting, tech.example).variants["default"]
    mine = tech.columns(recipe, Context(torch.device(setting.device)))
    assert set(mine) == set(tech.column_names)
    for col, value in mine.items():
        if value == value:  # NaN before a trial: a figure the technique observes during it
            assert record[col] == value, col
    assert EFFECTS[tech.name](got, default), \
        f"{tech.name}: its example did not do what EFFECTS says it does"


@pytest.mark.parametrize("tech", [t for t in REGISTRY if t.acts_on and
                                  t.acts_on.device == CUDA_ONLY], ids=lambda t: t.name)
def test_a_cuda_only_technique_says_why_it_cannot_act_on_a_cpu(tech: Technique):
    """Keeps the settings honest: a technique marked CUDA-only really is n/a on a CPU."""
    setting = tech.acts_on
    plan = plan_for(setting, tech.example, device="cpu")
    cpu = Context(torch.device("cpu"), model=build_model(plan.models[0], 0))
    reason = tech.not_applicable(plan.variants["default"], cpu)
    assert reason and reason.startswith("n/a: ") and len(reason) > len("n/a: ") + 10, reason
