"""Trials isolated from the user's code: what a model's code may change in this process is read
before it runs and put back after, and a model that changed it is named.

The model's code (its constructor, its forward) runs in speedbench's own process, and some of
what it may change is process-wide: the default dtype, grad mode, deterministic algorithms,
anomaly detection, the working directory, the stop signals' handlers, the random generators.
Left changed, it would reach every later trial: a `torch.set_default_dtype(torch.float64)` in a
constructor made the next model train in float64 while its row said fp32. So every trial and
probe (session.applied) and the n/a check's model runs inside `isolated()`: on the way out each
setting is put back as it was, and a change is said once per model and setting, on the console
and in the report (`notes()`, env.json's `model_changes`): "model m: its code sets the default
dtype to torch.float64 when it is built; ...". The random generators are put back silently (a
trial draws from them by design). A model's own trial runs with what its own code set.

`sys.exit()` in the model's code is the model's failure, not the end of the run: it is raised
as ModelExit, which the trial records as its row's status.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, n))


class ModelExit(RuntimeError):
    """The model's code called sys.exit(): its trial fails, the run goes on."""


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


# what -> (read, write, the value as the note says it). A change is named and put back.
WATCHED: dict[str, tuple[Callable[[], Any], Callable[[Any], None], Callable[[Any], str]]] = {
    "the default dtype": (torch.get_default_dtype, torch.set_default_dtype, str),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled,
                  lambda v: "on" if v else "off"),
    "deterministic algorithms": (_deterministic,
                                 lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
                                 lambda v: ("on" if v[0] else "off") + " (warn only)" * v[1]),
    "anomaly detection": (_anomaly, lambda v: torch.autograd.set_detect_anomaly(*v),
                          lambda v: "on" if v[0] else "off"),
    "the working directory": (os.getcwd, os.chdir, str),
    "the stop signals' handlers": (_handlers, _set_handlers, _handler_names),
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
        self.before = {what: read() for what, (read, _, _) in WATCHED.items()}
        self.generators = _generators()
        self.seen: dict[str, tuple[str, Any]] = {}  # what -> (where, the value) first seen

    def built(self) -> None:
        self._look("when it is built")

    def _look(self, where: str) -> None:
        for what, (read, _, _) in WATCHED.items():
            now = _safe(read)
            if what not in self.seen and _changed(now, self.before[what]):
                self.seen[what] = (where, now)

    def restore(self) -> None:
        self._look("while it trains")
        for what, (_, write, _) in WATCHED.items():
            try:
                write(self.before[what])
            except Exception:  # a setting this torch cannot set back: the others still are
                continue
        _set_generators(self.generators)
        for what, (where, value) in self.seen.items():
            self._note(what, where, value)

    def _note(self, what: str, where: str, value: Any) -> None:
        key = (self.model, what)
        if key in _NOTES:
            return
        text = WATCHED[what][2]
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


def _changed(now: Any, before: Any) -> bool:
    try:
        return bool(now != before)
    except Exception:  # values that do not compare (arrays): take them as changed
        return True


def _console(text: str) -> None:
    from tqdm.auto import tqdm

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
    finally:
        watch.restore()
