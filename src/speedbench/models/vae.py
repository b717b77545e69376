"""Convolutional VAE; forward(x, y) returns the loss (reconstruction + KL).

The reparameterisation noise is sampled every step through `new_tensor`, so the
tensor_creation knob decides whether it is born on the host or on the device.
`checkpoint_blocks = True` (set by the checkpointing technique) recomputes the activations of
the encoder's and the decoder's stages in the backward pass instead of storing them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

from speedbench.models.per_step import PerStepTensors


# Segments per Sequential when checkpointing: one per (conv, activation) stage. The last
# segment of each runs without checkpointing (backward needs its output at once anyway).
STAGES = 4


class ConvVAE(nn.Module, PerStepTensors):
    checkpoint_blocks: bool = False  # recompute each stage's activations in backward

    def __init__(self, image_size: int = 64, width: int = 32, latent: int = 64, kl_weight: float = 1e-3):
        super().__init__()
        if image_size % 16:
            raise ValueError(f"image_size: {image_size} must be a multiple of 16 for the VAE")
        w, self.side = width, image_size // 16
        self.kl_weight = kl_weight
        self.encoder = nn.Sequential(
            nn.Conv2d(3, w, 4, 2, 1), nn.SiLU(),
            nn.Conv2d(w, 2 * w, 4, 2, 1), nn.SiLU(),
            nn.Conv2d(2 * w, 4 * w, 4, 2, 1), nn.SiLU(),
            nn.Conv2d(4 * w, 8 * w, 4, 2, 1), nn.SiLU(),
            nn.Flatten(),
        )
        feat = 8 * w * self.side * self.side
        self.to_stats = nn.Linear(feat, 2 * latent)
        self.from_latent = nn.Linear(latent, feat)
        self.decoder = nn.Sequential(
            nn.Unflatten(1, (8 * w, self.side, self.side)),
            nn.ConvTranspose2d(8 * w, 4 * w, 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(4 * w, 2 * w, 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(2 * w, w, 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(w, 3, 4, 2, 1),
        )

    def _run(self, stages: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
            return checkpoint_sequential(stages, STAGES, x, use_reentrant=False)
        return stages(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        mu, logvar = self.to_stats(self._run(self.encoder, x)).chunk(2, dim=1)
        eps = self.new_tensor(torch.randn, mu.shape, device=mu.device, dtype=mu.dtype)
        z = mu + eps * torch.exp(0.5 * logvar)
        recon = self._run(self.decoder, self.from_latent(z))
        rec = F.mse_loss(recon.float(), x.float())
        kl = -0.5 * torch.mean(1 + logvar.float() - mu.float() ** 2 - logvar.float().exp())
        return rec + self.kl_weight * kl


def build(image_size: int = 64, width: int = 32, latent: int = 64) -> nn.Module:
    return ConvVAE(image_size=image_size, width=width, latent=latent)
