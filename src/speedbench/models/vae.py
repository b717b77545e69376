"""Convolutional VAE; forward(x, y) returns the loss (reconstruction + KL).

The reparameterisation noise is sampled every step through `new_tensor`, so the
tensor_creation knob decides whether it is born on the host or on the device.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from speedbench.models.per_step import PerStepTensors


class ConvVAE(nn.Module, PerStepTensors):
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

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        mu, logvar = self.to_stats(self.encoder(x)).chunk(2, dim=1)
        eps = self.new_tensor(torch.randn, mu.shape, device=mu.device, dtype=mu.dtype)
        z = mu + eps * torch.exp(0.5 * logvar)
        recon = self.decoder(self.from_latent(z))
        rec = F.mse_loss(recon.float(), x.float())
        kl = -0.5 * torch.mean(1 + logvar.float() - mu.float() ** 2 - logvar.float().exp())
        return rec + self.kl_weight * kl


def build(image_size: int = 64, width: int = 32, latent: int = 64) -> nn.Module:
    return ConvVAE(image_size=image_size, width=width, latent=latent)
