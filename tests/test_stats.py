"""Confidence intervals and verdicts: call a difference only when the CI excludes 1."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from speedbench.analysis import adaptive, intervals
from speedbench.analysis.summary import summarise
from speedbench.report import method
from speedbench.results import schema


def test_clear_speedup_is_called_faster():
    rng = np.random.default_rng(1)
    base = 100 + rng.normal(0, 1, 7)
    fast = 150 + rng.normal(0, 1, 7)
    ratio, lo, hi = intervals.unpaired_ratio_ci(fast, base)
    assert 1.4 < lo <= ratio <= hi < 1.6
    assert intervals.verdict(lo, hi) == intervals.FASTER
    assert intervals.verdict(*intervals.unpaired_ratio_ci(base, fast)[1:]) == intervals.SLOWER


def test_same_distribution_is_no_significant_difference():
    rng = np.random.default_rng(2)
    a, b = 100 + rng.normal(0, 5, 9), 100 + rng.normal(0, 5, 9)
    _, lo, hi = intervals.unpaired_ratio_ci(a, b)
    assert lo < 1 < hi and intervals.verdict(lo, hi) == intervals.SAME


def test_one_trial_gives_no_verdict():
    ratio, lo, hi = intervals.unpaired_ratio_ci([2.0], [1.0])
    assert ratio == 2.0 and math.isnan(lo) and intervals.verdict(lo, hi) == intervals.TOO_FEW


def _trials(rows):
    cols = ["experiment", "model", "variant", "is_baseline", "trial", "status", "samples_per_s",
            "step_ms", "data_wait_frac", "peak_mem_mb", "host_rss_mb", "final_loss"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows])


def test_summary_keeps_failed_variants_with_their_status():
    rows = []
    for t in range(3):
        rows.append(("e", "m", "base", True, t, "ok", 100 + t, 10, 0.1, 50, 500, 1.0))
        rows.append(("e", "m", "fast", False, t, "ok", 200 + t, 5, 0.1, 25, 480, 1.0))
        rows.append(("e", "m", "broken", False, t, "oom", math.nan, math.nan, math.nan, math.nan,
                     math.nan, math.nan))
    s = summarise(_trials(rows)).set_index("variant")
    assert s.loc["base", "verdict"] == "baseline" and s.loc["base", "speedup"] == 1
    assert s.loc["fast", "verdict"] == "faster" and 1.9 < s.loc["fast", "speedup"] < 2.1
    assert math.isclose(s.loc["fast", "mem_ratio"], 0.5)
    assert s.loc["broken", "status"] == "oom" and s.loc["broken", "verdict"] == "oom"
    assert math.isnan(s.loc["broken", "speedup"])


def test_t_quantile_matches_tables():
    # Two-sided Student t critical values (any statistics table).
    for level, df, want in ((0.95, 1, 12.706), (0.95, 4, 2.776), (0.99, 9, 3.250),
                            (0.95, 30, 2.042)):
        assert abs(intervals.t_quantile(level, df) - want) < 1e-3


def _rounds(base, variants, key="round"):
    """Trials of one model measured in rounds: base[i] and each variant's [i] in round i."""
    rows = []
    for i, b in enumerate(base):
        rows.append({"experiment": "e", "model": "m", "variant": "base", "is_baseline": True,
                     key: i, "status": "ok", "samples_per_s": b})
        for name, values in variants.items():
            rows.append({"experiment": "e", "model": "m", "variant": name, "is_baseline": False,
                         key: i, "status": "ok", "samples_per_s": values[i]})
    t = pd.DataFrame(rows)
    for col in ("step_ms", "data_wait_frac", "peak_mem_mb", "host_rss_mb", "final_loss"):
        t[col] = 1.0
    if key == "round":
        t["trial"] = t["round"]
    return t


