"""Claim verdicts for the tip experiments, on hand-made trials: they follow the CI, and rows that
cannot be judged say why (n/a) instead of disappearing."""
from __future__ import annotations

import pandas as pd

from speedbench import claims, stats


def _trials(values: dict, device: str = "cpu") -> pd.DataFrame:
    """values: variant -> list of (samples_per_s, data_wait_frac, host_rss_mb) or a status."""
    rows = []
    for i, (variant, trials) in enumerate(values.items()):
        for t, v in enumerate(trials if isinstance(trials, list) else [trials]):
            row = {"experiment": "workers", "model": "resnet", "variant": variant,
                   "is_baseline": i == 0, "trial": t, "device": device, "steps": 3}
            if isinstance(v, str):
                row["status"] = v
            else:
                row.update(status="ok", samples_per_s=v[0], step_ms=1000 / v[0],
                           data_wait_frac=v[1], host_rss_mb=v[2], peak_mem_mb=v[2],
                           final_loss=1.0)
            rows.append(row)
    return pd.DataFrame(rows)


TRIALS = {
    "w0": [(10, 0.50, 1000), (11, 0.52, 1001), (10.5, 0.49, 999)],
    "w1": [(15, 0.10, 1500), (16, 0.11, 1502), (15.5, 0.09, 1499)],
    "w2": [(15.2, 0.01, 2000), (16.1, 0.02, 2001), (15.4, 0.01, 1999)],
}


def _evaluate(claim: dict, values=TRIALS, device="cpu") -> pd.DataFrame:
    trials = _trials(values, device)
    return claims.evaluate([claim], stats.summarise(trials), trials).set_index("variant")


def test_lower_and_higher_follow_the_ci_of_the_metric_ratio():
    wait = _evaluate({"kind": "lower", "metric": "data_wait_frac"})
    assert list(wait.index) == ["w1", "w2"]  # no `variants`: every variant but the baseline
    assert (wait["verdict"] == claims.HOLDS).all()
    assert wait.loc["w2", "measured"].startswith("data_wait_frac 0.02x")
    rss = _evaluate({"kind": "lower", "metric": "host_rss_mb"})
    assert rss["verdict"].str.startswith(claims.FAILS + " (higher)").all()
    assert (_evaluate({"kind": "higher", "metric": "host_rss_mb"})["verdict"] == claims.HOLDS).all()


def test_best_names_the_fastest_and_tolerates_no_significant_difference():
    best = _evaluate({"kind": "best", "variants": ["w0", "w1", "w2"]})
    assert best["measured"].str.startswith("best: w1").all()
    assert best.loc["w0", "verdict"] == f"{claims.FAILS} (slower than w1)"
    assert best.loc["w1", "verdict"] == claims.HOLDS  # it is the best
    assert best.loc["w2", "verdict"] == claims.HOLDS  # its CI against w1 contains 1


def test_a_claim_stated_for_gpus_is_na_elsewhere_but_still_names_the_best():
    rule = _evaluate({"kind": "best", "requires": "cuda", "variants": ["w0"]})
    assert rule.loc["w0", "verdict"].startswith("n/a: the claim is stated for CUDA GPUs")
    assert rule.loc["w0", "measured"].startswith("best: w1")
    on_gpu = _evaluate({"kind": "best", "requires": "cuda", "variants": ["w0"]}, device="cuda:0")
    assert on_gpu.loc["w0", "verdict"] == f"{claims.FAILS} (slower than w1)"


def test_versus_compares_with_another_variant():
    v = _evaluate({"kind": "faster", "variants": ["w2"], "versus": "w1"})
    assert v.loc["w2", "measured"].endswith("vs w1")
    assert v.loc["w2", "verdict"] == f"{claims.FAILS} ({stats.SAME})"
    missing = _evaluate({"kind": "faster", "variants": ["w2"], "versus": "w9"})
    assert missing.loc["w2", "verdict"] == "n/a: no variant 'w9' in this run"


def test_rows_that_cannot_be_judged_carry_the_reason():
    na = "n/a: pin_memory needs CUDA (no pinned host-to-device copy without it)"
    v = _evaluate({"kind": "faster"}, {"w0": TRIALS["w0"], "w1": na, "w2": TRIALS["w2"]})
    assert v.loc["w1", "verdict"] == na
    assert v.loc["w2", "verdict"] == claims.HOLDS
    base_na = "n/a: empty_cache needs CUDA (the CPU has no caching allocator to empty)"
    v = _evaluate({"kind": "faster"}, {"w0": base_na, "w1": TRIALS["w1"]})
    assert v.loc["w1", "verdict"] == base_na  # nothing to compare with: the baseline's reason
    few = _evaluate({"kind": "lower", "metric": "data_wait_frac"},
                    {"w0": TRIALS["w0"][:1], "w1": TRIALS["w1"][:1]})
    assert few.loc["w1", "verdict"] == f"inconclusive ({stats.TOO_FEW})"


def test_a_memory_claim_gives_its_speed_cost_instead_of_repeating_the_memory_ratio():
    rows = _evaluate({"kind": "less_memory"}, values={"w2": TRIALS["w2"], "w0": TRIALS["w0"]})
    row = rows.loc["w0"]  # half the memory of w2, at 0.68 of its speed (medians 10.5 vs 15.4)
    assert row["verdict"] == claims.HOLDS
    assert row["measured"].startswith("memory 0.50x [") and "; speed-up 0.68x [" in row["measured"]
    assert row["memory"] == "-"
    speed = _evaluate({"kind": "faster"}).loc["w1"]  # other claims keep the memory column
    assert speed["memory"].startswith("1.50x")
