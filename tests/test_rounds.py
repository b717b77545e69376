"""The rounds' order: a Williams design per block, random from fresh entropy per run,
replayed from the recorded order_seed; and the position check of the analysis."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from speedbench.analysis.summary import position_effect, summarise
from speedbench.report import method
from speedbench.studies import orders as design, study


@pytest.mark.parametrize("k", [2, 3, 4, 5, 7])
def test_williams_design_balances_positions_and_carry_over(k):
    rows = design.williams_rows(k)
    assert len(rows) == (2 * k if k % 2 else k)
    per = len(rows) // k
    for position in range(k):  # every letter at every position equally often
        assert sorted(r[position] for r in rows) == sorted(list(range(k)) * per)
    follows = [(a, b) for r in rows for a, b in zip(r, r[1:])]
    counts = {pair: follows.count(pair) for pair in itertools.permutations(range(k), 2)}
    assert len(set(counts.values())) == 1  # every ordered pair equally often


def test_three_variants_six_rounds_each_first_twice():
    names = ["fp32", "fp16", "bf16"]
    for seed in range(20):
        orders = [design.round_order(names, seed, r) for r in range(6)]
        assert all(sorted(o) == sorted(names) for o in orders)
        firsts = [o[0] for o in orders]
        assert all(firsts.count(n) == 2 for n in names), firsts


def test_orders_are_random_per_seed_and_replayed():
    names = ["a", "b", "c", "d"]
    orders = [design.round_order(names, 7, r) for r in range(12)]
    assert orders == [design.round_order(names, 7, r) for r in range(12)]
    assert orders != [design.round_order(names, 8, r) for r in range(12)]
    assert orders != [design.round_order(names, 7, r, stream=1) for r in range(12)]
    assert design.fresh_order_seed() != design.fresh_order_seed()


def test_a_peer_lost_while_agreeing_on_the_order_fails_the_job_in_one_line(monkeypatch, capsys):
    from speedbench import distributed

    def lost(value, env):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:23424")

    monkeypatch.setattr(distributed, "same_on_every_rank", lost)
    env = distributed.DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, run_id="x")
    distributed.clear_failure()
    try:
        with pytest.raises(RuntimeError):
            design.fresh_order_seed(env)
        assert distributed.failed()  # so the CLI exits 1 without Hydra's traceback
    finally:
        distributed.clear_failure()  # the next test starts without it
    err = capsys.readouterr().err
    assert "rank 0 of 2 failed in agreeing on the round order" in err, err


def _trials(seed, first_boost=1.0, rounds_=12, k=3):
    rng = np.random.default_rng(seed)
    names = [f"v{i}" for i in range(k)]
    rows = []
    for r in range(rounds_):
        speed = 100 * math.exp(rng.normal(0, 0.05))
        for pos, name in enumerate(design.round_order(names, seed, r)):
            tp = speed * (first_boost if pos == 0 else 1.0) * math.exp(rng.normal(0, 0.01))
            rows.append({"experiment": "e", "model": "m", "variant": name, "round": r,
                         "trial": r, "position": pos, "is_baseline": name == "v0",
                         "status": "ok", "samples_per_s": tp})
    t = pd.DataFrame(rows)
    for col in ("step_ms", "data_wait_frac", "peak_mem_mb", "host_rss_mb", "final_loss"):
        t[col] = 1.0
    return t


def test_position_effect_is_found_and_warned():
    effect, lo, hi = position_effect(_trials(1, first_boost=0.95))
    assert lo < 0.95 < hi and hi < 1
    s = summarise(_trials(1, first_boost=0.95))
    assert any("first trial of a round" in w for w in method.spread_warnings(s))
    # balanced orders: the speed-ups stay unbiased under the position effect
    assert np.allclose(s[~s["is_baseline"]]["speedup"], 1, atol=0.01)
    quiet = summarise(_trials(2))
    assert not any("first trial of a round" in w for w in method.spread_warnings(quiet))


def _measured_orders(tmp_path, monkeypatch, *overrides):
    """The orders measure_plan runs amp's three variants in, for 6 rounds, with no training."""
    from conftest import TINY, compose_cfg
    from speedbench.config import build_plan
    from speedbench.measure import flops

    def fake(mc, variant, round_, position, *_):
        return {**mc.header(variant, round_, position), "status": "ok",
                "samples_per_s": 1.0, "step_ms": 1.0}

    monkeypatch.setattr(flops, "matmul_peak_tflops", lambda device, precision, **_: 1.0)
    plan = build_plan(compose_cfg(*TINY, "model=transformer", "bench.repeats=6",
                                  "bench.target_ci=null", *overrides, experiment="amp"), "amp")
    tmp_path.mkdir(exist_ok=True)
    study.measure_plan(plan, tmp_path, progress=False,
                       instruments=study.Instruments(trial=fake, probe=lambda *_: None))
    trials = pd.read_csv(tmp_path / "trials.csv")
    orders = [tuple(g.sort_values("position")["variant"]) for _, g in trials.groupby("round")]
    return orders, trials["order_seed"].unique()


def test_runs_draw_fresh_orders_and_record_how_to_replay_them(tmp_path, monkeypatch):
    first, seeds = _measured_orders(tmp_path / "a", monkeypatch)
    _, other_seeds = _measured_orders(tmp_path / "b", monkeypatch)
    # the same bench.seed, fresh order seeds. Not "different orders": six rounds of three
    # variants are one Williams block, all 6 permutations in one of 720 orders, so two fresh
    # seeds draw the same orders 1 run in 720 (CI saw it); a fixed pair of seeds is compared
    # in test_orders_are_random_per_seed_and_replayed.
    assert len(seeds) == len(other_seeds) == 1 and seeds[0] != other_seeds[0]
    assert sorted(o[0] for o in first) == sorted(["fp32", "fp16", "bf16"] * 2)
    replay, _ = _measured_orders(tmp_path / "c", monkeypatch, f"bench.order_seed={seeds[0]}")
    assert replay == first


def test_the_cheapest_models_rounds_run_first_and_the_summary_keeps_the_configs_order(tmp_path):
    """Every model's probes, then the rounds cheapest first, so that what a quick model leaves
    of the budget goes to the costlier one; summary.csv lists the models as the config does."""
    from conftest import TINY, only_run_dir, run_main

    images = "dataset: {kind: images, image_size: 16, num_classes: 4}"
    slow = "{_target_: own_models.Slow, " + images + "}"  # 20 ms a step
    quick = "{_target_: fault_models.Tiny, model_name: tiny, " + images + "}"
    out = run_main("+experiment=amp", f"model=[{slow}, {quick}]", *TINY, "bench.repeats=2",
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    trials = pd.read_csv(run_dir / "trials.csv")
    first_row = trials.groupby("model", sort=False).apply(lambda g: g.index.min())
    assert first_row["tiny"] < first_row["Slow"], trials[["model", "variant", "round"]]
    # the plan's lines come in the rounds' order, each after every model's probes
    plans = [ln.split(":")[0] for ln in out.stderr.splitlines() if "data and probes took" in ln]
    assert plans == ["tiny", "Slow"], out.stderr[-3000:]
    assert list(pd.read_csv(run_dir / "summary.csv")["model"].drop_duplicates()) == \
        ["Slow", "tiny"]
