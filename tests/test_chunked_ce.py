"""Chunked cross-entropy: the same loss and gradients as the whole loss, with at most one
slice's logits saved for backward, and the B x T x V forecast of the logits' memory."""
from __future__ import annotations

import pytest
import torch

from speedbench.models.transformer import TransformerLM
from speedbench.techniques import Context
from speedbench.techniques.chunked_ce import ChunkedCE, logits_mb

VOCAB, SEQ, BATCH = 512, 16, 4


def _run(chunks: int):
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=VOCAB, seq_len=SEQ, dim=16, layers=1, heads=2).train()
    recipe = type("R", (), {"loss_chunks": chunks})()
    ChunkedCE().prepare_model(model, recipe, Context(torch.device("cpu"), model=model))
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved


@pytest.mark.parametrize("chunks", [4, 16])
def test_chunks_give_the_whole_loss_and_gradients(chunks):
    whole, grads, _ = _run(1)
    chunked, chunked_grads, _ = _run(chunks)
    assert torch.allclose(whole, chunked, atol=1e-5)
    for a, b in zip(grads, chunked_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_no_whole_logits_are_saved_for_backward():
    logits = BATCH * SEQ * VOCAB
    _, _, whole = _run(1)
    _, _, chunked = _run(4)
    assert max(whole) >= logits  # the whole loss keeps the B x T x V logits
    assert max(chunked) < logits  # the chunks keep none of that size


def test_the_memory_forecast_is_b_t_v_fp32():
    model = TransformerLM(vocab_size=VOCAB, seq_len=SEQ, dim=16, layers=1, heads=2)
    assert logits_mb(model, BATCH) == BATCH * SEQ * VOCAB * 4 / 2 ** 20


def test_a_model_without_the_switch_is_na():
    recipe = type("R", (), {"loss_chunks": 4})()
    why = ChunkedCE().not_applicable(recipe, Context(torch.device("cpu"),
                                                     model=torch.nn.Linear(2, 2)))
    assert why.startswith("n/a: chunked cross-entropy")
