"""batch_scale: a larger batch per optimizer step with the learning rate scaled (sqrt, linear,
none), an optional linear warm-up from the base lr, and the extra samples taken as one larger
micro-batch or by accumulation."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY, compose_cfg
from speedbench import techniques
from speedbench.config import ConfigError, build_plan
from speedbench.measure.data import build_dataset
from speedbench.measure.session import applied, batching
from speedbench.measure.train import Trainer
from speedbench.techniques import Context

SMALL = [*TINY, "model=transformer", "lr=0.001",
         "models.transformer.small.vocab_size=32", "models.transformer.small.dataset.vocab_size=32",
         "models.transformer.small.seq_len=8", "models.transformer.small.dataset.seq_len=8",
         "models.transformer.small.dim=16", "models.transformer.small.layers=1",
         "models.transformer.small.heads=2"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


def plan_of(*overrides: str):
    plan = build_plan(compose_cfg(*SMALL, *overrides), None)
    return plan.models[0], plan.variants[plan.baseline]


def batches(n: int, size: int) -> list:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (size, 8), generator=gen),
             torch.randint(0, 32, (size, 8), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("rule,factor", [("sqrt", 2.0), ("linear", 4.0), ("none", 1.0)])
def test_the_optimizer_gets_the_lr_of_the_rule(rule, factor):
    spec, recipe = plan_of("batch_scale=4", f"lr_scaling={rule}")
    ctx = Context(CPU)
    dataset = build_dataset(spec.dataset, 64, seed=0)
    with applied(spec, recipe, ctx, dataset) as trainer:
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [pytest.approx(1e-3 * factor)]
        trainer.step()
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)
        assert techniques.columns(recipe, ctx)["lr_effective"] == pytest.approx(1e-3 * factor)
    # the default recipe keeps the recipe's lr
    spec, recipe = plan_of()
    with applied(spec, recipe, Context(CPU), dataset) as trainer:
        assert trainer.optimizer.param_groups[0]["lr"] == 1e-3


def test_warm_up_starts_at_the_base_lr_and_reaches_the_scaled_lr_after_n_steps():
    spec, recipe = plan_of("batch_scale=4", "lr_scaling=linear", "lr_warmup_steps=3")
    trainer = Trainer(spec, recipe, CPU, batches(6, 16))
    used = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *a: used.append(opt.param_groups[0]["lr"]))
    for _ in range(6):
        trainer.step()
    # 1e-3 rising by (4e-3 - 1e-3) / 3 per step, then 4e-3 from step 3 on
    assert used == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 4e-3, 4e-3])
    trainer.close()


def test_the_step_takes_batch_scale_times_the_batch_as_one_micro_batch_or_by_accumulation():
    ctx = Context(CPU)
    spec, one = plan_of()
    base = batching(spec, one, ctx)
    assert (base.micro, base.k, base.per_step) == (4, 1, 4)
    spec, bigger = plan_of("batch_scale=3")
    got = batching(spec, bigger, ctx)
    assert (got.micro, got.k, got.per_step) == (12, 1, 12)
    spec, acc = plan_of("batch_scale=3", "batch_scale_by=accumulate")
    got = batching(spec, acc, ctx)
    assert (got.micro, got.k, got.per_step) == (4, 3, 12)
    # composed with accumulation: split cuts the model's batch, batch_scale scales the pieces
    spec, both = plan_of("batch_scale=3", "accumulate=2", "accumulate_mode=split")
    got = batching(spec, both, ctx)
    assert (got.micro, got.k, got.per_step) == (6, 2, 12)
    spec, both = plan_of("batch_scale=3", "batch_scale_by=accumulate", "accumulate=2")
    got = batching(spec, both, ctx)
    assert (got.micro, got.k, got.per_step) == (4, 6, 24)
    # the largest batch is searched at the model's own batch
    assert techniques.capacity_overrides(bigger)["batch_scale"] == 1


@pytest.mark.parametrize("by,micro,forwards", [("batch", 12, 1), ("accumulate", 4, 3)])
def test_a_real_step_takes_the_scaled_batch(by, micro, forwards):
    spec, recipe = plan_of("batch_scale=3", f"batch_scale_by={by}")
    dataset = build_dataset(spec.dataset, 64, seed=0)
    with applied(spec, recipe, Context(CPU), dataset) as trainer:
        assert trainer.loader.batch_size == micro
        trainer.step()
        assert trainer.meter.count == forwards and trainer.optimizer_steps == 1


def test_both_ways_give_the_same_first_update():
    """3 micro-batches of 4 (each loss / 3) give the gradient of one micro-batch of 12."""
    data = batches(3, 4)
    big = [(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))]
    grads = {}
    for by, loader in (("batch", big), ("accumulate", data)):
        spec, recipe = plan_of("batch_scale=3", f"batch_scale_by={by}")
        trainer = Trainer(spec, recipe, CPU, loader)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * math.sqrt(3))
        seen = []
        trainer.optimizer.register_step_pre_hook(
            lambda opt, *a: seen.extend(p.grad.clone() for p in trainer.model.parameters()))
        trainer.step()
        grads[by] = seen
        trainer.close()
    for a, b in zip(grads["batch"], grads["accumulate"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override,message", [
    ("batch_scale=0", "batch_scale: 0 is out of range; it must be an integer >= 1"),
    ("lr_scaling=cubic", "lr_scaling: 'cubic' is not allowed; choose one of sqrt, linear, none"),
    ("batch_scale_by=both", "batch_scale_by: 'both' is not allowed; choose one of batch, "
                            "accumulate"),
    ("lr_warmup_steps=-1", "lr_warmup_steps: -1 is out of range; it must be an integer >= 0"),
])
def test_a_bad_value_is_one_line_naming_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as info:
        plan_of(override)
    assert str(info.value) == message


def test_the_experiment_compares_a_larger_batch_with_accumulation_at_the_same_lr():
    plan = build_plan(compose_cfg(*SMALL, experiment="batch_scale"), "batch_scale")
    assert plan.baseline == "b1" and list(plan.variants) == ["b1", "b2", "b4", "acc4"]
    ctx = Context(CPU)
    spec = plan.models[0]
    per_step = {n: batching(spec, r, ctx).per_step for n, r in plan.variants.items()}
    assert per_step == {"b1": 4, "b2": 8, "b4": 16, "acc4": 16}
    lrs = {n: techniques.columns(r, ctx)["lr_effective"] for n, r in plan.variants.items()}
    assert lrs["acc4"] == lrs["b4"] == pytest.approx(2e-3) and lrs["b1"] == pytest.approx(1e-3)
