"""Data sets that cost real CPU work per sample, generated locally and deterministically.

- images: a pool of synthetic pictures stored as encoded JPEG bytes (larger than the training
  size, as photos are); every sample is decoded, randomly cropped, flipped and normalised, so
  DataLoader workers have something to do. Each class has its own colour and stripe pattern,
  so the loss falls.
- tokens: sequences from a fixed sparse Markov chain (each token has a few likely successors),
  so a language model can learn it; with `dataset.documents` (a median length in tokens),
  documents of varying length (log-normal, cut to 2..seq_len), each batch padded to its longest.
- tabular: feature vectors with a class (or regression targets) from a fixed random map.
- the tasks beyond the default (`dataset.task`): one label per token sequence, a label per
  token, masked tokens to fill in (tokens); regression targets (images, tabular); 1-channel
  pictures (images' `channels`). Each wraps the data above, so held_out.py sets a random share
  of it aside as it does with a user's own data.
- real data: an ImageFolder directory, or a plain text file read as bytes (vocabulary 256);
  a user's own Dataset or DataLoader factory (own_data.py).

Augmentation is seeded per sample: sample i's crop and flip come from a generator seeded from
(the data set's seed, i), never from the global RNG, so the same sample gets the same pixels
whatever the number of DataLoader workers and whichever worker loads it.
"""
from __future__ import annotations

import io
import math
import random
import time
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from speedbench import distributed
from speedbench.errors import ConfigError

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
GRAY_MEAN, GRAY_STD = 0.449, 0.226  # of 1-channel pictures, ImageNet's in grey
MASK_SHARE = 0.15  # of the tokens masked_lm hides (at least one per sequence)
IGNORE = -100  # a label cross_entropy skips (masked_lm's unmasked tokens)


def synthetic_picture(label: int, num_classes: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """A uint8 CHW picture: class-coloured stripes at a class-specific angle, plus noise."""
    hue = 2 * math.pi * label / num_classes
    colour = torch.tensor([math.cos(hue), math.cos(hue + 2.1), math.cos(hue + 4.2)]) * 0.4 + 0.5
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    angle = math.pi * label / num_classes
    freq = 3 + (label % 5) * 2
    phase = torch.rand(1, generator=gen).item() * 2 * math.pi
    stripes = torch.sin(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle)) + phase)
    img = colour.view(3, 1, 1) * (0.6 + 0.4 * stripes) + 0.15 * torch.randn(3, size, size, generator=gen)
    return (img.clamp(0, 1) * 255).to(torch.uint8)


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The generator of sample `index`'s random augmentation: the same for the same (seed,
    index), in any process."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class DataOutOfTime(Exception):
    """Building a data set ran past the seconds the run's budget left it (build_dataset's
    `left_s`); its message says how far it got."""


class JpegImages(Dataset):
    """`length` samples drawn from a pool of JPEG-encoded pictures, decoded per sample; item i
    is deterministic in (seed, i)."""

    def __init__(self, length: int, image_size: int, num_classes: int, stored_size: Optional[int] = None,
                 pool: int = 256, seed: int = 0, quality: int = 90, channels: int = 3,
                 left_s: Optional[float] = None):
        self.length, self.image_size, self.seed = length, image_size, seed
        self.stored_size, self.channels = stored_size or 2 * image_size, channels
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (min(pool, length),), generator=gen)
        started, self.jpegs = time.perf_counter(), []
        for c in self.labels:  # the pool: the costly part (52 s for the ResNet's on a loaded CPU)
            if left_s is not None and time.perf_counter() - started > left_s:
                raise DataOutOfTime(f"building its data ran past what bench.time_budget_s left "
                                    f"it ({left_s:.3g} s) after {len(self.jpegs)} of "
                                    f"{len(self.labels)} pictures")
            self.jpegs.append(encode_jpeg(synthetic_picture(int(c), num_classes,
                                                            self.stored_size, gen),
                                          quality, channels))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        k = index % len(self.jpegs)
        img = decode_jpeg(self.jpegs[k], self.channels)  # uint8 CHW
        return augment(img, self.image_size, sample_generator(self.seed, index)), self.labels[k]


