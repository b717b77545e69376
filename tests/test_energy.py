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


# --- the verdict on energy per sample, energy to target, the report's section -----------------
def energy_trials(variant_j: list[float], base_j: list[float], status: str = "ok"):
    import pandas as pd

    rows = []
    for name, values in (("base", base_j), ("v", variant_j)):
        for rnd, j in enumerate(values):
            rows.append({"experiment": "e", "model": "m", "variant": name,
                         "is_baseline": name == "base", "status": "ok", "round": rnd,
                         "samples_per_s": 100.0, "step_ms": 10.0, "peak_mem_mb": 1.0,
                         "final_loss": 1.0, "data_wait_frac": 0.0, "host_rss_mb": 1.0,
                         "energy_per_sample_j": j if status == "ok" else math.nan,
                         "energy_status": status})
    return pd.DataFrame(rows)


def test_less_energy_per_sample_is_called_with_the_paired_interval():
    from speedbench.analysis import energy as verdicts
    from speedbench.analysis.intervals import paired_ratio_ci

    base = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0]
    variant = [b * f for b, f in zip(base, (0.70, 0.72, 0.69, 0.71, 0.70, 0.73))]
    trials = energy_trials(variant, base)
    ok, ref = trials[trials["variant"] == "v"], trials[trials["variant"] == "base"]
    got = verdicts.paired_energy(ok, ref, "round", 0.95, 0.02, False)
    assert got["energy_verdict"] == "less energy"
    assert (got["energy_ratio"], got["energy_ratio_lo"], got["energy_ratio_hi"]) == \
        pytest.approx(paired_ratio_ci(variant, base, 0.95))
    assert got["energy_ratio_hi"] < 1
    more = verdicts.paired_energy(ref.assign(variant="v", is_baseline=False), ok, "round", 0.95,
                                  0.02, False)
    assert more["energy_verdict"] == "more energy"


def test_without_a_counter_the_verdict_is_the_trials_na_and_no_figure():
    from speedbench.analysis import energy as verdicts

    reason = "n/a: no energy counter here (no /sys/class/powercap (no RAPL driver))"
    trials = energy_trials([1.0] * 3, [1.0] * 3, status=reason)
    ok, ref = trials[trials["variant"] == "v"], trials[trials["variant"] == "base"]
    got = verdicts.paired_energy(ok, ref, "round", 0.95, 0.02, False)
    assert got["energy_verdict"] == reason and math.isnan(got["energy_ratio"])
    assert math.isnan(got["energy_per_sample_j"])


def test_the_summary_carries_the_energy_columns_and_the_report_says_na():
    from speedbench.analysis.summary import summarise
    from speedbench.report import energy_section
    from speedbench.report.document import Document, to_markdown

    reason = "n/a: no energy counter here (no /sys/class/powercap)"
    trials = energy_trials([1.0] * 3, [1.0] * 3, status=reason)
    summary = summarise(trials)
    assert (summary["energy_verdict"] == reason).all()
    doc = Document("t")
    energy_section.add(doc, summary, trials)
    text = to_markdown(doc)
    assert "### Energy per sample" in text and f"{reason}: no energy figure" in text
    measured = energy_trials([0.5] * 3, [1.0] * 3)
    doc = Document("t")
    energy_section.add(doc, summarise(measured), measured)
    text = to_markdown(doc)
    assert "0.50x" in text and "less energy" in text


def test_energy_to_target_is_the_samples_at_the_measured_joules_per_sample():
    import pandas as pd

    from speedbench.analysis import energy as verdicts

    assert verdicts.to_target(1000, 0.25) == 250
    assert math.isnan(verdicts.to_target(1000, math.nan))
    runs = pd.DataFrame([{"experiment": "e", "model": "m", "variant": "v", "status": "ok",
                          "samples": s} for s in (900, 1000, 1100)])
    summary = pd.DataFrame([{"experiment": "e", "model": "m", "variant": "v",
                             "energy_per_sample_j": 0.5}])
    got = verdicts.to_target_rows(runs, summary)
    assert got["energy_to_target_j"].tolist() == [500.0]
