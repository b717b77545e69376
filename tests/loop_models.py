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
