"""Trials isolated from the user's code: what a model's code may change in this process is read
before it runs and put back after, and a model that changed it is named.

The model's code (its constructor, its forward) runs in speedbench's own process, and some of
what it may change is process-wide (WATCHED): the default dtype and device, grad mode,
deterministic algorithms, anomaly detection, oneDNN, the working directory, the umask, the
environment variables speedbench reads, the stop signals' handlers, sys.stdout, warnings turned
into errors, a lowered recursion limit, the garbage collector; and the random generators.
Left changed, it would reach every later trial: a `torch.set_default_dtype(torch.float64)` in a
constructor made the next model train in float64 while its row said fp32. So every trial and
probe (session.applied) and the n/a check's model runs inside `isolated()`: on the way out each
setting is put back as it was, and a change is said once per model and setting, on the console
and in the report (`notes()`, env.json's `model_changes`): "model m: its code sets the default
dtype to torch.float64 when it is built; ...". The random generators are put back silently (a
trial draws from them by design). A model's own trial runs with what its own code set.

`sys.exit()` in the model's code is the model's failure, not the end of the run: it is raised
as ModelExit, which the trial records as its row's status (so is any other BaseException of
the model's own, which `except Exception` would let through).
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, n))


class ModelExit(RuntimeError):
    """The model's code called sys.exit() or raised another BaseException that is not a stop
    (KeyboardInterrupt): its trial fails, the run goes on."""


def _handlers() -> tuple:
    return tuple(signal.getsignal(s) for s in STOP_SIGNALS)


def _set_handlers(saved: tuple) -> None:
    if threading.current_thread() is threading.main_thread():  # (only it may set them)
        for sig, handler in zip(STOP_SIGNALS, saved):
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def _handler_names(saved: tuple) -> str:
    names = {signal.SIG_DFL: "the default", signal.SIG_IGN: "ignored", None: "unknown"}
    return ", ".join(f"{signal.Signals(s).name} {names.get(h, 'its own')}"
                     for s, h in zip(STOP_SIGNALS, saved))


def _deterministic() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


def _anomaly() -> tuple:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _default_device():
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else str(context.device)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The environment variables speedbench reads or records (a trial's omp_num_threads, torchrun's)
# or that shape a fresh process: others are left alone (torch.compile sets some of its own).
VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD",
             "PYTORCH_CUDA_ALLOC_CONF", "KMP_AFFINITY", "KMP_BLOCKTIME", "RANK", "WORLD_SIZE",
             "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TMPDIR")


def _variables() -> tuple:
    return tuple(os.environ.get(v) for v in VARIABLES)


def _set_variables(values: tuple) -> None:
    for name, value in zip(VARIABLES, values):
        if value is None:
            os.environ.pop(name, None)
        elif os.environ.get(name) != value:
            os.environ[name] = value


def _changed_variables(values: tuple) -> str:
    return ", ".join(f"{n}={v}" if v is not None else f"{n} unset"
                     for n, v in zip(VARIABLES, values) if v is not None) or "none set"


def _error_filters() -> tuple:
    return tuple(f for f in warnings.filters if f[0] == "error")


def _set_error_filters(kept: tuple) -> None:
    """Warnings turned into errors since: that filter removed (others, which libraries add as
    they are imported, are left)."""
    warnings.filters[:] = [f for f in warnings.filters if f[0] != "error" or f in kept]
    warnings._filters_mutated()


def _streams() -> tuple:
    return sys.stdout, sys.stderr


def _set_streams(streams: tuple) -> None:
    sys.stdout, sys.stderr = streams


def _on_off(value) -> str:
    return "on" if value else "off"


@dataclass(frozen=True)
class Setting:
    """One thing of the process the model's code may change: how to read it, write it back and
    say it; `harmful(now, before)`: whether a change is one to undo and say (default: any)."""

    read: Callable[[], Any]
    write: Callable[[Any], None]
    text: Callable[[Any], str] = str
    harmful: Callable[[Any, Any], bool] | None = None


# what -> Setting. A change is named once and put back after every trial and probe.
WATCHED: dict[str, Setting] = {
    "the default dtype": Setting(torch.get_default_dtype, torch.set_default_dtype),
    "the default device": Setting(_default_device, torch.set_default_device,
                                  lambda v: v or "none"),
    "grad mode": Setting(torch.is_grad_enabled, torch.set_grad_enabled, _on_off),
    "deterministic algorithms": Setting(
        _deterministic, lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        lambda v: _on_off(v[0]) + " (warn only)" * v[1]),
    "anomaly detection": Setting(_anomaly, lambda v: torch.autograd.set_detect_anomaly(*v),
                                 lambda v: _on_off(v[0])),
    "cuDNN's deterministic flag": Setting(
        lambda: torch.backends.cudnn.deterministic,
        lambda v: setattr(torch.backends.cudnn, "deterministic", v), _on_off),
    "oneDNN (mkldnn)": Setting(lambda: torch.backends.mkldnn.enabled,
                               lambda v: setattr(torch.backends.mkldnn, "enabled", v), _on_off),
    "the working directory": Setting(os.getcwd, os.chdir),
    "the file mode mask (umask)": Setting(_umask, os.umask, lambda v: f"{v:04o}"),
    "the environment variables speedbench reads": Setting(_variables, _set_variables,
                                                          _changed_variables),
    "the stop signals' handlers": Setting(_handlers, _set_handlers, _handler_names),
    "sys.stdout or sys.stderr": Setting(_streams, _set_streams,
                                        lambda v: ", ".join(type(s).__name__ for s in v)),
    "the warnings turned into errors": Setting(
        _error_filters, _set_error_filters, lambda v: f"{len(v)} filter(s)"),
    "Python's recursion limit": Setting(sys.getrecursionlimit, sys.setrecursionlimit,
                                        harmful=lambda now, before: now < before),
    "the garbage collector": Setting(gc.isenabled,
                                     lambda v: gc.enable() if v else gc.disable(), _on_off),
}


def _generators() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _set_generators(saved: tuple) -> None:
    cpu, cuda, py, npy = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


_NOTES: dict[tuple[str, str], str] = {}  # (model, what) -> its note, said once per process


def notes() -> list[str]:
    """Every note of this process's run so far, in the order they were first seen."""
    return list(_NOTES.values())


