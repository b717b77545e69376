"""A LightningModule for tests/test_loops.py (imports lightning: import it after
pytest.importorskip)."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


class LitNet(L.LightningModule):
    """A LightningModule as people write one: forward, a training_step that unpacks the batch,
    calls itself and logs, its own configure_optimizers. `calls` counts training_step."""

    calls = 0

    def __init__(self, features: int = 32, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        type(self).calls += 1
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BlobsData(L.LightningDataModule):
    """A DataModule as people write one: setup() makes the data set, train_dataloader() its
    DataLoader with a collate_fn of its own (`collated` counts its calls)."""

    collated = 0

    def __init__(self, n: int = 64, batch_size: int = 16):
        super().__init__()
        self.n, self.batch_size = n, batch_size
        self.train = None

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 4, (self.n,), generator=g)
        x = F.one_hot(y, 32).float() + torch.randn(self.n, 32, generator=g)
        self.train = torch.utils.data.TensorDataset(x, y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size,
                                           collate_fn=self.collate, shuffle=True)

    @classmethod
    def collate(cls, items):
        cls.collated += 1
        return torch.utils.data.default_collate(items)
