"""Batches of any structure: x and y each a tensor or a tuple, list or dict (nested) of them,
moved to the device element by element, counted in samples by the first tensor's leading
dimension or the model's own `speedbench_samples`; what cannot be moved refused in one line."""
from __future__ import annotations

from unittest import mock

import pandas as pd
import pytest
import torch

from conftest import TINY, compose_cfg, only_run_dir, run_main
from own_models import DictSiamese, DictViews, PairCounted, Siamese, TwoViews
from speedbench.config import build_plan
from speedbench.measure import batches
from speedbench.measure.data import build_loader
from speedbench.measure.held_out import evaluate, split
from speedbench.measure.session import applied
from speedbench.techniques import Context
from speedbench.techniques.memory_format import _inputs_channels_last

SIAMESE = ("model={_target_: own_models.PairCounted, model_name: siamese, loss: module, "
           "dataset: {_target_: own_models.TwoViews, n: 64}}")


def test_every_tensor_of_a_nested_batch_moves_with_the_copy_options():
    x = {"a": torch.zeros(4, 2), "more": [torch.ones(4), (torch.zeros(4, 1),)]}
    seen = []
    real_to = torch.Tensor.to

    def spy(t, *args, **kwargs):
        seen.append(kwargs)
        return real_to(t, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", spy):
        moved = batches.to_device((x, torch.arange(4)), torch.device("cpu"), non_blocking=True)
    assert seen == [{"non_blocking": True}] * 4  # each tensor, each with the option
    assert isinstance(moved, tuple) and set(moved[0]) == {"a", "more"}
    assert isinstance(moved[0]["more"], list) and isinstance(moved[0]["more"][1], tuple)


def test_samples_are_the_first_tensors_rows_unless_the_model_counts_them():
    batch = (({"v": torch.zeros(5, 3)}, torch.zeros(7)), torch.zeros(5))
    assert batches.samples_of(batch) == 5
    assert batches.samples_of((torch.tensor(3.0), torch.zeros(2))) == 1  # no leading dimension
    views = ((torch.zeros(4, 3, 8, 8), torch.zeros(4, 3, 8, 8)), torch.zeros(4))
    assert batches.samples_of(views, PairCounted()) == 8
    assert batches.take(views, 1, 3)[0][1].shape == (2, 3, 8, 8)


def test_channels_last_acts_on_each_picture_of_a_tuple_input():
    a, b = torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4, 4)
    got = _inputs_channels_last(None, ((a, {"b": b}), torch.zeros(2)))[0]
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert got[1]["b"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("model, data", [(Siamese, TwoViews), (DictSiamese, DictViews)])
def test_a_two_view_model_trains_and_is_evaluated_under_bf16_autocast(model, data):
    """User trial 5, run 07: ((view1, view2), y) items raised AttributeError: 'list' object has
    no attribute 'to'. Now the views move one by one, train under autocast, and the held-out
    loss (BatchNorm recalibrated on the same structure) is a number."""
    plan = build_plan(compose_cfg(
        "device=cpu", "scale=small", "batch_size=8",
        f"model={{_target_: own_models.{model.__name__}, loss: module, "
        f"dataset: {{_target_: own_models.{data.__name__}, n: 64}}}}", experiment="amp"), None)
    spec, ctx, ds = plan.models[0], Context(device=torch.device("cpu")), data(64)
    train, xy, _ = split(ds, spec, 0, 16)
    with applied(spec, plan.variants["bf16"], ctx, train) as trainer:
        for _ in range(3):
            trainer.step()
        assert trainer.samples == 24 and trainer.meter.count == 3
        assert torch.isfinite(torch.tensor(trainer.meter.mean()))
        assert torch.isfinite(torch.tensor(evaluate(trainer.model, spec, xy, ctx.device, train)))


def test_a_siamese_model_runs_the_amp_experiment_its_samples_counted_its_way(tmp_path):
    """The whole run: every row measured (or n/a/not measured with its reason, never an
    error), and trials.csv's samples counted by the model's speedbench_samples (two per row)."""
    out = run_main("+experiment=amp", SIAMESE, *TINY, "bench.repeats=1", "~variants.fp16",
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert not trials["status"].str.startswith("error").any(), trials[["variant", "status"]]
    ok = trials[trials["status"] == "ok"]
    per_step = ok["samples_per_s"] * ok["step_ms"] / 1000
    assert len(ok) and ((per_step - 2 * 4).abs() < 1e-6).all(), per_step


def test_a_batch_speedbench_cannot_move_is_refused_in_one_line_naming_the_forms(tmp_path):
    out = run_main("model={_target_: own_models.Siamese, loss: module}",
                   "data._target_=own_models.Captioned", f"out_dir={tmp_path / 'results'}",
                   cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0] == ("speedbench: error: data: _target_ own_models.Captioned: a batch's x[1][0] "
                        "holds a str, which speedbench cannot move to the device; x and y are "
                        f"each {batches.FORMS}")
    assert not (tmp_path / "results").exists()


@pytest.mark.gpu
def test_pinning_acts_on_each_tensor_of_a_nested_batch():
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    loader = build_loader(DictViews(16), 4, {"num_workers": 0, "pin_memory": True}, seed=0)
    batch = next(iter(loader))
    assert all(t.is_pinned() for t in batches.tensors(batch))
    moved = batches.to_device(batch, torch.device("cuda"), non_blocking=True)
    assert all(t.is_cuda for t in batches.tensors(moved))
