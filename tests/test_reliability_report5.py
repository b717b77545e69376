"""Round 5's hand-edited run directories through the report tool (issue 50): cells no run
writes are read as missing and noted (K10: a 400-digit order_seed, a `nan` target loss, a
planned.json nested past any run's), messages never print `nan` for a figure (K13c), and no
file's size makes the report huge or slow (K14: a reason of megabytes, a curves.csv of 300,000
points). docs/outputs.md: such values are left out or mended and listed under "What this report
could not use"; only an unusable directory is an error.

Each asserts what the tool decided and wrote, never how fast it was.
"""
from __future__ import annotations

import pandas as pd
import pytest
from test_report import make_run

from speedbench.report.__main__ import main as report_main
from speedbench.results import runs
from speedbench.results.schema import TO_TARGET_COLUMNS


def _to_target(run, **cells) -> None:
    """to_target.csv and curves.csv of a time-to-target measurement of the run's resnet: fp32
    (its baseline) and fp16, two seeds each, every seed at the target; `cells` replace a
    column's values (as text, as a hand edit would)."""
    rows, points = [], []
    for i, variant in enumerate(("fp32", "fp16")):
        for seed in (0, 1):
            rows.append({"experiment": "amp", "model": "resnet", "variant": variant,
                         "is_baseline": i == 0, "seed": seed, "position": i, "order_seed": 1,
                         "status": "ok", "target_loss": 1.5, "target_source": "set by hand",
                         "entropy_floor": 1.0, "final_loss": 1.45, "steps": 10, "samples": 40,
                         "per_step": 4, "time_s": 2.0 - 0.5 * i + 0.1 * seed, "cold_s": 3.0,
                         "one_time_s": 0.5, "step_ms": 200.0, "cap_s": 60.0})
            points += [{"experiment": "amp", "model": "resnet", "variant": variant,
                        "seed": seed, "steps": s, "samples": 4 * s, "train_s": 0.2 * s,
                        "loss": 3.0 - 0.15 * s} for s in range(11)]
    frame = pd.DataFrame(rows, columns=TO_TARGET_COLUMNS)
    for column, value in cells.items():
        frame[column] = value
    frame.to_csv(run / "to_target.csv", index=False)
    pd.DataFrame(points).to_csv(run / "curves.csv", index=False)


def _report(run, capsys) -> str:
    """The tool on `run`: exit 0, nothing on stderr; its report.md."""
    assert report_main([str(run)]) == 0
    assert capsys.readouterr().err == ""
    return (run / "report.md").read_text()


def _order_seed(run) -> None:
    trials = pd.read_csv(run / "trials.csv")
    trials["order_seed"] = "9" * 400
    trials.to_csv(run / "trials.csv", index=False)


def _planned_deep(run) -> None:
    (run / "planned.json").write_text('{"planned": ' + "[" * 100_000 + "]" * 100_000 + "}")


# --- K10: one cell or file no run writes is noted, the rest reported ---------------------------
@pytest.mark.parametrize("case, edit, noted", [
    ("order_seed_of_400_digits", _order_seed,
     "trials.csv: 9 order_seed cell(s) not finite numbers, read as missing"),
    ("planned_json_100000_deep", _planned_deep, "planned.json nests deeper than 64 levels, "
     "deeper than a run writes: whether the run got to its end is unknown"),
    ("target_loss_text", lambda run: _to_target(run, target_loss="about 1.5"),
     "to_target.csv: 4 target_loss cell(s) not finite numbers, read as missing"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_a_hand_edited_value_is_noted_and_the_report_written(case, edit, noted, tmp_path, capsys):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    edit(run)
    md = _report(run, capsys)
    assert f"- {noted}" in md, md[-3000:]
    assert "## Experiment: amp" in md


# --- K13c: no `nan` for a figure in the report's words -----------------------------------------
def test_a_nan_target_loss_is_unknown_not_a_traceback(tmp_path, capsys):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    _to_target(run, target_loss="nan")  # how Python writes a loss it has not got
    md = _report(run, capsys)
    assert "time to target (held-out loss unknown, 2 seeds, against fp32 at 2.05 s)" in md, md
    assert "resnet: target held-out loss unknown (set by hand)" in md, md


def test_a_baseline_without_a_time_to_target_is_said_not_at_nan_seconds(tmp_path, capsys):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    _to_target(run, time_s=["nan", "inf", "1.5", "1.6"])  # the baseline's two seeds: no time
    md = _report(run, capsys)
    assert "against fp32, which has no time to target)" in md, md
    assert "nan s" not in md
    assert "- to_target.csv: 1 time_s cell(s) not finite numbers, read as missing" in md


def test_a_time_to_target_not_measured_under_torchrun_is_said_as_n_a():
    from speedbench.analysis.to_target import verdict_line

    na = "n/a: time to target is not measured under torchrun"
    rows = pd.DataFrame([{"experiment": "amp", "model": "m", "variant": v, "is_baseline": b,
                          "seed": 0, "status": na, "target_loss": 1.5, "target_source": "x",
                          "entropy_floor": 1.0, "final_loss": float("nan"), "steps": 0,
                          "time_s": float("nan"), "cold_s": float("nan"),
                          "one_time_s": float("nan")} for v, b in (("a", True), ("b", False))])
    assert verdict_line(rows, "m") == f"time to target: {na}"


# --- K14: no size in a run's files makes the report huge or slow -------------------------------
def test_a_reason_of_a_megabyte_is_shortened_where_it_is_read(tmp_path, capsys):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    huge = "n/a: " + "R" * 1_000_000  # 4 such cells: 8 MB, under the 20 MB a table may be
    pd.DataFrame([{"experiment": "amp", "model": "resnet", "variant": v, "technique": "precision",
                   "forecast": "", "share": "", "reason": huge, "status": huge, "is_bound": ""}
                  for v in ("fp16", "bf16")]).to_csv(run / "forecast.csv", index=False)
    md = _report(run, capsys)
    assert "- forecast.csv: 4 text cell(s) over 2,000 characters, more than a run writes, " \
           "shortened" in md, md[-3000:]
    assert (run / "report.md").stat().st_size < 200_000
    assert (run / "report.html").stat().st_size < 1_000_000


def test_a_curve_of_300000_points_is_thinned_where_it_is_read(tmp_path):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    _to_target(run)
    n = 300_000  # 13 MB, under the 20 MB a table may be
    pd.DataFrame({"experiment": "amp", "model": "resnet", "variant": "fp32", "seed": 0,
                  "steps": range(n), "samples": range(0, 4 * n, 4),
                  "train_s": [0.001 * s for s in range(n)], "loss": 2.0}).to_csv(
        run / "curves.csv", index=False)
    notes = []
    curves = runs._curves_table(run, notes)
    assert notes == ["curves.csv: 1 curve(s) of more than 2,000 points, more than a run "
                     "writes, thinned to about 2,000 each"]
    assert len(curves) <= runs.MAX_CURVE_POINTS + 1
    assert curves["steps"].iloc[-1] == n - 1 and curves["steps"].iloc[0] == 0  # its ends kept
    assert _curves_kept_as_written(run)


def _curves_kept_as_written(run) -> bool:
    """A run's own curves (11 points each) are read whole."""
    _to_target(run)
    notes = []
    return len(runs._curves_table(run, notes)) == 44 and notes == []