def encode_jpeg(img: torch.Tensor, quality: int, channels: int = 3) -> bytes:
    """uint8 CHW (RGB) → JPEG bytes (Pillow, as photo pipelines use), in grey for 1 channel."""
    from PIL import Image

    buf = io.BytesIO()
    pic = Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())
    (pic.convert("L") if channels == 1 else pic).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def decode_jpeg(data: bytes, channels: int = 3) -> torch.Tensor:
    """JPEG bytes → uint8 CHW."""
    from PIL import Image

    return pil_to_tensor(Image.open(io.BytesIO(data)), channels)


def pil_to_tensor(img, channels: int = 3) -> torch.Tensor:
    """A Pillow picture → uint8 CHW, RGB (3 channels) or grey (1)."""
    import numpy as np

    array = np.array(img.convert("L" if channels == 1 else "RGB"))
    if channels == 1:
        return torch.from_numpy(array).unsqueeze(0).contiguous()
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def augment(img: torch.Tensor, size: int, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Random crop (scale 0.35-1) resized to `size`, random flip, normalise: float CHW. The
    random draws come from `gen` (None: the global RNG)."""
    import torchvision.transforms.v2.functional as TF

    _, h, w = img.shape
    scale = 0.35 + 0.65 * torch.rand(1, generator=gen).item()
    ch, cw = max(1, int(h * math.sqrt(scale))), max(1, int(w * math.sqrt(scale)))
    top = int(torch.randint(0, h - ch + 1, (1,), generator=gen))
    left = int(torch.randint(0, w - cw + 1, (1,), generator=gen))
    img = TF.resized_crop(img, top, left, ch, cw, [size, size], antialias=True)
    if torch.rand(1, generator=gen).item() < 0.5:
        img = img.flip(-1)
    if img.shape[0] == 1:
        return (img.float() / 255 - GRAY_MEAN) / GRAY_STD
    return (img.float() / 255 - MEAN) / STD


class MarkovTokens(Dataset):
    """Token sequences from a fixed sparse Markov chain; item i is deterministic in (seed, i)."""

    def __init__(self, length: int, seq_len: int, vocab_size: int, branch: int = 4, seed: int = 0):
        self.length, self.seq_len, self.seed, self.vocab_size = length, seq_len, seed, vocab_size
        gen = torch.Generator().manual_seed(seed)
        # Plain lists: the walk is sequential, and list indexing beats tensor indexing here.
        self.successors = torch.randint(0, vocab_size, (vocab_size, branch), generator=gen).tolist()
        weights = torch.softmax(torch.randn(vocab_size, branch, generator=gen) * 2, dim=1)
        self.cum_weights = weights.cumsum(1).tolist()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        rng = random.Random(self.seed * 1_000_003 + index)
        tok = rng.randrange(self.vocab_size)
        seq = [tok]
        for _ in range(self.seq_len):
            tok = self.successors[tok][rng.choices(range(len(self.successors[tok])),
                                                   cum_weights=self.cum_weights[tok])[0]]
            seq.append(tok)
        seq = torch.tensor(seq)
        return seq[:-1], seq[1:]


DOC_SIGMA = 0.8  # of the log document length: web text's lengths spread over an order of size


def pad_to_longest(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length (x, y) token documents as one batch padded to its longest: x with
    token 0 after each document's end (the causal mask keeps it from the document), y with
    IGNORE there, so the padded positions cost compute but no loss."""
    longest = max(len(x) for x, _ in items)
    xs = torch.zeros(len(items), longest, dtype=torch.long)
    ys = torch.full((len(items), longest), IGNORE, dtype=torch.long)
    for row, (x, y) in enumerate(items):
        xs[row, :len(x)], ys[row, :len(y)] = x, y
    return xs, ys


class Documents(MarkovTokens):
    """The chain's sequences cut into documents of varying length, as real text comes: item i's
    length is drawn from (seed, i), log-normal around `median` tokens, cut to 2..seq_len.
    Batches are padded to their longest (pad_to_longest, its collate_fn), so the padding costs
    what it costs in real training."""

    def __init__(self, length: int, seq_len: int, vocab_size: int, median: int, seed: int = 0):
        super().__init__(length, seq_len, vocab_size, seed=seed)
        self.median = median
        self.loader_functions = {"collate_fn": pad_to_longest}

    def doc_length(self, index: int) -> int:
        rng = random.Random(-(self.seed * 1_000_003 + index) - 1)  # not the tokens' stream
        drawn = round(rng.lognormvariate(math.log(self.median), DOC_SIGMA))
        return min(self.seq_len, max(2, drawn))

    def __getitem__(self, index: int):
        x, y = super().__getitem__(index)
        n = self.doc_length(index)
        return x[:n], y[:n]


class TextBytes(Dataset):
    """A text file as bytes, cut into windows of seq_len + 1."""

    def __init__(self, path: str, seq_len: int):
        raw = Path(path).expanduser().read_bytes()
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.seq_len = seq_len
        if len(self.tokens) < seq_len + 1:
            raise ConfigError(f"data.path: '{path}' holds {len(raw)} bytes; a token model with "
                              f"seq_len {seq_len} needs at least {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int):
        s = index * self.seq_len
        chunk = self.tokens[s: s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class SeededImageFolder(Dataset):
    """A torchvision ImageFolder whose sample i is loaded by the folder's own loader and
    augmented from the generator of (seed, i)."""

    def __init__(self, folder, image_size: int, seed: int = 0, channels: int = 3):
        self.folder, self.image_size, self.seed = folder, image_size, seed
        self.classes, self.channels = folder.classes, channels

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int):
        path, label = self.folder.samples[index]
        img = pil_to_tensor(self.folder.loader(path), self.channels)
        return augment(img, self.image_size, sample_generator(self.seed, index)), label


def image_folder(path: str, image_size: int, num_classes: int, seed: int = 0,
                 channels: int = 3) -> Dataset:
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(path)
    except FileNotFoundError as exc:  # no class folder, or no image in any
        raise ConfigError(f"data.path: '{path}' holds no images in class folders "
                          f"({str(exc).splitlines()[0]})") from None
    if len(folder.classes) > num_classes:
        raise ConfigError(f"data.path: '{path}' has {len(folder.classes)} classes but the model is "
                          f"built for {num_classes}; set the model's num_classes")
    return SeededImageFolder(folder, image_size, seed, channels)


# A user's data set built to be checked before the run (trial.check_data, `keep`), handed to
# the next build of the same spec (the model's study), so that it is built once, not twice.
_KEPT: dict[str, Dataset] = {}


def build_dataset(dataset: dict, length: int, path: Optional[str] = None, seed: int = 0,
                  left_s: Optional[float] = None, keep: bool = False) -> Dataset:
    """The data set a model's `dataset` spec asks for: synthetic unless `path` is given, the
    user's own with a `_target_` (own_data.py: built once for its check and its study, `keep`);
    with its task's labels (`task`). `left_s`: the seconds the run's budget leaves it; the
    synthetic pictures' pool, the costly part, stops there (DataOutOfTime); the caller checks
    the others' time after them."""
    if "_target_" in dataset:
        from speedbench.measure.own_data import own_dataset

        key = repr(sorted(dict(dataset).items()))
        made = _KEPT.pop(key, None)
        if made is None:
            made = own_dataset(dataset)
        if keep:
            _KEPT[key] = made
        return made
    kind = dataset["kind"]
    if kind == "images":
        return _images(dataset, length, path, seed, left_s)
    if kind == "tabular":
        return Tabular(length, dataset["features"], dataset.get("num_classes"),
                       dataset.get("targets"), seed=seed)
    if path:
        if dataset["vocab_size"] < 256:
            raise ConfigError(f"data.path: a text file needs vocab_size >= 256, the model has "
                              f"{dataset['vocab_size']}")
        tokens = TextBytes(path, dataset["seq_len"])
    elif dataset.get("documents"):
        tokens = Documents(length, dataset["seq_len"], dataset["vocab_size"],
                           dataset["documents"], seed=seed)
    else:
        tokens = MarkovTokens(length, dataset["seq_len"], dataset["vocab_size"], seed=seed)
    task = dataset.get("task", "next_token")
    if task == "next_token":
        return tokens
    return TokenTask(tokens, task, dataset.get("num_classes"), dataset["vocab_size"], seed)


def _images(dataset: dict, length: int, path: Optional[str], seed: int,
            left_s: Optional[float] = None) -> Dataset:
    """Pictures (an ImageFolder, else synthetic JPEGs) in the model's channels, with a class or,
    for task regression, `targets` numbers per picture."""
    channels, classes = dataset.get("channels", 3), dataset.get("num_classes") or 10
    if path:
        pictures = image_folder(path, dataset["image_size"], classes, seed=seed,
                                channels=channels)
    else:
        pictures = JpegImages(length, dataset["image_size"], classes,
                              stored_size=dataset.get("stored_size"), seed=seed,
                              channels=channels, left_s=left_s)
    if dataset.get("task") == "regression":
        return Regression(pictures, classes, dataset["targets"], seed)
    return pictures if channels == 3 or path else Wrapped(pictures)


class Wrapped(Dataset):
    """Another data set's items as they are: not an instance of it, so that held_out.py sets a
    random share aside (its held-out pictures are made in 3 channels)."""

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        return self.inner[index]


class Regression(Wrapped):
    """Labelled items given regression targets: a fixed random vector of `targets` numbers per
    class (seeded), so that a model can learn them."""

    def __init__(self, inner: Dataset, classes: int, targets: int, seed: int = 0):
        super().__init__(inner)
        self.table = torch.randn(classes, targets, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, index: int):
        x, label = self.inner[index]
        return x, self.table[int(label)]


class Tabular(Dataset):
    """Rows of `features` standard normal numbers (item i from (seed, i)); y: the argmax of a
    fixed random linear map into `num_classes`, or (`targets` given) that map's values plus a
    little noise, a regression."""

    def __init__(self, length: int, features: int, num_classes: Optional[int] = None,
                 targets: Optional[int] = None, seed: int = 0):
        self.length, self.features, self.seed = length, features, seed
        self.regression = targets is not None
        out = targets if self.regression else num_classes
        self.weights = torch.randn(features, out, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        gen = sample_generator(self.seed, index)
        x = torch.randn(self.features, generator=gen)
        scores = x @ self.weights
        if self.regression:
            return x, scores + 0.1 * torch.randn(scores.shape, generator=gen)
        return x, scores.argmax()


class TokenTask(Wrapped):
    """Token sequences with the labels of a task other than the next token:
    sequence_classification: one class per sequence (the share of its tokens in the lower half
    of the vocabulary, in `num_classes` bins); token_classification: a class per token (the
    token modulo `num_classes`); masked_lm: MASK_SHARE of the tokens (one at least) replaced by
    the last token id, the labels those tokens and IGNORE elsewhere. Item i is deterministic in
    (seed, i)."""

    def __init__(self, inner: Dataset, task: str, num_classes: Optional[int], vocab_size: int,
                 seed: int = 0):
        super().__init__(inner)
        self.task, self.num_classes, self.vocab_size, self.seed = task, num_classes, vocab_size, seed

    def __getitem__(self, index: int):
        x, _ = self.inner[index]
        if self.task == "sequence_classification":
            low = (x < self.vocab_size // 2).float().mean().item()
            return x, torch.tensor(min(int(low * self.num_classes), self.num_classes - 1))
        if self.task == "token_classification":
            return x, x % self.num_classes
        rng = random.Random(self.seed * 1_000_003 + index)
        hidden = rng.sample(range(len(x)), max(1, round(MASK_SHARE * len(x))))
        y = torch.full_like(x, IGNORE)
        y[hidden] = x[hidden]
        x = x.clone()
        x[hidden] = self.vocab_size - 1
        return x, y


# From this many samples on, a data set's random order is drawn as it is read (LazyShuffle,
# held_out.sample) rather than permuted whole: a trial reads a few thousand samples, and the
# permutation of a lazy data set of 30 M items held 2.5 GB, charged to the trial's host_rss_mb.
LAZY_FROM = 1 << 20


def seeded_sample(length: int, n: int, seed: int) -> list[int]:
    """`n` distinct indices of range(length) drawn from `seed`, without listing the range."""
    return random.Random(seed).sample(range(length), n)


class LazyShuffle(Sampler):
    """A seeded random order of range(length), drawn as it is read (each epoch its own, from
    `generator`, as DataLoader's shuffle): memory for the samples read, not the data set.
    Under torchrun each of `ranks` ranks reads its own shard, as DistributedSampler with
    drop_last: every rank draws the same order (the same seed) and takes the positions `rank`,
    `rank + ranks`, ... of its first `length // ranks * ranks` distinct indices."""

    def __init__(self, length: int, generator: torch.Generator, rank: int = 0, ranks: int = 1):
        self.total, self.generator = length, generator
        self.rank, self.ranks = rank, ranks
        self.length = length // ranks  # this rank's share

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        rng = random.Random(int(torch.randint(1 << 62, (), generator=self.generator)))
        seen: set[int] = set()
        drawn = self.length * self.ranks  # every rank's share, the rest dropped
        while len(seen) < drawn:
            index = rng.randrange(self.total)
            if index not in seen:
                if len(seen) % self.ranks == self.rank:
                    yield index
                seen.add(index)


def rank_sampler(dataset: Dataset, env, seed: int) -> Optional[Sampler]:
    """This torchrun rank's shard of `dataset` (None on its own): DistributedSampler
    (distributed.sampler), or past LAZY_FROM samples a LazyShuffle of its share, which lists
    no index it does not read (DistributedSampler permutes every index on every rank)."""
    if env is None or len(dataset) <= LAZY_FROM:
        return distributed.sampler(dataset, env, seed)
    return LazyShuffle(len(dataset), torch.Generator().manual_seed(seed), env.rank,
                       env.world_size)


def build_loader(ds: Dataset, batch_size: int, options: Optional[dict], seed: int,
                 sampler=None) -> DataLoader:
    """A DataLoader with the techniques' options (`techniques.loader_options(recipe, ctx)`:
    num_workers, pin_memory, ...); shuffled from `seed` unless a sampler shards the data (past
    LAZY_FROM samples, in an order drawn as it is read). A user's DataLoader's collate_fn and
    worker_init_fn are kept (loader_functions), unless the techniques' options replace them."""
    if sampler is None and len(ds) > LAZY_FROM:
        sampler = LazyShuffle(len(ds), torch.Generator().manual_seed(seed))
    loader = DataLoader(ds, batch_size=batch_size, shuffle=sampler is None, sampler=sampler,
                        drop_last=True, generator=torch.Generator().manual_seed(seed),
                        **{**loader_functions(ds), **(options or {})})
    if len(loader) == 0:  # drop_last and too few samples: a step would wait forever for a batch
        raise ValueError(f"the data set yields no full batch: {len(sampler or ds)} samples, "
                         f"batches of {batch_size}")
    return loader


def loader_functions(ds: Dataset) -> dict:
    """The collate_fn and worker_init_fn of a user's DataLoader (own_data.LoaderData), found
    through the Subsets the held-out split wraps it in; {} for any other data set."""
    while isinstance(ds, Subset):
        ds = ds.dataset
    return dict(getattr(ds, "loader_functions", {}))
