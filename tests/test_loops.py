"""Entry points from the loops people have (speedbench.models.loops): a LightningModule's own
training_step and a Hugging Face model's own .loss, measured through the step hook with the
techniques acting on them (their wrappers see the user's forward)."""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import compose_cfg

from speedbench.config import build_plan
from speedbench.measure.step_hook import HookTrainer
from speedbench.models import loops
from speedbench.techniques import Context

CPU = Context(device=torch.device("cpu"))
BLOBS = "dataset: {_target_: own_models.TwoViews, n: 64}"


def _hook_trainer(model: torch.nn.Module, data, target: str) -> HookTrainer:
    """The hook's trainer on `model` inside DataParallel (a wrapper, as DDP or compile), fp32."""
    plan = build_plan(compose_cfg("device=cpu", "scale=small", "batch_size=8",
                                  f"model={{_target_: {target}, loss: module, {BLOBS}}}"), None)
    spec, recipe = plan.models[0], plan.variants["default"]
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    return HookTrainer(spec, recipe, CPU.device, loader, model=torch.nn.DataParallel(model),
                       ctx=CPU)


class _Blobs(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.nn.functional.one_hot(self.y, 32).float() + torch.randn(n, 32, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_lightning_modules_training_step_is_the_step_and_calls_the_wrapped_model():
    pytest.importorskip("lightning", reason="needs lightning")
    from loop_models import LitNet

    module = LitNet()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = _hook_trainer(loops.lightning(module), _Blobs(), "loop_models.LitNet")
    LitNet.calls = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's "no Trainer" warning stays off the console
        for _ in range(2):
            trainer.step()  # not n/a: its self(x) went through the wrapper (sb.model)
    assert LitNet.calls == 2
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert torch.isfinite(loops.lightning(module).speedbench_loss(next(iter(
        torch.utils.data.DataLoader(_Blobs(), batch_size=8)))))


def test_a_module_without_training_step_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^Linear has no training_step: give a LightningModule"):
        loops.lightning(torch.nn.Linear(2, 2))


def test_a_hugging_face_models_own_loss_is_the_step():
    pytest.importorskip("transformers", reason="needs transformers")
    from speedbench.models.by_name import hf_model

    bert = hf_model("BertForSequenceClassification", config={
        "vocab_size": 32, "num_labels": 4, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16})
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (16, 8), generator=g),
                                          torch.randint(0, 4, (16,), generator=g))
    step = loops.hf_loss(bert).eval()  # (no dropout, to compare)
    x, y = data[:8]
    expected = bert(input_ids=x, labels=y).loss
    assert torch.allclose(step.speedbench_loss((x, y)), expected)  # the Trainer's loss
    trainer = _hook_trainer(step.train(), data, "speedbench.models.loops.hf_loss")
    trainer.step()  # not n/a: the step called the wrapper (sb.model)
    assert not torch.allclose(step.eval().speedbench_loss((x, y)), expected)  # it trained
