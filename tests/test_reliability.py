"""Hostile input, hostile run directories, full disks: refused in one line, nothing half-written.

Two tables:
- BAD_INPUTS through `python -m speedbench`: a non-zero exit status, one line (speedbench's own
  errors) or Hydra's message, never a traceback, no run directory, nothing overwritten. Every
  row goes through speedbench's main() in this process; one row per way out also through a
  real subprocess (a torch import each).
- HOSTILE_RUNS through `python -m speedbench.report`: a report with a note saying what was left
  out, or one clear line; no traceback; nothing written outside the report's own files; nothing
  from the run directory executed.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import (SMALL_MODELS, TINY, compose_cfg, default_sigint, run_cli, run_main,
                      said_lines, usable_cores, without_busy_note)
from test_report import make_run

from speedbench.report.__main__ import main as report_main

T = [*TINY, *SMALL_MODELS, "model=transformer", "bench.repeats=1"]


def snapshot(root: Path) -> dict:
    """Every file under root with its content hash and type: what 'nothing changed' means."""
    out = {}
    for p in sorted(root.rglob("*")):
        kind = "link" if p.is_symlink() else "dir" if p.is_dir() else \
            "file" if p.is_file() else "other"  # a FIFO: reading it would block
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if kind == "file" else \
            os.readlink(p) if kind == "link" else ""
        out[str(p.relative_to(root))] = (kind, digest)
    return out


def _text_file(d: Path) -> str:
    (d / "notes.txt").write_text("not an image folder\n")
    return str(d / "notes.txt")


def _a_folder(d: Path) -> str:
    (d / "folder").mkdir()
    (d / "folder" / "a.txt").write_text("x" * 100)
    return str(d / "folder")


def _bytes(d: Path, n: int) -> str:
    (d / f"{n}.txt").write_bytes(b"abcdefghij" * (n // 10) + b"x" * (n % 10))
    return str(d / f"{n}.txt")


def _image_folder(d: Path, images: int) -> str:
    from PIL import Image

    (d / "images" / "cat").mkdir(parents=True)
    for i in range(images):
        Image.new("RGB", (40, 40), (i, 0, 0)).save(d / "images" / "cat" / f"{i}.png")
    return str(d / "images")


def _existing_run(d: Path) -> str:
    (d / "old").mkdir()
    (d / "old" / "trials.csv").write_text("experiment,model\nx,y\n")
    (d / "old" / "config.yaml").write_text("keep: me\n")
    return str(d / "old")


# (id, overrides (a callable gets the test's folder and returns one override), kind, needle)
# kind "config": speedbench's own check, exit 2 and one line naming the key;
# kind "hydra": the override cannot be composed: exit 1 with Hydra's message, or exit 2 and one
# line where speedbench checks the command line before Hydra does.
BAD_INPUTS = [
    ("batch_size", ["batch_size=-1"], "config", "batch_size"),
    ("accumulate", ["accumulate=0"], "config", "accumulate"),
    ("repeats", ["bench.repeats=0"], "config", "bench.repeats"),
    ("steps", ["bench.steps=0"], "config", "bench.steps"),
    ("precision", ["precision=fp8"], "config", "precision"),
    ("device", ["device=tpu7"], "config", "device"),
    ("lr", ["lr=-1"], "config", "lr"),
    ("workers", ["data.num_workers=-1"], "config", "data.num_workers"),
    ("prefetch", ["data.prefetch_factor=0", "data.num_workers=1"], "config",
     "data.prefetch_factor"),
    ("max_trial_s", ["bench.max_trial_s=0"], "config", "bench.max_trial_s"),
    ("warmup", ["bench.warmup=-1"], "config", "bench.warmup"),
    ("warmup_max", ["bench.warmup_max=-3"], "config", "bench.warmup_max"),
    ("sync_every", ["sync_every=0"], "config", "sync_every"),
    ("baseline", ["baseline=nope"], "config", "baseline"),
    ("scale", ["scale=huge"], "config", "scale"),
    ("dist_timeout", ["dist_timeout_s=-5"], "config", "dist_timeout_s"),
    ("target_ci", ["bench.target_ci=0"], "config", "bench.target_ci"),
    ("samples", ["data.samples=0"], "config", "data.samples"),
    ("nproc", [f"nproc={usable_cores() + 1}", "parallel=ddp"], "config", "nproc"),
    ("no_model", ["model=[]"], "config", "model"),
    ("model_twice", ["model=[transformer,transformer]"], "config", "model"),
    ("model_unknown", ["model=nosuch"], "config", "model"),
    ("model_case", ["model=[transformer,TRANSFORMER]"], "config", "model"),
    ("unknown_key", ["+foo=1"], "config", "foo"),
    ("unknown_key_without_plus", ["foo=1"], "hydra", "foo"),
    ("suite_exclude", ["+experiment=tips", "suite.exclude=[nosuch]"], "config", "suite.exclude"),
    ("split", ["accumulate=8", "accumulate_mode=split"], "config", "accumulate"),
    ("data_missing", ["data.path=/nonexistent/x"], "config", "data.path"),
    ("data_folder_for_text", [lambda d: f"data.path={_a_folder(d)}"], "config", "data.path"),
    ("data_text_for_images", ["model=resnet", lambda d: f"data.path={_text_file(d)}"], "config",
     "data.path"),
    ("run_dir_taken", [lambda d: f"run_dir={_existing_run(d)}"], "config", "run_dir"),
    ("run_dir_not_empty", [lambda d: f"run_dir={_a_folder(d)}"], "config", "run_dir"),
    ("out_dir_through_a_file", [lambda d: f"out_dir={_text_file(d)}/results"], "config",
     "out_dir"),
    ("out_dir_unwritable", ["out_dir=/proc/speedbench-results"], "config", "out_dir"),
    ("samples_below_a_batch", ["data.samples=1"], "config", "data.samples"),
    ("text_of_10_bytes", [lambda d: f"data.path={_bytes(d, 10)}"], "config", "data.path"),
    ("text_below_a_batch", [lambda d: f"data.path={_bytes(d, 46)}"], "config", "data.path"),
    ("image_folder_empty", ["model=resnet", lambda d: f"data.path={_image_folder(d, 0)}"],
     "config", "data.path"),
    ("image_folder_below_a_batch", ["model=resnet", lambda d: f"data.path={_image_folder(d, 1)}"],
     "config", "data.path"),
    ("steps_huge", ["bench.steps=1000000000"], "config", "bench.steps"),
    ("batch_huge", ["batch_size=100000000"], "config", "batch_size"),
    ("samples_huge", ["data.samples=1000000000"], "config", "data.samples"),
    ("samples_per_trial_huge", ["bench.steps=900000", "batch_size=64"], "config", "bench.steps"),
    ("not_an_int", ["batch_size=abc"], "hydra", "batch_size"),
    ("not_an_int_accumulate", ["accumulate=abc"], "hydra", "accumulate"),
    ("fraction", ["batch_size=1.5"], "hydra", "batch_size"),
    ("bench_scalar", ["bench=5"], "hydra", "bench"),
    ("bench_unknown", ["bench.nosuch=1"], "hydra", "nosuch"),
    ("no_experiment", ["+experiment=nosuch"], "hydra", "nosuch"),
    ("model_malformed", ["model={_target_: x"], "hydra", "{_target_: x"),
    ("variants_value", ["variants={a: 1}"], "hydra", "variants"),
    # values that reach the OS: refused before the run directory exists
    ("seed_negative", ["bench.seed=-1"], "config", "bench.seed"),
    ("seed_huge", ["bench.seed=99999999999999999999999"], "config", "bench.seed"),
    ("seed_2_32", ["bench.seed=4294967296"], "config", "bench.seed"),
    ("max_trial_inf_ddp", ["bench.max_trial_s=inf", "parallel=ddp", "nproc=2"], "config",
     "bench.max_trial_s"),
    ("max_trial_nan", ["bench.max_trial_s=nan"], "config", "bench.max_trial_s"),
    ("dist_timeout_inf_ddp", ["dist_timeout_s=inf", "parallel=ddp", "nproc=2"], "config",
     "dist_timeout_s"),
    ("dist_timeout_1e12_ddp", ["dist_timeout_s=1e12", "parallel=ddp", "nproc=2"], "config",
     "dist_timeout_s"),
    ("time_budget_inf", ["bench.time_budget_s=inf"], "config", "bench.time_budget_s"),
    ("largest_batch_inf", ["bench.largest_batch_s=inf"], "config", "bench.largest_batch_s"),
    ("quality_steps_huge", ["bench.quality_steps=1000000000"], "config", "bench.quality_steps"),
    ("quality_steps_negative", ["bench.quality_steps=-1"], "config", "bench.quality_steps"),
    ("variant_seed_negative", ["+variants={a: {bench.seed: -5}}"], "config",
     "variants.a.bench.seed"),
    # round 4: a data set's size, and deleting a schema key
    ("vocab_size_zero", ["models.transformer.small.dataset.vocab_size=0"], "config",
     "dataset.vocab_size"),
    ("seq_len_zero", ["models.transformer.small.dataset.seq_len=0"], "config",
     "dataset.seq_len"),
    ("delete_bench", ["~bench"], "config", "~bench"),
    ("delete_a_bench_key", ["~bench.steps"], "config", "~bench.steps"),
]
if not torch.cuda.is_available():
    BAD_INPUTS.append(("no_cuda", ["device=cuda"], "config", "device"))


def _overrides(row, folder: Path) -> list[str]:
    return [o(folder) if callable(o) else o for o in row[1]]


def _with_out_dir(row, folder: Path) -> list[str]:
    """The row's overrides, with out_dir in `folder` unless the row sets out_dir itself."""
    own = _overrides(row, folder)
    return own if any(o.startswith("out_dir=") for o in own) else \
        [*own, f"out_dir={folder / 'results'}"]


