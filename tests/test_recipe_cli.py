"""`+experiment=recipe` through the CLI on the tiny transformer, and its config checks."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import TINY, compose_cfg, only_run_dir, run_cli
from speedbench.search import check_findings
from speedbench.analysis.numbers import ratio_text
from speedbench.search import driver as recipe
from speedbench.measure.budget import Budget
from speedbench.config import ConfigError, build_plan
from speedbench.results import schema

# Two cheap candidate groups are enough to exercise the search, the closing measurement and
# the outputs; the others are deleted from the experiment (Hydra's ~key).
FEW = [f"~recipe.candidates.{group}" for group in (
    "parallel", "workers", "accumulation", "pinning", "memory_format", "optimizer",
    "matmul_precision", "cudnn_benchmark", "attention", "compile", "checkpointing",
    "zero_grad", "debug_apis", "conv_bias", "onednn_precision", "flex_attention", "packing",
    "float8", "cuda_graphs", "fused_ce", "expandable_segments", "comm_hook", "chunked_ce",
    "fsdp_reshard", "offload")] + \
    ["recipe.skip=[]"]


def _check(*overrides: str):
    cfg = compose_cfg(*TINY, "model=transformer", *overrides, experiment="recipe")
    return recipe.check(cfg, build_plan(cfg, "recipe"), None)


@pytest.mark.slow
def test_candidates_are_checked_before_anything_runs():
    groups = _check()
    assert {"precision", "workers", "sync"} <= {g.name for g in groups}
    assert next(g for g in groups if g.name == "accumulation").trades_memory
    with pytest.raises(ConfigError, match=r"recipe.budget_s: -1.0 is out of range"):
        _check("recipe.budget_s=-1")
    with pytest.raises(ConfigError, match=r"recipe.candidates: variants.precision.fp8.precision: "
                                          r"'fp8' is not allowed"):
        _check("+recipe.candidates.precision.options.fp8.precision=fp8")
    with pytest.raises(ConfigError, match=r"recipe.candidates.sync.colour: unknown key"):
        _check("+recipe.candidates.sync.colour=red")
    with pytest.raises(ConfigError, match=r"recipe.skip: 'colour' is not a candidate group"):
        _check("recipe.skip=[colour]")
    with pytest.raises(ConfigError, match=r"recipe.also_skip: 'colour' is not a candidate group"):
        _check("recipe.also_skip=[colour]")
    with pytest.raises(ConfigError, match=r"recipe.screen_rounds: 0 is out of range"):
        _check("recipe.screen_rounds=0")
    with pytest.raises(ConfigError, match=r"recipe.confirm_top: -2 is out of range"):
        _check("recipe.confirm_top=-2")


@pytest.mark.slow
def test_bad_candidate_fails_in_one_line(tmp_path):
    out = run_cli(*TINY, "+experiment=recipe", "model=transformer", f"out_dir={tmp_path}",
                  "+recipe.candidates.precision.options.fp8.precision=fp8", cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "fp8" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("trials.csv"))


@pytest.mark.slow
def test_recipe_run_end_to_end(tmp_path):
    out = run_cli(*TINY, "+experiment=recipe", "model=transformer", "bench.repeats=3",
                  "recipe.budget_s=null", f"out_dir={tmp_path}", *FEW, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    env = json.loads((run_dir / "env.json").read_text())
    assert env["format_version"] == schema.FORMAT_VERSION and "load_average_end" in env
    table = pd.read_csv(run_dir / "recipe.csv")
    assert {"step", "stopped"} <= set(table["table"])
    steps = table[table["table"] == "step"]
    notes = " ".join(table[table["table"] == "note"]["label"])
    for option in ("precision=bf16", "sync=deferred"):  # screened, or set aside with why
        assert option in set(steps["option"]) or \
            f"step 1: {option} not screened, by its forecast: " in notes
    assert "option screens set aside" in notes  # what the forecasts spared and cost
    assert steps["speedup"].notna().all()
    chosen = list(table[table["table"] == "chosen"]["option"])
    if chosen:  # the closing measurement ran: cumulative speed-ups and the ablation
        assert table[table["table"] == "waterfall"]["label"].iloc[0] == "naive"
        assert set(table[table["table"] == "ablation"]["option"]) == set(chosen)
        assert (run_dir / "plots" / "recipe-transformer-waterfall.png").is_file()
    trials = pd.read_csv(run_dir / "trials.csv")
    # the run's clock (bench.time_budget_s) bounds the search: a pilot sizes its first screen
    assert list(dict.fromkeys(trials["experiment"]))[:2] == ["recipe-pilot", "recipe-step1"]
    # the screen ran its rounds; a confirmation, when there was one, is its own experiment
    screen = trials[trials["experiment"] == "recipe-step1"]
    assert pd.to_numeric(screen["round"]).max() + 1 == 3  # recipe.screen_rounds
    for r in table[table["table"] == "confirm"].itertuples():
        assert f"recipe-step{int(r.step)}-confirm" in set(trials["experiment"])
    assert set(table[table["table"] == "chosen"]["option"]) <= set(
        table[table["table"] == "confirm"]["option"])
    # the report leads with the recommendation; the console ends with it and the html path
    md = (run_dir / "report.md").read_text()
    assert md.split("\n## ")[1].startswith("Recommendation")
    assert "## The best recipe for this machine" in md
    assert "Recommendation:" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith(f"report: {(run_dir / 'report.html').resolve()}")
    # recipe.yaml's overrides are accepted back by speedbench
    final = yaml.safe_load((run_dir / "recipe.yaml").read_text())["transformer"]
    if not final["decided"]:  # an option left open by noisy rounds: said, no recipe offered
        assert final["reason"].startswith("not decided: ") and "overrides" not in final
        return
    assert final["overrides"]["precision"] in ("fp32", "bf16", "fp16")
    args = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in final["overrides"].items()]  # as a user types them back
    again = run_cli(*TINY, "model=transformer", "bench.repeats=1", *args,
                    f"out_dir={tmp_path / 'again'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    rerun = pd.read_csv(only_run_dir(tmp_path / "again") / "trials.csv")
    assert rerun["status"].eq("ok").all()
    assert rerun["precision"].iloc[0] == final["overrides"]["precision"]


@pytest.mark.slow
def test_a_findings_suggestion_is_measured_before_it_is_recommended(tmp_path):
    from speedbench import results

    cfg = compose_cfg(*TINY, "model=transformer", experiment="sync")
    plan = build_plan(cfg, "sync")
    pd.DataFrame([{"experiment": "sync", "model": "transformer", "variant": "item",
                   "symptom": "host reads of device values every step", "figure": "1 per step",
                   "tip": "read the loss every K steps", "knob": "sync=deferred"},
                  {"experiment": "sync", "model": "transformer", "variant": "item",
                   "symptom": "model syncs", "figure": "-", "tip": "-", "knob": "-"}]
                 ).to_csv(tmp_path / "findings.csv", index=False)
    writer = results.TrialWriter(tmp_path / "trials.csv")
    findings = check_findings.check([plan], tmp_path, writer, False)
    assert findings["check"].iloc[0].startswith("measured ")
    assert findings["check"].iloc[0].endswith(("recommended", "not settled by this check"))
    assert findings["check"].iloc[1] == "-"
    rows = pd.DataFrame(writer.rows)
    assert set(rows["experiment"]) == {"check-sync"}
    assert set(rows["variant"]) == {"as run", "suggested"}
    assert set(rows[rows["variant"] == "suggested"]["status"]) == {"ok"}
    assert "check" in pd.read_csv(tmp_path / "findings.csv")
    # the check's figures are summary.csv's, at the checks' own share of the run's error
    from speedbench.analysis import intervals
    from speedbench.analysis.summary import summarise
    summary = summarise(rows, levels=check_findings.levels(tmp_path, rows))
    row = summary[summary["variant"] == "suggested"].iloc[0]
    assert findings["check"].iloc[0].startswith(
        f"measured {ratio_text(row.speedup, row.speedup_lo, row.speedup_hi)} here")
    assert row.ci_level == intervals.comparison_level(1, intervals.CHECK_SHARE)
    assert check_findings.parse_knob("data.num_workers=2 data.persistent_workers=true") == \
        {"data.num_workers": 2, "data.persistent_workers": True}


@pytest.mark.slow
def test_recipe_on_a_user_model_does_not_retry_what_failed(tmp_path):
    """A `_target_` model that breaks under autocast: both precision options fail in step 1 and
    are never measured again; the search goes on with the rest."""
    from speedbench.run import run

    model = ("model={_target_: fault_models.Tiny, fail: error_in_autocast, "
             "dataset: {kind: images, image_size: 32, num_classes: 10}}")
    cfg = compose_cfg(*TINY, model, "bench.repeats=2", "recipe.budget_s=null",
                      "recipe.forecasts=false",  # bf16 would be forecast under the threshold
                      f"out_dir={tmp_path}", *FEW, experiment="recipe")
    run_dir = run(cfg, "recipe", progress=False)
    table = pd.read_csv(run_dir / "recipe.csv")
    excluded = table[table["table"] == "excluded"].set_index("option")["status"]
    assert excluded["precision=bf16"].startswith("error: RuntimeError: this model breaks")
    trials = pd.read_csv(run_dir / "trials.csv")
    tried = trials[trials["variant"].str.startswith("precision")]
    assert set(tried["experiment"]) == {"recipe-step1"}
    final = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert list(final) == ["Tiny"]
    if final["Tiny"]["decided"]:  # else an option left open (noise): not decided, said why
        assert final["Tiny"]["overrides"]["precision"] == "fp32"
        # a re-run command only for a chosen stack
        assert ("command" in final["Tiny"]) == bool(final["Tiny"]["chosen"])
    else:
        assert final["Tiny"]["reason"].startswith("not decided: ")
    # the inline model on one line
    entry = {"_target_": "fault_models.Tiny", "fail": "error_in_autocast",
             "dataset": {"kind": "images", "image_size": 32, "num_classes": 10}}
    assert recipe.rerun_command(entry, ["precision=fp32"]).startswith(
        "speedbench 'model={_target_: fault_models.Tiny, ")


def _few(*more: str) -> list[str]:
    """Only precision and sync left as candidates; no forecasts (they profile the real model,
    which a simulated measurer does not time)."""
    return FEW + [f"~recipe.candidates.{g}" for g in ("tensor_creation", "empty_cache")] + [
        "recipe.forecasts=false", *more]


def test_a_budget_too_short_decides_nothing_and_says_so_first(tmp_path):
    """recipe.budget_s shorter than a screen: the pilot's one trial sizes the screen, which is
    not started; the report opens with "not decided", recipe.yaml offers no final recipe and
    no waterfall is drawn; recipe.also_skip adds to recipe.skip."""
    from speedbench.run import run

    cfg = compose_cfg(*TINY, "model=transformer", "recipe.budget_s=1", f"out_dir={tmp_path}",
                      *FEW, "recipe.skip=[sync]", "recipe.also_skip=[empty_cache]",
                      experiment="recipe")
    run_dir = run(cfg, "recipe", progress=False)
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(trials["experiment"]) == {"recipe-pilot"} and len(trials) == 1  # one trial
    final = yaml.safe_load((run_dir / "recipe.yaml").read_text())["transformer"]
    assert final["decided"] is False and "overrides" not in final
    assert final["reason"].startswith("not decided: the budget ran out before the first screen; "
                                      "a full search needs about ")
    md = (run_dir / "report.md").read_text()
    assert md.splitlines()[0] == "# speedbench report: recipe search"
    recommendation = md.split("\n## ")[1]
    assert recommendation.splitlines()[2].startswith("- not decided: the budget ran out")
    assert "use:" not in recommendation and "final recipe" not in recommendation.lower()
    assert not list(run_dir.rglob("*waterfall*.png"))
    notes = pd.read_csv(run_dir / "recipe.csv").query("table == 'note'")["label"]
    assert any(n.endswith("also_skip): sync, empty_cache; their naive setting stays")
               for n in notes)


@pytest.mark.slow
def test_summary_recipe_csv_and_the_waterfall_agree_to_the_digit(tmp_path):
    """One interval function: every comparison recipe.csv gives (screens, confirmations, the
    waterfall's cumulative speed-ups) is summary.csv's row for the same trials, to the digit,
    at the level the search used (the run's error shared out in advance)."""
    from speedbench.run import run

    cfg = compose_cfg(*TINY, "model=transformer", "bench.repeats=3", "bench.target_ci=null",
                      "recipe.budget_s=null", "recipe.screen_rounds=2", f"out_dir={tmp_path}",
                      *_few("~recipe.candidates.precision"), experiment="recipe")
    run_dir = run(cfg, "recipe", progress=False)
    _agree(pd.read_csv(run_dir / "recipe.csv"), pd.read_csv(run_dir / "summary.csv"))


def _sync_world(effect: float):
    """A simulated machine for the one candidate `sync=deferred` (true gain `effect`): the
    study's instruments (studies.study.Instruments) with no training and no probes, each trial
    a record with a drift per round and noise per trial."""
    from speedbench.studies import study

    rng, drifts = np.random.default_rng(0), {}

    def trial(mc, name, round_, position, *_):
        drift = drifts.setdefault((mc.plan.experiment, round_),
                                  math.exp(rng.normal(0, 0.05)))
        gain = effect if "sync=deferred" in name and not name.startswith("without") else 1.0
        return {**mc.header(name, round_, position), "status": "ok", "peak_mem_mb": 100.0,
                "samples_per_s": 100 * gain * drift * math.exp(rng.normal(0, 0.01)),
                "elapsed_s": 0.1, "steps": 2, "warmup_steps": 1, "final_loss": 1.0,
                # round 2 a burst of other processes: both the search and the summary drop it
                "others_cpu_share": 0.6 if round_ == 2 else 0.01}

    def prepare(mc):
        return study.Prepared(None, {}, {n: 4 for n in mc.plan.variants})

    def header(mc, name, round_, position):
        return {"experiment": mc.plan.experiment, "model": mc.spec.name, "variant": name,
                "is_baseline": name == mc.plan.baseline, "trial": round_, "round": round_,
                "position": position}
    return study.Instruments(prepare=prepare, probe=lambda *_: None, trial=trial, header=header)


def test_the_search_and_summary_agree_on_simulated_trials(tmp_path):
    """The same check on a simulated machine where the option is surely chosen, so that the
    waterfall's cumulative speed-up is compared too: the levels the search used
    (driver.levels) make summary.csv's intervals the search's."""
    from speedbench import results
    from speedbench.analysis.summary import summarise

    cfg = compose_cfg(*TINY, "model=transformer", "bench.repeats=6", "bench.target_ci=null",
                      "recipe.budget_s=null", f"out_dir={tmp_path}",
                      *_few("~recipe.candidates.precision"), experiment="recipe")
    plan = build_plan(cfg, "recipe")
    groups = recipe.check(cfg, plan, None)
    writer = results.TrialWriter(tmp_path / "trials.csv")
    found = recipe.execute(cfg, plan, groups, tmp_path, writer, False, None, Budget(None),
                           _sync_world(1.3))
    assert [o.label for o in found["transformer"].chosen] == ["sync=deferred"]
    summary = summarise(writer.frame(), levels=recipe.levels(found))
    table = pd.read_csv(tmp_path / "recipe.csv")
    assert table.query("table == 'waterfall'")["lo"].notna().sum() == 1
    _agree(table, summary)


def _agree(table: pd.DataFrame, summary: pd.DataFrame) -> None:
    summary = summary.set_index(["experiment", "variant"])
    compared = 0
    for r in table[table["table"].isin(["step", "confirm"])].itertuples():
        if r.status != "ok":
            continue
        step = f"step {int(r.step)}" + (" confirm" if r.table == "confirm" else "")
        row = summary.loc[(recipe.experiment_name(step), r.option)]
        assert (row["speedup"], row["speedup_lo"], row["speedup_hi"]) == \
            pytest.approx((r.speedup, r.lo, r.hi), rel=1e-12, nan_ok=True)
        assert row["family_scope"] == "allotted"
        compared += 1
    assert compared >= 1
    chosen = list(table[table["table"] == "chosen"]["option"])
    waterfall = table[table["table"] == "waterfall"].reset_index(drop=True)
    for i in range(1, len(waterfall)):
        if pd.notna(waterfall.loc[i, "lo"]):
            row = summary.loc[("recipe", " + ".join(chosen[:i]))]
            assert (row["speedup"], row["speedup_lo"], row["speedup_hi"]) == pytest.approx(
                tuple(waterfall.loc[i, ["speedup", "lo", "hi"]]), rel=1e-12)
    # the run's error shared out: no measurement's family is larger than the run's 5 %
    levels = summary.groupby("experiment")[["ci_level", "comparisons"]].first()
    spent = ((1 - levels["ci_level"]) * levels["comparisons"]).sum()
    assert spent <= 0.05 + 1e-12


def test_the_rerun_command_of_a_torchrun_search_starts_with_torchrun(monkeypatch):
    """A recipe found under torchrun is measured again under torchrun: its command keeps the
    launcher (distributed.launcher; here the job's variables, the parent being pytest)."""
    from speedbench.search import driver

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert driver.rerun_command("resnet", ["precision=bf16"]) == (
        "torchrun --nproc_per_node=2 -m speedbench model=resnet precision=bf16")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert driver.rerun_command("resnet", ["precision=bf16"]) == (
        "speedbench model=resnet precision=bf16")


@pytest.mark.parametrize("model", ["waves", "[waves]"])
def test_the_search_takes_an_own_model_whose_name_differs_from_its_config_key(model):
    """User trial 5, M3: `+models@models.waves=waves model=waves` with `model_name: wavenet1d`
    was refused (`recipe.candidates: model: 'wavenet1d' is not a known model`)."""
    cfg = compose_cfg(*TINY, "+models.waves={_target_: own_models.Siamese, loss: module, "
                      "model_name: wavenet1d, dataset: {_target_: own_models.TwoViews, n: 32}}",
                      f"model={model}", experiment="recipe")
    plan = build_plan(cfg, "recipe")
    assert plan.models[0].name == "wavenet1d"
    assert recipe.model_entry(cfg, plan.models[0]) == "waves"
    assert recipe.check(cfg, plan, None)  # the candidates' plans are built on that entry
