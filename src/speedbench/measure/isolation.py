"""Trials isolated from the user's code: what a model's code may change in this process is read
before it runs and put back after, and a model that changed it is named.

The model's code (its constructor, its forward) runs in speedbench's own process, and some of
what it may change is process-wide (WATCHED), a class rather than a list of incidents: torch's
global settings (the default dtype and device, deterministic algorithms, cuDNN's and oneDNN's
flags, the intra-op thread count, flushing denormals); autograd's state, which a context
entered and never left keeps on (grad mode with inference mode, forward AD and multithreaded
backward; the saved-tensors hooks; the autograd profiler; anomaly detection; autocast; the
torch function and dispatch mode stacks); the process's (the working directory, the umask, the
environment variables speedbench reads, the stop signals' handlers, sys.stdout and the
descriptors 1 and 2 under it, sys.excepthook);
the interpreter's (warnings turned into errors, a lowered recursion limit, the garbage collector
and its thresholds, a profile or trace function, the thread switch interval, numpy's
floating-point errors); and the random generators. A change left on reaches the next model: a
saved-tensors hook entered in a constructor inflated the next model's activation memory by
45 %, inference mode failed its trials, a profiler left on crashed the process at its exit.
Likewise a `torch.set_default_dtype(torch.float64)` in a constructor made the next model train
in float64 while its row said fp32. So every trial and
probe (session.applied) and the n/a check's model runs inside `isolated()`: on the way out each
setting is put back as it was, and a change is said once per model and setting, on the console
and in the report (`notes()`, env.json's `model_changes`): "model m: its code sets the default
dtype to torch.float64 when it is built; ...". The random generators are put back silently (a
trial draws from them by design). A model's own trial runs with what its own code set.

`sys.exit()` in the model's code is the model's failure, not the end of the run: it is raised
as ModelExit, which the trial records as its row's status (so is any other BaseException of
the model's own, GeneratorExit included, which `except Exception` would let through; told from
speedbench's own stops by class, never by a module's name).
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from speedbench.errors import OwnStop, stopping

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, n))


class ModelExit(RuntimeError):
    """The model's code called sys.exit() or raised another BaseException that is not a stop
    (KeyboardInterrupt): its trial fails, the run goes on."""


STOP_HANDLERS = "the stop signals' handlers"


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


# --- autograd's own state: grad and inference mode, saved-tensor hooks, the profiler ---------
def _grad_modes() -> tuple:
    """(grad mode, inference mode, forward AD, multithreaded backward): one autograd state,
    which torch.inference_mode() sets as a whole."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch._C._is_fwd_grad_enabled(), torch._C._is_multithreading_enabled())


# Inference mode is a guard's: the one speedbench enters to put it back is kept (released, it
# would put the model's inference mode back on).
_GUARDS: list = []


def _set_grad_modes(value: tuple) -> None:
    grad, inference, forward_ad, threads = value
    if torch.is_inference_mode_enabled() != inference:
        _GUARDS.append(torch.autograd.grad_mode._enter_inference_mode(inference))
    torch.set_grad_enabled(grad)
    torch._C._set_fwd_grad_enabled(forward_ad)
    torch._C._set_multithreading_enabled(threads)


def _grad_text(value: tuple) -> str:
    grad, inference, forward_ad, threads = value
    if inference:  # (which turns forward AD and multithreaded backward off too)
        return _on_off(grad) + ", in inference mode"
    return (_on_off(grad) + ", forward AD off" * (not forward_ad)
            + ", single-threaded backward" * (not threads))


_AUTOGRAD = torch._C._autograd


def _top_hooks():
    try:
        return _AUTOGRAD._top_saved_tensors_default_hooks(True)
    except TypeError:  # a torch whose reader takes no argument
        return _AUTOGRAD._top_saved_tensors_default_hooks()


def _saved_hooks() -> tuple:
    """(the saved-tensors hooks stack, bottom first; the message they are disabled with, or
    None): the stack is read by popping it and pushed back as it was."""
    disabled = _AUTOGRAD._saved_tensors_hooks_get_disabled_error_message()
    if disabled is not None:
        _AUTOGRAD._saved_tensors_hooks_enable()
    popped = []
    while (top := _top_hooks()) is not None:
        popped.append(tuple(top))
        _AUTOGRAD._pop_saved_tensors_default_hooks()
    stack = tuple(reversed(popped))
    _set_saved_hooks((stack, disabled))
    return stack, disabled


def _set_saved_hooks(value: tuple) -> None:
    stack, disabled = value
    _AUTOGRAD._saved_tensors_hooks_enable()
    while _top_hooks() is not None:
        _AUTOGRAD._pop_saved_tensors_default_hooks()
    for pack, unpack in stack:
        _AUTOGRAD._push_saved_tensors_default_hooks(pack, unpack)
    if disabled is not None:
        try:
            _AUTOGRAD._saved_tensors_hooks_disable(disabled, False)
        except TypeError:  # a torch without fail_if_non_empty
            _AUTOGRAD._saved_tensors_hooks_disable(disabled)


