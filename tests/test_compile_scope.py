"""Regional compilation (compile_scope=blocks) and compiled autograd (compile_autograd): what
each compiles, the loss unchanged, the timeline and the captures counted, and n/a where it
cannot act. The aot_eager backend: Dynamo's capture and AOTAutograd without Inductor's slow
code generation (2 cores)."""
from __future__ import annotations

import math

import pytest
import torch
import torchvision.models as tvm

from test_technique_effects import recipe, tiny_models, trial
from speedbench.models import transformer
from speedbench.techniques import Context
from speedbench.techniques import compile as compile_technique
from speedbench.techniques.base import global_snapshot
from speedbench.techniques.compile import Compile, repeated_blocks

TWO_LAYERS = ["models.transformer.small.layers=2", "bench.warmup=3", "bench.steps=3"]
CPU = Context(torch.device("cpu"))


def test_repeated_blocks_are_the_layers_of_one_class():
    models = tiny_models()
    assert [type(b) for b in repeated_blocks(models["transformer"])] == [transformer.Block] * 2
    assert {type(b) for b in repeated_blocks(models["resnet"])} == {tvm.resnet.BasicBlock}
    assert len(repeated_blocks(models["resnet"])) == 8
    assert repeated_blocks(models["vae"]) == []  # single layers only: nothing to compile alone


def test_knobs_without_compile_or_blocks_are_na():
    vae = Context(torch.device("cpu"), model=tiny_models()["vae"])
    why = Compile().not_applicable(recipe("compile=default", "compile_scope=blocks"), vae)
    assert why.startswith("n/a: compile_scope=blocks") and "none" in why
    why = Compile().not_applicable(recipe("compile_autograd=true"), CPU)
    assert why.startswith("n/a: ") and "compile=off" in why


def eager_and_compiled(monkeypatch, *overrides) -> tuple[dict, dict]:
    """An eager trial and one with `overrides` (on the aot_eager backend: no C++ compiler), the
    process's global state as it was; the compiled one ok and at the eager one's loss."""
    monkeypatch.setattr(compile_technique, "BACKEND", "aot_eager")
    before = global_snapshot()
    eager = trial(*TWO_LAYERS)
    compiled = trial(*overrides, *TWO_LAYERS)
    assert global_snapshot() == before
    assert compiled["status"] == "ok", compiled["status"]
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    return eager, compiled


def test_regional_compile_compiles_the_blocks_only_and_keeps_the_loss(monkeypatch):
    _, regional = eager_and_compiled(monkeypatch, "compile=default", "compile_scope=blocks")
    assert regional["compile_s"] > 0 and regional["recompiles"] == 0
    assert regional["compile_scope"] == "blocks"
    model = tiny_models()["transformer"]
    r = recipe("compile=default", "compile_scope=blocks", *TWO_LAYERS)
    try:
        out = Compile().prepare_model(model, r, Context(torch.device("cpu")))
    finally:
        torch.compiler.set_stance("default")  # prepare_model starts with the eager steps
    assert out is model  # compiled in place, not wrapped
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert getattr(model, "_compiled_call_impl", None) is None


def test_compiled_autograd_captures_the_backward(monkeypatch):
    eager, got = eager_and_compiled(monkeypatch, "compile=default", "compile_autograd=true")
    assert got["compiled_autograd_captures"] > 0
    assert math.isnan(eager["compiled_autograd_captures"])
    assert not torch._dynamo.compiled_autograd.compiled_autograd_enabled  # left as found


def test_the_experiment_file_sets_each_variant_and_runs_alone():
    from conftest import TINY, compose_cfg
    from speedbench.config import build_plan, suite

    plan = build_plan(compose_cfg(*TINY, experiment="compile_regional"), "compile_regional")
    got = {n: (r.compile, r.compile_scope, r.compile_autograd) for n, r in plan.variants.items()}
    assert got == {"eager": ("off", "model", False), "whole": ("default", "model", False),
                   "regional": ("default", "blocks", False),
                   "compiled_autograd": ("default", "model", True)}
    tips = compose_cfg(*TINY, experiment="tips")
    assert "compile_regional" not in suite.members(tips, "tips")
    vae = Context(torch.device("cpu"), model=tiny_models()["vae"])
    assert Compile().not_applicable(plan.variants["regional"], vae).startswith("n/a: ")


def test_max_autotunes_tables_go_to_the_runs_log_not_the_console(tmp_path, capfd):
    """Inductor's max-autotune writes its AUTOTUNE tables with sys.stderr.write from
    select_algorithm.py: in a run they go to <run dir>/autotune.log (Technique.logs), named in
    one line at the run's end, and the console keeps every other line."""
    import sys

    from torch._inductor import select_algorithm

    from speedbench import techniques

    with techniques.logs_into(tmp_path):
        log = techniques.base.log_path(compile_technique.AUTOTUNE_LOG)
        assert log == tmp_path / "autotune.log"
        with compile_technique.autotune_tables_to(log):
            select_algorithm.sys.stderr.write("AUTOTUNE mm(4x8, 8x16)\n")  # as Inductor does
            sys.stderr.write("a line of speedbench's own\n")
        assert select_algorithm.sys is sys  # restored
    assert techniques.base.log_path(compile_technique.AUTOTUNE_LOG) is None  # outside a run
    err = capfd.readouterr().err
    assert "AUTOTUNE" not in err and "a line of speedbench's own" in err
    assert log.read_text() == "AUTOTUNE mm(4x8, 8x16)\n"
    [line] = techniques.log_lines(tmp_path)
    assert line.endswith(f": {log}") and "AUTOTUNE tables" in line and len(line) < 100 + len(
        str(log))
    log.write_text("")
    assert techniques.log_lines(tmp_path) == []  # nothing written: no line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_max_autotune_compile_on_cuda_writes_its_tables_to_the_log(tmp_path, capfd):
    """On a GPU Inductor autotunes a matrix product against its Triton templates and prints
    the AUTOTUNE table; compiled inside autotune_tables_to, it lands in the log. (On this
    project's 2-core CPU a small model autotuned nothing: no table to route.)"""
    log = tmp_path / "autotune.log"
    model = torch.nn.Linear(512, 512).cuda()
    compiled = torch.compile(model, mode="max-autotune")
    with compile_technique.autotune_tables_to(log):
        compiled(torch.randn(256, 512, device="cuda")).sum().backward()
        torch.cuda.synchronize()
    assert "AUTOTUNE" in log.read_text()
    assert "AUTOTUNE" not in capfd.readouterr().err
