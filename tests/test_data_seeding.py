"""Augmentation is seeded per sample index: the same sample gets the same pixels in any call,
in any DataLoader worker and with any number of them; different samples differ."""
from __future__ import annotations

import pytest
import torch

from speedbench.measure.data import JpegImages, build_loader, image_folder


@pytest.fixture(scope="module")
def images() -> JpegImages:
    return JpegImages(length=16, image_size=16, num_classes=4, pool=4, seed=5)


def test_the_same_index_gives_the_same_tensor_and_the_global_rng_is_not_used(images):
    torch.manual_seed(0)
    a, label_a = images[3]
    torch.manual_seed(1)  # another global RNG state: no effect on the sample
    b, label_b = images[3]
    assert torch.equal(a, b) and torch.equal(label_a, label_b)
    state = torch.get_rng_state()
    images[3]
    assert torch.equal(torch.get_rng_state(), state)


def test_different_indices_and_seeds_differ(images):
    # index 7 shows the same stored picture as 3 (pool of 4), with its own crop and flip
    assert torch.equal(images[7][1], images[3][1])
    assert not torch.equal(images[7][0], images[3][0])
    assert not torch.equal(images[0][0], images[1][0])
    other = JpegImages(length=16, image_size=16, num_classes=4, pool=4, seed=6)
    assert not torch.equal(other[3][0], images[3][0])


def _all_batches(ds, workers: int) -> list:
    loader = build_loader(ds, 4, {"num_workers": workers}, seed=11)
    return list(loader)


def test_the_batches_are_the_same_with_0_or_2_workers(images):
    serial, parallel = _all_batches(images, 0), _all_batches(images, 2)
    assert len(serial) == len(parallel) == 4
    for (x0, y0), (x2, y2) in zip(serial, parallel):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


def test_an_image_folder_is_seeded_per_index_too(tmp_path):
    from PIL import Image

    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(4):
            Image.new("RGB", (40, 30), (i * 60, 20, 200)).save(tmp_path / cls / f"{i}.jpg")
    ds = image_folder(str(tmp_path), image_size=16, num_classes=10, seed=2)
    torch.manual_seed(0)
    a = ds[5][0]
    torch.manual_seed(1)
    assert torch.equal(ds[5][0], a) and ds[5][1] == 1 and ds.classes == ["cats", "dogs"]
    serial, parallel = _all_batches(ds, 0), _all_batches(ds, 2)
    for (x0, y0), (x2, y2) in zip(serial, parallel):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
