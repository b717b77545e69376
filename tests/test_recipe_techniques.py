"""The techniques of 2026 as the recipe search's options (configs/experiment/recipe.yaml):
packing, selective checkpointing, chunked cross-entropy, regional compile and compiled
autograd, DDP's communication hooks and FSDP2's resharding, and the CUDA-only ones, each n/a
with its reason where it cannot act (the search then never measures it)."""
from __future__ import annotations

import pytest
import torch

from conftest import SMALL_MODELS, TINY, compose_cfg
from speedbench.config import build_plan
from speedbench.search import driver


def _cfg(*overrides: str):
    return compose_cfg(*TINY, *SMALL_MODELS, "model=[transformer,vae]", *overrides,
                       experiment="recipe")


def _groups() -> dict:
    return {g.name: g for g in driver.parse_groups(_cfg())}


def _options(group) -> dict:
    return {o.name: dict(o.overrides) for o in group.options}


def test_the_search_has_the_new_techniques_as_options():
    groups = _groups()
    assert _options(groups["packing"]) == {"pack_reset": {"data.packing": "pack_reset"},
                                           "pack": {"data.packing": "pack"}}
    assert groups["packing"].naive == {"data.packing": "pad"}
    assert _options(groups["checkpointing"])["selective"] == {"checkpointing": "selective"}
    assert _options(groups["compile"])["regional"] == {"compile": "default",
                                                       "compile_scope": "blocks"}
    assert _options(groups["compile"])["compiled_autograd"] == {"compile": "default",
                                                                "compile_autograd": True}
    assert _options(groups["comm_hook"])["bf16"] == {"ddp_comm_hook": "bf16"}
    assert _options(groups["fsdp_reshard"]) == {"keep": {"reshard_after_forward": "false"}}
    for name in ("float8", "cuda_graphs", "fused_ce", "expandable_segments", "flex_attention"):
        assert name in groups
    # the speed-for-memory ones enter only under recipe.max_memory_mb, as checkpointing does
    memory = {name for name, g in groups.items() if g.trades_memory}
    assert {"checkpointing", "chunked_ce", "offload", "accumulation"} == memory


def test_every_new_option_is_a_valid_recipe_before_anything_runs():
    cfg = _cfg()
    groups = driver.check(cfg, build_plan(cfg, "recipe"), None)
    assert {"packing", "chunked_ce", "float8", "offload"} <= {g.name for g in groups}


@pytest.mark.parametrize("model,overrides,acts", [
    ("transformer", {"data.packing": "pack_reset"}, True),
    ("vae", {"data.packing": "pack"}, False),  # no packed documents
    ("transformer", {"checkpointing": "selective"}, True),
    ("transformer", {"loss_chunks": 4}, True),
    ("vae", {"loss_chunks": 4}, False),  # no LM loss of its own
    ("transformer", {"ddp_comm_hook": "fp16"}, False),  # no DDP in the recipe
    ("transformer", {"reshard_after_forward": "false"}, False),  # no FSDP
])
def test_an_option_acts_where_its_technique_can(model, overrides, acts):
    cfg = _cfg()
    plan = build_plan(cfg, "recipe")
    spec = next(m for m in plan.models if m.name == model)
    reason = driver.cannot_act_for(cfg)(spec)(overrides)
    assert (reason is None) == acts, reason
    if not acts:
        assert reason.startswith("n/a: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's n/a")
@pytest.mark.parametrize("overrides", [
    {"float8": "tensorwise"}, {"cuda_graphs": True}, {"fused_linear_ce": True},
    {"expandable_segments": True}, {"flex_attention": True}, {"offload_activations": True},
])
def test_the_cuda_only_options_are_na_on_a_cpu_with_their_reason(overrides):
    cfg = _cfg()
    spec = next(m for m in build_plan(cfg, "recipe").models if m.name == "transformer")
    reason = driver.cannot_act_for(cfg)(spec)(overrides)
    assert reason is not None and reason.startswith("n/a: ") and len(reason) > 20, reason
