"""The training loop: accumulation equals a bigger batch, AMP paths run, the loss falls."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import compose_cfg
from speedbench import techniques
from speedbench.config import build_plan
from speedbench.measure.data import build_dataset, build_loader
from speedbench.techniques import Context
from speedbench.measure.train import Trainer, build_model


def _plan(*overrides):
    return build_plan(compose_cfg("device=cpu", "scale=small", "model=transformer",
                                  "models.transformer.small.seq_len=16",
                                  "models.transformer.small.dataset.seq_len=16", *overrides), None)


def _trainer(plan, model, batches):
    spec, recipe = plan.models[0], plan.variants["default"]
    return Trainer(spec, recipe, torch.device("cpu"), batches, model=model)


def test_accumulation_gives_the_same_update_as_one_big_batch():
    """k micro-batches of B/k, each loss divided by k, step once == one batch of B."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 16))
    y = torch.randint(0, 256, (8, 16))
    big = _plan("batch_size=8", "accumulate=1", "lr=1e-2")
    acc = _plan("batch_size=2", "accumulate=4", "lr=1e-2")
    model = build_model(big.models[0], seed=0)
    t_big = _trainer(big, copy.deepcopy(model), [(x, y)])
    t_acc = _trainer(acc, copy.deepcopy(model), [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    # Plain SGD: Adam's first step is ~lr*sign(grad), which magnifies rounding where grad ~ 0.
    for t in (t_big, t_acc):
        t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.1)
    t_big.step()
    t_acc.step()
    assert t_big.optimizer_steps == t_acc.optimizer_steps == 1
    for p_big, p_acc in zip(t_big.model.parameters(), t_acc.model.parameters()):
        torch.testing.assert_close(p_big, p_acc, rtol=1e-5, atol=1e-6)
    # and the weights did move
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), t_big.model.parameters()))


def test_optimizer_steps_once_per_k_micro_batches():
    plan = _plan("batch_size=2", "accumulate=3")
    data = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))] * 6
    trainer = _trainer(plan, build_model(plan.models[0], 0), data)
    counted = []
    trainer.optimizer.register_step_post_hook(lambda *a: counted.append(1))
    trainer.step()
    trainer.step()
    assert len(counted) == 2 and trainer.meter.count == 6  # six forward passes


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_runs_autocast_and_scaler_on_cpu(precision):
    plan = _plan(f"precision={precision}", "batch_size=2")
    data = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))]
    trainer = _trainer(plan, build_model(plan.models[0], 0), data)
    seen = []
    trainer.model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.step()
    assert seen == [torch.float16 if precision == "fp16" else torch.bfloat16]
    assert (trainer.scaler is not None) == (precision == "fp16")
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights stay fp32


@pytest.mark.parametrize("model", ["transformer", "vae",
                                   pytest.param("resnet", marks=pytest.mark.slow)])
def test_loss_falls_on_the_synthetic_data(model):
    """The data has learnable structure: 60 steps reduce each reference model's loss."""
    # The VAE diverges at lr 3e-3 for most random streams (data seeds 1 and 2 did, before and
    # after augmentation was seeded per sample; seed 0 passed by luck): 1e-3 trains it steadily.
    lr = "1e-3" if model == "vae" else "3e-3"
    cfg = compose_cfg("device=cpu", "scale=small", f"model={model}", "batch_size=16", f"lr={lr}",
                      "models.resnet.small.dataset.image_size=32",
                      "models.vae.small.image_size=32", "models.vae.small.dataset.image_size=32",
                      "models.transformer.small.seq_len=32", "models.transformer.small.dataset.seq_len=32")
    plan = build_plan(cfg, None)
    spec, recipe = plan.models[0], plan.variants["default"]
    ds = build_dataset(spec.dataset, 16 * 70, seed=0)
    options = techniques.loader_options(recipe, Context(torch.device("cpu")))
    trainer = Trainer(spec, recipe, torch.device("cpu"), build_loader(ds, 16, options, seed=0))
    losses = []
    for _ in range(60):
        trainer.meter.reset()
        trainer.step()
        losses.append(trainer.meter.mean())
    trainer.close()
    first, last = sorted(losses[:10])[5], sorted(losses[-10:])[5]  # medians: robust to a spike
    assert last < 0.9 * first, losses
