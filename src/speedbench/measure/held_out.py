"""Held-out data and its loss: what the quality probe and the time-to-target stage evaluate.

- The synthetic tokens: sequences of the same Markov chain beyond the training set, and the
  chain's entropy floor (the lowest loss any model can reach on them).
- The synthetic pictures: pictures made from another seed.
- A user's own data (`data.path`): a seeded random share set aside from training.

Evaluation is in eval mode, without autocast, untimed.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.utils.data import Subset, default_collate

from speedbench.measure.data import JpegImages, MarkovTokens, build_dataset
from speedbench.measure.train import compute_loss

EVAL_CHUNK = 64  # held-out samples per forward pass


def markov_floor(ds: MarkovTokens) -> float:
    """The lowest mean next-token loss (nats) any model can reach on `ds`'s sequences: the
    chain's conditional entropy at each position, averaged over the positions, starting from the
    uniform first token the data set draws. The chain is Markov, so the best prediction given the
    whole prefix is the current token's row."""
    n = ds.vocab_size
    p = np.zeros((n, n))
    for i in range(n):
        prev = 0.0
        for succ, cum in zip(ds.successors[i], ds.cum_weights[i]):
            p[i, succ] += cum - prev
            prev = cum
    logs = np.log(np.where(p > 0, p, 1.0))
    row_entropy = -(p * logs).sum(axis=1)
    dist, total = np.full(n, 1.0 / n), 0.0
    for _ in range(ds.seq_len):
        total += float(dist @ row_entropy)
        dist = dist @ p
    return total / ds.seq_len


def held_out(spec, recipe, samples: int, n_eval: int):
    """(training data set, held-out batch (x, y), entropy floor or None) for one model."""
    train = build_dataset(spec.dataset, samples, recipe.data.path, seed=recipe.bench.seed)
    return split(train, spec, recipe.bench.seed, n_eval)


# per data set: every variant's probe and seed evaluates the same held-out batch. The values
# never hold the data set itself, or it would never be let go.
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def split(train, spec, seed: int, n_eval: int):
    """(what to train on, held-out batch (x, y), entropy floor or None) for a built data set,
    made once per data set, model, seed and size (making a batch of pictures takes seconds)."""
    key = (spec.name, seed, n_eval)
    try:
        made = _SPLITS.setdefault(train, {})
    except TypeError:  # a data set of the user's that cannot be weakly referenced or hashed
        made = {}
    if key not in made:
        made[key] = _held_out(train, spec, seed, n_eval)
    kept, xy, floor = made[key]
    return (train if kept is None else Subset(train, kept)), xy, floor


def _held_out(train, spec, seed: int, n_eval: int):
    """(indices of `train` kept for training, or None for all; held-out (x, y); floor)."""
    if isinstance(train, MarkovTokens):  # the same chain, sequences never trained on
        items = [train[len(train) + i] for i in range(n_eval)]
        return None, default_collate(items), markov_floor(train)
    if isinstance(train, JpegImages):  # new pictures of the same classes
        d = spec.dataset
        pics = JpegImages(n_eval, d["image_size"], d["num_classes"], d.get("stored_size"),
                          pool=n_eval, seed=seed + 1_000_003)
        torch.manual_seed(seed)  # their crops: the same for every variant
        return None, default_collate([pics[i] for i in range(n_eval)]), None
    # a user's own data: a seeded random share set aside
    n = min(n_eval, max(1, len(train) // 10))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    torch.manual_seed(seed)
    return order[n:], default_collate([train[i] for i in order[:n]]), None


def evaluate(model, spec, xy, device) -> float:
    """The mean loss on the held-out batch, in eval mode, without autocast, untimed."""
    x, y = xy
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), EVAL_CHUNK):
            xb, yb = x[i:i + EVAL_CHUNK].to(device), y[i:i + EVAL_CHUNK].to(device)
            total += float(compute_loss(model, spec.loss, xb, yb)) * len(xb)
    return total / len(x)
