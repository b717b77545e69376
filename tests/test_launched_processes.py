"""Variants whose trials run over several processes that speedbench launches through torchrun
(comm_hook, fsdp_reshard, ddp): they keep the run's clock, and get a held-out loss and a
forecast as the variants measured in this process do.

The clock: a launch's ranks get the deadline and the launch is killed BUDGET_GRACE_S past it,
as a trial in this process is stopped. Before, a launched trial was held only to
dist_timeout_s + 2 x bench.max_trial_s (306 s by default): `+experiment=comm_hook` ran 778 s
of a 540 s budget, a PowerSGD trial hung to that limit after the deadline had passed.
"""
from __future__ import annotations

import time

import pandas as pd
import pytest
from omegaconf import OmegaConf

from conftest import SMALL_MODELS, TINY, only_run_dir, run_cli
from speedbench.measure import launch
from speedbench.measure.budget import Budget
from speedbench.measure.trial import BUDGET_GRACE_S
from speedbench.results import schema
from test_distributed import ENV, FAILING_MODEL, TINY_MODEL


def _recipe(max_trial_s=3.0, dist_timeout_s=300.0):
    return OmegaConf.create({"bench": {"max_trial_s": max_trial_s},
                             "dist_timeout_s": dist_timeout_s})


def test_a_launch_is_held_to_what_the_budget_has_left():
    clock = [0.0]
    budget = Budget(40.0, lambda: clock[0], 0.0)
    clock[0] = 30.0  # 10 s left: the run's deadline comes before the launch's own limit
    assert launch.launch_limit(_recipe(), budget) == (10.0 + BUDGET_GRACE_S, True)
    clock[0] = 50.0  # past it: the grace alone
    assert launch.launch_limit(_recipe(), budget) == (BUDGET_GRACE_S, True)
    # a limit of its own shorter than the budget's rest stands, and is not the budget's
    assert launch.launch_limit(_recipe(), Budget(1000.0)) == (306.0, False)
    assert launch.launch_limit(_recipe(), None) == (306.0, False)
    assert launch.launch_limit(_recipe(max_trial_s=None), None) == (None, False)
    assert launch.launch_limit(_recipe(max_trial_s=None), Budget(None)) == (None, False)


def test_a_rank_gets_the_seconds_to_the_parents_deadline():
    assert launch.rank_budget(None) is None
    budget = launch.rank_budget(time.time() + 30)
    assert 29 < budget.left() <= 30 and budget.limit(100.0) <= 30
    assert launch.rank_budget(time.time() - 5).left() == 0  # started past it


def test_a_launch_stopped_by_the_budget_says_so():
    status = launch._timed_out(12.0, True, 2, 12.3)
    assert schema.parse_status(status).kind == schema.NOT_MEASURED
    assert "bench.time_budget_s ran out in its launch over 2 processes" in status
    assert launch._timed_out(306.0, False, 2, 306.1).startswith("error: DDP trial over 2 ")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hung_launched_trial_ends_within_the_runs_budget(tmp_path):
    # Rank 1 hangs in its second step; rank 0 would wait dist_timeout_s (200 s) for it, and the
    # launch's own limit is 206 s: only the run's clock (60 s) ends it in time.
    hanging = FAILING_MODEL.replace("FailsOnRank,", "FailsOnRank,hang:true,")
    budget_s = 60
    out = run_cli("+experiment=dp_vs_ddp", *TINY, *SMALL_MODELS, hanging, "model=failing",
                  "bench.repeats=1", "bench.max_trial_s=3", "dist_timeout_s=200",
                  "bench.explain=false", f"bench.time_budget_s={budget_s}",
                  f"out_dir={tmp_path}", cwd=tmp_path, env=ENV, timeout=400)
    log = out.stdout + out.stderr
    assert "over its bench.time_budget_s" not in log, log  # run.overrun_line: the promise
    df = pd.read_csv(only_run_dir(tmp_path) / "trials.csv").set_index("variant")
    status = df.loc["ddp", "status"]
    assert status.startswith("not measured: the run's bench.time_budget_s ran out in its "
                             "launch over 2 processes"), status


@pytest.mark.slow
@pytest.mark.distributed
def test_launched_variants_get_a_held_out_loss_and_a_forecast(tmp_path):
    # every variant DDP over 2 ranks: the probes and the baseline's forecast profile are
    # launched as the trials are (they were 'n/a: the quality probe trains in this process'
    # and no forecast at all)
    out = run_cli("+experiment=comm_hook", *TINY, *SMALL_MODELS, TINY_MODEL, "model=tiny",
                  "bench.repeats=1", "dist_timeout_s=60", "bench.explain=true",
                  "bench.time_budget_s=400", f"out_dir={tmp_path}", cwd=tmp_path, env=ENV,
                  timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = only_run_dir(tmp_path)
    quality = pd.read_csv(run_dir / "quality.csv").set_index("variant")
    for name in ("ddp", "fp16", "bf16"):
        assert quality.loc[name, "status"] == "ok", quality.loc[name, "status"]
        assert quality.loc[name, "loss"] > 0
    assert quality.loc["powersgd", "status"].startswith("n/a: ")
    forecast = pd.read_csv(run_dir / "forecast.csv").set_index("variant")
    for name in ("fp16", "bf16"):
        row = forecast.loc[name]
        assert row["status"] == "ok" and row["technique"] == "comm_hook", row.to_dict()
        assert row["forecast"] >= 1.0 and 0 <= row["share"] <= 1
    assert "| fp16 | comm_hook |" in (run_dir / "report.md").read_text()
    trials = pd.read_csv(run_dir / "trials.csv")
    ok = trials[trials["status"] == "ok"]
    assert len(ok) == 3  # where a launch's time goes: its start-up and exit beside the window
    assert (ok["launch_s"] > ok["elapsed_s"]).all()
