"""Validation: every bad input fails before training with a message naming the key."""
from __future__ import annotations

import pytest

from conftest import TINY, compose_cfg
from speedbench.config import ConfigError, build_plan


@pytest.mark.parametrize("override, key, allowed", [
    ("precision=fp8", "precision", "fp32, fp16, bf16"),
    ("data.num_workers=-1", "data.num_workers", ">= 0"),
    ("accumulate=0", "accumulate", ">= 1"),
    ("device=tpu7", "device", "auto, cpu, cuda, cuda:N, mps"),
    ("model=nosuchmodel", "model", "resnet, vae, transformer"),
    ("scale=huge", "scale", "auto, small, full"),
    ("sync=sometimes", "sync", "item, numpy, deferred"),
    ("tensor_creation=gpu", "tensor_creation", "host, device"),
    ("bench.steps=0", "bench.steps", ">= 1"),
    ("+foo=1", "foo", "device, scale, model"),
    ("+data.bar=1", "data.bar", "num_workers"),
    ("baseline=nosuch", "baseline", "fp32, fp16, bf16"),
])
def test_bad_value_names_key_and_allowed(override, key, allowed):
    cfg = compose_cfg(override, experiment="amp")
    with pytest.raises(ConfigError) as err:
        build_plan(cfg, "amp")
    msg = str(err.value)
    assert msg.startswith(key + ":"), msg
    assert allowed in msg, msg


def test_bad_value_inside_a_variant_is_named_with_its_variant():
    cfg = compose_cfg("+variants.broken.precision=fp8", experiment="amp")
    with pytest.raises(ConfigError, match=r"^variants\.broken\.precision: 'fp8'"):
        build_plan(cfg, "amp")


def test_variant_may_not_change_the_model():
    cfg = compose_cfg("+variants.odd.model=vae", experiment="amp")
    with pytest.raises(ConfigError, match="variants.odd.model"):
        build_plan(cfg, "amp")


def test_plan_of_amp_has_baseline_first_and_three_models():
    plan = build_plan(compose_cfg(*TINY, experiment="amp"), "amp")
    assert list(plan.variants) == ["fp32", "fp16", "bf16"]
    assert plan.baseline == "fp32"
    assert [m.name for m in plan.models] == ["resnet", "vae", "transformer"]
    assert [v.precision for v in plan.variants.values()] == ["fp32", "fp16", "bf16"]
    assert plan.device == "cpu" and plan.scale == "small"


def test_model_selection_by_name_and_list():
    assert [m.name for m in build_plan(compose_cfg("model=vae"), None).models] == ["vae"]
    plan = build_plan(compose_cfg("model=[transformer,resnet]"), None)
    assert [m.name for m in plan.models] == ["transformer", "resnet"]


def test_scale_picks_per_scale_block():
    small = build_plan(compose_cfg("model=resnet", "scale=small"), None).models[0]
    full = build_plan(compose_cfg("model=resnet", "scale=full"), None).models[0]
    assert small.target["arch"] == "resnet18" and small.dataset["image_size"] == 64
    assert full.target["arch"] == "resnet50" and full.dataset["image_size"] == 224


def test_auto_scale_is_small_without_an_accelerator():
    import torch

    plan = build_plan(compose_cfg("model=resnet"), None)
    assert plan.scale == ("full" if torch.cuda.is_available() else "small")


def test_user_model_through_target():
    cfg = compose_cfg("model={_target_: fault_models.Tiny, num_classes: 10, "
                      "dataset: {kind: images, image_size: 32, num_classes: 10}}")
    (spec,) = build_plan(cfg, None).models
    assert spec.name == "Tiny" and spec.target == {"_target_": "fault_models.Tiny", "num_classes": 10}
    assert spec.loss == "cross_entropy"


def test_loader_knobs_are_normalised_without_workers():
    cfg = compose_cfg("data.num_workers=0", "data.persistent_workers=true", "data.prefetch_factor=4")
    recipe = build_plan(cfg, None).variants["default"]
    assert recipe.data.persistent_workers is False and recipe.data.prefetch_factor is None
    kept = build_plan(compose_cfg("data.num_workers=2", "data.persistent_workers=true",
                                  "data.prefetch_factor=4"), None).variants["default"]
    assert kept.data.persistent_workers is True and kept.data.prefetch_factor == 4


def test_data_path_must_fit_the_model(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 100)
    with pytest.raises(ConfigError, match="data.path"):
        build_plan(compose_cfg("model=resnet", f"data.path={text}"), None)
    with pytest.raises(ConfigError, match="does not exist"):
        build_plan(compose_cfg("model=transformer", f"data.path={tmp_path / 'nope.txt'}"), None)
    assert build_plan(compose_cfg("model=transformer", f"data.path={text}"), None).models


