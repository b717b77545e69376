"""Models that fail on purpose, for the fault-handling tests (given to speedbench via _target_)."""
from __future__ import annotations

import atexit
import os
import pathlib
import signal
import threading
import time

import torch
import torch.nn as nn


POOLS = []  # kept, as a library keeps its pool


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
            # and a library's idle worker pool, never shut down (torch.compile's, say)
            from concurrent.futures import ThreadPoolExecutor
            POOLS.append(ThreadPoolExecutor(1))
            POOLS[-1].submit(int)
            if os.environ.get("ATEXIT_MARKER"):  # a library's clean-up at exit still runs
                atexit.register(pathlib.Path(os.environ["ATEXIT_MARKER"]).write_text, "ran")
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
    "stdout_fd": lambda: os.dup2(os.open(os.devnull, os.O_WRONLY), 1),  # print() goes nowhere
    "warnings_error": lambda: warnings.simplefilter("error"),
    "recursion_limit": lambda: sys.setrecursionlimit(_depth() + 60),  # far below the usual
    "gc_off": gc.disable,
    # round 5: contexts entered and never left, and the rest of process-wide state
    "inference_mode": lambda: _left_on(torch.inference_mode()),
    "saved_hooks": lambda: _left_on(torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.clone(), lambda t: t)),
    "profiler": lambda: _left_on(torch.autograd.profiler.profile()),
    "function_mode": lambda: _left_on(_FunctionMode()),
    "dispatch_mode": lambda: _left_on(_DispatchMode()),
    "autocast": lambda: _left_on(torch.autocast("cpu", dtype=torch.bfloat16)),
    "threads": lambda: torch.set_num_threads(torch.get_num_threads() + 1),
    "gc_thresholds": lambda: gc.set_threshold(1, 1, 1),
    "setprofile": lambda: sys.setprofile(lambda *a: None),
    "excepthook": lambda: setattr(sys, "excepthook", lambda *a: None),
    "switch_interval": lambda: sys.setswitchinterval(0.5),
    "numpy_errors": lambda: __import__("numpy").seterr(all="raise"),
}

LEFT_ON: list = []  # the contexts a model entered and never left (released, they would undo it)


def _left_on(context):
    context.__enter__()
    LEFT_ON.append(context)


from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


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


# --- round 5: a fault at one forward call of the process (the quality probe's, in a short run)
CALLS: dict[str, int] = {}  # tag -> forward calls so far in this process


class FailsAt(nn.Module):
    """A token model (loss: module) whose forward call number `at` (counted per `tag` in the
    process) raises (`how: raise`), calls sys.exit(7) (`exit`), raises GeneratorExit
    (`generator_exit`) or closes the process's standard output, descriptor 1, and trains on
    (`close_stdout`); every other call trains."""

    def __init__(self, at: int = 3, how: str = "raise", tag: str = "", vocab: int = 16,
                 dim: int = 8):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.at, self.how, self.tag = at, how, tag

    def forward(self, x, y):
        CALLS[self.tag] = CALLS.get(self.tag, 0) + 1
        if CALLS[self.tag] == self.at:
            if self.how == "exit":
                sys.exit(7)
            if self.how == "generator_exit":
                raise GeneratorExit("fails at call %d" % self.at)
            if self.how == "close_stdout":
                os.close(1)
            else:
                raise RuntimeError(f"fails at call {self.at}")
        logits = self.head(self.emb(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class Tokens(torch.utils.data.Dataset):
    """`n` token items (x, y) of 8 tokens below 16, computed from the index (no storage, so
    that `n` may be huge); `len_mode` raise, negative or float: a __len__ that fails;
    `item_mode` memory: the host out of memory reading any item but the first; exit:
    sys.exit(6) there."""

    def __init__(self, n: int = 64, len_mode: str = "", item_mode: str = ""):
        self.n, self.len_mode, self.item_mode = int(n), len_mode, item_mode

    def __len__(self):
        if self.len_mode == "raise":
            raise RuntimeError("this data set cannot count itself")
        if self.len_mode == "negative":
            return -1
        if self.len_mode == "float":
            return 2.5
        return self.n

    def __getitem__(self, index: int):
        if self.item_mode == "memory" and index > 0:  # (item 0, which a check reads, is fine)
            raise MemoryError("no room for this item")
        if self.item_mode == "exit" and index > 0:
            sys.exit(6)
        g = torch.Generator().manual_seed(int(index) % (1 << 62))
        x = torch.randint(0, 16, (8,), generator=g)
        return x, x.roll(-1)


BUILDS: dict[str, int] = {}  # tag -> how often counted_tokens built its data set


def counted_tokens(tag: str = "", n: int = 64) -> Tokens:
    BUILDS[tag] = BUILDS.get(tag, 0) + 1
    return Tokens(n)
