"""The model's own code shares speedbench's process: what it changes there is put back after
each trial and probe and said once, and what a hostile model object does fails its own trial
only (measure/isolation.py).

Two families of hostile models: MEDDLES (fault_models.py), code that changes the process (the
default dtype and device, grad mode, the working directory, the umask, the environment, the
signal handlers, sys.stdout, warnings as errors, the recursion limit, the garbage collector,
...), and HOSTILE objects (no parameters, frozen ones, a loss that is an int, detached, a Python
float or a dict without it, a BaseException of its own, sys.exit(0), a NUL in its message,
train() or repr() that raise, no forward).
"""
from __future__ import annotations

import json
import os
import signal
import sys

import pandas as pd
import pytest
import torch
from conftest import SMALL_MODELS, TINY, compose_cfg, only_run_dir, run_main
from fault_models import MEDDLES

from speedbench.config import build_plan
from speedbench.measure import isolation
from speedbench.measure.data import build_dataset
from speedbench.measure.train import build_model
from speedbench.measure.trial import dataset_length, measure_trial

TOKENS = "loss: module, batch_size: 4, dataset: {kind: tokens, seq_len: 8, vocab_size: 16}"
# which WATCHED setting each change is said as
SAID_AS = {
    "default_dtype": "the default dtype", "default_device": "the default device",
    "grad_off": "grad mode", "deterministic": "deterministic algorithms",
    "anomaly": "anomaly detection", "cudnn_deterministic": "cuDNN's deterministic flag",
    "mkldnn_off": "oneDNN (mkldnn)", "chdir": "the working directory",
    "umask": "the file mode mask (umask)",
    "omp_env": "the environment variables speedbench reads",
    "sigint_ignored": "the stop signals' handlers", "stdout": "sys.stdout or sys.stderr",
    "stdout_fd": "the standard output or error descriptor",
    "warnings_error": "the warnings turned into errors",
    "recursion_limit": "Python's recursion limit", "gc_off": "the garbage collector",
    "inference_mode": "grad mode", "saved_hooks": "the saved-tensors hooks",
    "profiler": "the autograd profiler", "function_mode": "the torch function modes",
    "dispatch_mode": "the torch dispatch modes", "autocast": "autocast",
    "threads": "the intra-op thread count", "gc_thresholds": "the garbage collector's thresholds",
    "setprofile": "Python's profile or trace function", "excepthook": "sys.excepthook",
    "switch_interval": "Python's thread switch interval",
    "numpy_errors": "numpy's floating-point error handling",
}


def _state() -> dict:
    return {what: setting.read() for what, setting in isolation.WATCHED.items()}


def test_every_change_a_model_can_make_is_watched():
    assert set(SAID_AS) == set(MEDDLES) and set(SAID_AS.values()) <= set(isolation.WATCHED)
    # and every setting watched has a model that changes it (flushing denormals: below)
    assert set(isolation.WATCHED) - set(SAID_AS.values()) == {"flushing denormals"}


def test_flushing_denormals_left_on_is_put_back_and_said_where_the_cpu_has_it():
    said = []
    with isolation.isolated("m-flush", say=said.append):
        supported = torch.set_flush_denormal(True)  # False: a CPU without it, nothing changed
    assert not isolation.WATCHED["flushing denormals"].read()
    assert len(said) == int(supported), said
    isolation.clear_notes()


def test_a_context_left_entered_does_not_reach_the_next_model_trial():
    """A saved-tensors hook or inference mode entered in a constructor and never left: the next
    model's step trains with gradients, and no hook packs its saved tensors (K1)."""
    packed = []
    with isolation.isolated("m-hooks", say=lambda _: None):
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t,
                                                         lambda t: t)
        inference = torch.inference_mode()  # kept: released, its guard would undo itself
        hooks.__enter__()
        inference.__enter__()
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    assert not packed and x.grad is not None and not torch.is_inference_mode_enabled()
    isolation.clear_notes()


