"""Memory forecasts (analysis/memory.py): the peak at another micro-batch and the largest that
fits, linear in the baseline's measured state/activation split, shown beside what was
measured (report/memory_section.py, capacity_section.py)."""
from __future__ import annotations

import math

import pandas as pd
import pytest
from conftest import TINY, only_run_dir, run_main

from speedbench.analysis import memory
from speedbench.report import capacity_section, memory_section
from speedbench.report.document import Document


def test_the_state_stays_and_the_activations_scale_with_the_micro_batch():
    assert memory.peak_at(100.0, 50.0, 4, 4) == 150.0
    assert memory.peak_at(100.0, 50.0, 4, 8) == 200.0
    assert memory.peak_at(100.0, 50.0, 4, 2) == 125.0


def test_the_largest_micro_batch_that_fits():
    assert memory.largest_fit(100.0, 50.0, 4, 300.0) == 16  # 4 x 200 / 50
    assert memory.largest_fit(100.0, 50.0, 4, 299.0) == 15  # floor
    assert memory.largest_fit(100.0, 50.0, 4, 90.0) == 0  # the state alone does not fit
    assert memory.largest_fit(100.0, 0.0, 4, 300.0) is None  # nothing scales with the batch
    assert memory.largest_fit(100.0, math.nan, 4, 300.0) is None  # not measured


def _trials(rows: list[tuple]) -> pd.DataFrame:
    """trials.csv rows: (variant, is_baseline, batch_size, peak_mem_mb, activation_mem_mb)."""
    return pd.DataFrame([{"experiment": "e", "model": "m", "variant": v, "is_baseline": base,
                          "status": "ok", "batch_size": b, "peak_mem_mb": p,
                          "activation_mem_mb": a} for v, base, b, p, a in rows])


def test_each_variant_beside_the_baseline_forecast_at_its_micro_batch():
    trials = _trials([("b1", True, 4, 150.0, 50.0), ("b1", True, 4, 152.0, 52.0),
                      ("b2", False, 8, 210.0, 110.0), ("acc4", False, 4, 160.0, 60.0)])
    got = memory.forecast_vs_measured(trials).set_index("variant")
    # the baseline's medians: peak 151, activations 51, so state 100
    assert got.loc["b1", "forecast_mb"] == pytest.approx(151.0)  # its own measured peak
    assert got.loc["b2", "forecast_mb"] == pytest.approx(100.0 + 51.0 * 2)
    assert got.loc["b2", "error"] == pytest.approx(202.0 / 210.0 - 1)
    assert got.loc["acc4", "forecast_mb"] == pytest.approx(151.0)  # the same micro-batch
    table = memory_section.forecast_table(trials).set_index("variant")
    assert table.loc["b2", "error"] == "-3.8 %"


def test_nothing_to_show_without_a_larger_micro_batch_or_a_split():
    same = _trials([("fp32", True, 4, 150.0, 50.0), ("bf16", False, 4, 120.0, 30.0)])
    assert memory.forecast_vs_measured(same).empty
    older = _trials([("b1", True, 4, 150.0, 50.0), ("b2", False, 8, 210.0, 110.0)]) \
        .drop(columns="activation_mem_mb")  # a run written before the split
    assert memory.forecast_vs_measured(older).empty
    doc = Document("t")
    memory_section.add(doc, older)
    assert doc.blocks == []


def test_the_capacity_table_gives_the_forecast_largest_beside_the_searched_one():
    trials = _trials([("b1", True, 4, 150.0, 50.0)])
    capacity = pd.DataFrame([{"experiment": "e", "model": "m", "variant": "b1", "status": "ok",
                              "largest_batch": 20, "first_oom": 21, "peak_mem_mb": 290.0,
                              "device_mem_mb": 300.0, "tries": 7, "stopped": "resolved"}])
    table = capacity_section.table(capacity, trials).iloc[0]
    assert (table["largest micro-batch"], table["forecast (linear)"]) == ("20", "16")
    assert "forecast (linear)" not in capacity_section.table(capacity)  # without the trials
    # no device memory (the CPU's n/a row): the baseline's peaks at 2x and 4x, forecast only
    na = capacity.assign(status="n/a: CUDA only", device_mem_mb=math.nan)
    assert capacity_section.table(na, trials).iloc[0]["forecast (linear)"] == "-"
    only = memory_section.forecast_only(trials, na).iloc[0]
    assert only["forecast peak MB at 2x (forecast only)"] == "200.0"  # 100 + 50 x 2
    assert only["forecast peak MB at 4x (forecast only)"] == "300.0"


@pytest.mark.slow
def test_a_batch_scale_run_forecasts_each_peak_beside_the_measured_one(tmp_path):
    """A tiny +experiment=batch_scale on the CPU: every variant has a forecast and a measured
    peak; the baseline's forecast is its own peak, acc4's too, and b2's and b4's grow with B."""
    proc = run_main("+experiment=batch_scale", *TINY, "model=transformer",
                    "models.transformer.small.dim=16", "models.transformer.small.layers=1",
                    "bench.explain=false", "bench.find_largest_batch=true",
                    f"out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    trials = pd.read_csv(run_dir / "trials.csv")
    got = memory.forecast_vs_measured(trials).set_index("variant")
    assert list(got.index) == ["b1", "acc4", "b2", "b4"]
    assert list(got["micro_batch"]) == [4, 4, 8, 16]
    measured_b1 = trials[trials["variant"] == "b1"]["peak_mem_mb"].median()
    assert got.loc["b1", "measured_mb"] == pytest.approx(measured_b1)
    assert got.loc["b1", "forecast_mb"] == pytest.approx(measured_b1)
    assert got.loc["acc4", "forecast_mb"] == pytest.approx(measured_b1)
    assert got.loc["b1", "forecast_mb"] < got.loc["b2", "forecast_mb"] < got.loc["b4",
                                                                                 "forecast_mb"]
    assert got["error"].map(math.isfinite).all()
    report = (run_dir / "report.md").read_text()
    assert "Memory: forecast beside measured" in report
    assert "(forecast only)" in report  # the CPU searches no largest batch: forecasts alone