def test_the_bad_input_table_is_large_enough():
    assert len(BAD_INPUTS) >= 40 and len({r[0] for r in BAD_INPUTS}) == len(BAD_INPUTS)


def _cli_row(row, root: Path, call=run_cli) -> dict:
    folder = root / row[0]
    folder.mkdir()
    args = [*T, *_with_out_dir(row, folder)]
    before = snapshot(folder)
    if call is run_cli:
        proc = run_cli(*args, cwd=folder, timeout=300, env={"OMP_NUM_THREADS": "1"})
    else:
        proc = call(*args, cwd=folder)
    return {"proc": proc, "before": before, "after": snapshot(folder), "folder": folder}


# Through the command line each row costs a torch import (about 4 s of CPU: 39 rows took 143 s
# of CPU, over a minute on two cores): every row goes through speedbench's main() in this
# process, and one row per way out (run()'s checks, the data checks, the run directory,
# Hydra's own error, the command-line check before Hydra) through `python -m speedbench` too.
CLI_ROWS = ("batch_size", "data_text_for_images", "run_dir_not_empty", "not_an_int",
            "samples_below_a_batch", "unknown_key")


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """The CLI_ROWS of BAD_INPUTS through the command line, three at a time."""
    rows = [r for r in BAD_INPUTS if r[0] in CLI_ROWS]
    root = tmp_path_factory.mktemp("cli")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return dict(zip([r[0] for r in rows], pool.map(lambda r: _cli_row(r, root), rows)))


def _refused_cleanly(row, result) -> None:
    proc = result["proc"]
    err = without_busy_note(proc.stderr).strip()
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert result["after"] == result["before"], "the command wrote or changed files"
    if row[2] == "config" or proc.returncode == 2:
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(err.splitlines()) == 1 and err.startswith("speedbench: error:"), err
    else:
        assert proc.returncode == 1, proc.stderr[-3000:]
    assert row[3] in err, err


