"""Models by name and a user's own data: the one-line model configs (timm, torchvision, Hugging
Face), speedbench's keys never swallowing a constructor's argument, the token tasks beyond the
next token, regression and tabular data, 1-channel pictures, a user's own Dataset or DataLoader
factory under speedbench's DataLoader, and a model whose baseline fails at once."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import TINY, compose_cfg, only_run_dir, run_main
from speedbench.config import ConfigError, ModelSpec, build_plan
from speedbench.measure import own_data
from speedbench.measure.data import IGNORE, TokenTask, build_dataset, build_loader, image_folder
from speedbench.measure.train import build_model, compute_loss

IMAGES = "dataset: {kind: images, image_size: 16, num_classes: 4}"


def _model(entry: str, *more: str) -> ModelSpec:
    return build_plan(compose_cfg(f"model={entry}", *more), None).models[0]


# --- models by name -----------------------------------------------------------------------------
def test_models_by_name_give_the_name_positionally_and_fill_in_what_the_data_says():
    timm = _model("{timm: resnet18, dataset: {kind: images, image_size: 16, num_classes: 4, "
                  "channels: 1}}")
    assert timm.name == "resnet18" and timm.target == {
        "_target_": "speedbench.models.by_name.timm_model", "_args_": ["resnet18"],
        "num_classes": 4, "in_chans": 1}
    tv = _model("{torchvision: mobilenet_v3_small, model_name: mnv3, " + IMAGES + "}")
    assert tv.name == "mnv3" and tv.target["_args_"] == ["mobilenet_v3_small"]
    assert tv.target["num_classes"] == 4 and "in_chans" not in tv.target
    bert = _model("{hf: BertForSequenceClassification, config: {num_hidden_layers: 2}, "
                  "dataset: {kind: tokens, seq_len: 8, vocab_size: 32, num_classes: 3}}")
    assert bert.inputs == ["input_ids"] and bert.loss == "cross_entropy"
    assert bert.dataset["task"] == "sequence_classification"
    assert bert.target["config"] == {"num_hidden_layers": 2, "vocab_size": 32, "num_labels": 3}
    gpt = _model("{hf: GPT2LMHeadModel, config: {vocab_size: 64}, "
                 "dataset: {kind: tokens, seq_len: 8, vocab_size: 32}}")
    assert gpt.target["config"] == {"vocab_size": 64}  # given: kept
    assert gpt.dataset["task"] == "next_token"


def test_a_torchvision_model_by_name_trains():
    spec = _model("{torchvision: squeezenet1_1, " + IMAGES.replace("16", "32") + "}")
    model = build_model(spec, seed=0)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 3])
    assert compute_loss(model, spec.loss, x, y).dim() == 0
    assert model.classifier[1].out_channels == 4  # num_classes from the dataset


@pytest.mark.parametrize("entry, says", [
    ("{timm: resnet18, _target_: mynet.build, " + IMAGES + "}",
     "give one of _target_, timm, torchvision, hf; it has _target_, timm"),
    ("{hf: [Bert], " + IMAGES + "}", "hf: ['Bert']; give the model's name, e.g. hf: Bert"),
])
def test_a_model_by_name_is_one_name(entry, says):
    with pytest.raises(ConfigError, match=r"^model .*" + says.replace("[", r"\[")
                       .replace("]", r"\]")):
        _model(entry)


def test_a_key_of_speedbench_that_is_also_the_constructors_argument_is_refused(tmp_path):
    """timm's create_model takes model_name, speedbench's name key: refused in one line,
    naming kwargs; with kwargs each gets its own."""
    entry = "{_target_: own_models.named_net, model_name: resnet18, " + IMAGES + "}"
    out = run_main(f"model={entry}", f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(
        "speedbench: error: model resnet18: model_name is speedbench's key (its name in the "
        "tables) and also an argument of own_models.named_net; give own_models.named_net's "
        "under kwargs: {model_name: ...}, speedbench's beside it")
    spec = _model("{_target_: own_models.named_net, model_name: mine, "
                  "kwargs: {model_name: resnet18}, " + IMAGES + "}")
    assert spec.name == "mine" and build_model(spec, 0).built_as == "resnet18"
    with pytest.raises(ConfigError, match="num_classes is given twice"):
        _model("{_target_: own_models.named_net, num_classes: 4, kwargs: {num_classes: 4}, "
               + IMAGES + "}")


# --- the data a model eats ----------------------------------------------------------------------
@pytest.mark.parametrize("dataset, says", [
    ("{kind: audio}", "dataset.kind: 'audio' is not allowed; choose one of images, tokens, "
                      "tabular"),
    ("{kind: tokens, seq_len: 8, vocab_size: 32, task: translation}",
     "dataset.task: 'translation' is not allowed; choose one of next_token, "
     "sequence_classification, token_classification, masked_lm"),
    ("{kind: tokens, seq_len: 8, vocab_size: 32, task: token_classification}",
     "dataset.num_classes: None; tokens for task token_classification needs num_classes"),
    ("{kind: images, image_size: 16, num_classes: 4, channels: 2}",
     "dataset.channels: '2' is not allowed; choose one of 1, 3"),
    ("{kind: tabular, features: 0, num_classes: 3}", "dataset.features: 0; tabular"),
])
def test_a_dataset_is_checked_naming_the_key_and_what_it_takes(dataset, says):
    with pytest.raises(ConfigError) as err:
        _model("{_target_: own_models.named_net, dataset: " + dataset + "}")
    assert str(err.value).startswith("model named_net: " + says)


def test_the_token_tasks_label_each_sequence_each_token_or_the_hidden_tokens():
    spec = {"kind": "tokens", "seq_len": 12, "vocab_size": 32, "num_classes": 3}
    seq = build_dataset({**spec, "task": "sequence_classification"}, 64, seed=1)
    labels = {int(seq[i][1]) for i in range(64)}
    assert seq[0][1].shape == () and len(labels) > 1 and labels <= {0, 1, 2}
    tok = build_dataset({**spec, "task": "token_classification"}, 8, seed=1)
    x, y = tok[2]
    assert y.shape == x.shape == (12,) and torch.equal(y, x % 3)
    mlm = build_dataset({**spec, "task": "masked_lm"}, 8, seed=1)
    nxt = build_dataset({**spec, "task": "next_token"}, 8, seed=1)
    x, y = mlm[3]
    hidden = y != IGNORE
    assert 1 <= int(hidden.sum()) < 12 and bool((x[hidden] == 31).all())
    assert torch.equal(y[hidden], nxt[3][0][hidden]) and torch.equal(x[~hidden], nxt[3][0][~hidden])
    assert torch.equal(mlm[3][0], x)  # item i is the same every time
    assert isinstance(mlm, TokenTask)  # not MarkovTokens: held-out data is a random share


def test_a_masked_lm_loss_counts_only_the_hidden_tokens():
    from own_models import TinyLM

    ds = build_dataset({"kind": "tokens", "seq_len": 8, "vocab_size": 32,
                        "task": "masked_lm"}, 4, seed=0)
    x, y = torch.utils.data.default_collate([ds[i] for i in range(4)])
    model = TinyLM(returns="tuple")
    logits = model(x)[0]
    hidden = y != IGNORE
    want = torch.nn.functional.cross_entropy(logits[hidden], y[hidden])
    assert torch.allclose(compute_loss(model, "cross_entropy", x, y), want)


def test_regression_targets_and_tabular_rows():
    pics = build_dataset({"kind": "images", "image_size": 16, "task": "regression",
                          "targets": 3}, 8, seed=0)
    x, y = pics[0]
    assert x.shape == (3, 16, 16) and y.shape == (3,) and y.dtype == torch.float32
    rows = build_dataset({"kind": "tabular", "features": 5, "task": "regression",
                          "targets": 2}, 8, seed=0)
    x, y = rows[1]
    assert x.shape == (5,) and y.shape == (2,) and torch.equal(rows[1][0], x)
    classes = build_dataset({"kind": "tabular", "features": 5, "num_classes": 4}, 64, seed=0)
    assert {int(classes[i][1]) for i in range(64)} <= set(range(4))
    spec = _model("{_target_: own_models.named_net, dataset: {kind: tabular, features: 5, "
                  "targets: 2}}")
    assert spec.loss == "mse" and spec.dataset["task"] == "regression"


def test_mse_takes_an_output_of_one_column_for_one_target_and_names_a_mismatch():
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(6, 4), torch.randn(6)
    want = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
    assert torch.allclose(compute_loss(model, "mse", x, y), want)
    with pytest.raises(ValueError, match=r"^mse: model output \(6, 1\), labels \(6, 3\): give "
                                         r"the model 3 outputs"):
        compute_loss(model, "mse", x, torch.randn(6, 3))


def test_a_classifier_given_next_token_labels_is_told_what_to_set():
    """BertForSequenceClassification on kind: tokens without num_classes: logits (N, C)
    against next-token labels (N, T)."""
    from own_models import SeqClassifier

    with pytest.raises(ValueError) as err:
        compute_loss(SeqClassifier(num_classes=4), "cross_entropy",
                     torch.zeros(16, 8, dtype=torch.long), torch.zeros(16, 8, dtype=torch.long))
    message = f"ValueError: {err.value}"
    assert message == ("ValueError: cross_entropy: model output (16, 4), labels (16, 8): one "
                       "label per sequence needs dataset num_classes: 4 (kind tokens gives "
                       "next-token labels)")
    assert len(message) <= 160  # a trial's status keeps 160 characters


def test_one_channel_pictures_synthetic_and_from_a_folder(tmp_path):
    from PIL import Image

    pics = build_dataset({"kind": "images", "image_size": 16, "num_classes": 4,
                          "channels": 1}, 8, seed=0)
    assert pics[0][0].shape == (1, 16, 16)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (20, 20), (200, 10, 10)).save(tmp_path / cls / "0.png")
    grey = image_folder(str(tmp_path), image_size=8, num_classes=2, channels=1)
    x, _ = grey[0]
    assert x.shape == (1, 8, 8)
    red = 0.299 * 200 + 0.587 * 10 + 0.114 * 10  # Pillow's "L" of that red
    assert abs(float(x.mean()) - (red / 255 - 0.449) / 0.226) < 0.05


# --- the user's own data ------------------------------------------------------------------------
def test_data_target_gives_every_model_the_users_dataset_under_speedbenchs_loader():
    spec = _model("{_target_: own_models.named_net, num_classes: 2}",
                  "data._target_=own_models.Shapes", "+data.kwargs={n: 40}")
    assert spec.dataset == {"_target_": "own_models.Shapes", "n": 40}
    ds = build_dataset(spec.dataset, 0)
    assert len(ds) == 40 and ds[0][0].shape == (1, 16, 16)
    loader = build_loader(ds, 8, {"num_workers": 1, "persistent_workers": True}, seed=0)
    assert loader.num_workers == 1 and loader.persistent_workers
    x, y = next(iter(loader))
    assert x.shape == (8, 1, 16, 16) and y.shape == (8,)


def test_a_dataloader_factory_keeps_its_collate_and_says_which_settings_speedbench_sets(capsys):
    own_data._SAID.clear()
    ds = build_dataset({"_target_": "own_models.shapes_loader", "n": 32}, 0)
    build_dataset({"_target_": "own_models.shapes_loader", "n": 32}, 0)  # said once only
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["speedbench: data: own_models.shapes_loader's DataLoader: speedbench loads "
                   "its dataset with its own DataLoader, keeping collate_fn and worker_init_fn "
                   "and replacing batch_size, num_workers, pin_memory, prefetch_factor, so that "
                   "the data knobs can be measured; to train as yours does, give batch_size=16 "
                   "data.num_workers=2 data.pin_memory=true data.prefetch_factor=2"]
    loader = build_loader(ds, 4, {"num_workers": 0}, seed=0)
    x, _ = next(iter(loader))
    assert loader.num_workers == 0 and x.shape[0] == 4 and float(x.view(-1)[0]) == 7.0


@pytest.mark.parametrize("target, says", [
    ("own_models.stream_loader", "returned a DataLoader of an IterableDataset"),
    ("own_models.Stream", "returned a Stream; give a map-style torch Dataset"),
    ("own_models.bucketed_loader", "a batch_sampler of its own (list)"),
    ("own_models.batches", "returned a generator; give a map-style torch Dataset"),
    ("own_models.dict_items", "items are a dict; speedbench trains on (x, y) pairs"),
    ("own_models.broken", "failed: OSError: no file shapes-4.npz"),
])
def test_data_that_speedbench_cannot_load_is_refused_in_one_line(tmp_path, target, says):
    out = run_main("model={_target_: own_models.named_net, num_classes: 2}",
                   f"data._target_={target}", f"out_dir={tmp_path / 'results'}", cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"speedbench: error: data: _target_ {target}") and says in lines[0]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("overrides, says", [
    (["data._target_=own_models.Shapes", "data.path=."],
     "data.path: model named_net eats its own data set (_target_)"),
    (["+data.kwargs={n: 4}"], "data.kwargs: given without data._target_"),
])
def test_own_data_keys_that_do_not_go_together(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _model("{_target_: own_models.named_net}", *overrides)


def test_a_knob_set_by_a_variant_acts_on_the_users_data(tmp_path):
    """+experiment=workers on the user's Dataset: each variant's own worker count, every row ok."""
    out = run_main("+experiment=workers", "model={_target_: own_models.named_net, num_classes: 2}",
                   "data._target_=own_models.Shapes", "+data.kwargs={n: 256}", *TINY,
                   "bench.repeats=1", "bench.quality_steps=0", f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert (trials["status"] == "ok").all(), trials[["variant", "status"]]
    assert set(trials["num_workers"]) == {int(v[1:]) for v in trials["variant"]}
    assert len(set(trials["num_workers"])) > 1


# --- a model that cannot train ------------------------------------------------------------------
def test_a_baseline_that_fails_its_first_trial_stops_the_models_trials(tmp_path):
    """A sequence classifier given next-token labels: the first failure's cause and its hint,
    once; no second round, the variants after it not measured."""
    model = ("model={_target_: own_models.SeqClassifier, num_classes: 4, "
             "dataset: {kind: tokens, seq_len: 8, vocab_size: 32}}")
    out = run_main("+experiment=amp", model, *TINY, f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 1
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert set(trials["round"]) == {0} and len(trials) == 3
    base = trials[trials["variant"] == "fp32"]
    assert len(base) == 1 and base["status"].iloc[0].startswith(
        "error: ValueError: cross_entropy: model output (4, 4), labels (4, 8): one label per "
        "sequence needs dataset num_classes: 4")
    after = trials[trials["position"] > base["position"].iloc[0]]
    assert (after["status"] == "not measured: the baseline's first trial failed, so the "
                               "model's trials stopped").all()
    assert "SeqClassifier: the baseline's first trial failed (error: ValueError" in out.stderr


# --- a run that stops -----------------------------------------------------------------------------
def test_a_run_that_stops_says_so_in_its_rebuilt_report_with_what_it_never_measured(tmp_path):
    """Ctrl-C as the second model's first trial starts (its rounds come after the cheaper
    first model's): the report rebuilt from the first model's trials says the run did not
    finish and names the second model's variants; the report
    of a run that finished says nothing of the kind."""
    from speedbench.report.__main__ import main as report

    tiny = "{_target_: fault_models.Tiny, model_name: tiny, " + IMAGES + "}"
    stops = "{_target_: own_models.Interrupts, " + IMAGES + "}"
    out = run_main("+experiment=amp", f"model=[{tiny}, {stops}]", *TINY, "bench.repeats=1",
                   f"out_dir={tmp_path / 'stopped'}", cwd=tmp_path)
    assert out.returncode == 130, out.stderr
    run_dir = only_run_dir(tmp_path / "stopped")
    assert set(pd.read_csv(run_dir / "trials.csv")["model"]) == {"tiny"}
    assert report([str(run_dir)]) == 0
    text = " ".join((run_dir / "report.md").read_text().split())
    assert "This run did not finish: it stopped after 3 trials" in text
    assert "Never measured: Interrupts/fp32, Interrupts/fp16, Interrupts/bf16." in text
    out = run_main("+experiment=amp", f"model={tiny}", *TINY, "bench.repeats=1",
                   f"out_dir={tmp_path / 'finished'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "did not finish" not in (only_run_dir(tmp_path / "finished") / "report.md").read_text()


@pytest.mark.parametrize("cls, task", [
    ("BertForSequenceClassification", "sequence_classification"),
    ("BertForTokenClassification", "token_classification"),
    ("BertForMaskedLM", "masked_lm"),
    ("AutoModelForSequenceClassification", "sequence_classification"),
    ("GPT2LMHeadModel", "next_token"),
])
def test_each_token_task_is_one_line_for_a_hugging_face_model(cls, task, capfd):
    """A Hugging Face model by name on the task's data: its loss from the logits, no warning
    about special-token ids past the small vocabulary."""
    pytest.importorskip("transformers", reason="needs transformers")
    config = ("{n_layer: 1, n_head: 2, n_embd: 16, n_positions: 8}" if cls.startswith("GPT2")
              else "{hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, "
                   "intermediate_size: 32, max_position_embeddings: 8}")
    if cls.startswith("Auto"):
        config = config.replace("{", "{model_type: bert, ")
    classes = "" if task in ("next_token", "masked_lm") else ", num_classes: 3"
    spec = _model(f"{{hf: {cls}, config: {config}, dataset: {{kind: tokens, seq_len: 8, "
                  f"vocab_size: 32, task: {task}{classes}}}}}")
    capfd.readouterr()
    model = build_model(spec, seed=0)
    assert "token_id" not in capfd.readouterr().err  # transformers' warning
    ds = build_dataset(spec.dataset, 4, seed=0)
    x, y = torch.utils.data.default_collate([ds[i] for i in range(4)])
    loss = compute_loss(model, spec.loss, x, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert model.inner.config.vocab_size == 32
    if cls.startswith("GPT2"):
        assert model.inner.config.bos_token_id == model.inner.config.eos_token_id == 0


def test_the_held_out_and_calibration_batches_of_a_dataloader_factory_use_its_collate():
    """The quality probe's batches are made as the user's DataLoader makes them (marked_collate
    marks every batch's first value 7), not by torch's default collate."""
    from types import SimpleNamespace

    from speedbench.measure import held_out

    ds = build_dataset({"_target_": "own_models.shapes_loader", "n": 40}, 0)
    train, (x, _), _ = held_out.split(ds, SimpleNamespace(name="own", dataset={}), 0, 8)
    assert float(x.view(-1)[0]) == 7.0
    cx, _ = held_out.calibration(train, 0, n=4)
    assert float(cx.view(-1)[0]) == 7.0 and cx.shape[0] == 4
