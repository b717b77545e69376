"""Sequence packing: the variable-length documents, the packing collate, the block-diagonal
attention it feeds the transformer, and the forecast from the baseline's padding share."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from speedbench.config import ConfigError, build_plan
from speedbench.config.models import check_dataset
from speedbench.measure import explain
from speedbench.measure.data import IGNORE, Documents, build_dataset, pad_to_longest
from speedbench.measure.held_out import split
from speedbench.measure.trial import dataset_length
from speedbench.models.transformer import TransformerLM
from speedbench.techniques import Bound, Context
from speedbench.techniques.packing import Packing, pack_documents, pack_rows

TINY_DOCS = ["model=transformer", "scale=small", "batch_size=8", "bench.warmup=1",
             "bench.steps=2", "bench.steady_tol=null",
             "models.transformer.small.vocab_size=32", "models.transformer.small.seq_len=16",
             "models.transformer.small.dim=16", "models.transformer.small.layers=1",
             "models.transformer.small.heads=2", "models.transformer.small.dataset.seq_len=16",
             "models.transformer.small.dataset.vocab_size=32",
             "++models.transformer.small.dataset.documents=4"]


def documents(n: int = 12, seq_len: int = 16) -> list:
    ds = Documents(1000, seq_len, 32, median=4, seed=3)
    return [ds[i] for i in range(n)]


def test_documents_vary_in_length_deterministically_and_pad_to_the_longest():
    ds = Documents(1000, 16, 32, median=4, seed=3)
    lengths = [len(ds[i][0]) for i in range(200)]
    assert min(lengths) >= 2 and max(lengths) <= 16 and len(set(lengths)) > 4
    assert [len(ds[i][0]) for i in range(200)] == lengths  # item i is a function of (seed, i)
    x, y = pad_to_longest([ds[i] for i in range(8)])
    longest = max(lengths[:8])
    assert x.shape == y.shape == (8, longest)
    for row in range(8):
        n = lengths[row]
        assert (y[row, n:] == IGNORE).all() and (y[row, :n] != IGNORE).all()


def test_the_dataset_spec_checks_documents_in_one_line():
    spec = {"kind": "tokens", "seq_len": 16, "vocab_size": 32, "documents": 4}
    assert check_dataset("t", spec)["documents"] == 4
    for bad in ({**spec, "documents": 1}, {**spec, "documents": "long"},
                {**spec, "task": "masked_lm"}):
        with pytest.raises(ConfigError, match="dataset.documents") as err:
            check_dataset("t", bad)
        assert "\n" not in str(err.value)
    assert isinstance(build_dataset(spec, 64), Documents)


def test_first_fit_decreasing_packs_every_document_once_within_the_row():
    lengths = [9, 3, 7, 2, 5, 16, 1, 8]
    rows = pack_rows(lengths, 16)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 16 for row in rows)
    assert len(rows) == 4  # 51 tokens: 4 rows of 16 at least, and FFD reaches it here


@pytest.mark.parametrize("reset", [False, True])
def test_the_collate_places_documents_ids_and_positions(reset):
    items = documents()
    (tokens, docs, positions), labels = pack_documents(items, 16, reset)
    assert tokens.shape == docs.shape == positions.shape == labels.shape
    assert tokens.shape[1] <= 16
    assert tokens.shape[0] < len(items)  # fewer rows than documents: that is the point
    for i, (x, y) in enumerate(items):
        where = docs == i
        assert int(where.sum()) == len(x)
        assert torch.equal(tokens[where], x) and torch.equal(labels[where], y)
        if reset:
            assert torch.equal(positions[where], torch.arange(len(x)))
    assert (labels[docs < 0] == IGNORE).all()


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(vocab_size=32, seq_len=16, dim=16, layers=1, heads=2).eval()


def test_packed_with_positions_reset_is_the_padded_loss_and_counts_documents():
    """Block-diagonal attention with positions restarting per document sees exactly what each
    padded document sees alone: the same loss over the same tokens. Positions running on across
    the row change it (the numerics `pack` changes)."""
    model, items = _model(), documents()
    padded = pad_to_longest(items)
    reset = pack_documents(items, 16, reset=True)
    running = pack_documents(items, 16, reset=False)
    with torch.no_grad():
        base = model(*padded)
        assert torch.allclose(model(*reset), base, atol=1e-5)
        assert not torch.allclose(model(*running), base, atol=1e-3)
    assert model.speedbench_samples(padded) == model.speedbench_samples(reset) == len(items)


def test_without_the_block_mask_documents_would_see_each_other():
    """The mask is what keeps packed documents apart: the same rows under a plain causal mask
    (one document per row) give another loss."""
    model, items = _model(), documents()
    (tokens, docs, positions), labels = pack_documents(items, 16, reset=True)
    with torch.no_grad():
        masked = model((tokens, docs, positions), labels)
        leaky = model((tokens, torch.zeros_like(docs), positions), labels)
    assert abs(float(masked - leaky)) > 1e-4  # the padded-equal check holds to 1e-5


def test_the_forecast_is_one_over_one_minus_the_baselines_padding_share():
    plan = build_plan(compose_cfg(*TINY_DOCS, "+experiment=packing"), "packing")
    spec, base = plan.models[0], plan.variants["pad"]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    profile = explain.profile_recipe(spec, base, Context(torch.device("cpu")), dataset, 3, 60)
    padded, total = profile.counters["padded_positions"]
    assert 0 < padded < total
    share = padded / total
    bound = Packing().bound(plan.variants["pack_reset"], base, profile, {})
    assert isinstance(bound, Bound) and bound.sound
    assert bound.speedup == pytest.approx(1 / (1 - share)) and bound.share == share
    assert Packing().bound(plan.variants["pack_reset"], plan.variants["pack"], profile, {}) \
        is None  # positions only: no padding removed


def test_held_out_documents_are_padded_for_every_variant():
    ds = Documents(1000, 16, 32, median=4, seed=0)
    spec = build_plan(compose_cfg(*TINY_DOCS), None).models[0]
    _, (x, y), floor = split(ds, spec, 0, 16)
    assert isinstance(x, torch.Tensor) and x.shape[0] == 16 and (y == IGNORE).any()
    assert floor is None  # the chain's floor is for whole sequences
