"""The local index of runs (results/index.py, `speedbench runs`): a row per run written at its
end, listed with date, label, experiment, models, verdicts and folder under a line naming the
machine, torch and CUDA; filtered; labelled (label=..., `speedbench runs label`); the report
tool takes labels and a reference; a run moved or deleted by hand is noticed, not an error; a
corrupt index is rebuilt from the run directories in one line."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3

import pandas as pd
import pytest
from conftest import SMALL_MODELS, TINY, compose_cfg, run_main
from test_report import make_run

from speedbench.config import build_plan
from speedbench.errors import ConfigError
from speedbench.report.__main__ import main as report_main
from speedbench.results import index
from speedbench.results import runs_cli


def _results(tmp_path, n: int = 3):
    """A results folder of `n` runs (resnet, fp32 against fp16 and bf16), indexed."""
    folder = tmp_path / "results"
    dirs = [make_run(folder / "amp" / f"2026-12-0{i + 1}_10-00-00", models=("resnet",),
                     repeats=3, seed=i) for i in range(n)]
    for d in dirs:
        index.record(folder, d)
    return folder, dirs


def test_each_run_is_a_line_with_its_date_experiment_models_verdicts_and_folder(tmp_path):
    folder, dirs = _results(tmp_path)
    said = []
    cards = index.list_runs(folder, say=said.append)
    assert said == [] and [c.path for c in cards] == [str(d.resolve()) for d in dirs]
    head, line = index.lines(cards, folder)[:2]
    assert head == "-- cpu: Test CPU, 2 cores · torch 2.5.0 · CUDA -", head
    assert line.startswith("2026-") and "  -  amp  resnet  faster 2  amp/2026-12-01_10-00-00" \
        in line, line
    whole = index.lines(cards)[1]  # no folder: the whole path, its start cut to 100 columns
    assert len(whole) == 100 and "  …" in whole and str(dirs[0].resolve()).endswith(
        whole.split("…")[-1]), whole
    index.record(folder, dirs[0])  # a run recorded again is one row
    assert len(index.list_runs(folder)) == 3
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_run_deleted_by_hand_is_listed_as_missing_not_an_error(tmp_path):
    folder, dirs = _results(tmp_path)
    shutil.rmtree(dirs[1])
    lines = index.lines(index.list_runs(folder), folder)[1:]  # (below the machine's line)
    assert lines[1].endswith(f"  amp/{dirs[1].name} (missing: moved or deleted)"), lines
    assert not lines[0].endswith(")") and not lines[2].endswith(")")


def test_a_run_the_index_lacks_is_added_when_listed(tmp_path):
    folder, dirs = _results(tmp_path, n=2)
    later = make_run(folder / "amp" / "2026-12-09_10-00-00", models=("resnet",), repeats=3)
    assert [c.path for c in index.list_runs(folder)][-1] == str(later.resolve())
    assert len(index.read_index(folder / index.FILE)) == 3  # and written


def test_a_corrupt_index_is_rebuilt_from_the_run_directories_in_one_line(tmp_path):
    folder, dirs = _results(tmp_path)
    (folder / index.FILE).write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    said = []
    cards = index.list_runs(folder, say=said.append)
    assert said == [f"speedbench runs: {folder / index.FILE} could not be read; rebuilt from "
                    f"the 3 run directories under {folder}"]
    assert [c.path for c in cards] == [str(d.resolve()) for d in dirs]
    assert index.list_runs(folder, say=said.append) == cards and len(said) == 1  # rewritten


def test_a_run_adds_itself_and_speedbench_runs_lists_it(tmp_path):
    out = tmp_path / "results"
    got = run_main(*TINY, *SMALL_MODELS, "model=transformer", "bench.repeats=1",
                   f"out_dir={out}", "label=mine", cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    listed = run_main("runs", str(out), cwd=tmp_path)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    machine, line = listed.stdout.splitlines()
    assert machine.startswith("-- cpu: ") and "torch " in machine, machine
    assert "  mine  default  transformer  no comparison  default/" in line, line
    assert all(len(x) <= 100 for x in listed.stdout.splitlines())
    bad = run_main("runs", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("speedbench: error: runs: "), bad.stderr


def _cli(capsys, *args) -> tuple[int, list[str], str]:
    """`speedbench runs args...` in this process: exit status, stdout's lines, stderr."""
    rc = runs_cli.main([str(a) for a in args])
    got = capsys.readouterr()
    return rc, got.out.splitlines(), got.err


def test_a_run_is_labelled_by_folder_name_then_listed_and_filtered_by_label(capsys, tmp_path):
    folder, dirs = _results(tmp_path)
    rc, out, err = _cli(capsys, "label", dirs[1].name, "torch2.5-a", "--in", folder)
    assert rc == 0 and out == [f"speedbench runs: {dirs[1].resolve()} is labelled torch2.5-a"]
    assert (dirs[1] / "label.txt").read_text() == "torch2.5-a\n"
    rc, out, err = _cli(capsys, folder, "--label", "torch2.5*")
    assert rc == 0 and len(out) == 2 and "  torch2.5-a  amp  resnet  " in out[1], out
    index.write_label(dirs[2], "other")  # by hand; the index learns it when the run is recorded
    (folder / index.FILE).unlink()  # rebuilt from the folders: the labels are theirs
    assert [c.label for c in index.list_runs(folder)] == ["", "torch2.5-a", "other"]


