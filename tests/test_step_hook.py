"""The user's own training step (`speedbench_step(batch, sb)`): called by speedbench in place of
its built-in step, with the techniques acting through `sb` (autocast, the scaler, the
optimizer's implementation, accumulation), any number of losses and optimizers, clipping, a
schedule and an EMA; a technique that cannot act through it is the row's n/a with the reason;
the held-out loss is the model's own."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

import own_models
from conftest import TINY, compose_cfg, only_run_dir, run_main
from speedbench.config import build_plan
from speedbench.measure.held_out import evaluate, split
from speedbench.measure.session import NotApplicable, applied
from speedbench.measure.step_hook import HookTrainer
from speedbench.measure.train import Trainer
from speedbench.techniques import Context

CPU = Context(device=torch.device("cpu"))


def _plan(model: str, *overrides: str, experiment: str | None = "amp"):
    return build_plan(compose_cfg(
        "device=cpu", "scale=small", "batch_size=8",
        f"model={{_target_: own_models.{model}, loss: module, "
        "dataset: {_target_: own_models.TwoViews, n: 64}}", *overrides,
        experiment=experiment), None)


def _steps(plan, variant: str, n: int = 2):
    spec = plan.models[0]
    with applied(spec, plan.variants[variant], CPU, own_models.TwoViews(64)) as trainer:
        for _ in range(n):
            trainer.step()
        return trainer


def test_the_users_step_runs_under_the_recipes_autocast_with_schedule_clip_and_ema():
    own_models.CALLS.clear()
    trainer = _steps(_plan("HookedSiamese"), "bf16", 3)
    assert isinstance(trainer, HookTrainer)
    assert own_models.CALLS["autocast"] == [True] * 3 and own_models.CALLS["steps"] == 3
    assert trainer.kit.state["sched"].last_epoch == 3  # stepped once per optimizer step
    assert trainer.kit.state["ema"].n_averaged == 3
    assert trainer.meter.count == 3 and trainer.samples == 24


def test_accumulation_calls_the_step_per_micro_batch_and_steps_the_optimizer_once():
    own_models.CALLS.clear()
    trainer = _steps(_plan("HookedSiamese", "accumulate=2", experiment=None), "default", 2)
    assert len(own_models.CALLS["autocast"]) == 4 and own_models.CALLS["steps"] == 2
    assert trainer.kit.state["sched"].last_epoch == 2 and trainer.optimizer_steps == 2


def test_fp16_scales_each_loss_through_sb_backward_and_updates_once_per_step():
    trainer = _steps(_plan("TinyGan"), "fp16", 2)
    assert trainer.scaler is not None and trainer.scaler._scale is not None
    assert trainer.scaler._get_growth_tracker() == 2  # one update per optimizer step


def test_a_gan_steps_both_optimizers_built_with_the_recipes_implementation():
    plan = _plan("TinyGan", "optimizer.impl=foreach", experiment=None)
    spec = plan.models[0]
    with applied(spec, plan.variants["default"], CPU, own_models.TwoViews(64)) as trainer:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.step()
        g_opt, d_opt = trainer.kit.state["g_opt"], trainer.kit.state["d_opt"]
        assert g_opt.defaults["foreach"] and d_opt.defaults["foreach"]
        assert g_opt.defaults["lr"] == 1e-3
        assert all(not torch.equal(p, q) for p, q in zip(before, trainer.model.parameters()))


def test_a_technique_the_users_step_leaves_out_is_na_with_the_reason_never_a_no_op():
    plan = _plan("ForgetsAutocast")
    _steps(plan, "fp32")  # nothing to enter in fp32
    with pytest.raises(NotApplicable, match=r"^n/a: precision: speedbench_step ran its forward "
                                            r"outside sb.autocast\(\)"):
        _steps(plan, "bf16")
    with pytest.raises(TypeError, match=r"speedbench_step did not call sb.step\(\)"):
        _steps(_plan("NeverSteps"), "fp32")


def test_a_step_that_calls_itself_past_the_techniques_wrapper_is_na():
    plan = _plan("CallsItself", experiment=None)
    spec, recipe = plan.models[0], plan.variants["default"]
    model = torch.nn.DataParallel(own_models.CallsItself())  # a wrapper, as DDP or compile
    loader = torch.utils.data.DataLoader(own_models.TwoViews(16), batch_size=8)
    trainer = HookTrainer(spec, recipe, CPU.device, loader, model=model,
                          ctx=Context(device=CPU.device))
    with pytest.raises(NotApplicable, match=r"prepared the model as DataParallel; "
                                            r"speedbench_step did not call sb.model"):
        trainer.step()


def test_a_model_without_a_step_hook_keeps_the_built_in_step():
    with applied(_plan("Siamese").models[0], _plan("Siamese").variants["fp32"], CPU,
                 own_models.TwoViews(64)) as trainer:
        assert type(trainer) is Trainer


def test_the_held_out_loss_is_the_models_own():
    own_models.CALLS.clear()
    plan = _plan("HookedSiamese")
    spec, ds = plan.models[0], own_models.TwoViews(64)
    train, xy, _ = split(ds, spec, 0, 16)
    with applied(spec, plan.variants["fp32"], CPU, train) as trainer:
        loss = evaluate(trainer.model, spec, xy, CPU.device, train)
    assert own_models.CALLS["held_out"] >= 1 and loss == loss


def test_the_amp_experiment_measures_the_users_step_and_probes_its_loss(tmp_path):
    own_models.CALLS.clear()
    out = run_main("+experiment=amp", "model={_target_: own_models.HookedSiamese, loss: module, "
                   "model_name: hooked, dataset: {_target_: own_models.TwoViews, n: 64}}",
                   *TINY, "bench.repeats=1", "~variants.fp16", f"out_dir={tmp_path}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert not trials["status"].str.startswith("error").any(), trials[["variant", "status"]]
    assert (trials["status"] == "ok").any()
    assert own_models.CALLS["held_out"] >= 1  # the probe's held-out loss: the model's own
    assert set(own_models.CALLS["autocast"]) == {True, False}  # bf16's steps and fp32's


def test_only_speedbenchs_and_the_techniques_wrappers_are_opened_to_find_the_step():
    from speedbench.measure.step_hook import step_hook
    from speedbench.measure.train import KeywordInputs, user_model

    class Holder(torch.nn.Module):  # a user's module with a `module` of its own
        def __init__(self):
            super().__init__()
            self.module = own_models.HookedSiamese()

    held = Holder()
    assert user_model(held) is held and step_hook(held) is None
    inner = own_models.HookedSiamese()
    assert user_model(KeywordInputs(torch.nn.DataParallel(inner), ["x"])) is inner
    assert step_hook(torch.nn.DataParallel(inner)).__self__ is inner