def _leaf_keys(node, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    from speedbench.config import FREE_FORM
    keys = []
    for key in node.keys():
        full, child = f"{prefix}{key}", node._get_node(key)
        keys += _leaf_keys(child, f"{full}.") if isinstance(child, DictConfig) \
            and full not in FREE_FORM else [full]
    return keys


def test_every_key_of_the_schema_has_a_doc_for_the_generated_docs():
    from omegaconf import OmegaConf

    from speedbench import techniques
    from speedbench.config import Schema, docs
    documented = {k.key: k.doc for k in docs.run_keys()}
    documented |= {k.key: k.doc for t in techniques.REGISTRY for k in docs.technique_keys(t)}
    assert sorted(documented) == sorted(_leaf_keys(OmegaConf.structured(Schema)))
    assert [key for key, doc in documented.items() if not doc] == []


def test_the_help_shows_the_schemas_defaults():
    from speedbench.config import BenchConfig, docs
    knobs = docs.help_knobs()
    assert f"bench.repeats=N [{BenchConfig().repeats}]" in knobs
    assert "precision=fp32|fp16|bf16 [fp32]" in knobs and "compile=off|" in knobs


def test_dist_timeout_s_is_a_run_level_key():
    from speedbench.techniques import fields
    assert "dist_timeout_s" not in {f.key for f in fields()}
    assert compose_cfg(*TINY, "dist_timeout_s=60").dist_timeout_s == 60
    with pytest.raises(ConfigError, match=r"^dist_timeout_s: -5.0 is out of range"):
        build_plan(compose_cfg(*TINY, "dist_timeout_s=-5"), None)


# --- one declaration per key: bounds, and whether a variant may set it ----------------------------
def _numeric_run_keys():
    from speedbench.config import docs
    return [k for k in docs.run_keys() if k.values in ("N", "X")]


def test_every_numeric_run_key_declares_its_range():
    """A number with no declared range is a key whose bad values reach the run: declare its
    Bounds in `setting(...)` (target.loss is any finite loss: check_target says so)."""
    assert [k.key for k in _numeric_run_keys() if not k.range] == ["target.loss"]


@pytest.mark.parametrize("key", [k.key for k in _numeric_run_keys() if k.range],
                         ids=lambda k: k)
def test_each_declared_range_is_enforced_with_the_keys_name(key):
    from omegaconf import OmegaConf

    from speedbench.config import check_declared
    declared = _declared(key)
    nan = [] if declared["type"] is int else [float("nan")]  # an int key cannot hold a NaN
    for bad in declared["bounds"].bad_values() + nan:
        cfg = compose_cfg(*TINY)
        OmegaConf.update(cfg, key, int(bad) if declared["type"] is int else bad)
        with pytest.raises(ConfigError, match=rf"^{key}: .* is out of range; it must be "):
            check_declared(cfg)


def _declared(key: str) -> dict:
    """The metadata of a dotted run key's dataclass field, with its type."""
    import dataclasses
    import typing

    from speedbench.config import SpeedbenchConfig
    cls, *path, name = [SpeedbenchConfig, *key.split(".")]
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    t = typing.get_type_hints(cls)[name]
    base = next((a for a in typing.get_args(t) if a is not type(None)), t)
    return {**f.metadata, "type": base}


def test_a_variant_that_sets_a_run_level_key_is_refused_with_the_key():
    from speedbench.config import RUN_LEVEL_KEYS
    assert {"bench.time_budget_s", "bench.target_ci", "bench.order_seed", "bench.quality_seeds",
            "bench.quality_steps", "bench.quality_tolerance", "bench.find_largest_batch",
            "bench.largest_batch_s", "bench.peak_s"} <= set(RUN_LEVEL_KEYS)
    for key in RUN_LEVEL_KEYS:
        group, name = key.split(".")
        for override in (f"+variants.b={{{group}: {{{name}: 1}}}}", f"+variants.b.{key}=1"):
            with pytest.raises(ConfigError, match=rf"^variants\.b\.{key}: a variant cannot "):
                build_plan(compose_cfg(*TINY, override, experiment="amp"), "amp")


def test_a_variant_may_set_the_per_variant_bench_keys():
    plan = build_plan(compose_cfg(*TINY, "+variants.b.bench.steps=7",
                                  "+variants.b.bench.max_trial_s=9", experiment="amp"), "amp")
    assert plan.variants["b"].bench.steps == 7 and plan.variants["b"].bench.max_trial_s == 9
