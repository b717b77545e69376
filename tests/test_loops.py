"""Entry points from the loops people have (speedbench.models.loops): a LightningModule's own
training_step and a Hugging Face model's own .loss, measured through the step hook with the
techniques acting on them (their wrappers see the user's forward)."""
from __future__ import annotations

import types
import warnings

import pytest
import torch
from conftest import compose_cfg

from speedbench.config import build_plan
from speedbench.errors import ConfigError
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


LIT = "_target_: speedbench.models.loops.lightning, module: {_target_: loop_models.LitNet}"
HF = ("_target_: speedbench.models.loops.hf_trainer, model: {_target_: torch.nn.Linear, "
      "in_features: 4, out_features: 4}")


def _plan(model: str, *more: str, experiment=None):
    return build_plan(compose_cfg("device=cpu", "scale=small", f"model={{{model}, {BLOBS}}}",
                                  *more, experiment=experiment), None)


def test_a_lightning_trainers_flags_set_the_runs_precision_and_accumulation():
    plan = _plan(LIT + ", trainer: {precision: bf16-mixed, accumulate_grad_batches: 2, "
                       "gradient_clip_val: 0.5, max_epochs: 3}")
    recipe = plan.variants["default"]
    assert (recipe.precision, recipe.accumulate) == ("bf16", 2)
    assert plan.notes == ["the model's own loop asks for precision=bf16 accumulate=2: set for "
                          "every variant (a variant's own setting wins, as one given on the "
                          "command line does)"]
    amp = _plan(LIT + ", trainer: {precision: bf16-mixed}", experiment="amp")
    assert [r.precision for r in amp.variants.values()] == ["fp32", "fp16", "bf16"]
    mine = _plan(LIT + ", trainer: {precision: bf16-mixed}", "precision=fp16")
    assert mine.variants["default"].precision == "fp16" and mine.notes == []  # the user's


@pytest.mark.parametrize("flags, says", [
    ("trainer: {precision: bf16-true}", r"^model lightning: trainer\.precision: 'bf16-true' "
                                        r"has no speedbench counterpart .*choose one of 32-true"),
    ("trainer: {accumulate_grad_batches: 0}", r"^model lightning: trainer\."
                                              r"accumulate_grad_batches: 0 is not allowed"),
])
def test_a_trainer_flag_without_counterpart_is_one_line(flags, says):
    with pytest.raises(ConfigError, match=says):
        _plan(f"{LIT}, {flags}")


def test_training_arguments_set_precision_accumulation_optimizer_and_lr():
    plan = _plan(HF + ", args: {bf16: true, gradient_accumulation_steps: 4, "
                      "optim: adamw_torch_fused, learning_rate: 5.0e-05, max_grad_norm: 0.5}")
    r = plan.variants["default"]
    assert (r.precision, r.accumulate, r.optimizer.impl, r.lr) == ("bf16", 4, "fused", 5e-5)
    with pytest.raises(ConfigError, match=r"^model hf_trainer: args\.optim: 'adafactor': "
                                          r"speedbench trains with torch's AdamW"):
        _plan(HF + ", args: {optim: adafactor}")
    with pytest.raises(ConfigError, match=r"args\.bf16 and fp16: both true; choose one"):
        _plan(HF + ", args: {bf16: true, fp16: true}")


def test_the_steps_clip_as_the_trainer_would():
    assert loops.hf_trainer(torch.nn.Linear(2, 2)).clip_norm == 1.0  # the Trainer's default
    assert loops.hf_trainer(torch.nn.Linear(2, 2), {"max_grad_norm": 0}).clip_norm is None
    # an object's attribute, as a TrainingArguments built by `_target_` (it needs accelerate)
    args = types.SimpleNamespace(max_grad_norm=0.25, optim="adamw_torch")
    assert loops.hf_trainer(torch.nn.Linear(2, 2), args).clip_norm == 0.25
    pytest.importorskip("lightning", reason="needs lightning")
    from loop_models import LitNet

    assert loops.lightning(LitNet(), {"gradient_clip_val": 0.5}).clip_norm == 0.5
    with pytest.raises(TypeError, match=r"^trainer: gradient_clip_algorithm 'value' is not"):
        loops.lightning(LitNet(), {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"})


def test_a_datamodule_is_taken_as_such_its_loaders_collate_kept():
    pytest.importorskip("lightning", reason="needs lightning")
    from loop_models import BlobsData

    from speedbench.measure import own_data
    from speedbench.measure.data import build_loader

    data = own_data.own_dataset({"_target_": "loop_models.BlobsData", "n": 32})
    assert len(data) == 32 and data.loader_functions["collate_fn"] == BlobsData.collate
    BlobsData.collated = 0
    x, y = next(iter(build_loader(data, 8, {}, seed=0)))
    assert x.shape == (8, 32) and BlobsData.collated == 1


def test_a_named_models_training_arguments_are_read_too():
    """A model by name (models/NAME.yaml, `+models.NAME=`) as well as an inline one."""
    plan = build_plan(compose_cfg("device=cpu", "scale=small", f"+models.hft={{{HF}, {BLOBS}, "
                                  "args: {gradient_accumulation_steps: 3}}", "model=hft"), None)
    assert plan.variants["default"].accumulate == 3 and plan.notes
