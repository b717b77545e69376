"""Arms: the Python environments an A/B compares (`arms: {a: {python: ..., env: {...}}, b: ...}`).

An arm is an interpreter (a venv's, a conda env's, a container's python) plus environment
variables; an arm without `python` is this interpreter, so that arms that differ only in their
variables (LD_PRELOAD, OMP_*/KMP_*, PYTORCH_CUDA_ALLOC_CONF, TORCHINDUCTOR_*) need no venv.
The techniques that act at a process's start (another malloc, the OpenMP runtime, the CUDA
allocator's settings) run their variants as arms of that kind too (studies/arms.variant_arm):
one mechanism. With `arms` set, every variant of the plan runs under every arm: the variants become
`<arm>` (the baseline recipe under that arm) and `<variant>@<arm>`, and each is compared with
its own reference: the first arm's baseline is the run's baseline, another arm's baseline is
compared with it (the version effect: B over A), and a variant under an arm with that arm's
baseline (the technique's effect under that version). Every variant then runs in a worker
process of its arm's interpreter (studies/arms.py), interleaved with the others in the same
balanced rounds, with the same data and seeds.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from speedbench.errors import ConfigError

ARM_KEYS = ("python", "env")
SEPARATOR = "@"  # <variant>@<arm>


@dataclass(frozen=True)
class Arm:
    """One environment: its name, its interpreter, and the variables set for its workers.
    `implied`: made by speedbench for a variant whose techniques set variables at a process's
    start (its name is the variant's; no A/B, so no arm column and no cache of its own)."""

    name: str
    python: str
    env: dict[str, str] = field(default_factory=dict)
    implied: bool = False

    def worker(self) -> str:
        """How a status names this arm's process."""
        return f"variant {self.name}'s fresh process" if self.implied \
            else f"arm {self.name}'s worker"


@dataclass(frozen=True)
class Crossed:
    """The plan's variants crossed with the arms: name -> recipe (baseline first), the
    baseline's name, each variant's arm, and each variant's reference ('' for the baseline's:
    the run's baseline)."""

    variants: dict[str, DictConfig]
    baseline: str
    arm_of: dict[str, Arm]
    reference: dict[str, str]


def parse_arms(node: Any) -> list[Arm]:
    """The `arms` mapping as Arms, in the order given; [] where none. Two at least; each with
    an executable `python` (this interpreter where none is given); `env` a mapping of names to
    strings. ConfigError otherwise."""
    if not node:
        return []
    items = OmegaConf.to_container(node) if isinstance(node, DictConfig) else node
    if not isinstance(items, dict) or len(items) < 2:
        raise ConfigError("arms: give two or more arms, e.g. arms: {a: {python: /venv-a/bin/"
                          "python}, b: {python: /venv-b/bin/python}}")
    return [_arm(str(name), spec) for name, spec in items.items()]


def _arm(name: str, spec: Any) -> Arm:
    where = f"arms.{name}"
    if SEPARATOR in name or not name:
        raise ConfigError(f"{where}: an arm's name may not be empty or hold '{SEPARATOR}'")
    if isinstance(spec, str):
        spec = {"python": spec}
    spec = {} if spec is None else spec
    if not isinstance(spec, dict) or set(spec) - set(ARM_KEYS):
        raise ConfigError(f"{where}: a mapping with `python` (an interpreter's path; this one "
                          "where omitted) and `env` ({NAME: value}); allowed keys: "
                          + ", ".join(ARM_KEYS))
    python = os.path.expanduser(str(spec.get("python") or sys.executable))
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"{where}.python: '{python}' is not an executable file; give a "
                          "Python interpreter (e.g. /path/to/venv/bin/python)")
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float)) for v in env.values()):
        raise ConfigError(f"{where}.env: a mapping of environment variable names to values")
    return Arm(name, python, {str(k): str(v) for k, v in env.items()})


def variant_name(variant: str, arm: Arm, baseline: str) -> str:
    """`<arm>` for the baseline recipe, `<variant>@<arm>` for another."""
    return arm.name if variant == baseline else f"{variant}{SEPARATOR}{arm.name}"


def cross(variants: dict[str, DictConfig], baseline: str, arms: list[Arm]) -> Crossed:
    """Every variant under every arm, the first arm's baseline first."""
    out, arm_of, reference = {}, {}, {}
    for arm in arms:
        for name, recipe in variants.items():
            crossed = variant_name(name, arm, baseline)
            out[crossed] = recipe
            arm_of[crossed] = arm
            # the baseline recipe under any arm: the run's baseline (the first arm's)
            reference[crossed] = "" if name == baseline else arm.name
    return Crossed(out, arms[0].name, arm_of, reference)