def test_pairing_by_round_cancels_drift():
    # The machine slows down 40 % over the run; the variant is always 10 % faster in its round.
    base = np.array([100, 90, 80, 70, 60, 100, 95.0])
    s = summarise(_rounds(base, {"v": base * 1.10})).set_index("variant")
    assert math.isclose(s.loc["v", "speedup"], 1.10)
    assert s.loc["v", "verdict"] == intervals.FASTER and s.loc["v", "rounds"] == 7
    # Unpaired, the same numbers would overlap completely.
    _, lo, hi = intervals.unpaired_ratio_ci(base * 1.1, base)
    assert lo < 1 < hi


def test_pairs_on_trial_when_no_round_column():
    base = np.array([100, 90, 80, 70, 60.0])
    t = _rounds(base, {"v": base * 0.8}, key="trial")
    assert intervals.pair_key(t) == "trial"
    assert summarise(t).set_index("variant").loc["v", "verdict"] == intervals.SLOWER


def test_four_verdicts_and_detectable_effect():
    rng = np.random.default_rng(0)
    base = 100 * np.exp(rng.normal(0, 0.005, 8))
    noisy = base * np.array([1.25, 0.8] * 4)  # centred on 1, far too spread to decide
    t = _rounds(base, {"same": base * np.exp(rng.normal(0, 0.005, 8)), "fast": base * 1.5,
                       "tiny": base * 1.02, "noisy": noisy})
    s = summarise(t).set_index("variant")
    assert s.loc["same", "verdict"] == intervals.EQUIVALENT
    assert s.loc["fast", "verdict"] == intervals.FASTER
    # Significant (the CI excludes 1) but below the 5 % threshold: not a call.
    assert s.loc["tiny", "speedup_lo"] > 1 and s.loc["tiny", "verdict"] == intervals.EQUIVALENT
    assert s.loc["noisy", "verdict"] == intervals.INCONCLUSIVE
    assert s.loc["noisy", "min_detectable"] >= s.loc["noisy", "ci_halfwidth"] > 0.05
    assert math.isnan(s.loc["fast", "min_detectable"])


def test_summary_states_the_family_and_adjusted_level():
    rng = np.random.default_rng(4)
    base = 100 * np.exp(rng.normal(0, 0.02, 5))
    variants = {f"v{i}": base * np.exp(rng.normal(0, 0.02, 5)) for i in range(4)}  # noisy
    s = summarise(_rounds(base, variants))
    assert (s["comparisons"] == 4).all() and (s["family_level"] == 0.05).all()
    rounds = 0.05 * (1 - intervals.STOP_SHARE)  # the probes' early stops spend the rest
    assert np.allclose(s["ci_level"], 1 - rounds / 4)
    one = summarise(_rounds(base, {"v0": variants["v0"]}))
    assert (one["comparisons"] == 1).all() and np.allclose(one["ci_level"], 1 - rounds)
    # More comparisons, wider intervals, for the same data: v0's half-width on the log scale
    # grows by the ratio of the t quantiles at the two levels (5 rounds: 4 degrees of freedom).
    w4 = s.set_index("variant").loc["v0", "ci_halfwidth"]
    w1 = one.set_index("variant").loc["v0", "ci_halfwidth"]
    widening = intervals.t_quantile(1 - rounds / 4, 4) / intervals.t_quantile(1 - rounds, 4)
    assert w1 > 0 and math.log1p(w4) / math.log1p(w1) == pytest.approx(widening)


def test_threshold_read_from_trials():
    base = np.array([100, 101, 99, 100, 102.0])
    t = _rounds(base, {"v": base * 1.08})
    assert summarise(t).set_index("variant").loc["v", "verdict"] == intervals.FASTER
    t["noise_threshold"] = 0.10
    assert summarise(t).set_index("variant").loc["v", "verdict"] == intervals.EQUIVALENT


class _Bench:
    target_ci, time_budget_s, repeats = 0.03, 100.0, 5


