"""Models written the way people write them (Hugging Face style), given to speedbench via
_target_: they return a dict, a tuple or an output object, or take keyword inputs."""
from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelOutput(OrderedDict):
    """Like transformers.utils.ModelOutput: a dict whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TinyLM(nn.Module):
    """forward(input_ids, labels=None) -> {"loss": ..., "logits": ...} (or a ModelOutput, a
    namespace or a tuple, by `returns`)."""

    def __init__(self, vocab_size: int = 32, dim: int = 16, returns: str = "dict"):
        super().__init__()
        self.returns = returns
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.head(self.embed(input_ids))
        loss = None if labels is None else F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if self.returns == "tuple":
            return (loss, logits) if loss is not None else (logits,)
        if self.returns == "namespace":
            return SimpleNamespace(loss=loss, logits=logits)
        if self.returns == "output":
            return ModelOutput(loss=loss, logits=logits) if loss is not None else \
                ModelOutput(logits=logits)
        if self.returns == "string":
            return "not a tensor"
        return {"loss": loss, "logits": logits}


def build_lm(**kwargs) -> nn.Module:
    return TinyLM(**kwargs)


class SeqClassifier(nn.Module):
    """Token ids -> one class per sequence (mean of the embeddings, then a linear head)."""

    def __init__(self, vocab_size: int = 32, num_classes: int = 4, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(1))


def named_net(model_name: str = "tiny", num_classes: int = 10) -> nn.Module:
    """A builder with an argument named like speedbench's `model_name` (as timm's
    create_model has): it must reach it."""
    net = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
    net.built_as = model_name
    return net


# --- a user's own data ------------------------------------------------------------------------
class Shapes(torch.utils.data.Dataset):
    """In memory: 1-channel pictures of a square (label 0) or a disc (label 1) on noise."""

    def __init__(self, n: int = 64, size: int = 16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=gen)
        yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        c = size / 2
        disc = ((yy - c) ** 2 + (xx - c) ** 2 < (size / 4) ** 2).float()
        square = ((yy - c).abs() < size / 4).float() * ((xx - c).abs() < size / 4).float()
        noise = 0.3 * torch.randn(n, 1, size, size, generator=gen)
        self.x = torch.where(self.y.view(-1, 1, 1, 1) == 1, disc, square) + noise

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def marked_collate(items):
    """A collate of the user's own, seen in its batches: x's first value becomes 7."""
    x, y = torch.utils.data.default_collate(items)
    x = x.clone()
    x.view(-1)[0] = 7.0
    return x, y


def shapes_loader(n: int = 64, batch_size: int = 16) -> torch.utils.data.DataLoader:
    """A DataLoader factory with settings of its own, which speedbench's knobs replace."""
    return torch.utils.data.DataLoader(Shapes(n), batch_size=batch_size, num_workers=2,
                                       pin_memory=True, shuffle=True, collate_fn=marked_collate)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(4), torch.tensor(0))] * 8)


def stream_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Stream(), batch_size=4)


def bucketed_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Shapes(16), batch_sampler=[[0, 1], [2, 3, 4]])


def batches():
    """Batches from a generator: not a Dataset, not a DataLoader."""
    return (b for b in [(torch.zeros(2, 4), torch.zeros(2))])


def dict_items() -> list:
    return [{"x": torch.zeros(4), "y": 0}] * 8


def broken(n: int = 4):
    raise OSError(f"no file shapes-{n}.npz")


class Slow(nn.Module):
    """A linear classifier whose every forward sleeps 20 ms: costlier than fault_models.Tiny."""

    def __init__(self, num_classes: int = 10, **kwargs):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.net(x)


class Interrupts(Slow):
    """Its data and probes go through; building it for a timed trial is Ctrl-C, so the run
    stops at this model's first trial (its rounds come after a cheaper model's)."""

    def __init__(self, num_classes: int = 10, **kwargs):
        if any(frame.function == "measure_trial" for frame in inspect.stack()):
            raise KeyboardInterrupt
        super().__init__(num_classes)


