"""Quality verdicts (analysis/quality.py): the probe's held-out loss per seed -> a paired
ratio with a CI and a non-inferiority verdict; the recipe search refuses a worse option."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest

from speedbench.analysis import intervals, quality
from speedbench.search import selection
from speedbench.search.selection import Arm, Group, Option


def _rows(losses: dict[str, list[float]], baseline: str = "base", initial=2.3,
          chance=math.log(10), steps: int = 12) -> pd.DataFrame:
    return pd.DataFrame([{"experiment": "e", "model": "m", "variant": v, "is_baseline": v == baseline,
                          "seed": k, "steps": steps, "samples": 96, "loss": x, "status": "ok",
                          "initial_loss": initial, "chance_loss": chance}
                         for v, xs in losses.items() for k, x in enumerate(xs)])


def test_identical_numerics_are_non_inferior_with_a_ratio_of_exactly_one():
    base = [1.10, 1.31, 1.05]
    got = quality.summarise(_rows({"base": base, "same": list(base)}), 0.05).set_index("variant")
    assert got.loc["base", "quality_verdict"] == "baseline"
    same = got.loc["same"]
    assert (same["learning_lost"], same["learning_lost_lo"], same["learning_lost_hi"]) == (0, 0, 0)
    assert same["loss_ratio"] == 1.0
    assert same["quality_verdict"] == quality.NON_INFERIOR and same["quality_seeds"] == 3
    assert same["quality_loss"] == pytest.approx(1.10)
    assert same["learned_nats"] == pytest.approx(2.3 - np.mean(base))
    assert same["quality_tolerance_nats"] == pytest.approx(0.05 * same["learned_nats"])


def test_a_share_of_the_learning_lost_is_worse_and_a_noisy_one_inconclusive():
    base = [1.0, 1.2, 0.9, 1.1, 1.05]
    learned = [2.3 - x for x in base]
    worse = [x + f * g for x, g, f in zip(base, learned, (0.30, 0.32, 0.29, 0.31, 0.30))]
    noisy = [x + f * g for x, g, f in zip(base, learned, (-0.1, 0.2, 0.0, 0.15, -0.05))]
    got = quality.summarise(_rows({"base": base, "worse": worse, "noisy": noisy}),
                            0.05).set_index("variant")
    assert got.loc["worse", "quality_verdict"] == quality.WORSE
    assert got.loc["worse", "learning_lost"] == pytest.approx(0.304)
    assert got.loc["worse", "learning_lost_lo"] > 0.05
    assert got.loc["noisy", "quality_verdict"] == "inconclusive"
    # both comparisons share the run's quality family: Bonferroni over 2
    assert got.loc["noisy", "quality_level"] == pytest.approx(1 - 0.05 / 2)


def test_a_small_but_real_loss_within_the_tolerance_is_non_inferior():
    base = [1.0, 1.2, 0.9, 1.1]
    slightly = [x + 0.02 * (2.3 - x) for x in base]  # 2 % of what the baseline learned
    got = quality.summarise(_rows({"base": base, "v": slightly}), 0.05).set_index("variant")
    assert got.loc["v", "learning_lost"] == pytest.approx(0.02)
    assert got.loc["v", "quality_verdict"] == quality.NON_INFERIOR
    tight = quality.summarise(_rows({"base": base, "v": slightly}), 0.01).set_index("variant")
    assert tight.loc["v", "quality_verdict"] == quality.WORSE


# Held-out losses the default amp probe measured on the ResNet (12 steps, quality.py's path,
# BatchNorm recalibrated; AMD EPYC with avx512_bf16, loaded): per seed, the step-0 loss, fp32,
# bf16 and fp32 with lr=1e-8.
RESNET_PROBE = {"initial": [2.3548, 2.3148, 2.4300, 2.4931, 2.5095],
                "fp32": [0.2893, 0.2189, 1.0258, 0.5461, 0.2000],
                "bf16": [0.3115, 0.2588, 0.2532, 0.7284, 0.2003],
                "lr8": [2.3545, 2.3145, 2.4297, 2.4928, 2.5091]}


@pytest.mark.parametrize("seeds", [3, 5])
def test_on_real_probe_losses_a_recipe_that_learns_nothing_is_worse(seeds):
    """At amp's family with the lr=1e-8 variant on all three models (9 quality comparisons),
    from 3 or 5 seeds: lr=1e-8 is worse; bf16 (the noise of 12 steps) is not called worse."""
    data = {v: RESNET_PROBE[v][:seeds] for v in ("fp32", "bf16", "lr8")}
    rows = _rows(data, baseline="fp32")
    rows["initial_loss"] = [RESNET_PROBE["initial"][k] for _ in data for k in range(seeds)]
    got = quality.summarise(rows, 0.05, family=0.05 * 2 / 9).set_index("variant")
    assert got.loc["lr8", "quality_verdict"] == quality.WORSE
    assert got.loc["lr8", "learning_lost_lo"] > 0.99
    assert got.loc["bf16", "quality_verdict"] == "inconclusive"
    # the loss ratio alone put this recipe at 0.91x in the audit; the raw difference in nats
    # with 3 seeds cannot call it at this level (the baselines' spread over seeds)
    diff = np.array(data["lr8"]) - np.array(data["fp32"])
    half = intervals.t_quantile(1 - 0.05 / 9, seeds - 1) * diff.std(ddof=1) / math.sqrt(seeds)
    assert (diff.mean() - half < 0.1) == (seeds == 3)


def test_no_verdict_where_the_baseline_has_not_learned_and_the_steps_that_would_do():
    flat = _rows({"base": [2.28, 2.27, 2.29], "v": [2.28, 2.27, 2.29]})
    got = quality.summarise(flat, 0.05).set_index("variant")
    # its worst seed learned 0.01 nats in 12 steps; 0.05 asks for twice 12 x 0.05 / 0.01 steps
    assert got.loc["v", "quality_verdict"] == ("no quality verdict: the baseline has not learned "
                                               "in 12 steps; give bench.quality_steps=120")
    assert got.loc["v", "loss_ratio"] == 1.0  # shown all the same
    above_chance = _rows({"base": [2.5, 2.45, 2.6], "v": [2.5, 2.45, 2.6]}, initial=3.5)
    verdict = quality.summarise(above_chance, 0.05).set_index("variant").loc["v",
                                                                              "quality_verdict"]
    assert verdict.startswith("no quality verdict: the baseline has not learned in 12 steps")
    one_seed = _rows({"base": [1.0, 2.27, 1.1], "v": [1.0, 2.27, 1.1]})  # every seed must
    assert quality.summarise(one_seed, 0.05).set_index("variant").loc[
        "v", "quality_verdict"].startswith(quality.NO_VERDICT)
    nothing = _rows({"base": [2.35, 2.31, 2.4], "v": [2.35, 2.31, 2.4]})  # no progress at all
    assert quality.summarise(nothing, 0.05).set_index("variant").loc[
        "v", "quality_verdict"].endswith("bench.quality_steps=48")
    # no chance level (a VAE's reconstruction loss): the step-0 margin alone
    vae = _rows({"base": [0.6, 0.62], "v": [0.6, 0.62]}, initial=1.0, chance=math.nan)
    assert quality.summarise(vae, 0.05).set_index("variant").loc["v", "quality_verdict"] == \
        quality.NON_INFERIOR
    old = _rows({"base": [1.0, 1.1], "v": [1.0, 1.1]}).drop(columns=["initial_loss"])
    assert "no step-0 loss" in quality.summarise(old, 0.05).set_index("variant").loc[
        "v", "quality_verdict"]


def test_a_diverged_seed_and_a_variant_without_loss_say_so():
    frame = _rows({"base": [1.0, 1.1, 1.2], "nan": [1.0, math.nan, 1.2]})
    frame = pd.concat([frame, pd.DataFrame([{
        "experiment": "e", "model": "m", "variant": "slow", "is_baseline": False, "seed": 0,
        "status": "too slow: 9x slower"}])], ignore_index=True)
    got = quality.summarise(frame, 0.05).set_index("variant")
    assert got.loc["nan", "quality_verdict"] == quality.DIVERGED
    assert got.loc["slow", "quality_verdict"] == "no loss (too slow: 9x slower)"
    assert math.isnan(got.loc["slow", "loss_ratio"])



def test_a_variant_whose_baseline_has_no_loss_says_so_without_a_numpy_warning():
    # the baseline's probe ran out of time (the ResNet of a default amp run at a busy hour)
    frame = _rows({"bf16": [0.31]}, baseline="fp32")
    frame = pd.concat([pd.DataFrame([{
        "experiment": "e", "model": "m", "variant": "fp32", "is_baseline": True, "seed": 0,
        "status": "n/a: no held-out loss: no time was left for the quality probe"}]), frame],
        ignore_index=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Mean of empty slice" printed on the user's console
        got = quality.summarise(frame, 0.05).set_index("variant")
    assert got.loc["bf16", "quality_verdict"].startswith("no loss (the baseline has no ")
    assert math.isnan(got.loc["bf16", "learning_lost"])

def test_attach_joins_the_verdicts_to_the_summary_and_leaves_old_runs_alone():
    summary = pd.DataFrame({"experiment": ["e", "e"], "model": ["m", "m"],
                            "variant": ["base", "same"], "speedup": [1.0, 1.1]})
    joined = quality.attach(summary, _rows({"base": [1.0, 1.5], "same": [1.0, 1.5]}), 0.05)
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
                arms[label].quality, arms[label].quality_note = quality.WORSE, "+40 % [+30, +50]"
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
         "learning_lost": 0.3, "learning_lost_lo": 0.2, "learning_lost_hi": 0.4,
         "learned_nats": 1.9}])
    advice, = recommend.advise(summary)
    assert not advice.use
    assert recommend.lines(advice) == [
        "use: nothing measured here was significantly faster than plain PyTorch",
        "skip: e: fast, 1.50x [1.40, 1.60], but its held-out loss is worse: learning lost "
        "+30 % [+20, +40] of 1.9 nats"]


@pytest.mark.slow
def test_the_rounds_write_paired_seeds_and_a_recipe_that_learns_nothing_is_worse(
        tmp_path, monkeypatch):
    """Identical recipes: the same losses in every seed, non-inferior at exactly 1; lr=1e-8
    learns nothing: worse (the tiny transformer's baseline learns 0.15 nats in 12 steps). A
    variant stopped as too slow leaves the baseline nothing to compare: its extra seeds are
    spared."""
    from conftest import SMALL_MODELS, TINY, compose_cfg

    from speedbench.config import build_plan
    from speedbench.studies import stopping, study
    from speedbench.results.runs import load_quality

    real = stopping.far_slower
    monkeypatch.setattr(stopping, "far_slower", lambda s, p, ref: (0.1, 0.08, 0.12)
                        if ref is not None and p == 8 and len(s) in stopping.STOP_LOOKS
                        else real(s, p, ref))
    cfg = compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", "bench.repeats=1",
                      "bench.quality_seeds=3", "bench.quality_steps=12",
                      "+variants={base:{},same:{},flat:{lr:1.0e-8},slow:{accumulate:2}}",
                      "baseline=base")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    writer = study.measure_plan(build_plan(cfg, None), tmp_path / "a", progress=False)
    rows = load_quality(tmp_path / "a")
    assert rows.groupby("variant").size().to_dict() == {"base": 3, "same": 3, "flat": 3,
                                                        "slow": 1}
    assert rows[rows["variant"] == "slow"]["status"].iloc[0].startswith("too slow: ")
    base, same = (rows[rows["variant"] == v]["loss"].tolist() for v in ("base", "same"))
    assert base == same and len(set(base)) == 3
    assert (rows[rows["variant"] == "base"]["initial_loss"] - base > 0.1).all()  # it learned
    judged = quality.summarise(rows, 0.05).set_index("variant")
    assert judged.loc["same", "quality_verdict"] == quality.NON_INFERIOR
    assert judged.loc["same", "loss_ratio"] == 1.0 and judged.loc["same", "learning_lost"] == 0
    assert judged.loc["flat", "quality_verdict"] == quality.WORSE
    assert judged.loc["flat", "learning_lost"] == pytest.approx(1.0, abs=0.01)
    assert {r["variant"] for r in writer.rows} == {"base", "same", "flat", "slow"}

    cfg = compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", "bench.repeats=1",
                      "bench.quality_seeds=3", "+variants={base:{},slow:{accumulate:2}}",
                      "baseline=base")
    study.measure_plan(build_plan(cfg, None), tmp_path / "b", progress=False)
    assert load_quality(tmp_path / "b").groupby("variant").size().to_dict() == \
        {"base": 1, "slow": 1}


def test_the_probes_losses_do_not_depend_on_the_data_sets_length():
    """The held-out split, the training order and the calibration batch are fixed per seed:
    the same probe on a data set of 20 samples and of 5000 gives the same losses."""
    from conftest import SMALL_MODELS, TINY, compose_cfg

    from speedbench.config import build_plan
    from speedbench.studies import quality as probe
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import context

    cfg = compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", "bench.too_slow_factor=null")
    plan = build_plan(cfg, None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    got = [probe.quality_probe(spec, recipe, context(plan),
                               build_dataset(spec.dataset, n, None, seed=0), 2, seeds=2)
           for n in (20, 5000)]
    assert got[0]["seed_losses"] == got[1]["seed_losses"]
    assert [x.initial for x in got[0]["seed_losses"]] == [x.initial for x in got[1]["seed_losses"]]
    assert all(x.chance == pytest.approx(math.log(256)) for x in got[0]["seed_losses"])
    assert probe.loss_columns(got[0]["seed_losses"][0])["initial_loss"] > got[0]["final_loss"]


def test_recalibrated_batchnorm_measures_training_not_its_running_statistics():
    """After a dozen steps at momentum 0.1 a BatchNorm's running statistics still hold 28 % of
    their initial (0, 1): in eval mode the model scores above chance though it has learned.
    Recalibrated on training samples (cumulative statistics) it scores what it learned."""
    from types import SimpleNamespace

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from speedbench.measure import held_out

    gen = torch.Generator().manual_seed(0)
    classes = 4
    y = torch.randint(0, classes, (640,), generator=gen)
    # features far from BatchNorm's initial (0, 1): eval mode 4.9, recalibrated 0.15 here
    x = 3 * torch.randn(classes, 8, generator=gen)[y] + torch.randn(640, 8, generator=gen) + 100
    train, xy = TensorDataset(x[:512], y[:512]), (x[512:], y[512:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                          nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, classes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(12):
        xb, yb = x[32 * step:32 * step + 32], y[32 * step:32 * step + 32]
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    spec, cpu = SimpleNamespace(loss="cross_entropy", name="bn", dataset={}), torch.device("cpu")
    as_trained = held_out.evaluate(model, spec, xy, cpu)
    recalibrated = held_out.evaluate(model, spec, xy, cpu, train, seed=0)
    assert as_trained > math.log(classes) > recalibrated + quality.LEARNED_MARGIN
    assert held_out.evaluate(model, spec, xy, cpu, train, seed=0) == recalibrated  # the same
    assert model[1].momentum == 0.1 and not model.training
    assert held_out.has_running_stats(model) and not held_out.has_running_stats(nn.Linear(2, 2))


def test_the_console_says_why_a_model_has_no_quality_verdict():
    from speedbench.report.render import console_table

    why = "no quality verdict: the baseline has not learned in 12 steps; give " \
          "bench.quality_steps=120"
    summary = pd.DataFrame([
        {"experiment": "e", "model": "m", "variant": v, "status": "ok", "verdict": verdict,
         "samples_per_s": 10.0, "speedup": 1.0, "speedup_lo": math.nan,
         "speedup_hi": math.nan, "peak_mem_mb": 1.0, "quality_loss": 2.28,
         "quality_verdict": q}
        for v, verdict, q in (("base", "baseline", "baseline"), ("v", "inconclusive", why))])
    text = console_table(summary, width=100)
    assert "no verd.*" in text and f"* m: {why}" in " ".join(text.split())