@pytest.mark.parametrize("mode", sorted(MEDDLES))
def test_a_change_of_the_process_by_the_model_is_put_back_and_said_once(mode, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("FAULT_CHDIR", str(tmp_path))
    before, said = _state(), []
    for when in ("build", "train"):  # the same change again: said once
        with isolation.isolated(f"m-{mode}", say=said.append) as watch:
            if when == "build":
                MEDDLES[mode]()
                watch.built()
            else:
                MEDDLES[mode]()
    assert _state() == before
    assert len(said) == 1, said
    assert said[0].startswith(f"speedbench: note: model m-{mode}: its code changes "
                              f"{SAID_AS[mode]} (to "), said
    assert "when it is built" in said[0] and "put it back" in said[0]
    assert isolation.notes() and said[0].endswith(isolation.notes()[-1])
    isolation.clear_notes()


def test_a_change_while_it_trains_is_said_so_and_a_harmless_one_is_not_said():
    said = []
    with isolation.isolated("m", say=said.append) as watch:
        watch.built()
        torch.set_default_dtype(torch.float64)
    with isolation.isolated("n", say=said.append):
        sys.setrecursionlimit(sys.getrecursionlimit() + 100)  # raised (torch.compile does)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit - 100)
    assert torch.get_default_dtype() == torch.float32
    assert len(said) == 1 and "while it trains" in said[0], said
    isolation.clear_notes()


def test_the_random_generators_are_put_back_silently():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    said = []
    with isolation.isolated("m", say=said.append):
        torch.manual_seed(1234)
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected) and not said


# --- hostile model objects: each fails its own trial, in one line ------------------------------

HOSTILE = [  # (mode, what its row's status holds)
    ("no_params", "error: ValueError: optimizer got an empty parameter list"),
    ("frozen", "does not require grad"),
    ("int_loss", "does not require grad"),
    ("detached", "does not require grad"),
    ("python_float", "error: TypeError: forward returned float"),
    ("dict_without_loss", "error: TypeError: forward returned a dict with keys logits"),
    ("base_exception", "error: ModelExit: the model's code raised Boom (a BaseException)"),
    ("exit_zero", "error: ModelExit: the model's code called sys.exit(0)"),
    ("message_with_nul_and_lines", "error: ValueError: first line"),
    ("train_raises", "error: RuntimeError: train() refuses"),
    ("repr_raises", "ok"),
]


def _trial(model: str) -> dict:
    return _trial_of(model)


def _trial_of(model: str, *more: str) -> dict:
    cfg = compose_cfg(*TINY, "bench.repeats=1", *more, f"model={model}")
    plan = build_plan(cfg, None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, plan.baseline, recipe, 0, dataset)


def _one_line(status: str) -> None:
    assert status.isprintable() and "\n" not in status and len(status) < 400, repr(status)


