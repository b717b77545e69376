"""Quality verdicts (analysis/quality.py): the probe's held-out loss per seed -> a paired
ratio with a CI and a non-inferiority verdict; the recipe search refuses a worse option."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from speedbench.analysis import quality
from speedbench.search import selection
from speedbench.search.selection import Arm, Group, Option


def _rows(losses: dict[str, list[float]], baseline: str = "base") -> pd.DataFrame:
    return pd.DataFrame([{"experiment": "e", "model": "m", "variant": v, "is_baseline": v == baseline,
                          "seed": k, "steps": 12, "samples": 96, "loss": x, "status": "ok"}
                         for v, xs in losses.items() for k, x in enumerate(xs)])


def test_identical_numerics_are_non_inferior_with_a_ratio_of_exactly_one():
    base = [2.10, 2.31, 2.05]
    got = quality.summarise(_rows({"base": base, "same": list(base)}), 0.05).set_index("variant")
    assert got.loc["base", "quality_verdict"] == "baseline"
    same = got.loc["same"]
    assert (same["loss_ratio"], same["loss_ratio_lo"], same["loss_ratio_hi"]) == (1.0, 1.0, 1.0)
    assert same["quality_verdict"] == quality.NON_INFERIOR and same["quality_seeds"] == 3
    assert same["quality_loss"] == pytest.approx(2.10)


def test_a_clearly_higher_loss_is_worse_and_a_noisy_one_inconclusive():
    base = [2.0, 2.2, 1.9, 2.1, 2.05]
    worse = [x * f for x, f in zip(base, (1.30, 1.32, 1.29, 1.31, 1.30))]
    noisy = [x * f for x, f in zip(base, (0.9, 1.2, 1.0, 1.15, 0.95))]
    got = quality.summarise(_rows({"base": base, "worse": worse, "noisy": noisy}),
                            0.05).set_index("variant")
    assert got.loc["worse", "quality_verdict"] == quality.WORSE
    assert got.loc["worse", "loss_ratio_lo"] > 1.05
    assert got.loc["noisy", "quality_verdict"] == "inconclusive"
    # both comparisons share the run's family: Bonferroni over 2
    assert got.loc["noisy", "quality_level"] == pytest.approx(1 - 0.05 / 2)


def test_a_small_but_real_increase_within_the_tolerance_is_non_inferior():
    base = [2.0, 2.2, 1.9, 2.1]
    slightly = [x * 1.02 for x in base]
    got = quality.summarise(_rows({"base": base, "v": slightly}), 0.05).set_index("variant")
    assert got.loc["v", "loss_ratio"] == pytest.approx(1.02)
    assert got.loc["v", "quality_verdict"] == quality.NON_INFERIOR
    tight = quality.summarise(_rows({"base": base, "v": slightly}), 0.01).set_index("variant")
    assert tight.loc["v", "quality_verdict"] == quality.WORSE


def test_a_diverged_seed_and_a_variant_without_loss_say_so():
    frame = _rows({"base": [2.0, 2.1, 2.2], "nan": [2.0, math.nan, 2.2]})
    frame = pd.concat([frame, pd.DataFrame([{
        "experiment": "e", "model": "m", "variant": "slow", "is_baseline": False, "seed": 0,
        "status": "too slow: 9x slower"}])], ignore_index=True)
    got = quality.summarise(frame, 0.05).set_index("variant")
    assert got.loc["nan", "quality_verdict"] == quality.DIVERGED
    assert got.loc["slow", "quality_verdict"] == "no loss (too slow: 9x slower)"
    assert math.isnan(got.loc["slow", "loss_ratio"])


def test_attach_joins_the_verdicts_to_the_summary_and_leaves_old_runs_alone():
    summary = pd.DataFrame({"experiment": ["e", "e"], "model": ["m", "m"],
                            "variant": ["base", "same"], "speedup": [1.0, 1.1]})
    joined = quality.attach(summary, _rows({"base": [1.0, 2.0], "same": [1.0, 2.0]}), 0.05)
    assert list(joined["quality_verdict"]) == ["baseline", quality.NON_INFERIOR]
    assert list(joined["speedup"]) == [1.0, 1.1]
    assert quality.attach(summary, None, 0.05) is summary


def test_the_search_refuses_a_confirmed_faster_option_whose_loss_is_worse():
    """A fast option that trains worse is never added; the next best one is."""
    groups = [Group("g", [Option("g", "g_fast_but_worse", {"a": 1})]),
              Group("h", [Option("h", "h_fast_and_fine", {"b": 1})])]
    rng = np.random.default_rng(0)

    def measure(recipes, *, step, time_left_s, rounds=None):
        n = rounds or 6
        arms = {}
        for label, over in recipes.items():
            gain = (1.6 if over.get("a") else 1.0) * (1.3 if over.get("b") else 1.0)
            arms[label] = Arm("ok", list(100 * gain * rng.normal(1, 0.01, n)))
            if over.get("a") and "confirm" in step:
                arms[label].quality, arms[label].quality_note = quality.WORSE, "1.4x [1.3, 1.5]"
        return arms

    result = selection.search(groups, {}, measure, screen_rounds=4)
    assert [o.label for o in result.chosen] == ["h_fast_and_fine"]
    assert result.excluded["g_fast_but_worse"].startswith("refused: held-out loss significantly")


def test_the_recommendation_skips_a_faster_variant_whose_loss_is_worse():
    from speedbench.report import recommend

    summary = pd.DataFrame([
        {"experiment": "e", "model": "m", "variant": "base", "is_baseline": True,
         "status": "ok", "verdict": "baseline", "speedup": 1.0, "quality_verdict": "baseline"},
        {"experiment": "e", "model": "m", "variant": "fast", "is_baseline": False,
         "status": "ok", "verdict": "faster", "speedup": 1.5, "speedup_lo": 1.4,
         "speedup_hi": 1.6, "quality_verdict": quality.WORSE, "loss_ratio": 1.3,
         "loss_ratio_lo": 1.2, "loss_ratio_hi": 1.4}])
    advice, = recommend.advise(summary)
    assert not advice.use
    assert recommend.lines(advice) == [
        "use: nothing measured here was significantly faster than plain PyTorch",
        "skip: e: fast, 1.50x [1.40, 1.60], but its held-out loss is worse: 1.30x [1.20, 1.40]"]


@pytest.mark.slow
def test_the_rounds_write_paired_seeds_where_a_variant_is_left_to_compare(tmp_path,
                                                                            monkeypatch):
    """Identical recipes: the same losses in every seed, non-inferior at exactly 1. A variant
    stopped as too slow leaves the baseline nothing to compare: its extra seeds are spared."""
    from conftest import TINY, compose_cfg

    from speedbench.config import build_plan
    from speedbench.measure import rounds, stopping
    from speedbench.results.runs import load_quality

    cfg = compose_cfg(*TINY, "model=transformer", "bench.repeats=1", "bench.quality_seeds=3",
                      "+variants={base:{},same:{},slow:{accumulate:2}}", "baseline=base")
    real = stopping.far_slower
    monkeypatch.setattr(stopping, "far_slower", lambda s, p, ref: (0.1, 0.08, 0.12)
                        if ref is not None and p == 8 and len(s) in stopping.STOP_LOOKS
                        else real(s, p, ref))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    writer = rounds.measure_plan(build_plan(cfg, None), tmp_path / "a", progress=False)
    rows = load_quality(tmp_path / "a")
    assert rows.groupby("variant").size().to_dict() == {"base": 3, "same": 3, "slow": 1}
    assert rows[rows["variant"] == "slow"]["status"].iloc[0].startswith("too slow: ")
    base, same = (rows[rows["variant"] == v]["loss"].tolist() for v in ("base", "same"))
    assert base == same and len(set(base)) == 3
    judged = quality.summarise(rows, 0.05).set_index("variant")
    assert judged.loc["same", "quality_verdict"] == quality.NON_INFERIOR
    assert {r["variant"] for r in writer.rows} == {"base", "same", "slow"}

    cfg = compose_cfg(*TINY, "model=transformer", "bench.repeats=1", "bench.quality_seeds=3",
                      "+variants={base:{},slow:{accumulate:2}}", "baseline=base")
    rounds.measure_plan(build_plan(cfg, None), tmp_path / "b", progress=False)
    assert load_quality(tmp_path / "b").groupby("variant").size().to_dict() == \
        {"base": 1, "slow": 1}