@pytest.mark.parametrize("row", BAD_INPUTS, ids=lambda r: r[0])
def test_bad_input_through_main(row, tmp_path):
    _refused_cleanly(row, _cli_row(row, tmp_path, call=run_main))


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in BAD_INPUTS if r[0] in CLI_ROWS], ids=lambda r: r[0])
def test_bad_input_through_the_cli(row, cli_results):
    _refused_cleanly(row, cli_results[row[0]])


# --- hostile run directories through the report tool -------------------------------------------

def _trials(run: Path, edit) -> None:
    t = pd.read_csv(run / "trials.csv")
    edit(t)
    t.to_csv(run / "trials.csv", index=False)
    (run / "summary.csv").unlink(missing_ok=True)  # recomputed from the edited trials


def _cell(column, value, row=0):
    def edit(t):
        t[column] = t[column].astype(object)
        t.loc[row, column] = value
    return edit


def _config(run: Path, **changes) -> None:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg.update(changes)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def _summary_junk(run: Path) -> None:
    s = pd.read_csv(run / "summary.csv").astype(object)
    s.loc[0, "speedup"], s.loc[1, "speedup_lo"], s.loc[2, "samples_per_s"] = "abc", "1e999", "-"
    s.to_csv(run / "summary.csv", index=False)


def _scaling_with_mathtext(run: Path) -> None:
    name = r"$\frac{1}{$"
    _trials(run, lambda t: t.__setitem__("variant", t["variant"].replace({"fp16": name})))
    t = pd.read_csv(run / "trials.csv")
    t["devices"] = t["variant"].map({"fp32": 1, name: 2, "bf16": 4})
    t.to_csv(run / "trials.csv", index=False)
    from speedbench import results
    from speedbench.analysis.summary import add_efficiency, summarise
    t["is_baseline"] = t["is_baseline"].astype(bool)
    results.write_summary(add_efficiency(summarise(t), t), run)


