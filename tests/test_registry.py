"""Generic tests over the technique registry (the way Composer tests its algorithms): every
technique in speedbench.techniques.REGISTRY gets them without writing any.

For each technique: its declaration is complete; its config validates its example and rejects
bad values (one line naming the key); one trial with its example setting either runs and
shows the setting in its record, or is n/a with the technique's own reason; the global state
is the same after the trial as before; its columns appear in trials.csv.
"""
from __future__ import annotations

import csv
import importlib
import inspect
import pkgutil

import pytest
import torch

from conftest import compose_cfg
from speedbench import results, techniques
from speedbench.config import ConfigError, build_plan
from speedbench.measure.data import build_dataset
from speedbench.techniques import REGISTRY, Context, Technique, in_order
from speedbench.techniques.base import get_key, global_snapshot
from speedbench.measure.trial import dataset_length, measure_trial

IDS = [t.name for t in REGISTRY]
# A transformer small enough that a trial takes well under a second of compute.
SMALL = [
    "scale=small", "device=cpu", "model=transformer", "batch_size=4", "bench.warmup=1",
    "bench.steps=2", "bench.repeats=1", "bench.max_trial_s=20", "bench.steady_tol=null",
    "models.transformer.small.vocab_size=32", "models.transformer.small.seq_len=8",
    "models.transformer.small.dim=16", "models.transformer.small.layers=1",
    "models.transformer.small.heads=2", "models.transformer.small.dataset.seq_len=8",
    "models.transformer.small.dataset.vocab_size=32",
]


