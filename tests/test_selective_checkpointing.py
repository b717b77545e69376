"""Selective (op-level) activation checkpointing: backward recomputes the cheap ops of each
block and none of its matrix products, where per-block checkpointing recomputes them all."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speedbench.models.resnet import build as build_resnet
from speedbench.models.transformer import TransformerLM
from speedbench.techniques import Context
from speedbench.techniques.checkpointing import Checkpointing

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> Counter:
    """The aten ops the backward pass of one transformer step runs, under `checkpointing=mode`."""
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=32, seq_len=8, dim=16, layers=2, heads=2).train()
    recipe = type("R", (), {"checkpointing": mode})()
    model = Checkpointing().prepare_model(model, recipe, Context(torch.device("cpu")))
    x = torch.randint(0, 32, (2, 8))
    loss = model(x, x)
    with OpCounter() as seen:
        loss.backward()
    return seen.ops


def matmuls(ops: Counter) -> int:
    return sum(n for op, n in ops.items() if op in MATMULS)


def test_selective_recomputes_the_cheap_ops_but_no_matrix_product():
    off, blocks, selective = (backward_ops(m) for m in ("off", "blocks", "selective"))
    assert matmuls(blocks) > matmuls(off)  # the blocks' forward runs again
    assert matmuls(selective) == matmuls(off)  # the products' outputs were kept
    assert selective["aten.gelu.default"] > off["aten.gelu.default"]  # recomputed
    assert blocks["aten.gelu.default"] == selective["aten.gelu.default"]


def test_selective_gives_the_same_gradients():
    grads = {}
    for mode in ("off", "selective"):
        torch.manual_seed(0)
        model = TransformerLM(vocab_size=32, seq_len=8, dim=16, layers=2, heads=2).train()
        recipe = type("R", (), {"checkpointing": mode})()
        Checkpointing().prepare_model(model, recipe, Context(torch.device("cpu")))
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        model(x, x).backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["off"], grads["selective"]):
        assert torch.allclose(a, b, atol=1e-6)


def test_selective_runs_on_the_resnet_too():
    model = build_resnet("resnet18", 10).train()
    recipe = type("R", (), {"checkpointing": "selective"})()
    Checkpointing().prepare_model(model, recipe, Context(torch.device("cpu")))
    out = model(torch.randn(2, 3, 32, 32))
    with OpCounter() as seen:
        out.sum().backward()
    assert seen.ops["aten.convolution.default"] == 0  # no convolution recomputed
    assert seen.ops["aten.relu.default"] + seen.ops["aten.relu_.default"] > 0


@pytest.mark.parametrize("mode", ["selective"])
def test_a_model_without_checkpoint_options_is_na(mode):
    class Own(torch.nn.Module):
        checkpoint_blocks = False

    recipe = type("R", (), {"checkpointing": mode})()
    why = Checkpointing().not_applicable(recipe, Context(torch.device("cpu"), model=Own()))
    assert why.startswith("n/a: selective checkpointing") and "checkpoint_options" in why


def test_the_vae_is_na_for_selective():
    """Its stages go through checkpoint_sequential, which takes no context_fn (a trial of it
    failed with "Unexpected keyword arguments: context_fn"): it has no checkpoint_options."""
    from speedbench.models.vae import build as build_vae

    recipe = type("R", (), {"checkpointing": "selective"})()
    why = Checkpointing().not_applicable(recipe, Context(torch.device("cpu"),
                                                         model=build_vae(32, 8, 8)))
    assert why.startswith("n/a: selective checkpointing")