def test_rounds_stop_at_a_look_once_decided_or_out_of_time():
    rng = np.random.default_rng(3)
    base = 100 * np.exp(rng.normal(0, 0.05, 15))
    wide = _rounds(base, {"v": base * np.exp(rng.normal(0, 0.05, 15))}).to_dict("records")
    narrow = _rounds(base[:5], {"v": base[:5] * 1.2}).to_dict("records")
    five = [r for r in wide if r["round"] < 5]
    assert adaptive.wants_more_rounds(five, _Bench, 5, elapsed_s=10)  # 5 more fit: 20 s
    # the next look (10 rounds, 120 s) would not fit, but a 6th round does (72 s): on, and the
    # rounds that end between the looks are reported at the 2nd look's level
    assert adaptive.wants_more_rounds(five, _Bench, 5, elapsed_s=60)
    assert not adaptive.wants_more_rounds(five, _Bench, 5, elapsed_s=90)  # a 6th: 108 s
    assert not adaptive.wants_more_rounds(narrow, _Bench, 5, elapsed_s=10)  # decided: faster
    # between two looks: on while the next round fits (7 rounds in 80 s: the 8th ends by 91 s)
    assert adaptive.wants_more_rounds(wide[:14], _Bench, 7, elapsed_s=80)
    assert not adaptive.wants_more_rounds(wide[:14], _Bench, 7, elapsed_s=99)  # 113 s > 100
    assert not adaptive.wants_more_rounds(wide, _Bench, 15, elapsed_s=10)  # the last look


def test_looks_spend_the_family_error_once():
    for looks in (1, 2, 3, 5):
        shares = [intervals.spending_share(k, looks) for k in range(1, looks + 1)]
        assert math.isclose(sum(shares), 1) and all(x > 0 for x in shares)
    # one look: Bonferroni over the rounds' share of the family (the early stops spend the rest)
    rounds = 0.05 * (1 - intervals.STOP_SHARE)
    assert intervals.sequential_level(4) == intervals.comparison_level(4, rounds)
    assert intervals.sequential_level(4, 1, 3) > 1 - rounds / 4
    assert [intervals.look_of(n, 5, 3) for n in (3, 5, 9, 10, 15, 20)] == [1, 1, 1, 2, 3, 3]


def test_summary_reports_the_level_of_the_look_it_stopped_at():
    rng = np.random.default_rng(4)
    base = 100 * np.exp(rng.normal(0, 0.05, 10))
    t = _rounds(base, {"v": base * 1.1 * np.exp(rng.normal(0, 0.02, 10)), "w": base})
    t["min_rounds"], t["looks"] = 5, 3
    row = summarise(t).set_index("variant").loc["v"]
    assert row["rounds"] == 10
    rounds = 0.05 * (1 - intervals.STOP_SHARE)
    assert math.isclose(row["ci_level"], 1 - rounds * intervals.spending_share(2, 3) / 2)
    one_look = summarise(t.assign(looks=1)).set_index("variant").loc["v"]
    assert one_look["speedup_hi"] - one_look["speedup_lo"] < row["speedup_hi"] - row["speedup_lo"]


def test_a_recipe_screen_is_a_screen_a_budget_cut_is_judged_and_one_round_has_no_ci():
    """A recipe search's screen (its level allotted, fewer rounds than the run's floor) ranks
    options and decides nothing; an experiment's rounds the budget cut short are judged at
    their look's level; one round has no interval."""
    base = np.array([100, 101, 99, 100, 102.0])
    screen = _rounds(base[:3], {"v": base[:3] * 1.5}).assign(experiment="screen", min_rounds=3)
    cut = _rounds(base[:3], {"v": base[:3] * 1.5}).assign(experiment="cut", min_rounds=5)
    one = _rounds(base[:1], {"v": base[:1] * 1.5}).assign(experiment="one", min_rounds=5)
    full = _rounds(base, {"v": base * 1.5}).assign(min_rounds=5)
    s = summarise(pd.concat([screen, cut, one, full]), per_experiment=True,
                  levels={("screen", "m"): 0.99})
    verdicts = s[~s["is_baseline"]].set_index("experiment")["verdict"]
    assert verdicts["screen"] == intervals.SCREENING and verdicts["e"] == intervals.FASTER
    assert verdicts["cut"] == intervals.FASTER and verdicts["one"] == intervals.NO_CI


