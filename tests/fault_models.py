"""Models that fail on purpose, for the fault-handling tests (given to speedbench via _target_)."""
from __future__ import annotations

import signal
import threading
import time

import torch
import torch.nn as nn


class Tiny(nn.Module):
    """A small image classifier without BatchNorm: forward(x) returns logits."""

    def __init__(self, num_classes: int = 10, fail: str = "none", sleep_s: float = 0.0,
                 sleep_after: int = 0):
        super().__init__()
        self.fail, self.sleep_s, self.sleep_after, self.calls = fail, sleep_s, sleep_after, 0
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = torch.is_autocast_enabled(x.device.type)
        if half and self.fail == "error_in_autocast":
            raise RuntimeError("this model breaks under autocast")
        if half and self.fail == "oom_in_autocast":
            raise torch.OutOfMemoryError("pretend the device ran out of memory")
        if self.fail == "leaves_a_thread" and not any(
                t.name == "left-behind" for t in threading.enumerate()):
            threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()
        self.calls += 1
        late = self.calls > self.sleep_after  # the first `sleep_after` calls do not sleep
        if half and late and self.fail == "sleeps_in_autocast":
            time.sleep(self.sleep_s)  # a step far longer than bench.max_trial_s
        if late and self.fail == "hangs_outside_python":
            # SIGALRM blocked, then a wait in C: the watchdog's alarm cannot interrupt it
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(self.sleep_s)
        out = self.net(x)
        if half and self.fail == "nan_in_autocast":
            out = out * float("nan")
        return out
