"""Running trials in-process: faults stay in their row, n/a is reported, data and loop behave."""
from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest
import torch

from conftest import TINY, compose_cfg
from speedbench.studies import orders, study
from speedbench.run import run

TINY_MODEL = ("model={_target_: fault_models.Tiny, fail: %s, "
              "dataset: {kind: images, image_size: 32, num_classes: 10}}")


@pytest.mark.slow
@pytest.mark.parametrize("fail, status", [
    ("error_in_autocast", "error: RuntimeError: this model breaks under autocast"),
    ("oom_in_autocast", "oom"),
    ("nan_in_autocast", "diverged"),
])
def test_a_failing_variant_is_recorded_and_the_others_still_run(tmp_path, fail, status):
    cfg = compose_cfg(*TINY, TINY_MODEL % fail, f"out_dir={tmp_path}", experiment="amp")
    run_dir = run(cfg, "amp", progress=False)
    trials = pd.read_csv(run_dir / "trials.csv")
    by_variant = trials.groupby("variant")["status"].agg(set).to_dict()
    assert by_variant["fp32"] == {"ok"}
    assert by_variant["fp16"] == {status} and by_variant["bf16"] == {status}
    summary = pd.read_csv(run_dir / "summary.csv")
    assert summary.set_index("variant").loc["fp16", "status"] == status
    assert (run_dir / "report.html").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning acts on CUDA")
def test_knob_that_cannot_act_is_na_with_reason(tmp_path):
    cfg = compose_cfg(*TINY, "model=transformer", f"out_dir={tmp_path}",
                      "+variants.plain={}", "+variants.pinned={data: {pin_memory: true}}")
    run_dir = run(cfg, "pins", progress=False)
    summary = pd.read_csv(run_dir / "summary.csv").set_index("variant")
    assert summary.loc["pinned", "status"] == "n/a: pin_memory needs CUDA (no pinned host-to-device copy without it)"
    assert math.isnan(summary.loc["pinned", "samples_per_s"])
    assert summary.loc["plain", "status"] == "ok"


@pytest.mark.slow
def test_incomplete_run_has_no_summary(tmp_path, monkeypatch):
    """A run that dies half-way leaves trials.csv (what finished) but nothing that looks complete."""
    calls = {"n": 0}
    measured = []  # the variants whose trial finished
    def dies_on_third(mc, name, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        record = study.run_trial(mc, name, *args)
        measured.append(name)
        return record

    # the command line's instruments, its trials cut short (study.INSTRUMENTS: the seam)
    monkeypatch.setattr(study, "INSTRUMENTS", replace(study.INSTRUMENTS, trial=dies_on_third))
    cfg = compose_cfg(*TINY, "model=transformer", f"out_dir={tmp_path}", experiment="amp")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, "amp", progress=False)
    (run_dir,) = [p.parent for p in tmp_path.rglob("trials.csv")]
    trials = pd.read_csv(run_dir / "trials.csv")
    # both finished trials kept; any other row is a variant the probes stopped (under load
    # fp16 can be), written without a trial
    assert len(trials[trials["variant"].isin(measured)]) == len(measured) == 2
    assert (trials[~trials["variant"].isin(measured)]["status"] != "ok").all()
    assert not (run_dir / "summary.csv").exists() and not (run_dir / "report.md").exists()


def test_explicit_run_dir_is_not_overwritten(tmp_path):
    from speedbench.results import new_run_dir

    target = tmp_path / "mine"
    new_run_dir(str(tmp_path), "x", str(target))
    (target / "trials.csv").write_text("experiment\n")
    with pytest.raises(FileExistsError):
        new_run_dir(str(tmp_path), "x", str(target))


# --- rounds --------------------------------------------------------------------------------------
def test_rounds_are_shuffled_reproducibly_from_the_seed():
    from speedbench.studies.orders import round_order

    names = ["a", "b", "c", "d"]
    orders = [round_order(names, 0, r) for r in range(20)]
    assert all(sorted(o) == names for o in orders)  # every variant once per round
    assert len({tuple(o) for o in orders}) > 1  # the order changes between rounds
    assert orders == [round_order(names, 0, r) for r in range(20)]  # same seed, same orders
    assert orders != [round_order(names, 1, r) for r in range(20)]


def test_trials_record_their_round_and_position(tmp_path, monkeypatch):
    from speedbench.config import build_plan
    from speedbench.measure import flops

    def fake(mc, variant, round_, position, *_):  # the trial's own header, no training
        return {**mc.header(variant, round_, position), "status": "ok",
                "samples_per_s": 1.0, "step_ms": 1.0}

    monkeypatch.setattr(flops, "matmul_peak_tflops", lambda device, precision, **_: 1.0)
    plan = build_plan(compose_cfg(*TINY, "model=transformer", "bench.repeats=3",
                                  experiment="amp"), "amp")
    # no quality probes: on a loaded machine one may stop a variant as too slow
    writer = study.measure_plan(plan, tmp_path, progress=False,
                                instruments=study.Instruments(trial=fake, probe=lambda *_: None))
    trials = pd.read_csv(tmp_path / "trials.csv")
    assert len(trials) == 9 and (trials["round"] == trials["trial"]).all()
    for r, one in trials.groupby("round"):
        assert sorted(one["variant"]) == ["bf16", "fp16", "fp32"]
        assert one["position"].tolist() == [0, 1, 2]  # written in the order they ran
        order = orders.round_order(list(plan.variants), int(one["order_seed"].iloc[0]), r)
        assert one["variant"].tolist() == order
    assert len(writer.rows) == 9


def test_a_trial_builds_its_whole_record(tmp_path):
    """Round, position, the quality probe's loss, FLOPs and the peak: all from the trial."""
    from speedbench.config import build_plan
    from speedbench.measure import flops
    from speedbench.measure.data import build_dataset
    from speedbench.measure.trial import dataset_length, measure_trial

    plan = build_plan(compose_cfg(*TINY, "model=transformer", "bench.repeats=1"), None)
    spec, recipe = plan.models[0], plan.variants[plan.baseline]
    book = flops.FlopsBook(torch.device("cpu"))
    book.peaks["fp32"] = 1.0
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), None, seed=0)
    record = measure_trial(plan, spec, plan.baseline, recipe, 2, dataset, position=1,
                           probe={"final_loss": 1.5}, book=book)
    assert record["status"] == "ok" and (record["round"], record["position"]) == (2, 1)
    assert record["final_loss"] == 1.5 and math.isfinite(record["window_loss"])
    assert record["flops_per_step"] > 0 and record["peak_tflops"] == 1.0
    assert record["achieved_tflops"] == pytest.approx(
        record["flops_per_step"] / (record["step_ms"] / 1000) / 1e12)
