"""How the running loss reaches the host: every step (.item(), .numpy()) or every K steps."""
from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from speedbench.techniques.base import (ActsOn, Bound, Context, Field, Finding, Technique,
                                        amdahl, percent, times)

PER_STEP = 0.5  # host reads per step from which it is "every step"
TIP = ("keep the running loss on the device (loss.detach()) and read it every K steps: "
       "each .item() or .cpu() makes the host wait for the device")


class LossMeter:
    """Keeps the running loss the way the `sync` key says.

    item: `loss.item()` every step (a host read, which waits for the device);
    numpy: `loss.detach().cpu().numpy()` every step (a copy to the host, which waits too);
    deferred: `loss.detach()` summed on the device, read on the host every `every` steps.
    `host_reads` counts the reads, so tests and diagnosis can see them.
    """

    def __init__(self, mode: str, every: int, device: torch.device):
        self.mode, self.every, self.device = mode, every, device
        self.reset()

    def reset(self) -> None:
        self.host_sum, self.count, self.host_reads = 0.0, 0, 0
        self.pending = torch.zeros((), device=self.device)
        self.pending_n = 0

    def add(self, loss: torch.Tensor) -> None:
        self.count += 1
        if self.mode == "item":
            self.host_sum += loss.item()
            self.host_reads += 1
        elif self.mode == "numpy":
            self.host_sum += float(loss.detach().float().cpu().numpy())
            self.host_reads += 1
        else:
            self.pending += loss.detach().float()
            self.pending_n += 1
            if self.pending_n >= self.every:
                self._drain()

    def _drain(self) -> None:
        if self.pending_n:
            self.host_sum += self.pending.item()
            self.host_reads += 1
            self.pending.zero_()
            self.pending_n = 0

    def mean(self) -> float:
        self._drain()
        return self.host_sum / self.count if self.count else math.nan


class Sync(Technique):
    name = "sync"
    card = """\
**What**: how the training loop reads the loss: `item` (`loss.item()` every step), `numpy`
(`loss.cpu().numpy()` every step) or `deferred` (`loss.detach()` summed on the device, read
every `sync_every` forward passes).
**Helps**: on GPUs, where every host read makes the host wait until the device has caught up
and so stops it queueing work ahead.
**Costs**: the printed loss is `sync_every` steps late; nothing on a CPU."""
    fields = (
        Field("sync", Literal["item", "numpy", "deferred"], "deferred",
              "how the loss reaches the host"),
        Field("sync_every", int, 10, "deferred: read the summed loss every K forward passes",
              low=1),
    )
    example = {"sync": "item"}
    acts_on = ActsOn()
    snippets = {"sync": {"deferred": (
        "no host read every step: accumulate the loss on the device", """\
running = torch.zeros((), device=device)        # before the loop
...
running += loss.detach()                        # instead of loss.item()
if step % 10 == 0:
    print(running.item() / 10); running.zero_()  # one host read per 10 steps""")}}

    def loss_meter(self, recipe, ctx: Context) -> LossMeter:
        return LossMeter(recipe.sync, recipe.sync_every, ctx.device)

    def bound(self, recipe, baseline, profile, peaks) -> Optional[Bound]:
        """Deferred reads can at most remove the host's wait for the device (the sync share);
        reading every step where the baseline defers cannot gain."""
        share = profile.share("host_sync")
        if recipe.sync == "deferred" and baseline.sync != "deferred":
            gain = amdahl(share)
            return Bound(gain, share, f"host-device sync is {percent(share)} of the step: "
                                      f"deferred reads cannot gain more than {times(gain)}")
        if baseline.sync == "deferred" and recipe.sync != "deferred":
            return Bound(1.0, share, f"sync={recipe.sync} reads the loss every step, the "
                                     "baseline every sync_every steps: it cannot gain")
        return None

    def diagnose(self, tp) -> list[Finding]:
        reads = tp.host_reads / tp.steps if tp.steps else 0.0
        if reads < PER_STEP:
            return []
        figure = (f"{reads:.1f} host reads of the loss per step "
                  f"(sync={tp.settings.get('sync')}), "
                  f"{tp.ms('other'):.2f} ms per step in them")
        if tp.cuda_syncs is not None:
            figure += f"; {tp.cuda_syncs / tp.steps:.1f} synchronising CUDA calls per step in all"
        elif tp.device == "cpu":
            figure += " (cheap on a CPU, where nothing runs ahead of the host; a stall on a GPU)"
        return [Finding("host reads of device values every step", figure, TIP, "sync=deferred")]