def overrides(setting: dict) -> list[str]:
    def text(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return [f"{k}={text(v)}" for k, v in setting.items()]


def one_trial(setting: dict) -> dict:
    plan = build_plan(compose_cfg(*SMALL, *overrides(setting)), None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


@pytest.fixture(scope="module")
def default_record() -> dict:
    torch.set_num_threads(1)
    return one_trial({})


# --- the declaration ---------------------------------------------------------------------------
def test_names_and_keys_are_unique():
    names = [t.name for t in REGISTRY]
    keys = [f.key for t in REGISTRY for f in t.fields]
    assert len(set(names)) == len(names) and len(set(keys)) == len(keys)


# Modules of speedbench/techniques/ that hold no technique of their own.
NOT_TECHNIQUES = {"base"}


def _technique_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(techniques.__path__)
                  if m.name not in NOT_TECHNIQUES)


@pytest.mark.parametrize("module", _technique_modules())
def test_every_technique_module_is_registered(module: str):
    """A module written under techniques/ but left out of `_ALL` would never be applied,
    validated or tested: each defines a Technique that is in REGISTRY."""
    mod = importlib.import_module(f"speedbench.techniques.{module}")
    defined = [c for c in vars(mod).values() if inspect.isclass(c) and issubclass(c, Technique)
               and c.__module__ == mod.__name__]
    assert defined, f"techniques/{module}.py defines no Technique subclass"
    registered = {type(t) for t in REGISTRY}
    missing = [c.__name__ for c in defined if c not in registered]
    assert not missing, (f"techniques/{module}.py: {', '.join(missing)} not in the registry "
                         "(add an instance to _ALL in techniques/__init__.py)")


# The application order the registry had when it was sorted by hand-set integers.
NUMBERED_ORDER = ["precision", "accumulation", "loader", "tensor_creation", "sync", "empty_cache",
                  "memory_format", "checkpointing", "attention", "matmul_precision",
                  "cudnn_benchmark", "optimizer", "parallel", "compile"]


def test_the_declared_relations_keep_the_numbered_order():
    """A new technique may go anywhere; the existing ones keep their relative order."""
    names = [t.name for t in REGISTRY]
    assert [n for n in names if n in NUMBERED_ORDER] == NUMBERED_ORDER


def test_every_technique_comes_after_the_ones_it_names_whatever_the_registration_order():
    assert any(t.after for t in REGISTRY)
    for techs in (REGISTRY, in_order(list(reversed(REGISTRY)))):
        seen: set = set()
        for t in techs:
            assert set(t.after) <= seen, f"{t.name} comes before one of {t.after}"
            seen.add(t.name)


def _named(name: str, *after: str) -> Technique:
    return type(name, (Technique,), {"name": name, "after": after})()


def test_a_cycle_or_an_unknown_name_in_after_is_refused():
    with pytest.raises(ValueError, match="cycle among: a, b$"):
        in_order([_named("a", "b"), _named("b", "a"), _named("c")])
    with pytest.raises(ValueError, match="a.after names no technique: z"):
        in_order([_named("a", "z")])
    assert [t.name for t in in_order([_named("a", "b"), _named("b")])] == ["b", "a"]


@pytest.mark.parametrize("tech", REGISTRY, ids=IDS)
def test_declaration_is_complete(tech: Technique):
    assert tech.name and tech.fields and tech.column_names and all(f.doc for f in tech.fields)
    for part in ("**What**", "**Helps**", "**Costs**"):
        assert part in tech.card, f"{tech.name}'s method card lacks {part}"
    own = {f.key: f for f in tech.fields}
    assert tech.example and set(tech.example) <= set(own), "example: its own keys only"
    assert any(own[k].default != v for k, v in tech.example.items()), "example: not the default"
    for key, value in tech.example.items():
        own[key].validate(value)
    schema = compose_cfg(*SMALL)
    for f in tech.fields:
        assert get_key(schema, f.key) == f.default  # merged into Hydra's schema with its default


# --- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tech", REGISTRY, ids=IDS)
def test_config_accepts_the_example_and_rejects_bad_values(tech: Technique):
    plan = build_plan(compose_cfg(*SMALL, *overrides(tech.example)), None)
    recipe = plan.variants[plan.baseline]
    for key, value in tech.example.items():
        assert get_key(recipe, key) == value
    for f in tech.fields:
        for bad in f.bad_values():
            with pytest.raises(ConfigError, match=rf"^{f.key}: "):
                build_plan(compose_cfg(*SMALL, f"{f.key}={bad}"), None)
            with pytest.raises(ConfigError, match=rf"^variants\.v\.{f.key}: "):
                build_plan(compose_cfg(*SMALL, f"+variants.v={{{f.key}: {bad}}}"), None)


# --- one trial (where each technique acts: tests/test_techniques.py) ----------------------------
def test_global_state_is_restored_after_a_trial_that_changes_it():
    """Whatever a technique's global_state sets, the trial puts every registered flag back."""
    before = global_snapshot()
    ctx = Context(torch.device("cpu"))
    recipe = compose_cfg(*SMALL)
    with techniques.global_state(recipe, ctx):
        torch.set_num_threads(1 if before["torch_threads"] != 1 else 2)
        torch.backends.cudnn.benchmark = not before["cudnn.benchmark"]
        torch.backends.cudnn.allow_tf32 = not before["cudnn.allow_tf32"]
        torch.backends.cuda.matmul.allow_tf32 = not before["matmul.allow_tf32"]
        torch.set_float32_matmul_precision("medium" if before["float32_matmul_precision"] != "medium"
                                           else "high")
        assert global_snapshot() != before
    assert global_snapshot() == before


# --- trials.csv ------------------------------------------------------------------------------------
# The techniques' trials.csv columns as they were declared by hand, before they were derived
# from the fields: readers of older runs depend on these names and this order.
DECLARED_COLUMNS = [
    "precision", "accumulate", "accumulate_mode", "num_workers", "pin_memory", "non_blocking",
    "persistent_workers", "prefetch_factor", "tensor_creation", "sync", "sync_every",
    "empty_cache", "memory_format", "checkpointing", "attention", "matmul_precision",
    "cudnn_tf32", "cudnn_benchmark", "first_step_s", "optimizer_impl", "optimizer_ms",
    "parallel", "compile", "compile_s", "compile_eager_step_ms", "compile_step_ms",
    "compile_breakeven_steps", "recompiles", "graph_breaks", "compile_cache",
]


def test_derived_columns_keep_the_declared_names_and_order():
    """A new technique may add columns anywhere; the existing ones keep their names and order."""
    assert [c for c in techniques.column_names() if c in DECLARED_COLUMNS] == DECLARED_COLUMNS


@pytest.mark.parametrize("tech", REGISTRY, ids=IDS)
def test_columns_appear_in_trials_csv(tech: Technique, tmp_path, default_record):
    writer = results.TrialWriter(tmp_path / "trials.csv", techniques.column_names())
    writer.append(default_record)
    with open(tmp_path / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    for col in tech.column_names:
        assert col in rows[0], f"{col} missing from trials.csv"
    recipe = compose_cfg(*SMALL)
    for col, value in tech.columns(recipe, Context(torch.device("cpu"))).items():
        if value == value:  # NaN before a trial: a figure the technique observes during it
            assert rows[0][col] == ("" if value is None else str(value))
