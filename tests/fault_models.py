"""Models that fail on purpose, for the fault-handling tests (given to speedbench via _target_)."""
from __future__ import annotations

import os
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
        if late and self.fail == "swallows_stops":  # a retry loop's bare except, sleeping
            open(os.environ["FAULT_MARKER"], "w").close()
            end = time.monotonic() + self.sleep_s
            while time.monotonic() < end:
                try:
                    time.sleep(0.1)
                except BaseException:
                    pass
        if late and self.fail == "hangs_outside_python":
            # SIGALRM blocked, then a wait in C: the watchdog's alarm cannot interrupt it
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(self.sleep_s)
        out = self.net(x)
        if half and self.fail == "nan_in_autocast":
            out = out * float("nan")
        return out


# --- round 4: model code that changes the process, and hostile model objects -----------------
import gc  # noqa: E402
import io  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch.nn.functional as F  # noqa: E402

# What a model's own code may do to the process it shares with speedbench (measure/isolation.py
# puts each back): mode -> the change.
MEDDLES = {
    "default_dtype": lambda: torch.set_default_dtype(torch.float64),
    "default_device": lambda: torch.set_default_device("meta"),
    "grad_off": lambda: torch.set_grad_enabled(False),
    "deterministic": lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    "anomaly": lambda: torch.autograd.set_detect_anomaly(True),
    "cudnn_deterministic": lambda: setattr(torch.backends.cudnn, "deterministic", True),
    "mkldnn_off": lambda: setattr(torch.backends.mkldnn, "enabled", False),
    "chdir": lambda: os.chdir(os.environ.get("FAULT_CHDIR", "/")),
    "umask": lambda: os.umask(0o777),
    "omp_env": lambda: os.environ.__setitem__("OMP_NUM_THREADS", "77"),
    "sigint_ignored": lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    "stdout": lambda: setattr(sys, "stdout", io.StringIO()),
    "warnings_error": lambda: warnings.simplefilter("error"),
    "recursion_limit": lambda: sys.setrecursionlimit(_depth() + 60),  # far below the usual
    "gc_off": gc.disable,
}


def _depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


class Meddler(nn.Module):
    """A token model (loss: module) whose code makes the change MEDDLES[mode] when it is built
    (`when: init`) or at its first forward call (`when: forward`)."""

    def __init__(self, mode: str = "", when: str = "init", vocab: int = 16, dim: int = 8):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.mode, self.when, self.done = mode, when, False
        if when == "init" and mode:
            MEDDLES[mode]()

    def forward(self, x, y):
        if self.when == "forward" and not self.done:
            self.done = True
            MEDDLES[self.mode]()
        logits = self.head(self.emb(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class Boom(BaseException):
    """Neither an Exception nor a stop: `except Exception` lets it through."""


class Hostile(nn.Module):
    """A token model (loss: module) that is hostile as an object (`mode`); see HOSTILE."""

    def __init__(self, mode: str = "ok", vocab: int = 16, dim: int = 8):
        super().__init__()
        self.mode = mode
        if mode != "no_params":
            self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        if mode == "frozen":
            for p in self.parameters():
                p.requires_grad_(False)
        if mode == "seed_fails" and torch.initial_seed() == 1:  # build_model seeds it
            raise RuntimeError("this model cannot be built with bench.seed=1")

    def __repr__(self):
        if self.mode == "repr_raises":
            raise RuntimeError("no repr for you")
        return super().__repr__()

    def train(self, mode: bool = True):
        if self.mode == "train_raises":
            raise RuntimeError("train() refuses")
        return super().train(mode)

    def forward(self, x, y):
        m = self.mode
        if m == "no_params":
            return torch.zeros((), requires_grad=True) + x.float().mean() * 0
        loss = F.cross_entropy(self.head(self.emb(x)).reshape(-1, 16).float(), y.reshape(-1))
        if m == "int_loss":
            return loss.long()
        if m == "detached":
            return loss.detach()
        if m == "python_float":
            return loss.item()
        if m == "dict_without_loss":
            return {"logits": loss}
        if m == "base_exception":
            raise Boom("a BaseException of the model's own")
        if m == "message_with_nul_and_lines":
            raise ValueError("first\0line\n" + "second line\n" * 50_000)
        if m == "exit_zero":
            sys.exit(0)
        return loss


def no_forward(**kwargs):
    """A module with a parameter but no forward: nn.Module's own raises NotImplementedError."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(1))
    return module