@pytest.mark.parametrize("mode, status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_model_object_fails_its_own_trial_in_one_line(mode, status):
    before = _state()
    record = _trial(f"{{_target_: fault_models.Hostile, mode: {mode}, {TOKENS}}}")
    _one_line(record["status"])
    assert record["status"].startswith(status) or status in record["status"], record["status"]
    assert _state() == before


def test_a_model_without_forward_fails_its_own_trial_in_one_line():
    record = _trial(f"{{_target_: fault_models.no_forward, {TOKENS}}}")
    _one_line(record["status"])
    assert record["status"].startswith("error: NotImplementedError: "), record["status"]


# --- a whole run: the rows after a model that changed the process ran as configured (G1, G6,
# G21) ----------------------------------------------------------------------------------------

def _model(mode: str, when: str, name: str) -> str:
    return (f"{{_target_: fault_models.Meddler, mode: {mode}, when: {when}, model_name: {name}, "
            f"{TOKENS}}}")


def test_a_run_with_models_that_change_the_process_keeps_the_others_as_configured(tmp_path,
                                                                                  monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("FAULT_CHDIR", str(elsewhere))
    models = [_model("default_dtype", "init", "float64"), _model("chdir", "forward", "mover"),
              _model("stdout", "forward", "muter"), _model("warnings_error", "init", "strict"),
              f"{{_target_: fault_models.Hostile, mode: exit_zero, model_name: quitter, {TOKENS}}}",
              "transformer"]
    cwd = os.getcwd()
    proc = run_main(*TINY, *SMALL_MODELS, "bench.repeats=1", "bench.quality_steps=0",
                    f"model=[{', '.join(models)}]", "out_dir=results", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.getcwd() == cwd and not any(elsewhere.iterdir()), list(elsewhere.iterdir())
    assert proc.stdout.rstrip().splitlines()[-1].startswith("6 trials in "), proc.stdout[-500:]
    run = only_run_dir(tmp_path / "results")
    trials = pd.read_csv(run / "trials.csv").set_index("model")
    assert trials.loc["quitter", "status"].startswith("error: ModelExit: the model's code "
                                                      "called sys.exit(0)")
    assert (trials.drop(index="quitter")["status"] == "ok").all(), trials["status"]
    # the transformer trained in float32, whatever the first model's constructor set
    spec = build_plan(compose_cfg(*TINY, *SMALL_MODELS, "model=transformer"), None).models[0]
    params = sum(p.numel() * p.element_size() for p in build_model(spec, 0).parameters())
    assert trials.loc["transformer", "params_mem_mb"] == pytest.approx(params / 2**20, rel=1e-6)
    changes = json.loads((run / "env.json").read_text())["model_changes"]
    for name, what in (("float64", "the default dtype (to torch.float64) when it is built"),
                       ("mover", "the working directory"), ("muter", "sys.stdout or sys.stderr"),
                       ("strict", "the warnings turned into errors")):
        assert any(c.startswith(f"model {name}: its code changes {what}") for c in changes), \
            changes
    assert "Model float64: its code changes the default dtype" in (run / "report.md").read_text()
    assert proc.stderr.count("speedbench: note: model float64:") == 1, proc.stderr[-3000:]
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


@pytest.mark.slow
def test_contexts_a_model_leaves_entered_do_not_reach_the_next_models_row(tmp_path):
    """Round 5's K1 (a whole run in a process of its own: a profiler left on crashed it at its
    exit): saved-tensors hooks, inference mode and the autograd profiler entered in three
    constructors and never left; the transformer after them trains, its memory split is its
    own, each change is said once, and the run exits 0."""
    from conftest import run_cli

    models = [_model("saved_hooks", "init", "hooker"), _model("inference_mode", "init", "infer"),
              _model("profiler", "init", "profiled"), "transformer"]
    tests = os.path.dirname(os.path.abspath(__file__))  # (fault_models, for the child)
    proc = run_cli(*TINY, *SMALL_MODELS, "bench.repeats=1", "bench.quality_steps=0",
                   "bench.explain=false", f"model=[{', '.join(models)}]", "out_dir=results",
                   cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join(
                       [tests, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path / "results")
    trials = pd.read_csv(run / "trials.csv").set_index("model")
    assert trials.loc["transformer", "status"] == "ok", trials["status"]
    control = _trial_of("transformer", *SMALL_MODELS, "bench.quality_steps=0")
    for column in ("activation_mem_mb", "peak_mem_mb", "params_mem_mb"):
        assert trials.loc["transformer", column] == pytest.approx(control[column], rel=1e-9)
    changes = json.loads((run / "env.json").read_text())["model_changes"]
    for name, what in (("hooker", "the saved-tensors hooks"), ("infer", "grad mode"),
                       ("profiled", "the autograd profiler")):
        assert sum(c.startswith(f"model {name}: its code changes {what}") for c in changes) == 1,\
            changes
