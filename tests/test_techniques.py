"""Every technique of the registry acts where its `acts_on` says it can: one trial of
its example setting on that model and device runs, shows the setting in its record, and leaves
the global state as it was. On a machine without that device it is skipped, and the technique
must still say why it cannot act here."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset
from speedbench.measure.train import build_model
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.techniques import REGISTRY, Context, Technique
from speedbench.techniques.base import ActsOn, global_snapshot

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


def one_trial(setting: ActsOn, example: dict) -> dict:
    plan = plan_for(setting, example)
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, plan.variants[plan.baseline], 0, dataset)


def skip_without_its_device(setting: ActsOn) -> None:
    gpus = torch.cuda.device_count()
    if setting.device == CUDA_ONLY and gpus < max(1, setting.gpus):
        pytest.skip(f"acts on {max(1, setting.gpus)} CUDA device(s), this machine has {gpus}: "
                    f"{setting.why}")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


@pytest.fixture(scope="module")
def default_records() -> dict:
    """The default recipe's trial per (model, device), measured once for the whole module."""
    records = {}

    def get(setting: ActsOn) -> dict:
        key = (setting.model, setting.device)
        if key not in records:
            records[key] = one_trial(setting, {})
        return records[key]
    return get


def test_every_technique_says_where_it_acts():
    missing = [t.name for t in REGISTRY if not isinstance(t.acts_on, ActsOn)]
    assert not missing, f"set `acts_on = ActsOn(...)` in these techniques: {missing}"


@pytest.mark.parametrize("tech", REGISTRY, ids=IDS)
def test_acts_where_its_settings_say_and_leaves_global_state_as_it_was(tech: Technique,
                                                                        default_records):
    setting = tech.acts_on
    skip_without_its_device(setting)
    before = global_snapshot()
    record = one_trial(setting, tech.example)
    assert global_snapshot() == before
    assert record["status"] == "ok", record["status"]
    assert record["steps"] == 2 and record["samples_per_s"] > 0
    recipe = plan_for(setting, tech.example).variants["default"]
    mine = tech.columns(recipe, Context(torch.device(setting.device)))
    assert set(mine) == set(tech.column_names)
    for col, value in mine.items():
        if value == value:  # NaN before a trial: a figure the technique observes during it
            assert record[col] == value, col
    default = default_records(setting)
    assert any(record[c] != default[c] for c in tech.column_names), \
        f"{tech.name}: the example leaves every column of the record at its default"


@pytest.mark.parametrize("tech", [t for t in REGISTRY if t.acts_on and
                                  t.acts_on.device == CUDA_ONLY], ids=lambda t: t.name)
def test_a_cuda_only_technique_says_why_it_cannot_act_on_a_cpu(tech: Technique):
    """Keeps the settings honest: a technique marked CUDA-only really is n/a on a CPU."""
    setting = tech.acts_on
    plan = plan_for(setting, tech.example, device="cpu")
    cpu = Context(torch.device("cpu"), model=build_model(plan.models[0], 0))
    reason = tech.not_applicable(plan.variants["default"], cpu)
    assert reason and reason.startswith("n/a: ") and len(reason) > len("n/a: ") + 10, reason