# --- batches of other structures: two views, a dict, a string ----------------------------------
class TwoViews(torch.utils.data.Dataset):
    """Items ((view1, view2), y): two noisy views of a small 3-channel picture (user trial 5's
    siamese data, tiny)."""

    def __init__(self, n: int = 64, size: int = 8, classes: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.base = self.y.float().view(-1, 1, 1, 1) + 0.3 * torch.randn(n, 3, size, size,
                                                                          generator=g)
        self.noise = 0.1 * torch.randn(2, n, 3, size, size, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.base[i] + self.noise[0, i], self.base[i] + self.noise[1, i]), self.y[i]


class Siamese(nn.Module):
    """forward(views, y) with views a pair of picture batches: a contrastive loss plus an
    auxiliary classification loss, in a dict."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width),
                                     nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.proj = nn.Linear(width, width)
        self.cls = nn.Linear(width, classes)

    def forward(self, views, y):
        a, b = views
        ha, hb = self.encoder(a), self.encoder(b)
        za, zb = F.normalize(self.proj(ha), dim=1), F.normalize(self.proj(hb), dim=1)
        logits = (za @ zb.t() / 0.1).float()
        target = torch.arange(len(za), device=za.device)
        contrastive = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
        return {"loss": contrastive + 0.5 * F.cross_entropy(self.cls(ha).float(), y)}


class DictViews(TwoViews):
    """Items ({"a": view1, "b": {"b": view2}}, y): a nested dict."""

    def __getitem__(self, i):
        (a, b), y = super().__getitem__(i)
        return {"a": a, "more": {"b": b}}, y


class DictSiamese(Siamese):
    def forward(self, x, y):
        return super().forward((x["a"], x["more"]["b"]), y)


class PairCounted(Siamese):
    """Counts a sample as a pair of views: two per row."""

    def speedbench_samples(self, batch) -> int:
        (a, _), _ = batch
        return 2 * len(a)


class Captioned(TwoViews):
    """Items ((view, caption), y): a caption is a str, which no device takes."""

    def __getitem__(self, i):
        (a, _), y = super().__getitem__(i)
        return (a, f"picture {i}"), y


# --- models with their own training step (speedbench_step) --------------------------------------
CALLS: dict = {}  # what the hooks saw, by name (run_main runs in this process)


class HookedSiamese(Siamese):
    """Its own step: two views, two losses, clipping, a cosine schedule and an EMA of the
    weights; its own held-out loss (speedbench_loss)."""

    def speedbench_step(self, batch, sb):
        views, y = batch
        if "sched" not in sb.state:
            sb.state["sched"] = torch.optim.lr_scheduler.CosineAnnealingLR(sb.optimizer, 100)
            sb.state["ema"] = torch.optim.swa_utils.AveragedModel(
                self, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
        with sb.autocast():
            out = sb.model(views, y)
            CALLS.setdefault("autocast", []).append(  # a matrix product in 16 bits?
                (torch.ones(2, 2) @ torch.ones(2, 2)).dtype != torch.float32)
        sb.backward(out["loss"])
        if sb.step(clip_norm=1.0):
            sb.state["sched"].step()
            sb.state["ema"].update_parameters(self)
            CALLS["steps"] = CALLS.get("steps", 0) + 1
        return out["loss"]

    def speedbench_loss(self, batch):
        CALLS["held_out"] = CALLS.get("held_out", 0) + 1
        return self(*batch)["loss"]


class TinyGan(nn.Module):
    """A GAN's step: a discriminator's and a generator's optimizer, each stepped once."""

    def __init__(self, dim: int = 8, size: int = 8):
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(dim, 3 * size * size), nn.Tanh())
        self.disc = nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, 1))
        self.dim, self.size = dim, size

    def forward(self, real, y=None):  # the discriminator's and the generator's losses
        z = torch.randn(len(real), self.dim, device=real.device)
        fake = self.gen(z).view(len(real), 3, self.size, self.size)
        ones, zeros = torch.ones(len(real), 1, device=real.device), \
            torch.zeros(len(real), 1, device=real.device)
        bce = F.binary_cross_entropy_with_logits
        d_loss = bce(self.disc(real).float(), ones) + bce(self.disc(fake.detach()).float(), zeros)
        return d_loss, bce(self.disc(fake).float(), ones)

    def speedbench_step(self, batch, sb):
        (real, _), _ = batch
        if "g_opt" not in sb.state:
            sb.state["g_opt"] = sb.optimizer_like(self.gen.parameters(), lr=1e-3)
            sb.state["d_opt"] = sb.optimizer_like(self.disc.parameters(), lr=1e-3)
        with sb.autocast():
            d_loss, _ = sb.model(real)
        sb.backward(d_loss)
        sb.step(sb.state["d_opt"])
        with sb.autocast():
            _, g_loss = sb.model(real)
        sb.backward(g_loss)
        sb.step(sb.state["g_opt"])
        return d_loss + g_loss

    def speedbench_loss(self, batch):
        (real, _), _ = batch
        return sum(self(real))


class ForgetsAutocast(Siamese):
    def speedbench_step(self, batch, sb):
        loss = sb.model(*batch)["loss"]
        sb.backward(loss)
        sb.step()


class CallsItself(Siamese):
    def speedbench_step(self, batch, sb):
        with sb.autocast():
            loss = self(*batch)["loss"]
        sb.backward(loss)
        sb.step()


class NeverSteps(Siamese):
    def speedbench_step(self, batch, sb):
        with sb.autocast():
            loss = sb.model(*batch)["loss"]
        sb.backward(loss)
