"""Data sets that cost real CPU work per sample, generated locally and deterministically.

- images: a pool of synthetic pictures stored as encoded JPEG bytes (larger than the training
  size, as photos are); every sample is decoded, randomly cropped, flipped and normalised, so
  DataLoader workers have something to do. Each class has its own colour and stripe pattern,
  so the loss falls.
- tokens: sequences from a fixed sparse Markov chain (each token has a few likely successors),
  so a language model can learn it.
- real data: an ImageFolder directory, or a plain text file read as bytes (vocabulary 256).

Augmentation is seeded per sample: sample i's crop and flip come from a generator seeded from
(the data set's seed, i), never from the global RNG, so the same sample gets the same pixels
whatever the number of DataLoader workers and whichever worker loads it.
"""
from __future__ import annotations

import io
import math
import random
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from speedbench.errors import ConfigError

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


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


class JpegImages(Dataset):
    """`length` samples drawn from a pool of JPEG-encoded pictures, decoded per sample; item i
    is deterministic in (seed, i)."""

    def __init__(self, length: int, image_size: int, num_classes: int, stored_size: Optional[int] = None,
                 pool: int = 256, seed: int = 0, quality: int = 90):
        self.length, self.image_size, self.seed = length, image_size, seed
        self.stored_size = stored_size or 2 * image_size
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (min(pool, length),), generator=gen)
        self.jpegs = [encode_jpeg(synthetic_picture(int(c), num_classes, self.stored_size, gen), quality)
                      for c in self.labels]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        k = index % len(self.jpegs)
        img = decode_jpeg(self.jpegs[k])  # uint8 CHW
        return augment(img, self.image_size, sample_generator(self.seed, index)), self.labels[k]


def encode_jpeg(img: torch.Tensor, quality: int) -> bytes:
    """uint8 CHW → JPEG bytes (Pillow, as photo pipelines use)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).contiguous().numpy()).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def decode_jpeg(data: bytes) -> torch.Tensor:
    """JPEG bytes → uint8 CHW."""
    from PIL import Image

    return pil_to_tensor(Image.open(io.BytesIO(data)))


def pil_to_tensor(img) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


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

    def __init__(self, folder, image_size: int, seed: int = 0):
        self.folder, self.image_size, self.seed = folder, image_size, seed
        self.classes = folder.classes

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int):
        path, label = self.folder.samples[index]
        img = pil_to_tensor(self.folder.loader(path))
        return augment(img, self.image_size, sample_generator(self.seed, index)), label


def image_folder(path: str, image_size: int, num_classes: int, seed: int = 0) -> Dataset:
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(path)
    except FileNotFoundError as exc:  # no class folder, or no image in any
        raise ConfigError(f"data.path: '{path}' holds no images in class folders "
                          f"({str(exc).splitlines()[0]})") from None
    if len(folder.classes) > num_classes:
        raise ConfigError(f"data.path: '{path}' has {len(folder.classes)} classes but the model is "
                          f"built for {num_classes}; set the model's num_classes")
    return SeededImageFolder(folder, image_size, seed)


def build_dataset(dataset: dict, length: int, path: Optional[str] = None, seed: int = 0) -> Dataset:
    """The data set a model's `dataset` spec asks for (synthetic unless `path` is given)."""
    kind = dataset["kind"]
    if kind == "images":
        if path:
            return image_folder(path, dataset["image_size"], dataset["num_classes"], seed=seed)
        return JpegImages(length, dataset["image_size"], dataset["num_classes"],
                          stored_size=dataset.get("stored_size"), seed=seed)
    if path:
        if dataset["vocab_size"] < 256:
            raise ConfigError(f"data.path: a text file needs vocab_size >= 256, the model has "
                              f"{dataset['vocab_size']}")
        return TextBytes(path, dataset["seq_len"])
    return MarkovTokens(length, dataset["seq_len"], dataset["vocab_size"], seed=seed)


def build_loader(ds: Dataset, batch_size: int, options: Optional[dict], seed: int,
                 sampler=None) -> DataLoader:
    """A DataLoader with the techniques' options (`techniques.loader_options(recipe, ctx)`:
    num_workers, pin_memory, ...); shuffled from `seed` unless a sampler shards the data."""
    loader = DataLoader(ds, batch_size=batch_size, shuffle=sampler is None, sampler=sampler,
                        drop_last=True, generator=torch.Generator().manual_seed(seed),
                        **(options or {}))
    if len(loader) == 0:  # drop_last and too few samples: a step would wait forever for a batch
        raise ValueError(f"the data set yields no full batch: {len(sampler or ds)} samples, "
                         f"batches of {batch_size}")
    return loader
