"""bench.time_budget_s is a wall-clock bound on the whole run, quiet or beside CPU hogs: the run
ends within it plus max(5 %, 10 s), or says by how much it overran and what no budget shortens
(start-up, the report); its own clock (the console's last line) is the process's."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import run_cli

# The small transformer (a tenth of a second a step on a CPU) asked for far more rounds than fit
BUDGET_S = 15
RUN = ["+experiment=amp", "model=transformer", "bench.repeats=50", "bench.target_ci=null",
       f"bench.time_budget_s={BUDGET_S}", "bench.peak_s=0.05"]
SLACK_S = max(0.05 * BUDGET_S, 10)


def _took_s(output: str) -> float:
    return float(re.search(r"trials in (\d+) s; report:", output).group(1))


def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("hogs", [0, 2 * (os.cpu_count() or 1)], ids=["quiet", "busy"])
def test_a_run_ends_within_its_budget(tmp_path, hogs):
    import time

    procs = _hogs(hogs)
    try:
        started = time.monotonic()
        proc = run_cli(*RUN, f"out_dir={tmp_path}", cwd=tmp_path, timeout=600)
        wall_s = time.monotonic() - started
    finally:
        for p in procs:
            p.kill()
            p.wait()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    took_s = _took_s(output)
    # the run's clock is the process's: it neither hides its start nor claims more than it took
    assert wall_s / 2 - 1 <= took_s <= wall_s + 1, (took_s, wall_s)
    if took_s > BUDGET_S + SLACK_S:
        # beside other CPU hogs (a shared CI machine at load 10: a 4 % CPU share) the start-up
        # and the report alone can outlast 15 s: the run says so, and what took it
        over = re.search(r"the run took (\d+) s, (\d+) s over its bench.time_budget_s of 15 s "
                         r"\(.*took \d+ s\)", output)
        assert over and int(over.group(1)) == took_s, output[-3000:]
    # the plan said what the budget buys before the rounds (on a busy machine the probes may
    # have timed no round)
    assert re.search(r"transformer: data and probes took \d+ s; (about \d+ rounds|no probe)",
                     output), output[-3000:]


def test_a_quick_look_is_one_round_of_fixed_windows_without_probes_or_intervals(tmp_path):
    import pandas as pd

    from conftest import TINY, compose_cfg
    from speedbench.config import build_plan
    from speedbench.run import run

    cfg = compose_cfg(*TINY, "model=transformer", "bench.mode=quick", f"out_dir={tmp_path}",
                      experiment="amp")
    for recipe in build_plan(cfg, "amp").variants.values():
        b = recipe.bench
        assert (b.repeats, b.target_ci, b.steady_tol, b.quality_steps, b.too_slow_factor) == \
            (1, None, None, 0, None)
    run_dir = run(cfg, "amp", progress=False)
    summary = pd.read_csv(run_dir / "summary.csv")
    measured = summary[~summary["is_baseline"] & (summary["status"] == "ok")]
    assert len(measured) and (measured["verdict"] == "no CI").all()
    assert measured["speedup"].notna().all() and measured["speedup_lo"].isna().all()
    assert (pd.read_csv(run_dir / "trials.csv")["round"] == 0).all()
