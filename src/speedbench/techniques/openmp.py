"""The OpenMP runtime and its thread placement: the GNU OpenMP that PyTorch links (libgomp) vs
Intel's (libiomp5, from the `intel-openmp` wheel, loaded with LD_PRELOAD), each with its
affinity settings (the Performance Tuning Guide's "Utilize OpenMP" and "Intel OpenMP Runtime
Library" tips).

LD_PRELOAD and the OpenMP variables act only when a process starts, so every trial of a
variant that sets `openmp` runs in a fresh process of its own (an arm of this interpreter,
studies/arms.py, through `environment`), the GNU runtime's included. Intel's library is looked up where its wheel puts
it (`<prefix>/lib`), then in ldconfig's cache and the usual lib folders; where it is missing the
variant is n/a with the command that installs it. The trial process records which library
really serves PyTorch's parallel regions (`openmp_loaded`: the one GOMP_parallel resolves to)
and, under Intel's runtime, the block time it runs with.
"""
from __future__ import annotations

import ctypes
import os
import site
import sys
from typing import Literal, Optional

from speedbench.techniques.allocator import LIB_DIRS, MAPS, ldconfig_paths
from speedbench.techniques.base import (ANY, ActsOn, ConfigError, Context, Field, Technique,
                                        preload_instead)

INHERIT, GNU, INTEL = "inherit", "gnu", "intel"
IOMP = "libiomp5.so"
# The guide's settings: GNU threads kept close to the main thread, one per core; Intel's
# "common setting" of KMP_AFFINITY.
GNU_BIND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
INTEL_BIND = {"KMP_AFFINITY": "granularity=fine,compact,1,0"}
PRELOAD = """\
# at the top of train.py (pip install intel-openmp puts libiomp5.so in <prefix>/lib)
import os, sys
lib = os.path.join(sys.prefix, "lib", "libiomp5.so")
if lib not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = lib
    os.execv(sys.executable, [sys.executable] + sys.argv)"""


def _prefix_dirs() -> list[str]:
    """Where `pip install intel-openmp` puts its libraries: the environment's and the user's lib."""
    dirs = [os.path.join(sys.prefix, "lib")]
    user = getattr(site, "USER_BASE", None)
    return dirs + ([os.path.join(user, "lib")] if user else [])


def find_iomp(path: Optional[str] = None) -> Optional[str]:
    """Intel's OpenMP library: `path` when given and a file, else the first found; None."""
    if path:
        return path if os.path.isfile(path) else None
    candidates = [os.path.join(d, IOMP) for d in _prefix_dirs()]
    candidates += [ldconfig_paths().get(IOMP, "")] + [os.path.join(d, IOMP) for d in LIB_DIRS]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def serving_library() -> str:
    """The file name of the library that serves GOMP_parallel, PyTorch's entry into an OpenMP
    parallel region, in this process ("libgomp.so.1", "libiomp5.so"); "unknown" if unseen."""
    try:
        process = ctypes.CDLL(None)
        info = _DlInfo()
        if process.dladdr(ctypes.cast(process.GOMP_parallel, ctypes.c_void_p),
                          ctypes.byref(info)) and info.dli_fname:
            return os.path.basename(info.dli_fname.decode())
    except (AttributeError, OSError):  # not glibc, or no GNU OpenMP entry in the global scope
        pass
    return "unknown"


def block_time_ms() -> Optional[int]:
    """KMP_BLOCKTIME as Intel's runtime in this process reads it; None without that runtime."""
    try:
        return int(ctypes.CDLL(None).kmp_get_blocktime())
    except (AttributeError, OSError):
        return None