def test_report_lead_line_crowns_only_a_significant_result():
    from speedbench.report.render import at_a_glance

    base = np.array([100, 101, 99, 100, 102.0])
    noisy = base * np.array([1.6, 0.9, 1.5, 0.8, 1.4])  # 1.2x on average, far too spread
    s = summarise(_rounds(base, {"noisy": noisy}))
    assert s.set_index("variant").loc["noisy", "verdict"] == intervals.INCONCLUSIVE
    text = at_a_glance(s)
    assert "Best:" not in text and "No variant is significantly faster" in text
    s = summarise(_rounds(base, {"noisy": noisy, "fast": base * 1.3}))
    assert "Best: fast on m, 1.30x (faster)." in at_a_glance(s)


def test_family_text_states_comparisons_level_and_loss_meaning():
    base = np.array([100, 101, 99, 100, 102.0])
    text = method.family_text(summarise(_rounds(base, {f"v{i}": base for i in range(6)})))
    assert "6 speed comparisons" in text and "at most 5%" in text and "99.25%" in text
    assert "paired seeds" in text and "non-inferior" in text and "time to target" in text


def test_a_variant_stopped_early_keeps_its_step_time_and_counts_in_the_family():
    import pytest

    base = np.array([100, 101, 99, 100, 102.0])
    t = _rounds(base, {}).assign(probe_samples_per_s=80.0)
    slow = {"experiment": "e", "model": "m", "variant": "fp16", "is_baseline": False, "round": 0,
            "trial": 0, "status": "too slow: 100x slower than the baseline in steady steps "
            "(38 s/step, median of 3), stopped after 4 steps", "samples_per_s": 0.8,
            "step_ms": 38000.0, "probe_samples_per_s": 0.8}
    s = summarise(pd.concat([t, pd.DataFrame([slow])])).set_index("variant")
    assert s.loc["fp16", "verdict"] == schema.STOPPED_SLOWER and s.loc["fp16", "step_ms"] == 38000
    assert s.loc["fp16", "speedup"] == pytest.approx(0.01)  # the probes' ratio, no CI
    assert s.loc["fp16", "comparisons"] == 1


def test_new_bench_keys_are_range_checked():
    import pytest

    from conftest import TINY, compose_cfg
    from speedbench.config import ConfigError, build_plan

    for key, value, allowed in (("noise_threshold", 2.0, "> 0 and < 1"),
                                ("target_ci", 1.5, "> 0 and < 1"),
                                ("quality_steps", -1, "integer >= 0")):
        with pytest.raises(ConfigError, match=rf"bench\.{key}: {value} is out of range; it must "
                                              rf"be (an )?{allowed}"):
            build_plan(compose_cfg(*TINY, f"bench.{key}={value}", experiment="amp"), "amp")


def test_two_wild_pairs_at_a_strict_level_give_an_infinite_upper_end_not_an_error():
    # a trial at 3.4 samples/s on a loaded machine, at a level over 15 comparisons (CI)
    ratio, lo, hi = intervals.paired_ratio_ci([196.0, 290.7], [226.0, 3.41], 0.99933)
    assert math.isfinite(ratio) and lo >= 0 and hi == math.inf
    assert intervals.verdict(lo, hi) == intervals.SAME  # "no significant difference"


