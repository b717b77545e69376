"""The local index of runs (results/index.py, `speedbench runs`): a row per run written at its
end, listed with date, experiment, models, verdicts and folder; a run moved or deleted by hand
is noticed, not an error; a corrupt index is rebuilt from the run directories in one line."""
from __future__ import annotations

import shutil

from conftest import SMALL_MODELS, TINY, run_main
from test_report import make_run

from speedbench.results import index


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
    line = index.lines(cards)[0]
    assert "  amp  resnet  faster 2  " in line and line.endswith(str(dirs[0].resolve())), line
    index.record(folder, dirs[0])  # a run recorded again is one row
    assert len(index.list_runs(folder)) == 3
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_run_deleted_by_hand_is_listed_as_missing_not_an_error(tmp_path):
    folder, dirs = _results(tmp_path)
    shutil.rmtree(dirs[1])
    lines = index.lines(index.list_runs(folder))
    assert lines[1].endswith(f"{dirs[1].resolve()} (missing: moved or deleted)"), lines
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
                   f"out_dir={out}", cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    listed = run_main("runs", str(out), cwd=tmp_path)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    (line,) = listed.stdout.splitlines()
    assert "  default  transformer  no comparison  " in line and str(out) in line, line
    bad = run_main("runs", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("speedbench: error: runs: "), bad.stderr