def _link_out(run: Path, name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if name == "plots":
        target.mkdir()
        (target / "amp-speedup.png").write_bytes(b"not ours")
        (target / "zz-speedup.png").write_bytes(b"not ours either")
    else:
        target.write_text("not ours")
    os.symlink(target, run / name)


def _members(run: Path, bomb: bool = False) -> None:
    (run / "members").mkdir()
    if bomb:
        _alias_bomb(run / "members" / "a.yaml")
    else:
        (run / "members" / "a.yaml").write_text("[: not yaml")
    (run / "members" / "b.yaml").write_text("- a list\n")
    (run / "members" / "c.yaml").write_text("bench: 5\n")


def _executable_config(run: Path) -> None:
    marker = run.parent / "EXECUTED"
    (run / "config.yaml").write_text(
        f"bench: !!python/object/apply:os.system ['touch {marker}']\n")


def _target_config(run: Path) -> None:
    _config(run, model={"_target_": "pathlib.Path.touch", "self": str(run.parent / "EXECUTED")})


# (id, setup(run, outside), expected rc, text that must appear: in report.md when rc is 0,
# in the one-line error otherwise)
HOSTILE_RUNS = [
    ("step_ms_text", lambda r, o: _trials(r, _cell("step_ms", "abc")), 0,
     "1 step_ms cell(s) not finite numbers"),
    ("throughput_inf", lambda r, o: _trials(r, _cell("samples_per_s", "inf")), 0,
     "without a positive, finite samples_per_s"),
    ("throughput_zero", lambda r, o: _trials(r, lambda t: t.__setitem__("samples_per_s", 0.0)), 0,
     "without a positive, finite samples_per_s"),
    ("throughput_negative", lambda r, o: _trials(r, _cell("samples_per_s", -5.0, row=3)), 0,
     "without a positive, finite samples_per_s"),
    ("env_list", lambda r, o: (r / "env.json").write_text("[1, 2]"), 0,
     "env.json is not a JSON object"),
    ("env_nested_types", lambda r, o: (r / "env.json").write_text(json.dumps(
        {"versions": "2.5", "cuda_devices": 5, "env": [1], "device": {"a": 1}})), 0,
     "versions, env, cuda_devices of an unexpected type"),
    ("summary_junk", lambda r, o: _summary_junk(r), 0, "summary recomputed from trials.csv"),
    ("claim_factor_text", lambda r, o: _config(r, claims=[
        {"tip": "t", "source": "s", "quote": "q", "kind": "less_memory", "factor": "abc"}]), 0,
     "claim 1 of the config left out (unexpected factor)"),
    ("claim_variants_number", lambda r, o: _config(r, claims=[
        {"tip": "t", "source": "s", "quote": "q", "variants": 5}]), 0,
     "claim 1 of the config left out (unexpected variants)"),
    ("claim_quote_mapping", lambda r, o: _config(r, claims=[
        {"tip": "t", "source": "s", "quote": {"a": 1}}, "just text"]), 0,
     "claim 2 of the config left out (not a mapping)"),
    ("claims_not_a_list", lambda r, o: _config(r, claims={"a": 1}), 0,
     "claims: is not a list"),
    ("members_invalid", lambda r, o: _members(r), 0, "members/a.yaml is not a readable"),
    ("empty_names", lambda r, o: _trials(r, lambda t: t.__setitem__(
        "variant", t["variant"].replace({"fp16": ""})) or t.__setitem__("model", "")), 0,
     "(empty)"),
    ("mathtext_in_scaling", lambda r, o: _scaling_with_mathtext(r), 0, "scaling eff."),
    ("javascript_link", lambda r, o: _trials(r, lambda t: t.__setitem__(
        "variant", t["variant"].replace({"fp16": "[x](javascript:alert(1))"}))), 0,
     r"[x\](javascript:alert(1))"),
    ("report_html_symlink", lambda r, o: _link_out(r, "report.html", o / "victim.html"), 0,
     "## Experiment: amp"),
    ("plots_symlink", lambda r, o: _link_out(r, "plots", o / "victims"), 0,
     "## Experiment: amp"),
    ("yaml_python_tag", lambda r, o: _executable_config(r), 0,
     "config.yaml is not valid YAML"),
    ("target_in_config", lambda r, o: _target_config(r), 0, "## Experiment: amp"),
    ("trials_fifo", lambda r, o: ((r / "trials.csv").unlink(), os.mkfifo(r / "trials.csv")), 2,
     "trials.csv is not a regular file"),
    ("env_fifo", lambda r, o: ((r / "env.json").unlink(), os.mkfifo(r / "env.json")), 0,
     "no env.json"),
    ("trials_not_utf8", lambda r, o: (r / "trials.csv").write_bytes(b"\xff\xfe\x00garbage"), 2,
     "not a readable CSV file"),
    ("yaml_alias_bomb", lambda r, o: _alias_bomb(r / "config.yaml"), 0, "uses YAML aliases"),
    ("members_alias_bomb", lambda r, o: _members(r, bomb=True), 0,
     "members/a.yaml is not a readable"),
    ("trials_over_the_size_limit", lambda r, o: _grow(r / "trials.csv", 21_000_000), 2,
     "more than a run writes"),
    ("summary_over_the_size_limit", lambda r, o: _grow(r / "summary.csv", 21_000_000), 0,
     "summary recomputed from trials.csv"),
    ("config_utf8", lambda r, o: _config(r, note="ünï 😀 名前"), 0, "## Experiment: amp"),
    ("config_a_folder", lambda r, o: ((r / "config.yaml").unlink(), (r / "config.yaml").mkdir()),
     0, "## Experiment: amp"),
    ("env_a_link_loop", lambda r, o: ((r / "env.json").unlink(),
                                      (r / "env.json").symlink_to(r / "env.json")), 0,
     "no env.json"),
    ("trials_a_folder", lambda r, o: ((r / "trials.csv").unlink(), (r / "trials.csv").mkdir()),
     2, "trials.csv is not a regular file"),
    ("env_huge_value", lambda r, o: _env_value(r, "x" * 5_000_000), 0, "## Experiment: amp"),
    # round 4 (G9-G12, G22-G24): types, nesting, sizes and values no run writes
    ("cfg_bench_a_list", lambda r, o: _config(r, bench=[1, 2]), 0,
     "config.yaml: bench of an unexpected type, left out"),
    ("cfg_bench_a_string", lambda r, o: _config(r, bench="fast"), 0,
     "config.yaml: bench of an unexpected type, left out"),
    ("env_cpu_flags_an_int", lambda r, o: _env_entry(r, cpu_flags=5), 0,
     "env.json: cpu_flags of an unexpected type, left out"),
    ("env_cpu_flags_not_strings", lambda r, o: _env_entry(r, cpu_flags=[1, "avx2"]), 0,
     "- **CPU flags**: avx2\n"),
    ("env_deep", lambda r, o: (r / "env.json").write_text("[" * 200_000 + "]" * 200_000), 0,
     "env.json nests deeper than 64 levels"),
    ("env_deep_but_parseable", lambda r, o: (r / "env.json").write_text(
        '{"versions": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}"), 0,
     "env.json nests deeper than 64 levels"),
    ("cfg_deep", lambda r, o: (r / "config.yaml").write_text("a: " + "[" * 50_000 + "]" * 50_000),
     0, "config.yaml nests deeper than 64 levels"),
    ("members_deep", lambda r, o: ((r / "members").mkdir(),
                                   (r / "members" / "a.yaml").write_text("[" * 50_000)), 0,
     "members/a.yaml is not a readable"),
    ("techniques_deep", lambda r, o: (r / "techniques.json").write_text("[" * 200_000), 0,
     "## Experiment: amp"),
    ("techniques_fields_an_int", lambda r, o: _techniques(r, [{"name": "x", "fields": 5}]), 0,
     "## Experiment: amp"),
    ("techniques_column_a_list", lambda r, o: _techniques(
        r, [{"name": "x", "fields": [{"column": ["num_workers"], "doc": "d"}]}]), 0,
     "## Experiment: amp"),
    ("techniques_host_sweep_column_a_list", lambda r, o: _techniques(
        r, [{"name": "x", "fields": [], "host_sweep": {"column": ["variant"], "title": "t"}}]),
     0, "## Experiment: amp"),
    ("recipe_csv_empty", lambda r, o: (r / "recipe.csv").write_text(""), 0,
     "recipe.csv left out: "),
    ("recipe_csv_binary", lambda r, o: (r / "recipe.csv").write_bytes(bytes(range(256)) * 4), 0,
     "recipe.csv left out: "),
    ("recipe_csv_other_columns", lambda r, o: (r / "recipe.csv").write_text("a,b\n1,2\n"), 0,
     "recipe.csv left out: it lacks the columns model"),
    ("memory_negative", lambda r, o: _trials(r, lambda t: t.__setitem__("peak_mem_mb", -1e9)), 0,
     "peak_mem_mb cell(s) not finite numbers"),
    ("every_row_a_baseline", lambda r, o: _trials(r, lambda t: t.__setitem__("is_baseline", True)),
     0, "trials.csv flags more than one baseline variant of a model"),
    ("variant_name_of_2_mb", lambda r, o: _trials(r, lambda t: t.__setitem__(
        "variant", t["variant"].replace({"fp16": "W" * 2_000_000}))), 0,
     "(2,000,000 characters, #"),
    ("env_device_name_of_30_mb", lambda r, o: _env_entry(r, device_name="D" * 30_000_000), 0,
     "env.json is 30 MB, more than a run writes"),
    ("env_device_name_of_1_mb", lambda r, o: _env_entry(r, device_name="D" * 1_000_000), 0,
     "D… (1,000,0"),  # the device line, shortened: "cpu (DDD…)" has a few more characters
]


def _alias_bomb(path: Path, levels: int = 7) -> None:
    """A "billion laughs" appended to a YAML file: 9^levels strings from a few hundred bytes."""
    lines = ['bomb0: &b0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"bomb{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]" for i in range(1, levels)]
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


def _grow(path: Path, size: int) -> None:
    """The file's data rows repeated until it holds `size` bytes."""
    header, *rows = path.read_text().splitlines(keepends=True)
    body = "".join(rows) or "x\n"
    path.write_text(header + body * (size // len(body) + 1))


def _env_entry(run: Path, **entries) -> None:
    env = json.loads((run / "env.json").read_text())
    (run / "env.json").write_text(json.dumps({**env, **entries}))


def _techniques(run: Path, entries: list) -> None:
    (run / "techniques.json").write_text(json.dumps({"techniques": entries}))


def _env_value(run: Path, value: str) -> None:
    env = json.loads((run / "env.json").read_text())
    (run / "env.json").write_text(json.dumps({**env, "env": {**env.get("env", {}), "BIG": value}}))


@pytest.mark.parametrize("row", HOSTILE_RUNS, ids=lambda r: r[0])
def test_hostile_run_directory_through_the_report_tool(row, tmp_path, capsys):
    name, setup, rc, text = row
    run, outside = make_run(tmp_path / "run", models=("resnet",), repeats=3), tmp_path / "outside"
    outside.mkdir()
    setup(run, outside)
    before_outside = snapshot(outside)
    before_run = {k: v for k, v in snapshot(run).items()
                  if not k.startswith(("plots", "report."))}
    assert report_main([str(run)]) == rc
    err = capsys.readouterr().err.strip()
    assert snapshot(outside) == before_outside, "the report wrote through a link"
    assert not (tmp_path / "EXECUTED").exists(), "something from the run directory ran"
    after_run = {k: v for k, v in snapshot(run).items() if not k.startswith(("plots", "report."))}
    assert after_run == before_run, "the report changed the run's own files"
    if rc:
        assert len(err.splitlines()) == 1 and err.startswith("speedbench.report: error:"), err
        assert text in err, err
        return
    md = (run / "report.md").read_text()
    assert text in md, md[-2000:]
    assert not re.search(r"(?<!\\)\]\(\s*javascript:", md), "a name became a link"
    assert not (run / "report.html").is_symlink() and not (run / "plots").is_symlink()
    assert (run / "report.html").stat().st_size > 1000
    assert (run / "report.html").stat().st_size < 3_000_000, "a huge value made a huge report"


def test_the_hostile_run_table_is_large_enough():
    assert len(HOSTILE_RUNS) >= 30 and len({r[0] for r in HOSTILE_RUNS}) == len(HOSTILE_RUNS)


def test_out_pointing_at_a_file_is_refused_in_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    (tmp_path / "afile").write_text("keep")
    assert report_main([str(run), "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"speedbench.report: error: --out {tmp_path / 'afile'} is a file, not a directory"
    assert (tmp_path / "afile").read_text() == "keep"
    assert report_main([str(run), str(run), "--out", str(tmp_path / "afile" / "sub")]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_two_experiment_names_that_map_to_one_file_name_get_figures_of_their_own(tmp_path):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    t = pd.read_csv(run / "trials.csv")
    other = t.assign(experiment="exp-one", samples_per_s=t["samples_per_s"] * 10)
    pd.concat([t.assign(experiment="exp/one"), other]).to_csv(run / "trials.csv", index=False)
    (run / "summary.csv").unlink()
    assert report_main([str(run)]) == 0
    md = (run / "report.md").read_text()
    sections = md.split("## Experiment: ")[1:]
    figures = [set(re.findall(r"\(plots/([^)]+\.png)\)", s)) for s in sections]
    assert len(figures) == 2 and figures[0] and figures[1] and not figures[0] & figures[1], figures


def test_out_never_replaces_another_runs_report(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=1.2, seed=1)
    assert report_main([str(b)]) == 0
    before = snapshot(b)
    for argv in ([str(a), str(b), "--out", str(b)], [str(a), "--out", str(b)]):
        assert report_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"speedbench.report: error: --out {b} holds a run of its own (trials.csv); "
                       "its report is not replaced: choose another folder"), err
    assert snapshot(b) == before
    assert report_main([str(b), "--out", str(b)]) == 0  # its own folder: a rebuild in place


def test_a_comparison_with_a_run_still_going_is_refused(tmp_path, capsys):
    from speedbench import results

    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=1.2, seed=1)
    fd = results._flocked(b, __import__("fcntl").LOCK_EX)  # its run holds the lock
    try:
        assert report_main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err.strip()
    assert err == f"speedbench.report: error: {b}: its run is still going; compare it when it " \
                  "has ended", err
    assert not (tmp_path / "cmp").exists()


def test_a_comparison_whose_default_folder_cannot_be_made_says_so_in_one_line(tmp_path, capsys,
                                                                             monkeypatch):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=1.2, seed=1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").write_text("a file where the folder would go")
    assert report_main([str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "speedbench.report: error: --out: cannot make the folder 'results/compare/"), err


def test_a_run_without_quality_probe_has_nothing_to_say_about_its_final_loss(tmp_path):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    _trials(run, lambda t: t.__setitem__("final_loss", "nan"))  # as Python writes NaN
    assert "nan" in (run / "trials.csv").read_text()
    assert report_main([str(run)]) == 0
    assert "final_loss cell(s)" not in (run / "report.md").read_text()


# --- round 4, new: hostile command lines of the report tool ----------------------------------

def _symlinked(tmp_path: Path) -> str:
    run = make_run(tmp_path / "real", models=("resnet",), repeats=3)
    (tmp_path / "link").symlink_to(run)
    return str(tmp_path / "link")


def _odd_name(tmp_path: Path) -> str:
    return str(make_run(tmp_path / "ünï\nline 😀 [x](y)", models=("resnet",), repeats=3))


def _loop(tmp_path: Path) -> str:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return str(tmp_path / "loop")


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "trials.csv").write_text("experiment\n")
    return str(tmp_path / "trials.csv")


# (id, the arguments made in tmp_path, expected rc, what the one-line error says (rc 2))
ODD_ARGUMENTS = [
    ("same_run_twice", lambda d: [str(make_run(d / "r", models=("resnet",), repeats=3))] * 2 +
     ["--out", str(d / "cmp")], 0, None),
    ("through_a_symlink", lambda d: [_symlinked(d)], 0, None),
    ("name_with_a_newline_and_markdown", lambda d: [_odd_name(d)], 0, None),
    ("the_root_folder", lambda d: ["/"], 2, "/ has no trials.csv"),
    ("a_file", lambda d: [_a_file(d)], 2, "is not a directory"),
    ("a_symlink_loop", lambda d: [_loop(d)], 2, "does not exist"),
    ("a_name_too_long", lambda d: [str(d / ("x" * 5000))], 2, "characters) cannot be read"),
]


@pytest.mark.parametrize("row", ODD_ARGUMENTS, ids=[r[0] for r in ODD_ARGUMENTS])
def test_odd_arguments_to_the_report_tool_give_a_report_or_one_short_line(row, tmp_path, capsys):
    name, make, rc, text = row
    argv = make(tmp_path)
    assert report_main(argv) == rc
    err = capsys.readouterr().err.strip()
    if rc:
        assert len(err.splitlines()) == 1 and len(err) < 400 and text in err, err[:500]
        return
    out = Path(argv[-1]) if "--out" in argv else Path(argv[0])
    assert (out / "report.html").is_file() and not (out / "report.html").is_symlink()
    assert not out.is_symlink() or (out.resolve() / "report.html").is_file()


@pytest.mark.slow
def test_a_closed_output_pipe_ends_the_report_tool_quietly(tmp_path):
    run = make_run(tmp_path / "run", models=("resnet",), repeats=3)
    r, w = os.pipe()
    os.close(r)  # the reader went away (`| head -0`)
    proc = subprocess.run([sys.executable, "-m", "speedbench.report", str(run)], stdout=w,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(w)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert (run / "report.html").is_file()


@pytest.mark.slow
def test_a_run_whose_output_pipe_closes_says_so_in_one_line(tmp_path):
    r, w = os.pipe()
    os.close(r)  # `speedbench ... | head -0`: the reader is gone before the table is printed
    proc = subprocess.run([sys.executable, "-m", "speedbench", *T, "bench.quality_steps=0",
                           f"out_dir={tmp_path / 'out'}"], cwd=tmp_path, stdout=w,
                          stderr=subprocess.PIPE, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(w)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    said = said_lines(proc.stderr)
    assert said == ["speedbench: the output pipe was closed (its reader ended); stopped"], said


# --- a full disk ---------------------------------------------------------------------------

def _capped(limit_bytes: int):
    """preexec_fn: writes past limit_bytes fail with EFBIG (Python ignores SIGXFSZ), the way a
    full disk makes them fail with ENOSPC, without root or a special file system."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))


@pytest.mark.slow
def test_a_full_disk_leaves_the_old_report_whole_and_no_temp_files(tmp_path):
    run = make_run(tmp_path / "run")
    assert report_main([str(run)]) == 0
    assert (run / "report.html").stat().st_size > 60_000  # over the cap below: cannot be written
    # plots changed so the report is rebuilt from scratch; a limit below report.html's size
    trials = pd.read_csv(run / "trials.csv")
    trials.loc[trials["variant"] == "bf16", "samples_per_s"] *= 0.5
    trials.to_csv(run / "trials.csv", index=False)
    (run / "summary.csv").unlink()
    before = {k: v for k, v in snapshot(run).items() if k.startswith("report.")}
    proc = subprocess.run([sys.executable, "-m", "speedbench.report", str(run)],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_capped(60_000), env={**os.environ, "MPLBACKEND": "Agg"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "could not write the report" in err, err
    assert "File too large" in err or "No space left" in err, err
    assert {k: v for k, v in snapshot(run).items() if k.startswith("report.")} == before
    assert not [p for p in run.rglob("*.tmp")], "a temp file was left behind"


def test_a_full_disk_while_quality_csv_is_written_is_one_line(tmp_path, monkeypatch):
    import errno

    from speedbench.results import atomic

    real = atomic.append_rows

    def full(path, columns, rows):
        if Path(path).name == "quality.csv":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, columns, rows)

    monkeypatch.setattr(atomic, "append_rows", full)
    proc = run_main(*T, f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = said_lines(proc.stderr)
    assert "Traceback" not in proc.stderr and len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith("speedbench: error: out_dir: cannot write ") and \
        "quality.csv (No space left on device)" in said[0] and \
        said[0].endswith("is incomplete (no report)"), said
    run = next((tmp_path / "out").rglob("config.yaml")).parent
    assert not (run / "summary.csv").exists() and not (run / "report.html").exists()
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]


# --- torchrun's variables checked before anything is written (G8) ----------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("variables, says", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "make no torchrun job"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "make no torchrun job"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "free"},
     "could not join torchrun's job as rank 0 of 2"),
], ids=["rank_not_an_int", "world_of_0", "rank_outside", "no_master", "missing_peer"])
def test_stale_torchrun_variables_are_one_line_and_nothing_is_written(variables, says, tmp_path,
                                                                      monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, str(_free_port()) if value == "free" else value)
    proc = run_main(*T, "dist_timeout_s=1", f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("speedbench: error: ") and says in err, \
        err
    assert not (tmp_path / "out").exists()


# --- a sweep goes on past a refused or failed job (G5) -----------------------------------------

def test_a_sweep_runs_every_job_and_counts_the_failed_ones(tmp_path):
    model = ("model={_target_: fault_models.Hostile, mode: seed_fails, loss: module, "
             "batch_size: 4, dataset: {kind: tokens, seq_len: 8, vocab_size: 16}}")
    proc = run_main("-m", *TINY, "bench.repeats=1", "bench.quality_steps=0", model,
                    "bench.seed=0,-1,1", f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]  # two jobs failed
    assert "Traceback" not in proc.stderr
    assert err[-1].startswith("speedbench: sweep: 2 of 3 jobs failed (job 1, 2); each job's "
                              "outcome.txt is in "), err[-3:]
    assert any(e.startswith("speedbench: error: bench.seed: -1 is out of range") for e in err)
    sweep = next((tmp_path / "out" / "multirun").iterdir())
    outcome = {d.name: (d / "outcome.txt").read_text() for d in sweep.iterdir() if d.is_dir()}
    assert outcome["0"].startswith("ok: ") and outcome["1"].startswith(
        "failed (exit status 2): bench.seed: -1") and outcome["2"].startswith(
        "failed (exit status 1): no trial succeeded"), outcome
    runs = sorted(p.parent for p in (tmp_path / "out").rglob("trials.csv"))
    assert len(runs) == 2  # job 1 wrote nothing; job 2's failed trials are kept
    assert outcome["0"].strip() == f"ok: {runs[0]}" or outcome["0"].strip() == f"ok: {runs[1]}"


# --- own experiment files (G25) ----------------------------------------------------------------

def _own_experiment(folder: Path, header: bool = True) -> Path:
    (folder / "conf" / "experiment").mkdir(parents=True)
    (folder / "conf" / "experiment" / "mine.yaml").write_text(
        ("# @package _global_\n" if header else "") +
        "baseline: a\nvariants:\n  a: {precision: fp32}\n  b: {precision: fp32}\n")
    return folder / "conf"


@pytest.mark.parametrize("how", ["config_dir", "searchpath"])
def test_an_experiment_file_of_ones_own_is_found_on_the_search_path(how, tmp_path):
    from speedbench.__main__ import command_line_problem, experiment_names

    conf = _own_experiment(tmp_path)
    args = ["--config-dir", str(conf), "+experiment=mine"] if how == "config_dir" else \
        [f"hydra.searchpath=[file://{conf}]", "+experiment=mine"]
    assert "mine" in experiment_names(args) and "mine" not in experiment_names([])
    assert command_line_problem(args) is None
    if how == "config_dir":  # the whole run once
        proc = run_main(*args, *T, "bench.quality_steps=0", f"out_dir={tmp_path / 'out'}",
                        cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        trials = pd.read_csv(next((tmp_path / "out" / "mine").rglob("trials.csv")))
        assert sorted(trials["variant"]) == ["a", "b"]


def test_an_experiment_file_without_its_package_line_is_one_line(tmp_path):
    conf = _own_experiment(tmp_path, header=False)
    proc = run_main("--config-dir", str(conf), "+experiment=mine", *T, cwd=tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "mine.yaml does not start with `# @package _global_`" in err, err


# --- atomic writes -------------------------------------------------------------------------

def test_atomic_write_replaces_a_link_not_its_target(tmp_path):
    from speedbench.results import atomic

    (tmp_path / "elsewhere.txt").write_text("not ours")
    os.symlink(tmp_path / "elsewhere.txt", tmp_path / "report.md")
    atomic.write_text(tmp_path / "report.md", "ours")
    assert (tmp_path / "elsewhere.txt").read_text() == "not ours"
    assert not (tmp_path / "report.md").is_symlink()
    assert (tmp_path / "report.md").read_text() == "ours"
    assert oct((tmp_path / "report.md").stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's
    (tmp_path / "away").mkdir()
    os.symlink(tmp_path / "away", tmp_path / "plots")
    atomic.real_dir(tmp_path / "plots")
    assert (tmp_path / "plots").is_dir() and not (tmp_path / "plots").is_symlink()
    assert (tmp_path / "away").is_dir()


def test_atomic_write_of_several_files_is_all_or_nothing(tmp_path):
    from speedbench.results import atomic

    (tmp_path / "report.md").write_text("old md")
    with pytest.raises(OSError):  # the second file cannot be written: the first is not replaced
        atomic.write_files({tmp_path / "report.md": b"new md",
                            tmp_path / "missing" / "report.html": b"new html"})
    assert (tmp_path / "report.md").read_text() == "old md"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


# --- run-side faults: failures keep their cause, CPU out-of-memory, nothing succeeded ----------

class CpuOom(torch.nn.Module):
    """A model whose forward fails as the CPU allocator does when memory runs out."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.out = torch.nn.Linear(3, num_classes)

    def forward(self, x):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 34359738368 bytes.")


IMAGES = "dataset: {kind: images, image_size: 32, num_classes: 10}"


def test_failure_status_keeps_the_cause_and_calls_cpu_memory_oom():
    from speedbench.distributed import failure_status

    try:
        try:
            raise TypeError("Tiny.__init__() got an unexpected keyword argument 'x'")
        except TypeError as cause:
            raise RuntimeError("Error in call to target 'm.Tiny':\nTypeError(...)") from cause
    except RuntimeError as exc:
        status = failure_status(exc)
    assert status == ("error: RuntimeError: Error in call to target 'm.Tiny'; caused by "
                      "TypeError: Tiny.__init__() got an unexpected keyword argument 'x'")
    assert failure_status(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == "oom"
    assert failure_status(MemoryError()) == "oom"


def test_cpu_out_of_memory_is_recorded_as_oom(tmp_path):
    from speedbench.run import run

    cfg = compose_cfg(*TINY, "bench.repeats=1", f"out_dir={tmp_path}",
                      f"model={{_target_: test_reliability.CpuOom, {IMAGES}}}")
    with pytest.raises(SystemExit) as end:  # nothing succeeded: a non-zero exit status
        run(cfg, None, progress=False)
    assert end.value.code == 1
    trials = pd.read_csv(next(tmp_path.rglob("trials.csv")))
    assert list(trials["status"]) == ["oom"]


@pytest.mark.slow
def test_a_model_that_cannot_be_built_keeps_its_cause_and_the_exit_status_fails(tmp_path):
    proc = run_cli(*TINY, "bench.repeats=1", f"out_dir={tmp_path}",
                   f"model={{_target_: fault_models.Tiny, nosuch: 1, {IMAGES}}}", cwd=tmp_path,
                   env={"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"),
                                                       str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("speedbench: no trial succeeded")
    status = pd.read_csv(next(tmp_path.rglob("trials.csv")))["status"].iloc[0]
    assert status.startswith("error: InstantiationException: Error in call to target "
                             "'fault_models.Tiny'; caused by TypeError:"), status
    assert "nosuch" in status


# --- a full disk on the run side ----------------------------------------------------------

WRITER = ("import sys\nfrom pathlib import Path\nfrom speedbench.results import TrialWriter\n"
          "w = TrialWriter(Path(sys.argv[1]))\n"
          "for i in range(int(sys.argv[2])):\n"
          "    w.append({'experiment': 'e' * 200, 'model': 'm', 'variant': str(i)})\n")


@pytest.mark.parametrize("limit, rows_fit", [(100, False), (1500, True)])
def test_trials_csv_is_never_0_bytes_nor_a_half_row_on_a_full_disk(tmp_path, limit, rows_fit):
    path = tmp_path / "trials.csv"
    proc = subprocess.run([sys.executable, "-c", WRITER, str(path), "50"], capture_output=True,
                          text=True, timeout=120, preexec_fn=_capped(limit))
    assert proc.returncode == 1 and "OutputError: out_dir: cannot write" in proc.stderr
    if not rows_fit:  # the header itself did not fit: no file rather than an empty one
        assert list(tmp_path.iterdir()) == []
        return
    header, *rows = path.read_text().splitlines()
    assert 1 <= len(rows) < 50 and path.read_text().endswith("\n")
    assert all(r.startswith("e" * 200) and r.count(",") == header.count(",") for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["trials.csv"]


@pytest.mark.slow
def test_a_full_disk_during_a_run_leaves_an_incomplete_run_and_one_line(tmp_path):
    from speedbench import techniques
    # techniques.json (its size grows with the registry: 69 KB today) fits, the report's
    # HTML (74 KB here) does not
    cards = len(json.dumps(techniques.metadata(), indent=2, default=str)) + 1
    proc = subprocess.run([sys.executable, "-m", "speedbench", *T, f"out_dir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          preexec_fn=_capped(cards + 500),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert last.startswith("speedbench: error: out_dir: cannot write") and "incomplete" in last
    run_dir = next(tmp_path.rglob("trials.csv")).parent
    assert len(pd.read_csv(run_dir / "trials.csv")) == 1  # the finished trial is kept
    for name in ("summary.csv", "report.md", "report.html"):  # it does not look complete
        assert not (run_dir / name).exists(), name
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob(".*"))


# --- DDP trials launched by speedbench: no orphan, no temp folder, the hung rank named -----

TESTS = Path(__file__).resolve().parent
# the checkout's src/ first, as an absolute path: a relative PYTHONPATH=src does not reach a
# child started in tmp_path, which would import another speedbench (an installed one)
DDP_ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS),
                                          os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
HANGING = ("+models.hanging={_target_:dist_models.FailsOnRank,hang:true,loss:cross_entropy,"
           "batch_size:4,dataset:{kind:tokens,seq_len:8,vocab_size:32}}")
DDP_RUN = ["+experiment=dp_vs_ddp", *TINY, "bench.repeats=1", HANGING, "model=hanging"]


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of the live processes that mention `text` (a job's temp folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and text in cmd:
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


def _leftovers(tmp: Path) -> list[str]:
    return [p.name for p in tmp.iterdir()  # launched trials: DDP, or a fresh process
            if p.name.startswith(("speedbench-launch-", "speedbench-ddp-", "torchelastic_"))]


def _wait_until(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_signal_to_the_parent_mid_ddp_trial_leaves_no_process_and_no_temp_folder(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-m", "speedbench", *DDP_RUN, "dist_timeout_s=300",
         f"out_dir={tmp_path / 'results'}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, **DDP_ENV, "TMPDIR": str(tmp)},
        preexec_fn=default_sigint)
    try:
        ranks = lambda: [c for c in _processes_mentioning(str(tmp)) if "--torchrun" not in c]
        assert _wait_until(lambda: len(ranks()) >= 2, 240), "the DDP ranks never started"
        time.sleep(3)  # into the trial: rank 1 hangs in its forward pass, rank 0 waits for it
        parent.send_signal(sig)
        parent.wait(timeout=60)
        assert _wait_until(lambda: not _processes_mentioning(str(tmp)), 30), \
            _processes_mentioning(str(tmp))
        assert _wait_until(lambda: not _leftovers(tmp), 5), _leftovers(tmp)
    finally:
        if parent.poll() is None:
            parent.kill()
        for line in _processes_mentioning(str(tmp)):  # only what this test started
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hung_rank_of_a_launched_ddp_trial_is_named_in_its_status(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run_cli(*DDP_RUN, "dist_timeout_s=5", f"out_dir={tmp_path / 'results'}",
                   cwd=tmp_path, env={**DDP_ENV, "TMPDIR": str(tmp)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]  # single ran: a failed trial is a row
    trials = pd.read_csv(next(tmp_path.rglob("trials.csv"))).set_index("variant")
    status = trials.loc["ddp", "status"]
    assert status.startswith("error: rank 1 hung: no answer within dist_timeout_s (rank 0: "), \
        status
    assert not _processes_mentioning(str(tmp)) and not _leftovers(tmp)
