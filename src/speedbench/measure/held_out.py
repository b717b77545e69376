"""Held-out data and its loss: what the quality probe and the time-to-target stage evaluate.

- The synthetic tokens: sequences of the same Markov chain far beyond any training index (a
  fixed offset, whatever the training set's length), and the chain's entropy floor (the lowest
  loss any model can reach on them).
- The synthetic pictures: pictures made from another seed.
- A user's own data (`data.path`): a seeded random share set aside from training.

Evaluation is in eval mode, without autocast, untimed. A model with normalisation layers that
keep running statistics (BatchNorm) is first recalibrated: its running statistics are reset and
recomputed as the cumulative average (momentum None) over CALIBRATION_SAMPLES training samples
fixed per seed, with the model's weights as they are, BN in train mode and everything else in
eval mode, without gradients. After a few steps at momentum 0.1 the running statistics still
hold most of their initial (0, 1): an eval-mode loss would then measure them, not training.
Every variant is evaluated the same way, so identical numerics still give identical losses.

The quality probe trains on `probe_pool`: for the synthetic data, the first PROBE_POOL samples
by index (a view that does not depend on how long the rounds' data set is), so that the held-out
split, the training order (the loader's shuffle of that pool, from the seed) and the calibration
batch are fixed per seed, not a function of len(dataset).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, default_collate

from speedbench.measure.batches import samples_of, take, to_device
from speedbench.measure.data import LAZY_FROM, Documents, JpegImages, MarkovTokens, \
    build_dataset, loader_functions, seeded_sample
from speedbench.measure.train import compute_loss, user_model

EVAL_CHUNK = 64  # held-out samples per forward pass
HELD_OUT_INDEX = 1 << 40  # the synthetic tokens' held-out sequences start at this index
PROBE_POOL = 8192  # samples of synthetic data the quality probe's training order draws from
CALIBRATION_SAMPLES = 256  # training samples that recalibrate running statistics


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


def chance_loss(spec) -> float:
    """The loss (nats) of a uniform guess where the task has one: ln(classes) for a classifier
    trained with cross-entropy, ln(vocabulary) for next-token prediction on tokens; NaN
    otherwise (a VAE's reconstruction loss has no chance level)."""
    d = spec.dataset or {}
    if d.get("kind") == "tokens" and d.get("vocab_size"):
        return math.log(d["vocab_size"])
    if spec.loss == "cross_entropy" and d.get("num_classes"):
        return math.log(d["num_classes"])
    return math.nan


def held_out(spec, recipe, samples: int, n_eval: int):
    """(training data set, held-out batch (x, y), entropy floor or None) for one model."""
    train = build_dataset(spec.dataset, samples, recipe.data.path, seed=recipe.bench.seed)
    return split(train, spec, recipe.bench.seed, n_eval)


# per data set: every variant's probe and seed evaluates the same held-out batch. The values
# never hold the data set itself, or it would never be let go.
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached(train, key, make):
    """make() once per data set and key (made again for a data set that cannot be weakly
    referenced or hashed)."""
    try:
        made = _SPLITS.setdefault(train, {})
    except TypeError:  # a data set of the user's that cannot be weakly referenced or hashed
        made = {}
    if key not in made:
        made[key] = make()
    return made[key]


def split(train, spec, seed: int, n_eval: int):
    """(what to train on, held-out batch (x, y), entropy floor or None) for a built data set,
    made once per data set, model, seed and size (making a batch of pictures takes seconds)."""
    kept, xy, floor = _cached(train, (spec.name, seed, n_eval),
                              lambda: _held_out(train, spec, seed, n_eval))
    return (train if kept is None else Subset(train, kept)), xy, floor


def _held_out(train, spec, seed: int, n_eval: int):
    """(indices of `train` kept for training, or None for all; held-out (x, y); floor)."""
    if isinstance(train, MarkovTokens):  # the same chain, sequences never trained on
        items = [train[HELD_OUT_INDEX + i] for i in range(n_eval)]
        if isinstance(train, Documents):  # padded; the floor is for whole sequences
            return None, _collate(train)(items), None
        return None, default_collate(items), markov_floor(train)
    if isinstance(train, JpegImages):  # new pictures of the same classes
        d = spec.dataset
        pics = JpegImages(n_eval, d["image_size"], d["num_classes"], d.get("stored_size"),
                          pool=n_eval, seed=seed + 1_000_003)
        torch.manual_seed(seed)  # their crops: the same for every variant
        return None, default_collate([pics[i] for i in range(n_eval)]), None
    # a user's own data: a seeded random share set aside (past LAZY_FROM samples, drawn
    # without permuting them all)
    length = len(train)
    n = min(n_eval, max(1, length // 10))
    if length > LAZY_FROM:
        held = seeded_sample(length, n, seed)
        kept = _Kept(length, held)
    else:
        order = torch.randperm(length, generator=torch.Generator().manual_seed(seed)).tolist()
        held, kept = order[:n], order[n:]
    torch.manual_seed(seed)
    return kept, _collate(train)([train[i] for i in held]), None


class _Kept(Sequence):
    """range(length) less the `held` indices, in order, without listing it (a Subset's
    indices)."""

    def __init__(self, length: int, held: list[int]):
        self.length, self.held = length, sorted(held)

    def __len__(self) -> int:
        return self.length - len(self.held)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i) + (len(self) if i < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(i)
        for h in self.held:  # the i-th index not held out: past every held one at or below it
            if h > i:
                break
            i += 1
        return i


def _collate(ds):
    """How a batch of `ds` is made: its DataLoader's collate_fn where the user gave one
    (own_data.LoaderData: padding, dicts), else torch's default."""
    return loader_functions(ds).get("collate_fn") or default_collate


class _Prefix(Dataset):
    """The first `length` samples of a synthetic data set by index, whatever its own length
    (its samples are a function of the index alone)."""

    def __init__(self, data, length: int):
        self.data, self.length = data, length
        self.loader_functions = loader_functions(data)  # variable-length documents' padding

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.data[index]


def probe_pool(train, length: int = PROBE_POOL):
    """What the quality probe trains on: for the synthetic data, its first `length` samples by
    index, whatever len(train) is; a user's own data (already split) as it is."""
    if isinstance(train, (MarkovTokens, JpegImages)):
        return _Prefix(train, length)
    return train


def calibration(train, seed: int, n: int = CALIBRATION_SAMPLES):
    """The (x, y) batch of `n` training samples that recalibrates running statistics, drawn from
    `seed` among the first PROBE_POOL samples of synthetic data (all of a user's training
    share), made once per data set, seed and size."""
    base, index, size = train, list, len(train)
    if isinstance(train, _Prefix):
        base = train.data
    elif isinstance(train, Subset):  # a user's data less its held-out share
        base, index = train.dataset, (lambda order: [train.indices[i] for i in order])
    elif isinstance(train, (MarkovTokens, JpegImages)):
        size = PROBE_POOL

    def make():
        if size > LAZY_FROM:
            order = seeded_sample(size, min(n, size), seed)
        else:
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:n]
            order = order.tolist()
        return _collate(base)([base[int(i)] for i in index(order)])
    return _cached(base, ("calibration", seed, n, size), make)


def has_running_stats(model) -> bool:
    return any(_normalisers(model))


def _normalisers(model) -> list:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
            and m.track_running_stats]


def recalibrate(model, spec, xy, device) -> None:
    """Reset every running statistic of `model` and recompute it as the cumulative average over
    the batch `xy` (in EVAL_CHUNK pieces), without gradients; momentum restored after."""
    layers = _normalisers(model)
    if not layers:
        return
    momenta = [m.momentum for m in layers]
    model.eval()
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # the cumulative average of the batches' statistics
        m.train()
    try:
        with torch.no_grad():
            for i in range(0, samples_of(xy), EVAL_CHUNK):
                held_out_loss(model, spec, to_device(take(xy, i, i + EVAL_CHUNK), device))
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
            m.eval()


def evaluate(model, spec, xy, device, train=None, seed: int = 0) -> float:
    """The mean loss on the held-out batch, in eval mode, without autocast, untimed; a model
    with running statistics recalibrated first on calibration(train, seed) (when `train` is
    given)."""
    if train is not None and has_running_stats(model):
        recalibrate(model, spec, calibration(train, seed), device)
    n = samples_of(xy)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, EVAL_CHUNK):
            batch = to_device(take(xy, i, i + EVAL_CHUNK), device)
            total += float(held_out_loss(model, spec, batch)) * samples_of(batch)
    return total / n


LOSS_HOOK = "speedbench_loss"  # a model method (batch) -> loss: the user's own loss


def held_out_loss(model, spec, batch):
    """The loss of one held-out batch: the model's own `speedbench_loss(batch)` where it has
    one (a step hook's model), else the model config's `loss`."""
    own = getattr(user_model(model), LOSS_HOOK, None)
    if callable(own):
        return own(batch)
    x, y = batch
    return compute_loss(model, spec.loss, x, y)
