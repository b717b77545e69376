"""The host memory allocator: the system's malloc (glibc) vs jemalloc vs TCMalloc, loaded with
LD_PRELOAD (the Performance Tuning Guide's "Switch Memory allocator" tip).

LD_PRELOAD acts only when a process starts, so every trial of a variant that sets `allocator`
runs in a fresh process of its own (an arm of this interpreter, studies/arms.py, through
`environment`), the system malloc's included, so that the comparison is between equally fresh
processes. The library is
looked up where Debian and Ubuntu install it (ldconfig's cache, then the usual lib folders);
where it is missing the variant is n/a with the command that installs it. The trial process
reads its own /proc/self/maps and records the allocator it really runs with.
"""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Literal, Optional

from speedbench.techniques.base import ActsOn, Context, Field, Technique, preload_instead

INHERIT, SYSTEM = "inherit", "system"
# allocator -> (shared libraries, most wanted first; the Debian/Ubuntu package that has the first)
LIBRARIES = {
    "jemalloc": (("libjemalloc.so.2", "libjemalloc.so"), "libjemalloc2"),
    "tcmalloc": (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "libtcmalloc-minimal4"),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib", "/lib/x86_64-linux-gnu")
MAPS = Path("/proc/self/maps")
# LD_PRELOAD acts only at a process's start, so the snippet re-executes the script with it set:
# the shell equivalent is `LD_PRELOAD={library} python train.py`.
PRELOAD = """\
# at the top of train.py (Debian/Ubuntu: apt install {package})
import os, sys
if "{library}" not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = "{library}"
    os.execv(sys.executable, [sys.executable] + sys.argv)"""


@functools.lru_cache(maxsize=None)
def ldconfig_paths() -> dict[str, str]:
    """soname -> path from ldconfig's cache (`ldconfig -p`); empty where there is none."""
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = {}
        for line in out.splitlines():  # "\tlibjemalloc.so.2 (libc6,x86-64) => /usr/lib/..."
            name, _, path = line.strip().partition(" => ")
            found.setdefault(name.split(" (")[0], path)
        return found
    return {}


def find_library(allocator: str, path: Optional[str] = None) -> Optional[str]:
    """The allocator's shared library: `path` when given and a file, else the first of its
    libraries in ldconfig's cache or the usual lib folders; None where there is none."""
    if path:
        return path if os.path.isfile(path) else None
    names, _ = LIBRARIES[allocator]
    cache = ldconfig_paths()
    for name in names:
        for candidate in [cache.get(name, "")] + [os.path.join(d, name) for d in LIB_DIRS]:
            if candidate and os.path.isfile(candidate):
                return candidate
    return None


def loaded_allocator() -> str:
    """The malloc this process runs with, read from its own memory map: the jemalloc or
    TCMalloc library mapped into it, else `system`."""
    try:
        maps = MAPS.read_text()
    except OSError:
        return "unknown"
    for line in maps.splitlines():
        name = os.path.basename(line.split()[-1]) if len(line.split()) >= 6 else ""
        if "jemalloc" in name or "tcmalloc" in name:
            return name
    return SYSTEM


def kind_of(loaded: str) -> str:
    """`jemalloc`, `tcmalloc` or `system` for a loaded_allocator() answer."""
    return next((k for k in LIBRARIES if k in loaded), loaded)


def preload(library: Optional[str]) -> str:
    """LD_PRELOAD for a fresh process: ours without any jemalloc/TCMalloc, `library` first."""
    return preload_instead(library, tuple(LIBRARIES))


class Allocator(Technique):
    name = "allocator"
    card = """\
**What**: replaces the process's `malloc` with jemalloc or TCMalloc through `LD_PRELOAD`
(`system`: glibc's own). Each trial then runs in a fresh process started with it; the row
records the allocator the trial process really mapped (`allocator_loaded`).
**Helps**: host-side allocation: PyTorch allocates every CPU operator's output, and these
allocators keep freed memory in per-thread caches for the next step instead of returning it
to the system; the gain is largest on CPUs and in data loading.
**Costs**: a library to install (`apt install libjemalloc2` / `libtcmalloc-minimal4`); cached
memory counts in the process's RSS; on a GPU the device memory is PyTorch's own allocator's."""
    fields = (
        Field("allocator", Literal["inherit", "system", "jemalloc", "tcmalloc"], INHERIT,
              "host malloc: inherit (this process's); system, jemalloc or tcmalloc: a fresh "
              "process per trial with that malloc (LD_PRELOAD)"),
        Field("allocator_path", Optional[str], None,
              "the allocator's shared library; null: found with ldconfig -p or in the usual "
              "lib folders", column=None),
    )
    extra_columns = ("allocator_library", "allocator_loaded")
    example = {"allocator": "system"}
    acts_on = ActsOn(model="resnet")  # glibc's malloc, in a fresh process through the runs
    snippets = {"allocator": {
        kind: (f"{kind} as the host allocator (LD_PRELOAD)",
               PRELOAD.replace("{package}", package).replace(
                   "{library}", f"/usr/lib/x86_64-linux-gnu/{names[0]}"))
        for kind, (names, package) in LIBRARIES.items()}}

    def library(self, recipe) -> Optional[str]:
        if recipe.allocator in LIBRARIES:
            return find_library(recipe.allocator, recipe.allocator_path)
        return None

    def not_applicable(self, recipe, ctx: Context) -> Optional[str]:
        kind = recipe.allocator
        if kind == INHERIT:
            return None
        if not MAPS.exists():
            return "n/a: allocator needs Linux (LD_PRELOAD, /proc/self/maps)"
        if kind in LIBRARIES and recipe.allocator_path and \
                kind not in os.path.basename(recipe.allocator_path):
            return f"n/a: allocator_path {recipe.allocator_path} is not a {kind} library"
        if kind in LIBRARIES and self.library(recipe) is None:
            names, package = LIBRARIES[kind]
            where = recipe.allocator_path or f"no {names[0]} in ldconfig -p nor in {LIB_DIRS[0]} " \
                f"and {len(LIB_DIRS) - 1} other lib folders"
            return f"n/a: {kind} not found ({where}); install it: apt install {package}"
        if ctx.dist_env is not None and kind_of(loaded_allocator()) != kind:
            return (f"n/a: allocator={kind}, but the ranks of a torchrun started by hand run "
                    f"with {loaded_allocator()}: LD_PRELOAD acts at start-up; start torchrun "
                    "with it, or run speedbench without torchrun (it starts each trial fresh)")
        return None

    def environment(self, recipe, ctx: Context) -> dict[str, str]:
        if recipe.allocator == INHERIT or ctx.dist_env is not None:
            return {}  # torchrun's ranks are started already
        return {"LD_PRELOAD": preload(self.library(recipe))}

    def columns(self, recipe, ctx: Context) -> dict:
        loaded = loaded_allocator() if ctx.trainer is not None else float("nan")
        return {**super().columns(recipe, ctx), "allocator_library": self.library(recipe) or "",
                "allocator_loaded": loaded}
