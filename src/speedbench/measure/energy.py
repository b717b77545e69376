"""Energy per sample: a hardware energy counter read at the timed window's two ends.

- NVIDIA GPUs: NVML's total-energy counter (nvmlDeviceGetTotalEnergyConsumption, millijoules
  since the driver loaded; Volta and later), from the optional `nvidia-ml-py` package
  (`pip install speedbench[energy]`). The counter updates at about 10 Hz or slower: a window
  under MIN_WINDOW_S gives no figure, and says so.
- CPUs: Linux's RAPL counters (/sys/class/powercap/intel-rapl:N/energy_uj, the packages'
  energy in microjoules; AMD's kernels expose theirs there too) where the process can read
  them; they wrap at max_energy_range_uj.
- Anywhere else: `n/a: no energy counter here (<reason>)`. Never an estimate from a TDP.

The window's two ends are synchronised points (timing.timed_steps synchronises the device
before its clock starts and after its last step), so the reads bracket the window's work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from speedbench.results import schema

POWERCAP = Path("/sys/class/powercap")
MIN_WINDOW_S = 1.0  # NVML's counter updates at ~10 Hz: shorter windows are not read


@dataclass
class EnergyCounter:
    """A monotonic energy counter: read() in joules; `wrap_j` where it wraps (RAPL), else inf."""

    name: str
    read: Callable[[], float]
    wrap_j: float = math.inf

    def joules(self, before: float, after: float) -> float:
        """The energy between two reads, across one wrap at most."""
        spent = after - before
        return spent + self.wrap_j if spent < 0 else spent


def rapl_counter(root: Path = POWERCAP) -> Union[EnergyCounter, str]:
    """The CPU packages' RAPL counters summed, or why there are none."""
    if not root.is_dir():
        return f"no {root} (no RAPL driver: a virtual machine, or a kernel without powercap)"
    zones = sorted(p for p in root.glob("intel-rapl:*") if ":" not in p.name.split("rapl:")[1])
    if not zones:
        return f"{root} has no intel-rapl package zones"
    try:
        wrap = sum(int((z / "max_energy_range_uj").read_text()) for z in zones) / 1e6
        for z in zones:
            int((z / "energy_uj").read_text())
    except (OSError, ValueError) as exc:
        return f"RAPL is not readable here ({type(exc).__name__}: {exc}; it is often root-only)"

    def read() -> float:
        return sum(int((z / "energy_uj").read_text()) for z in zones) / 1e6
    return EnergyCounter("rapl", read, wrap)


def nvml_counter(device: torch.device) -> Union[EnergyCounter, str]:
    """NVML's total-energy counter of the CUDA device, or why there is none."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install speedbench[energy])"
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError as exc:
        return f"NVML has no energy counter for this GPU ({exc})"
    return EnergyCounter("nvml", lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                         / 1e3)


def energy_counter(device: torch.device) -> Union[EnergyCounter, str]:
    """The counter for `device`'s work: NVML on CUDA, RAPL on the CPU; else the reason
    (`n/a: no energy counter here (<reason>)`)."""
    if device.type == "cuda":
        got = nvml_counter(device)
    elif device.type == "cpu":
        got = rapl_counter()
    else:
        got = f"no energy counter speedbench reads on {device.type}"
    return got if isinstance(got, EnergyCounter) else f"n/a: no energy counter here ({got})"


_OPENED: dict[str, Union[EnergyCounter, str]] = {}


def counter_for(device: torch.device) -> Union[EnergyCounter, str]:
    """energy_counter, opened once per process and device."""
    key = str(device)
    if key not in _OPENED:
        _OPENED[key] = energy_counter(device)
    return _OPENED[key]


def window_energy(counter: Union[EnergyCounter, str], before: Optional[float],
                  after: Optional[float], elapsed_s: float, samples: int) -> dict:
    """The trial's energy columns: energy_j and energy_per_sample_j (NaN where not measured),
    and energy_status (`ok`, or `n/a: <why>`)."""
    nan = {"energy_j": math.nan, "energy_per_sample_j": math.nan}
    if isinstance(counter, str):
        return {**nan, "energy_status": counter}
    if before is None or after is None:
        return {**nan, "energy_status": "n/a: the counter was not read at both ends"}
    if elapsed_s < MIN_WINDOW_S:
        return {**nan, "energy_status": f"n/a: a {elapsed_s:.2g} s window is under "
                                        f"{MIN_WINDOW_S:g} s, the counter's resolution"}
    joules = counter.joules(before, after)
    return {"energy_j": joules, "energy_per_sample_j": joules / samples if samples else math.nan,
            "energy_status": schema.OK}


def read(counter: Union[EnergyCounter, str]) -> Optional[float]:
    return None if isinstance(counter, str) else counter.read()
