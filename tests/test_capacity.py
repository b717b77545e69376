"""The search for the largest micro-batch that fits (speedbench.studies.capacity), on a stated limit.

The device side (real out-of-memory errors) is in tests/test_gpu.py; here `fits` is a plain
predicate, so that the search's arithmetic can be checked exactly.
"""
from __future__ import annotations

import pytest
from conftest import TINY, compose_cfg

from speedbench.studies import capacity
from speedbench.config import ConfigError, build_plan


def test_doubles_then_halves_the_gap_to_within_a_sixteenth():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 300

    found = capacity.search(fits, start=8, limit=10_000, budget_s=60)
    assert tried[:7] == [8, 16, 32, 64, 128, 256, 512]  # doubling until the first failure
    assert found.largest <= 300 < found.first_oom
    assert found.first_oom - found.largest <= found.largest // 16
    assert found.stopped == "resolved" and found.tries == len(tried)


def test_a_start_that_does_not_fit_searches_below_it():
    found = capacity.search(lambda n: n <= 3, start=8, limit=100, budget_s=60)
    assert (found.largest, found.first_oom, found.stopped) == (3, 4, "resolved")


def test_nothing_fits():
    found = capacity.search(lambda n: False, start=8, limit=100, budget_s=60)
    assert (found.largest, found.first_oom) == (0, 1)


def test_stops_at_the_limit_while_still_fitting():
    found = capacity.search(lambda n: True, start=8, limit=100, budget_s=60)
    assert (found.largest, found.first_oom, found.stopped) == (64, None, "limit")


def test_stops_when_the_time_is_up_with_what_it_found():
    now = [0.0]

    def fits(n):
        now[0] += 10  # each try takes 10 s
        return True

    found = capacity.search(fits, start=8, limit=10_000, budget_s=25, clock=lambda: now[0])
    assert (found.largest, found.tries, found.stopped) == (32, 3, "time")


def test_largest_batch_s_must_be_positive():
    cfg = compose_cfg(*TINY, "bench.largest_batch_s=0")
    with pytest.raises(ConfigError, match=r"bench.largest_batch_s: 0(\.0)? is out of range; it must be > 0"):
        build_plan(cfg, None)


def test_the_report_says_when_the_search_stopped_short():
    import pandas as pd

    from speedbench.report import capacity_section

    rows = pd.DataFrame([
        {"model": "resnet", "variant": "bf16", "status": "ok", "largest_batch": 2048,
         "first_oom": float("nan"), "peak_mem_mb": 90000.4, "device_mem_mb": 143771.0,
         "tries": 7, "stopped": "limit"},
        {"model": "vae", "variant": "bf16", "status": "ok", "largest_batch": 300,
         "first_oom": 320, "peak_mem_mb": 140000.0, "device_mem_mb": 143771.0, "tries": 9,
         "stopped": "resolved"}])
    assert "resnet >= 2048, vae 300." in capacity_section.text(rows)
    table = capacity_section.table(rows).set_index("model")
    assert table.loc["resnet", "first out of memory"] == "-"
    assert table.loc["resnet", "status"].startswith("ok (still fitting at the search's limit (256")
    assert (table.loc["vae", "largest micro-batch"], table.loc["vae", "status"]) == ("300", "ok")
    assert capacity_section.searched(rows)
    assert not capacity_section.searched(rows.assign(status="n/a: CUDA only"))


def test_the_search_runs_one_micro_batch_per_step_on_one_device():
    """The techniques say which of their keys change for the search (capacity_overrides)."""
    from speedbench import techniques

    recipe = build_plan(compose_cfg(*TINY, "accumulate=4", "accumulate_mode=split"),
                        None).variants["default"]
    assert techniques.capacity_overrides(recipe) == {"accumulate": 1, "accumulate_mode": "add",
                                                     "batch_scale": 1, "parallel": "none"}