def test_the_looks_spread_over_the_budget_within_their_bounds():
    # the first look after bench.repeats (5); 3 looks at 2 s a round: 30 s fit 15 rounds,
    # looks at 5, 10, 15
    assert intervals.look_spacing(30, 5, 2.0, 3) == 5
    # 120 s fit 60 rounds: the later looks 27 apart, capped at 4 x 5: looks at 5, 25, 45
    assert intervals.look_spacing(120, 5, 2.0, 3) == 20
    assert intervals.most_rounds(5, 3, 20) == 45
    assert intervals.look_spacing(70, 5, 2.0, 3) == 15  # 35 rounds: 5, 20, 35
    # no pace measured, no budget, one look: bench.repeats
    assert intervals.look_spacing(120, 5, 0.0, 3) == 5
    assert intervals.look_spacing(math.inf, 5, 2.0, 3) == 5
    assert intervals.look_spacing(120, 5, 2.0, 1) == 5
    # the look a comparison stopped at, and whether rounds end at one, on that schedule
    assert [intervals.look_of(n, 5, 3, 20) for n in (3, 5, 24, 25, 44, 45, 60)] == \
        [1, 1, 1, 2, 2, 3, 3]
    assert [n for n in range(1, 50) if intervals.is_look(n, 5, 20)] == [5, 25, 45]
    # ended between two looks, a comparison is reported at the next look, whose share of the
    # error no interim analysis spent: never twice at one look's level
    assert [intervals.reported_look(n, 5, 3, 20) for n in (3, 5, 24, 25, 26, 44, 45)] == \
        [1, 1, 2, 2, 3, 3, 3]
    plan = intervals.Looks(comparisons=2, min_rounds=5, looks=3, every=20)
    assert plan.level(30) == intervals.sequential_level(2, 3, 3) > plan.level(25)  # stricter


def test_a_long_budget_adds_looks_rather_than_leaving_its_time_unspent():
    # 2 s a round, bench.repeats 5: 3 looks fit from 30 s; at their widest spacing (20) they
    # end at 45 rounds, so 130 s (65 rounds) adds a 4th look and 600 s (300) reaches MAX_LOOKS
    assert [intervals.planned_looks(s, 5, 2.0) for s in (8, 20, 30, 120, 130, 170, 600)] == \
        [1, 2, 3, 3, 4, 5, intervals.MAX_LOOKS]
    looks = intervals.planned_looks(170, 5, 2.0)
    spacing = intervals.look_spacing(170, 5, 2.0, looks)
    assert spacing == 20 and intervals.most_rounds(5, looks, spacing) == 85  # of 85 that fit
    # more looks, each at a stricter level: the error they spend still sums to the family's
    assert sum(intervals.spending_share(k, looks) for k in range(1, looks + 1)) == \
        pytest.approx(1.0)
    assert intervals.planned_looks(math.inf, 5, 2.0) == intervals.LOOKS


def test_a_not_measured_row_shows_no_speed_up_and_keeps_its_unpaired_probe_ratio():
    """Finding 6 (measurement audit 5): identical variants a limit stopped printed their
    probe's unpaired ratio (1.50x, 0.58x, 1.23x for A/A recipes) as the row's speed-up."""
    base = np.array([100, 101, 99, 100, 102.0])
    t = _rounds(base, {}).assign(probe_samples_per_s=100.0)
    cut = {"experiment": "e", "model": "m", "variant": "b", "is_baseline": False, "round": 0,
           "trial": 0, "status": "not measured: a steady probe step took 2.25 s; ...",
           "probe_samples_per_s": 150.0, "probe_speedup": 1.5}
    s = summarise(pd.concat([t, pd.DataFrame([cut])])).set_index("variant")
    assert s.loc["b", "verdict"] == schema.NOT_MEASURED
    assert s.loc["b", ["speedup", "speedup_lo", "speedup_hi"]].isna().all()
    assert s.loc["b", "probe_speedup"] == 1.5  # kept, as the probe's (unpaired) figure


def _burst_pair(shares_a, shares_b, speed_a, speed_b):
    """Two sides of a paired comparison, round by round, with others' CPU share per trial."""
    rounds = range(len(shares_a))
    side = lambda shares, speeds: pd.DataFrame(  # noqa: E731
        {"round": list(rounds), "samples_per_s": speeds, "others_cpu_share": shares})
    return side(shares_a, speed_a), side(shares_b, speed_b)