class OpenMP(Technique):
    name = "openmp"
    card = """\
**What**: the OpenMP runtime that runs PyTorch's CPU parallel regions: `gnu` (libgomp, which
PyTorch links) or `intel` (libiomp5 from `pip install intel-openmp`, through `LD_PRELOAD`);
`openmp_bind` pins the threads to cores (`OMP_PROC_BIND=close OMP_PLACES=cores`, or Intel's
`KMP_AFFINITY=granularity=fine,compact,1,0`); `kmp_blocktime` is how long Intel's threads
spin after a parallel region before they sleep (`KMP_BLOCKTIME`, 200 ms by default; the guide
suggests 1 or 0). Each trial runs in a fresh process started with them; the row records the
library that really served the parallel regions (`openmp_loaded`) and the block time read back.
**Helps**: CPU training and inference whose operators run in parallel: fewer cache misses and
migrations with pinned threads; Intel's runtime on Intel CPUs.
**Costs**: a wheel to install; pinned threads compete badly with other busy processes and with
DataLoader workers; a short block time makes a thread sleep and wake between operators, a long
one keeps cores busy spinning that the workers could use."""
    fields = (
        Field("openmp", Literal["inherit", "gnu", "intel"], INHERIT,
              "OpenMP runtime: inherit (this process's); gnu (libgomp, PyTorch's) or intel "
              "(libiomp5, LD_PRELOAD): a fresh process per trial"),
        Field("openmp_bind", bool, False,
              "pin OpenMP threads to cores: OMP_PROC_BIND=close OMP_PLACES=cores (gnu), "
              "KMP_AFFINITY=granularity=fine,compact,1,0 (intel)"),
        Field("kmp_blocktime", Optional[int], None,
              "Intel OpenMP: ms a thread waits after a parallel region before it sleeps "
              "(KMP_BLOCKTIME); null: the runtime's default (200)", low=0),
        Field("openmp_path", Optional[str], None,
              "Intel's libiomp5.so; null: found in <prefix>/lib (pip install intel-openmp), "
              "ldconfig -p or the usual lib folders", column=None),
    )
    extra_columns = ("openmp_library", "openmp_loaded", "kmp_blocktime_read")
    example = {"openmp": "gnu", "openmp_bind": True}
    acts_on = ActsOn(model="resnet")  # PyTorch's own libgomp, pinned, in a fresh process
    snippets = {
        "openmp": {INTEL: ("Intel's OpenMP runtime (LD_PRELOAD)", PRELOAD)},
        "openmp_bind": {True: ("pin OpenMP threads to cores", """\
# at the top of train.py: the OpenMP runtime reads these as the process starts
import os, sys
if os.environ.get("OMP_PROC_BIND") != "close":
    os.environ.update(OMP_PROC_BIND="close", OMP_PLACES="cores")  # GNU OpenMP (PyTorch's)
    os.environ["KMP_AFFINITY"] = "granularity=fine,compact,1,0"  # Intel's OpenMP
    os.execv(sys.executable, [sys.executable] + sys.argv)""")},
        "kmp_blocktime": {ANY: ("Intel OpenMP's threads sleep after {value} ms", """\
# at the top of train.py: Intel's OpenMP reads it as the process starts
import os, sys
if os.environ.get("KMP_BLOCKTIME") != "{value}":
    os.environ["KMP_BLOCKTIME"] = "{value}"
    os.execv(sys.executable, [sys.executable] + sys.argv)""")},
    }

    def check(self, recipe, where: str = "") -> None:
        if recipe.kmp_blocktime is not None and recipe.openmp != INTEL:
            raise ConfigError(f"{where}kmp_blocktime: {recipe.kmp_blocktime} acts only on "
                              f"Intel's OpenMP; set openmp=intel, or kmp_blocktime=null")
        if recipe.openmp_bind and recipe.openmp == INHERIT:
            raise ConfigError(f"{where}openmp_bind: true acts at a process's start; set "
                              "openmp=gnu or openmp=intel (a fresh process per trial)")

    def library(self, recipe) -> Optional[str]:
        return find_iomp(recipe.openmp_path) if recipe.openmp == INTEL else None

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        kind = recipe.openmp
        if kind == INHERIT:
            return None
        if not MAPS.exists():
            return "n/a: openmp needs Linux (LD_PRELOAD, a fresh process per trial)"
        if kind == INTEL and self.library(recipe) is None:
            where = recipe.openmp_path or f"no {IOMP} in {_prefix_dirs()[0]}, ldconfig -p nor " \
                f"{len(LIB_DIRS)} lib folders"
            return (f"n/a: Intel OpenMP not found ({where}); install it: pip install "
                    "intel-openmp (x86-64 Linux)")
        if ctx.dist_env is not None and (serving_library().startswith("libiomp")) != (
                kind == INTEL):
            return (f"n/a: openmp={kind}, but the ranks of a torchrun started by hand run "
                    f"with {serving_library()}: the runtime is chosen at start-up; start "
                    "torchrun with it, or run speedbench without torchrun")
        return None

    def environment(self, recipe, ctx: Context) -> dict[str, str]:
        if recipe.openmp == INHERIT or ctx.dist_env is not None:
            return {}  # torchrun's ranks are started already
        env = {"LD_PRELOAD": preload_instead(self.library(recipe), ("libiomp",))}
        if recipe.openmp_bind:
            env.update(INTEL_BIND if recipe.openmp == INTEL else GNU_BIND)
        if recipe.kmp_blocktime is not None:
            env["KMP_BLOCKTIME"] = str(recipe.kmp_blocktime)
        return env

    def columns(self, recipe, ctx: Context) -> dict:
        inside = ctx.trainer is not None  # in the trial's own process, after it trained
        read = block_time_ms() if inside else None
        return {**super().columns(recipe, ctx), "openmp_library": self.library(recipe) or "",
                "openmp_loaded": serving_library() if inside else float("nan"),
                "kmp_blocktime_read": float("nan") if read is None else read}
