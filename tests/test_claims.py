"""Claim verdicts for the tip experiments, on hand-made trials: they follow the CI, and rows that
cannot be judged say why (n/a) instead of disappearing."""
from __future__ import annotations

import pandas as pd

from speedbench.analysis import claims, intervals
from speedbench.analysis.summary import summarise


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
    return claims.evaluate([claim], summarise(trials), trials).set_index("variant")


def test_lower_and_higher_follow_the_ci_of_the_metric_ratio():
    wait = _evaluate({"kind": "lower", "metric": "data_wait_frac"})
    assert list(wait.index) == ["w1", "w2"]  # no `variants`: every variant but the baseline
    assert (wait["verdict"] == claims.HOLDS).all()
    assert wait.loc["w2", "measured"].startswith("data_wait_frac 0.03x")
    rss = _evaluate({"kind": "lower", "metric": "host_rss_mb"})
    assert (rss["verdict"] == claims.FAILS + " (not lower)").all()
    assert (_evaluate({"kind": "higher", "metric": "host_rss_mb"})["verdict"] == claims.HOLDS).all()


def test_best_requires_significance():
    best = _evaluate({"kind": "best", "variants": ["w0", "w1", "w2"]})
    assert best["measured"].str.startswith("fastest: w1").all()  # by median samples/s
    assert best.loc["w0", "verdict"] == f"{claims.FAILS} (slower than w1, w2)"
    # w1 and w2 are within noise of each other: neither is "the best".
    assert best.loc["w1", "verdict"] == f"{claims.INCONCLUSIVE} (not significantly faster than w2)"
    assert best.loc["w2", "verdict"] == f"{claims.INCONCLUSIVE} (not significantly faster than w1)"
    clear = dict(TRIALS, w2=[(20, 0.01, 2000), (21.5, 0.02, 2001), (20.6, 0.01, 1999)])
    assert _evaluate({"kind": "best", "variants": ["w2"]}, clear).loc["w2", "verdict"] == \
        claims.HOLDS


def test_a_claim_stated_for_gpus_is_na_elsewhere_but_still_names_the_best():
    rule = _evaluate({"kind": "best", "requires": "cuda", "variants": ["w0"]})
    assert rule.loc["w0", "verdict"].startswith("n/a: the claim is stated for CUDA GPUs")
    assert rule.loc["w0", "measured"].startswith("fastest: w1")
    on_gpu = _evaluate({"kind": "best", "requires": "cuda", "variants": ["w0"]}, device="cuda:0")
    assert on_gpu.loc["w0", "verdict"] == f"{claims.FAILS} (slower than w1, w2)"


def test_versus_compares_with_another_variant():
    v = _evaluate({"kind": "faster", "variants": ["w2"], "versus": "w1"})
    assert v.loc["w2", "measured"].endswith("vs w1")
    assert v.loc["w2", "verdict"] == f"{claims.FAILS} ({intervals.EQUIVALENT})"
    # its memory and loss are against w1 too (2000 MB / 1500 MB), not the baseline's 2.00x
    assert v.loc["w2", "memory"] == "1.33x" and v.loc["w2", "loss Δ"] == "+0.000"
    assert _evaluate({"kind": "faster", "variants": ["w2"]}).loc["w2", "memory"] \
        .startswith("2.00x [")
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
    assert few.loc["w1", "verdict"] == f"{claims.INCONCLUSIVE} (too few rounds)"


def test_a_memory_claim_gives_its_speed_cost_instead_of_repeating_the_memory_ratio():
    rows = _evaluate({"kind": "less_memory"}, values={"w2": TRIALS["w2"], "w0": TRIALS["w0"]})
    row = rows.loc["w0"]  # half the memory of w2, at 0.67 of its speed (paired by round)
    assert row["verdict"] == claims.HOLDS
    assert row["measured"].startswith("memory 0.50x [") and "; speed-up 0.67x [" in row["measured"]
    assert row["memory"] == "-"
    speed = _evaluate({"kind": "faster"}).loc["w1"]  # other claims keep the memory column
    assert speed["memory"].startswith("1.50x")