def _hooks_text(value: tuple) -> str:
    stack, disabled = value
    return f"{len(stack)} pair(s) of hooks" + ", disabled" * (disabled is not None)


def _set_profiler(on: bool) -> None:
    """An autograd profiler left on is stopped (one that was on, speedbench's own, is never
    stopped by a trial: see `harmful`)."""
    if on or not torch.autograd._profiler_enabled():
        return
    legacy = _AUTOGRAD._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY
    if legacy:
        _AUTOGRAD._disable_profiler_legacy()
    else:
        torch.autograd._disable_profiler()
    torch.autograd.profiler._run_on_profiler_stop()


# --- torch's mode stacks and autocast ------------------------------------------------------
def _function_modes() -> tuple:
    """The torch function modes entered (the default device's own is `the default device`)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return tuple(m for m in _get_current_function_mode_stack()
                 if not isinstance(m, DeviceContext))


def _set_function_modes(before: tuple) -> None:
    from torch.overrides import _len_torch_function_stack, _pop_mode, _push_mode
    from torch.utils._device import DeviceContext

    popped = []
    while _len_torch_function_stack() and _function_modes() != before:
        popped.append(_pop_mode())
    for mode in reversed(popped):  # the default device's stays
        if isinstance(mode, DeviceContext):
            _push_mode(mode)


def _dispatch_modes() -> tuple:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return tuple(_get_current_dispatch_mode_stack())


def _set_dispatch_modes(before: tuple) -> None:
    from torch.utils._python_dispatch import _pop_mode

    while _dispatch_modes() and _dispatch_modes() != before:
        _pop_mode()


def _modes_text(value: tuple) -> str:
    return ", ".join(type(m).__name__ for m in value) or "none"


AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_nesting() -> int:
    """How many autocast contexts are entered (read by one more, then one less)."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _autocast() -> tuple:
    """(each device's (on, dtype)..., the nesting): a context left entered keeps the nesting
    up, and its cast weights cached, past every later autocast's exit."""
    return (*((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
              for d in AUTOCAST_DEVICES), _autocast_nesting())


def _set_autocast(value: tuple) -> None:
    for device, (on, dtype) in zip(AUTOCAST_DEVICES, value):
        torch.set_autocast_enabled(device, on)
        torch.set_autocast_dtype(device, dtype)
    depth = _autocast_nesting()
    for _ in range(depth - value[-1]):
        torch.autocast_decrement_nesting()
    for _ in range(value[-1] - depth):
        torch.autocast_increment_nesting()
    torch.clear_autocast_cache()


def _autocast_text(value: tuple) -> str:
    return ", ".join(f"{d} {str(dtype).replace('torch.', '')}"
                     for d, (on, dtype) in zip(AUTOCAST_DEVICES, value) if on) or "off"


# --- the interpreter's and the CPU's -------------------------------------------------------
def _tracers() -> tuple:
    return sys.getprofile(), sys.gettrace(), threading.getprofile(), threading.gettrace()


def _set_tracers(value: tuple) -> None:
    sys.setprofile(value[0])
    sys.settrace(value[1])
    threading.setprofile(value[2])
    threading.settrace(value[3])


STD_FDS = (1, 2)  # standard output and error: print() and the console's summary write there
MAX_KEPT_FDS = 8
_KEPT_FDS: dict[tuple, int] = {}  # (descriptor, what it pointed at) -> a duplicate of it


def _std_fds() -> tuple:
    """What descriptors 1 and 2 point at ((device, inode); None where closed). A duplicate of
    each is kept (a few, per process), so a model's os.close(1) or dup2 can be put back."""
    out = []
    for fd in STD_FDS:
        try:
            stat = os.fstat(fd)
        except OSError:
            out.append(None)
            continue
        out.append((stat.st_dev, stat.st_ino))
        if (fd, out[-1]) not in _KEPT_FDS and len(_KEPT_FDS) < MAX_KEPT_FDS:
            _KEPT_FDS[(fd, out[-1])] = os.dup(fd)  # (not inherited by a child's exec)
    return tuple(out)


def _set_std_fds(value: tuple) -> None:
    for fd, pointed in zip(STD_FDS, value):
        kept = _KEPT_FDS.get((fd, pointed))
        if kept is not None:
            os.dup2(kept, fd)


def _fds_text(value: tuple) -> str:
    """`stdout closed, stderr as it was` (as when first read in this process)."""
    def said(fd: int, pointed) -> str:
        first = next((at for kept_fd, at in _KEPT_FDS if kept_fd == fd), None)
        return "closed" if pointed is None else "as it was" if pointed == first \
            else "on another file"
    return ", ".join(f"{name} {said(fd, pointed)}"
                     for fd, name, pointed in zip(STD_FDS, ("stdout", "stderr"), value))


_TINY, _ONE = 5e-324, 1.0  # the smallest denormal: flushed to zero where the CPU is told to


def _flush_denormal() -> bool:
    """Whether this thread's floating point flushes denormals (torch.set_flush_denormal, which
    has no reader): the smallest denormal times one is then zero."""
    return _TINY * _ONE == 0.0


def _numpy_errors() -> dict:
    return np.geterr()


def _set_numpy_errors(value: dict) -> None:
    np.seterr(**value)


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
    "grad mode": Setting(_grad_modes, _set_grad_modes, _grad_text),
    "the saved-tensors hooks": Setting(_saved_hooks, _set_saved_hooks, _hooks_text),
    "the autograd profiler": Setting(torch.autograd._profiler_enabled, _set_profiler, _on_off,
                                     harmful=lambda now, before: now and not before),
    "the torch function modes": Setting(_function_modes, _set_function_modes, _modes_text),
    "the torch dispatch modes": Setting(_dispatch_modes, _set_dispatch_modes, _modes_text),
    "autocast": Setting(_autocast, _set_autocast, _autocast_text),
    "the intra-op thread count": Setting(torch.get_num_threads, torch.set_num_threads),
    "flushing denormals": Setting(_flush_denormal, torch.set_flush_denormal, _on_off),
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
    STOP_HANDLERS: Setting(_handlers, _set_handlers, _handler_names),
    "sys.stdout or sys.stderr": Setting(_streams, _set_streams,
                                        lambda v: ", ".join(type(s).__name__ for s in v)),
    "the standard output or error descriptor": Setting(_std_fds, _set_std_fds, _fds_text),
    "the warnings turned into errors": Setting(
        _error_filters, _set_error_filters, lambda v: f"{len(v)} filter(s)"),
    "Python's recursion limit": Setting(sys.getrecursionlimit, sys.setrecursionlimit,
                                        harmful=lambda now, before: now < before),
    "the garbage collector": Setting(gc.isenabled,
                                     lambda v: gc.enable() if v else gc.disable(), _on_off),
    "the garbage collector's thresholds": Setting(gc.get_threshold,
                                                  lambda v: gc.set_threshold(*v)),
    "Python's profile or trace function": Setting(
        _tracers, _set_tracers, lambda v: f"{sum(f is not None for f in v)} set"),
    "sys.excepthook": Setting(lambda: sys.excepthook,
                              lambda v: setattr(sys, "excepthook", v),
                              lambda v: getattr(v, "__qualname__", "its own")),
    "Python's thread switch interval": Setting(sys.getswitchinterval, sys.setswitchinterval,
                                               lambda v: f"{v:g} s"),
    "numpy's floating-point error handling": Setting(
        _numpy_errors, _set_numpy_errors,
        lambda v: ", ".join(f"{k} {a}" for k, a in sorted(v.items()))),
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
        # (a setting this torch cannot read is None before and after: never said)
        self.before = {what: _safe(setting.read) for what, setting in WATCHED.items()}
        self.generators = _generators()
        self.seen: dict[str, tuple[str, Any]] = {}  # what -> (where, the value) first seen
        self.stop = stopping()  # a stop signal taken inside is speedbench's, not the model's

    def built(self) -> None:
        self._look("when it is built")

    def _look(self, where: str) -> None:
        for what, setting in WATCHED.items():
            now = _safe(setting.read)
            if what not in self.seen and _changed(setting, now, self.before[what]):
                self.seen[what] = (where, now)

    def restore(self) -> None:
        self._look("while it trains")
        if stopping() is not self.stop:  # a stop came: its handling (distributed's on_term,
            self.seen.pop(STOP_HANDLERS, None)  # the command's) set the handlers: left as set
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
        tqdm.write(textwrap.fill(text, width=100, subsequent_indent="  "), file=sys.stderr)


@contextlib.contextmanager
def isolated(model: str, say: Callable[[str], None] | None = _console) -> Iterator[Watch]:
    """Runs the model's code: whatever it changes of WATCHED (and the random generators) is put
    back on exit, a change said once (`say`, the console by default); sys.exit() in it raises
    ModelExit."""
    watch = Watch(model, say)
    try:
        yield watch
    except SystemExit as exc:
        raise ModelExit(f"the model's code called sys.exit({exc.code!r})") from None
    except (Exception, KeyboardInterrupt, OwnStop):
        raise  # speedbench's own stops (the watchdog's, a signal's) go on, told by class
    except BaseException as exc:  # the model's own, past `except Exception` (GeneratorExit too)
        raise ModelExit(f"the model's code raised {type(exc).__name__} (a BaseException): "
                        f"{str(exc)[:100]}") from None
    finally:
        watch.restore()