def test_the_filters_take_globs_and_dates_and_a_bad_date_is_one_line(capsys, tmp_path):
    folder, dirs = _results(tmp_path)
    os.utime(dirs[0] / "trials.csv", (1.7e9, 1.7e9))  # 2023-11-14: the run's date
    index.record(folder, dirs[0])
    assert len(_cli(capsys, folder, "--model", "res*", "--experiment", "AMP")[1]) == 4
    assert _cli(capsys, folder, "--model", "vae")[1:] == ([], f"speedbench runs: none of the "
                                                              f"3 runs in {folder} matches\n")
    rc, out, _ = _cli(capsys, folder, "--until", "2023-11-14")
    assert rc == 0 and len(out) == 2 and out[1].startswith("2023-11-14 "), out
    assert len(_cli(capsys, folder, "--since", "2023-11-15")[1]) == 3
    rc, out, err = _cli(capsys, folder, "--since", "yesterday")
    assert rc == 2 and out == [] and err == (
        "speedbench: error: runs: --since: 'yesterday' is not a date; give YYYY-MM-DD or "
        "YYYY-MM-DDTHH:MM\n"), err
    rc, _, err = _cli(capsys, folder, "--colour", "red")
    assert rc == 2 and err.startswith("speedbench: error: runs: unrecognized arguments: "
                                      "--colour red (usage: speedbench runs [FOLDER]"), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("bad", ["", "a/b", "-x", "x" * 61, "tab\there"])
def test_a_bad_label_is_refused_in_one_line_naming_the_rule(capsys, tmp_path, bad):
    folder, dirs = _results(tmp_path, n=1)
    rc, out, err = _cli(capsys, "label", dirs[0], bad, "--in", folder)
    assert rc == 2 and out == [] and len(err.splitlines()) == 1, err
    assert "a label is 1 to 60 printable characters, without '/'" in err
    assert not (dirs[0] / "label.txt").exists()
    with pytest.raises(ConfigError, match=r"^label: .* is not allowed \(.*\); a label is 1 to 60"):
        build_plan(compose_cfg("device=cpu", "model=transformer", f"label='{bad}'"), None)


def test_the_report_takes_labels_and_its_reference_is_the_first_that_measured(capsys, tmp_path):
    folder, dirs = _results(tmp_path)
    trials = pd.read_csv(dirs[0] / "trials.csv").assign(status="error", samples_per_s=float("nan"))
    trials.to_csv(dirs[0] / "trials.csv", index=False)  # the first run measured nothing
    for d, name in zip(dirs, ("empty", "base", "new")):
        assert _cli(capsys, "label", d, name, "--in", folder)[0] == 0
    said = []
    out = tmp_path / "cmp"
    assert report_main(["empty", "base", "new", "--index", str(folder), "--out", str(out)],
                       say=said.append) == 0
    assert said[0] == ("reference: base, the first run given that measured something (empty "
                       "measured nothing; another: --reference RUN)"), said
    md = (out / "report.md").read_text()
    assert "reference: base" in md and "new / base" in md
    said.clear()
    assert report_main(["base", "new", "--reference", "new", "--index", str(folder), "--out",
                        str(tmp_path / "cmp2")], say=said.append) == 0
    assert said[0] == "reference: new (--reference)"
    assert "base / new" in (tmp_path / "cmp2" / "report.md").read_text()


def test_a_label_of_a_moved_or_deleted_run_is_noticed_not_an_error(capsys, tmp_path):
    folder, dirs = _results(tmp_path)
    index.relabel(folder, dirs[0], "moved")
    index.relabel(folder, dirs[1], "gone")
    dirs[0].rename(folder / "amp" / "kept-aside")  # by hand: the index follows it
    shutil.rmtree(dirs[1])
    said = []
    cards = index.list_runs(folder, say=said.append)
    assert said == [f"speedbench runs: {dirs[0].resolve()} was moved to "
                    f"{(folder / 'amp' / 'kept-aside').resolve()}; the index follows it"]
    assert sorted(c.label for c in cards) == ["", "gone", "moved"]
    assert index.find(folder, "moved") == (folder / "amp" / "kept-aside").resolve()
    rc = report_main(["gone", "--index", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"speedbench.report: error: gone: its run {dirs[1].resolve()} was "
                               f"moved or deleted (`speedbench runs {folder}` lists it as "
                               "missing); give its folder where it is now\n"), err
    rc = report_main(["nosuch", "--index", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("speedbench.report: error: nosuch: not a run directory, "
                                      "nor a run of ") and "(its labels: gone, moved)" in err


def test_an_index_written_before_labels_is_read_and_brought_up_to_date(tmp_path):
    folder, dirs = _results(tmp_path, n=2)
    index.write_label(dirs[0], "old")
    (folder / index.FILE).unlink()
    db = sqlite3.connect(folder / index.FILE)  # the columns an earlier speedbench wrote
    with db:
        db.execute("CREATE TABLE runs (date TEXT, experiment TEXT, models TEXT, verdicts TEXT, "
                   "path TEXT PRIMARY KEY)")
        db.executemany("INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
                       [("2026-12-01T10:00:00", "amp", "resnet", "faster 2", str(d.resolve()))
                        for d in dirs])
    db.close()
    said = []
    assert [c.label for c in index.list_runs(folder, say=said.append)] == ["old", ""]
    assert said == [] and index.read_index(folder / index.FILE)[0].machine.startswith("cpu: ")


def test_env_json_gives_the_machine_class_and_versions(tmp_path):
    run = make_run(tmp_path / "r", models=("resnet",), repeats=2, env={
        "device": "cuda:0", "device_name": "NVIDIA H100", "cuda_device_count": 8,
        "versions": {"torch": "2.6.0"}, "torch_cuda_version": "12.4"})
    c = index.card(run)
    assert (c.machine, c.torch, c.cuda) == ("cuda: NVIDIA H100 x8", "2.6.0", "12.4")
    (run / "env.json").write_text(json.dumps([1, 2]))  # not what a run writes: unknown
    assert index.card(run).machine == ""