def test_a_round_a_burst_hit_is_left_out_of_the_paired_comparison():
    """A quiet-machine A/B of identical speeds came out 0.68x [0.33, 1.37] because another
    process took half the CPU during 4 of 21 trials (10x slower there); the rounds a burst
    hit are left out, both sides, on what the machine did, not on the figures."""
    quiet = [0.01, 0.02, 0.01, 0.03, 0.02, 0.01, 0.02, 0.01]
    burst = quiet[:3] + [0.55] + quiet[4:]
    speeds = [100, 101, 99, 100, 102, 98, 100, 101]
    slow = speeds[:3] + [10] + speeds[4:]
    other = [101, 100, 100, 99, 101, 99, 101, 100]
    variant, base = _burst_pair(burst, quiet, slow, other)
    rounds = pd.Index(range(8))
    assert list(intervals.burst_rounds(variant, base, "round", rounds)) == [3]
    num, den = intervals.paired(variant, base, "samples_per_s", "round")
    assert len(num) == 7 and 10 not in num
    _, lo, hi = intervals.paired_ratio_ci(num, den, 0.99)
    _, lo_all, hi_all = intervals.paired_ratio_ci(slow, other, 0.99)
    assert lo < 1 < hi and hi / lo < 1.1 < hi_all / lo_all
    # the same slow trial on a machine that was quiet throughout stays in: the figures alone
    # never decide
    variant, base = _burst_pair(quiet, quiet, slow, speeds)
    assert len(intervals.paired(variant, base, "samples_per_s", "round")[0]) == 8


def test_a_machine_busy_throughout_keeps_its_rounds():
    """Load that is the norm is no burst (the pairing cancels it); and no rule may leave
    under half of the rounds, nor act on runs without the column."""
    busy = [0.6, 0.55, 0.62, 0.58, 0.61, 0.57]
    speeds = [50, 52, 49, 51, 50, 48]
    variant, base = _burst_pair(busy, busy, speeds, speeds)
    assert intervals.burst_rounds(variant, base, "round", pd.Index(range(6))).empty
    half = [0.01, 0.9, 0.02, 0.9, 0.01, 0.9, 0.9]
    variant, base = _burst_pair(half, half, speeds + [50], speeds + [50])
    assert intervals.burst_rounds(variant, base, "round", pd.Index(range(7))).empty
    plain = variant.drop(columns="others_cpu_share")
    assert intervals.burst_rounds(plain, base, "round", pd.Index(range(7))).empty


def test_the_report_says_how_many_rounds_a_burst_took_out():
    quiet, burst = [0.01] * 6, [0.01, 0.01, 0.7, 0.01, 0.01, 0.01]
    rows = []
    for variant, shares, base in (("a", quiet, True), ("b", burst, False)):
        rows += [{"model": "m", "variant": variant, "is_baseline": base, "round": r,
                  "status": schema.OK, "samples_per_s": 100.0, "others_cpu_share": s}
                 for r, s in enumerate(shares)]
    trials = pd.DataFrame(rows)
    assert method.left_out_rounds(trials) == {("m", 2)}
    note = method.busy_trials_note(trials)
    assert "1 round(s) that a burst hit" in note and "left out of the comparisons" in note
    assert "left out" not in method.busy_trials_note(trials.assign(
        others_cpu_share=[0.01] * 6 + [0.3] * 6))


def test_a_run_before_the_burst_rule_is_not_said_to_have_left_rounds_out():
    """Its summary.csv kept the burst rounds: the report tool must not claim otherwise."""
    rows = [{"model": "m", "variant": v, "is_baseline": v == "a", "round": r,
             "status": schema.OK, "samples_per_s": 100.0,
             "others_cpu_share": 0.7 if (v, r) == ("b", 2) else 0.01}
            for v in "ab" for r in range(6)]
    trials = pd.DataFrame(rows)
    trials.attrs["format_version"] = 5
    assert "left out" not in method.busy_trials_note(trials)
    trials.attrs["format_version"] = schema.FORMAT_VERSION
    assert "left out of the comparisons" in method.busy_trials_note(trials)
