"""The data sets: deterministic, real per-sample work, and the real-data paths."""
from __future__ import annotations

import torch

from speedbench.measure.data import JpegImages, MarkovTokens, TextBytes, build_dataset, image_folder


def test_jpeg_images_are_decoded_and_augmented_per_sample():
    ds = JpegImages(length=50, image_size=32, num_classes=4, pool=8, seed=3)
    assert all(isinstance(j, bytes) and j[:2] == b"\xff\xd8" for j in ds.jpegs)  # JPEG magic
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < 4
    assert len(ds) == 50 and torch.equal(ds[8][1], ds[0][1])  # the pool repeats
    again = JpegImages(length=50, image_size=32, num_classes=4, pool=8, seed=3)
    assert again.jpegs == ds.jpegs and torch.equal(again.labels, ds.labels)


def test_markov_tokens_are_deterministic_and_shifted():
    ds = MarkovTokens(length=10, seq_len=20, vocab_size=50, seed=1)
    x, y = ds[4]
    assert x.shape == y.shape == (20,)
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(ds[4][0], MarkovTokens(10, 20, 50, seed=1)[4][0])
    # each token has at most `branch` successors: learnable structure
    succ = {}
    for i in range(10):
        a, b = ds[i]
        for s, t in zip(a.tolist(), b.tolist()):
            succ.setdefault(s, set()).add(t)
    assert max(len(v) for v in succ.values()) <= 4


def test_real_data_paths(tmp_path):
    from PIL import Image

    for cls in ("cats", "dogs"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 30), (i * 90, 20, 200)).save(tmp_path / "imgs" / cls / f"{i}.jpg")
    ds = image_folder(str(tmp_path / "imgs"), image_size=16, num_classes=10)
    x, y = ds[3]
    assert x.shape == (3, 16, 16) and int(y) == 1
    (tmp_path / "t.txt").write_text("abcdefgh" * 10)
    text = build_dataset({"kind": "tokens", "seq_len": 8, "vocab_size": 256}, 0, str(tmp_path / "t.txt"))
    assert isinstance(text, TextBytes) and len(text) == 9
    x, y = text[0]
    assert bytes(x.tolist()) == b"abcdefgh" and bytes(y.tolist()) == b"bcdefgha"