def clear_notes() -> None:
    """A new run in this process starts with none (a Hydra sweep runs several)."""
    _NOTES.clear()


class Watch:
    """What `isolated` read on the way in; `built()` marks the model's construction done, so
    that a change is said with where it happened."""

    def __init__(self, model: str, say: Callable[[str], None] | None):
        self.model, self.say = model, say
        self.before = {what: setting.read() for what, setting in WATCHED.items()}
        self.generators = _generators()
        self.seen: dict[str, tuple[str, Any]] = {}  # what -> (where, the value) first seen

    def built(self) -> None:
        self._look("when it is built")

    def _look(self, where: str) -> None:
        for what, setting in WATCHED.items():
            now = _safe(setting.read)
            if what not in self.seen and _changed(setting, now, self.before[what]):
                self.seen[what] = (where, now)

    def restore(self) -> None:
        self._look("while it trains")
        for what in self.seen:  # only what was changed: a write can cost (signal handlers)
            try:
                WATCHED[what].write(self.before[what])
            except Exception:  # a setting this torch cannot set back: the others still are
                continue
        _set_generators(self.generators)
        for what, (where, value) in self.seen.items():
            self._note(what, where, value)

    def _note(self, what: str, where: str, value: Any) -> None:
        key = (self.model, what)
        if key in _NOTES:
            return
        text = WATCHED[what].text
        _NOTES[key] = (f"model {self.model}: its code changes {what} (to {_said(text, value)}) "
                       f"{where}; speedbench put it back ({_said(text, self.before[what])}) "
                       "after each of its trials, so the rows of the other models and variants "
                       "ran as configured")
        if self.say is not None:
            self.say(f"speedbench: note: {_NOTES[key]}")


def _said(text: Callable[[Any], str], value: Any) -> str:
    try:
        return text(value)
    except Exception:
        return "another value"


def _safe(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:
        return None


def _changed(setting: Setting, now: Any, before: Any) -> bool:
    try:
        if setting.harmful is not None:
            return bool(setting.harmful(now, before))
        return bool(now != before)
    except Exception:  # values that do not compare (arrays): take them as changed
        return True


def _console(text: str) -> None:
    from tqdm.auto import tqdm

    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank sees it: rank 0 says it
        tqdm.write(text, file=sys.stderr)


@contextlib.contextmanager
def isolated(model: str, say: Callable[[str], None] | None = _console) -> Iterator[Watch]:
    """Runs the model's code: whatever it changes of WATCHED (and the random generators) is put
    back on exit, a change said once (`say`, the console by default); sys.exit() in it raises
    ModelExit."""
    watch = Watch(model, say)
    try:
        yield watch
    except SystemExit as exc:
        raise ModelExit(f"the model's code called sys.exit({exc.code!r}); its trial was "
                        "recorded as failed and the run went on") from None
    except (Exception, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # one of the model's own, past `except Exception`: its
        if type(exc).__module__.startswith("speedbench"):  # trial's failure (speedbench's own,
            raise                                          # the watchdog's, go on)
        raise ModelExit(f"the model's code raised {type(exc).__name__} (a BaseException): "
                        f"{str(exc)[:100]}") from None
    finally:
        watch.restore()