def test_magnitude_of_a_faster_claim():
    three = (0.9, 0.5, 1.6), (1.5, 1.4, 1.6), (2.5, 1.8, 3.4), (3.5, 3.1, 3.9)
    got = [claims.judge_faster(r, factor=3) for r in three]
    assert got[0] == f"{claims.FAILS} ({intervals.INCONCLUSIVE}; the CI stays below 3x)"
    assert got[1] == f"{claims.PARTLY} (faster, but the CI stays below 3x)"
    assert got[2].startswith(f"{claims.INCONCLUSIVE} (the CI reaches 3x")
    assert got[3] == claims.HOLDS
    # Without a factor: a CI containing 1 is inconclusive, never "does not hold".
    assert claims.judge_faster((1.1, 0.9, 1.3)).startswith(claims.INCONCLUSIVE)
    assert claims.judge_faster((1.0, 0.98, 1.02)) == f"{claims.FAILS} ({intervals.EQUIVALENT})"
    assert claims.judge_faster((0.7, 0.6, 0.8)) == f"{claims.FAILS} ({intervals.SLOWER})"


def test_less_memory_never_holds_at_equality_and_respects_the_factor():
    assert claims.judge_less_memory((1.0, 1.0, 1.0)) == f"{claims.FAILS} (not less)"
    assert claims.judge_less_memory((0.9, 0.85, 0.95)) == claims.HOLDS
    assert claims.judge_less_memory((0.45, 0.40, 0.50), 0.5) == claims.HOLDS
    assert claims.judge_less_memory((0.7, 0.65, 0.75), 0.5) == \
        f"{claims.PARTLY} (less memory, not x0.5)"
    # The CI contains 0.5: neither "partly" nor "holds".
    assert claims.judge_less_memory((0.6, 0.45, 0.8), 0.5) == \
        f"{claims.INCONCLUSIVE} (less memory; the CI contains x0.5)"
    assert claims.judge_less_memory((0.9, 0.7, 1.1), 0.5) == \
        f"{claims.FAILS} (the CI lies above x0.5)"  # halving is excluded
    assert claims.judge_less_memory((0.9, 0.4, 1.1), 0.5) == \
        f"{claims.INCONCLUSIVE} (the CI contains 1)"


def test_memory_claim_on_a_named_metric():
    values = {"w0": TRIALS["w0"], "w1": TRIALS["w1"]}
    missing = _evaluate({"kind": "less_memory", "metric": "activation_mem_mb"}, values)
    assert missing.loc["w1", "verdict"] == \
        f"{claims.INCONCLUSIVE} (this run recorded no activation_mem_mb)"
    trials = _trials(values)
    trials["activation_mem_mb"] = trials["peak_mem_mb"].where(trials["variant"] == "w0",
                                                              trials["peak_mem_mb"] / 4)
    v = claims.evaluate([{"kind": "less_memory", "metric": "activation_mem_mb", "factor": 0.5}],
                        summarise(trials), trials).set_index("variant")
    assert v.loc["w1", "verdict"] == claims.HOLDS
    assert v.loc["w1", "measured"].startswith("activation_mem 0.38x")


def test_compute_capability_scope():
    claim = {"kind": "faster", "requires": "cuda", "min_capability": 7.0}
    old = {"cuda_devices": [{"index": 0, "capability": "6.1"}]}
    new = {"cuda_devices": [{"index": 0, "capability": "8.0"}]}
    assert claims.out_of_scope(claim, "cpu").startswith("n/a: the claim is stated for CUDA GPUs")
    assert "compute capability 7.0 or later; this GPU has 6.1" in claims.out_of_scope(
        claim, "cuda:0", old)
    assert claims.out_of_scope(claim, "cuda:0", new) is None
    assert claims.out_of_scope({"kind": "faster"}, "cpu") is None


def test_experiment_claims_cite_findable_sources_and_carry_scope():
    from pathlib import Path

    import yaml

    folder = Path(__file__).resolve().parents[1] / "configs" / "experiment"
    for path in folder.glob("*.yaml"):
        for claim in (yaml.safe_load(path.read_text()) or {}).get("claims") or []:
            assert "seeds/" not in claim["source"] and "DESIGN" not in claim["source"], path
            # A claim about GPU transfers or GPU speed is judged on CUDA only.
            if claim.get("kind") == "faster" and "gpu" in claim["quote"].lower():
                assert claim.get("requires") == "cuda", (path.name, claim["quote"])


def test_cpu_maker_scope():
    claim = {"kind": "faster", "cpu_model": "Intel"}  # the openmp experiment's Intel runtime
    epyc = {"cpu_model": "AMD EPYC 7B13 64-Core Processor"}
    xeon = {"cpu_model": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"}
    assert claims.out_of_scope(claim, "cpu", epyc) == (
        "n/a: the claim is stated for Intel CPUs; this CPU is AMD EPYC 7B13 64-Core Processor")
    assert claims.out_of_scope(claim, "cpu", xeon) is None
    assert claims.out_of_scope(claim, "cuda:0", xeon).startswith("n/a: the claim is stated for "
                                                                "Intel CPUs; this run is on")
