"""Energy per sample: a counter read at the window's two ends, or n/a with its reason; never
an estimate. This VM has no RAPL: the n/a path runs here; NVML's is `gpu`-marked."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from speedbench.measure import energy
from speedbench.measure.energy import EnergyCounter, rapl_counter, window_energy

CPU = torch.device("cpu")


def test_without_a_counter_the_trial_says_na_with_the_reason():
    got = energy.energy_counter(CPU)
    if not energy.POWERCAP.is_dir():  # this VM: no RAPL driver
        assert got.startswith("n/a: no energy counter here (no /sys/class/powercap")
    cols = window_energy(got, None, None, 2.0, 10) if isinstance(got, str) else None
    if cols is not None:
        assert math.isnan(cols["energy_j"]) and math.isnan(cols["energy_per_sample_j"])
        assert cols["energy_status"] == got


def test_rapl_sums_the_package_zones_and_crosses_a_wrap(tmp_path: Path):
    for n, uj in ((0, 5_000_000), (1, 7_000_000)):
        zone = tmp_path / f"intel-rapl:{n}"
        zone.mkdir()
        (zone / "energy_uj").write_text(str(uj))
        (zone / "max_energy_range_uj").write_text("10000000")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-zone (core): inside its package's count
    counter = rapl_counter(tmp_path)
    assert isinstance(counter, EnergyCounter) and counter.read() == pytest.approx(12.0)
    assert counter.joules(19.0, 3.0) == pytest.approx(4.0)  # wrapped at 20 J
    cols = window_energy(counter, 10.0, 16.0, 2.0, 12)
    assert cols == {"energy_j": 6.0, "energy_per_sample_j": 0.5, "energy_status": "ok"}


def test_an_unreadable_or_missing_rapl_says_why(tmp_path: Path):
    assert "no " in rapl_counter(tmp_path / "absent")
    assert "no intel-rapl" in rapl_counter(tmp_path)
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    assert rapl_counter(tmp_path).startswith("RAPL is not readable here")


def test_a_window_under_a_second_gives_no_figure():
    counter = EnergyCounter("test", lambda: 0.0)
    cols = window_energy(counter, 1.0, 2.0, 0.4, 10)
    assert math.isnan(cols["energy_j"]) and "under 1 s" in cols["energy_status"]


def test_a_trial_records_the_energy_columns():
    from test_technique_effects import trial

    got = trial("bench.warmup=1", "bench.steps=2")
    counter = energy.counter_for(CPU)
    if isinstance(counter, str):  # this VM: the reason, exactly, and no figure
        assert got["energy_status"] == counter
        assert math.isnan(got["energy_j"]) and math.isnan(got["energy_per_sample_j"])
    else:  # RAPL readable: a figure, or a window too short for one
        assert got["energy_status"] == "ok" or "under 1 s" in got["energy_status"]


@pytest.mark.gpu
def test_gpu_nvml_counts_the_windows_energy():
    pytest.importorskip("pynvml")
    counter = energy.energy_counter(torch.device("cuda:0"))
    assert isinstance(counter, EnergyCounter), counter
    before = counter.read()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):
        a = a @ a / 64
    torch.cuda.synchronize()
    import time
    time.sleep(1.0)
    assert counter.read() > before
