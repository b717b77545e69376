"""`python -m speedbench.report`: one run rebuilt, several compared; escaping, well-formed HTML,
embedded images, interrupted runs, runs of other versions, clear errors."""
from __future__ import annotations

import base64
import json
import math
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import TINY, only_run_dir, run_cli

from speedbench import results
from speedbench.analysis import intervals
from speedbench.analysis.numbers import AUTO, ratio_text
from speedbench.analysis.summary import summarise, summarised
from speedbench.report.__main__ import main as report_main
from speedbench.report.compare import comparison_rows, config_differences, env_differences
from speedbench.report.render import write_report
from speedbench.results.runs import label_runs, load_run

HOSTILE = "<script>alert(1)</script>"
ENV = {"device": "cpu", "device_name": "Test CPU", "cpu_model": "Test CPU", "cpu_count": 2,
       "torch_threads": 2, "torch_interop_threads": 2, "env": {}, "python": "3.11",
       "versions": {"torch": "2.5.0"}, "git_revision": "abc"}
CLAIMS = [{"tip": "16-bit precision", "source": "seeds/000", "quote": "half the memory",
           "kind": "less_memory", "factor": 0.5, "variants": ["fp16", "bf16"]},
          {"tip": "16-bit precision", "source": "seeds/000", "quote": "3-8 times faster",
           "kind": "faster", "variants": ["fp16", "bf16"]}]


def make_run(path: Path, speed: float = 1.0, variants=("fp32", "fp16", "bf16"),
             models=("resnet", "vae"), repeats=4, env=None, summary=True, seed=0) -> Path:
    """A finished run directory built by hand: trials.csv, summary.csv, env.json, config.yaml."""
    rng = np.random.default_rng(seed)
    rows = []
    for model in models:
        for t in range(repeats):
            for i, variant in enumerate(variants):
                rows.append({
                    "experiment": "amp", "model": model, "variant": variant,
                    "is_baseline": i == 0, "trial": t, "status": "ok", "device": "cpu",
                    "world_size": 1,
                    "samples_per_s": speed * (100 + 30 * i) * (1 + 0.01 * rng.standard_normal()),
                    "step_ms": 10.0, "data_wait_frac": 0.05, "peak_mem_mb": 80.0 - 20 * i,
                    "final_loss": 2.0, "host_rss_mb": 400.0, "num_workers": 0, "accumulate": 1})
    path.mkdir(parents=True)
    trials = pd.DataFrame(rows)
    trials.to_csv(path / "trials.csv", index=False)
    if summary:
        results.write_summary(summarise(trials), path)
    (path / "env.json").write_text(json.dumps(env or ENV))
    (path / "config.yaml").write_text(yaml.safe_dump({"claims": CLAIMS, "bench": {
        "seed": 0, "warmup": 1, "steps": 2, "repeats": repeats, "max_trial_s": 20}}))
    return path


class Structure(HTMLParser):
    """Tags opened and closed in order; the mismatches and what was left open."""
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags, self.imgs = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def parse_html(path: Path) -> Structure:
    parser = Structure()
    parser.feed(path.read_text())
    parser.close()
    assert not parser.errors, parser.errors
    assert not parser.stack, f"left open: {parser.stack}"
    return parser


def assert_images_embedded(parser: Structure, at_least: int) -> None:
    assert len(parser.imgs) >= at_least
    for img in parser.imgs:
        src = img["src"]
        assert src.startswith("data:image/png;base64,"), src[:40]
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def report_cli(capsys, *args: str):
    """`python -m speedbench.report args...` in this process (the subprocess form is tested
    below with a real run): exit status and stderr."""
    rc = report_main([str(a) for a in args])
    return rc, capsys.readouterr().err


# --- one run ----------------------------------------------------------------------------------

def test_report_of_one_run_is_well_formed_with_images_embedded(capsys, tmp_path):
    run = make_run(tmp_path / "run")
    assert report_cli(capsys, run)[0] == 0
    parser = parse_html(run / "report.html")
    assert_images_embedded(parser, at_least=3)  # speed-up, throughput, memory
    assert "script" not in parser.tags
    md = (run / "report.md").read_text()
    for link in re.findall(r"\]\((plots/[^)]+\.png)\)", md):
        assert (run / link).stat().st_size > 0
    # the claims table was evaluated from config.yaml's claims
    assert "half the memory" in md and "holds" in md


def test_hostile_strings_are_escaped_in_the_html(tmp_path):
    run = make_run(tmp_path / "run", variants=("fp32", HOSTILE, "a&b"),
                   env={**ENV, "device_name": '<img src=x onerror="alert(2)">'})
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["claims"] = [{"tip": HOSTILE, "source": "</table>", "quote": "<b>bold</b>",
                      "kind": "faster", "variants": [HOSTILE]}]
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    write_report(run)
    text = (run / "report.html").read_text()
    assert HOSTILE not in text and "<b>bold</b>" not in text and "onerror=\"alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "a&amp;b" in text
    parser = parse_html(run / "report.html")
    assert "script" not in parser.tags and "b" not in parser.tags
    assert all(set(img) == {"alt", "src", "width"} for img in parser.imgs)


def test_interrupted_run_without_summary_is_summarised_from_its_trials(capsys, tmp_path):
    run = make_run(tmp_path / "run", summary=False)
    trials = pd.read_csv(run / "trials.csv")
    trials.iloc[:-5].to_csv(run / "trials.csv", index=False)  # stopped mid-way
    rc, err = report_cli(capsys, run)
    assert rc == 0, err
    md = (run / "report.md").read_text()
    assert "no summary.csv" in md and "recomputed" in md
    assert "| vae | fp32 |" in md
    parse_html(run / "report.html")


def test_run_of_another_version_missing_optional_columns(capsys, tmp_path):
    run = make_run(tmp_path / "run")
    trials = pd.read_csv(run / "trials.csv").drop(columns=["peak_mem_mb", "final_loss",
                                                             "data_wait_frac", "host_rss_mb"])
    trials["their_new_metric"] = 7  # an unknown column is carried along, not an error
    trials.to_csv(run / "trials.csv", index=False)
    (run / "summary.csv").unlink()
    (run / "config.yaml").unlink()
    rc, err = report_cli(capsys, run, "--out", tmp_path / "out")
    assert rc == 0, err
    md = (tmp_path / "out" / "report.md").read_text()
    assert "lacks data_wait_frac, peak_mem_mb, final_loss" in md
    assert "memory.png" not in md and "speedup.png" in md
    assert not (run / "report.md").exists()  # --out: the run directory is left alone


def test_trials_are_paired_as_the_runs_format_says(tmp_path):
    """Format 3 pairs trials by `round`; a run without a format version (the oldest) by
    `trial`, whatever else its trials.csv holds."""
    run = make_run(tmp_path / "run", models=("resnet",))
    trials = pd.read_csv(run / "trials.csv")
    trials["round"] = trials["trial"].max() - trials["trial"]  # not the trial: tells them apart
    trials.to_csv(run / "trials.csv", index=False)
    old = load_run(run)
    assert old.format_version == 1 and (old.trials["round"] == old.trials["trial"]).all()
    (run / "env.json").write_text(json.dumps({**ENV, "format_version": 3}))
    new = load_run(run)
    assert new.format_version == 3 and list(new.trials["round"]) == list(trials["round"])
    assert results.load_trials(run)["round"].tolist() == trials["round"].tolist()


def test_a_run_without_a_usable_summary_is_summarised_by_analysis(tmp_path):
    run = load_run(make_run(tmp_path / "run", summary=False))
    assert run.summary is None and any("no summary.csv" in n for n in run.notes)
    summary = summarised(run).summary
    assert summary.equals(summarise(run.trials))


def test_a_summary_rebuilt_from_the_trials_has_the_runs_columns(tmp_path):
    """The run (run._summary) and the report's rebuild from trials.csv (summarised) make
    summary.csv one way: the same columns, scaling efficiency and quality verdicts included."""
    from speedbench.run import _summary

    path = make_run(tmp_path / "run", models=("resnet",), summary=False)
    trials = pd.read_csv(path / "trials.csv")
    trials["devices"] = trials["variant"].map({"fp32": 1, "fp16": 2, "bf16": 2})
    trials.to_csv(path / "trials.csv", index=False)
    pd.DataFrame([{"experiment": "amp", "model": "resnet", "variant": v, "is_baseline": i == 0,
                   "seed": k, "steps": 4, "samples": 32, "loss": 2.0 + 0.01 * k, "status": "ok"}
                  for i, v in enumerate(("fp32", "fp16", "bf16")) for k in range(3)]
                 ).to_csv(path / "quality.csv", index=False)
    run_s = _summary(SimpleNamespace(frame=lambda: trials), [], intervals.FAMILY_LEVEL, {},
                     path, 0.05)
    rebuilt = summarised(load_run(path)).summary
    assert list(rebuilt.columns) == list(run_s.columns)
    assert {"scaling_efficiency", "quality_verdict"} <= set(rebuilt.columns)
    pd.testing.assert_frame_equal(rebuilt, run_s, check_dtype=False)


def test_the_method_text_states_the_rounds_rule_once_with_this_runs_settings():
    """The adaptive rounds' stopping rule is METHOD's (report/method.py); method_text adds only
    the run's settings, not a second, different account of the rule."""
    from speedbench.report.method import METHOD
    from speedbench.report.render import method_text

    bench = {"seed": 0, "warmup": 1, "steps": 2, "repeats": 5, "max_trial_s": 20,
             "target_ci": 0.03, "time_budget_s": 600}
    text = method_text({"bench": bench})
    assert text.count(METHOD) == 1 and "bench.target_ci 0.03" in text
    assert "decided or its CI's relative half-width is at most bench.target_ci" in METHOD
    assert text.count("half-width") == 1  # the rule once
    assert "adaptive" not in method_text({"bench": {**bench, "target_ci": None}}).split(METHOD)[0]


def test_profiling_tables_are_shown_when_present(tmp_path):
    run = make_run(tmp_path / "run")
    pd.DataFrame([{"experiment": "amp", "model": m, "variant": v, "phase": p, "mean_ms": 1.0,
                   "total_ms": 10.0, "share": 0.25}
                  for m in ("resnet", "vae") for v in ("fp32", "fp16")
                  for p in ("data", "forward", "backward", "optimizer")]
                 ).to_csv(run / "phases.csv", index=False)
    pd.DataFrame([{"experiment": "amp", "model": "resnet", "variant": "fp32",
                   "symptom": "data loading waits", "figure": "40% of step", "tip": "workers",
                   "knob": "data.num_workers=4"}]).to_csv(run / "findings.csv", index=False)
    write_report(run)
    md = (run / "report.md").read_text()
    assert "amp-phases.png" in md and "data.num_workers=4" in md


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "has no trials.csv"),
    (lambda d: (d.mkdir(), (d / "trials.csv").write_text("")), "is empty"),
    (lambda d: (d.mkdir(), (d / "trials.csv").write_text(",".join(results.TRIAL_COLUMNS) + "\n")),
     "holds no trials"),
    (lambda d: (d.mkdir(), (d / "trials.csv").write_text("experiment,model,variant\namp,a,b\n")),
     "lacks the contract columns is_baseline, status, samples_per_s"),
])
def test_bad_run_directories_fail_with_a_clear_message(capsys, tmp_path, setup, message):
    setup(tmp_path / "run")
    rc, err = report_cli(capsys, tmp_path / "run")
    assert rc == 2
    assert message in err and err.startswith("speedbench.report: error:")


# --- comparing runs ---------------------------------------------------------------------------

def test_comparison_ratio_uses_the_trials_of_both_runs(tmp_path):
    a = load_run(make_run(tmp_path / "a", speed=1.0, seed=1))
    b = load_run(make_run(tmp_path / "b", speed=2.0, seed=2))
    label_runs([a, b])
    keys = [("amp", "resnet", "fp32"), ("amp", "vae", "bf16")]
    rows = comparison_rows([a, b], keys)
    assert list(rows["verdict"]) == [intervals.FASTER, intervals.FASTER]
    expected = intervals.welch_ratio_ci(
        b.trials.query("model == 'resnet' and variant == 'fp32'")["samples_per_s"],
        a.trials.query("model == 'resnet' and variant == 'fp32'")["samples_per_s"],
        intervals.comparison_level(len(keys)))
    assert rows.iloc[0][["ratio", "lo", "hi"]].tolist() == pytest.approx(list(expected))
    assert 1.9 < rows.iloc[0]["ratio"] < 2.1


def test_environment_differences_are_listed(tmp_path):
    a = load_run(make_run(tmp_path / "a"))
    b = load_run(make_run(tmp_path / "b", env={**ENV, "torch_threads": 1,
                                               "versions": {"torch": "2.6.0"}}))
    label_runs([a, b])
    diffs = env_differences([a, b]).set_index("setting")
    assert set(diffs.index) == {"torch_threads", "versions.torch"}
    assert diffs.loc["versions.torch"].tolist() == ["2.5.0", "2.6.0"]
    assert config_differences([a, b]).empty
    b.cfg["bench"]["steps"] = 50
    b.cfg["run_dir"] = "elsewhere"  # where a run went is not a setting that matters
    assert config_differences([a, b])["setting"].tolist() == ["bench.steps"]


def test_compare_two_runs_with_missing_trials_and_an_unknown_column(capsys, tmp_path):
    a = make_run(tmp_path / "machine-a")
    b = make_run(tmp_path / "machine-b", speed=1.5, env={**ENV, "device_name": "Other CPU"})
    trials = pd.read_csv(b / "trials.csv")
    trials = trials[~((trials["model"] == "vae") & (trials["variant"] == "bf16"))]  # never ran
    trials = trials[~((trials["model"] == "resnet") & (trials["trial"] >= 2))]  # cut short
    trials["gpu_temperature_c"] = 61.0
    trials.to_csv(b / "trials.csv", index=False)
    (b / "summary.csv").unlink()
    out = tmp_path / "cmp"
    rc, err = report_cli(capsys, a, b, "--out", out)
    assert rc == 0, err
    md = (out / "report.md").read_text()
    assert "machine-b / machine-a [adj. CI]" in md
    assert "device_name" in md and "Other CPU" in md  # the environment difference
    assert "1 rows of machine-a are not in machine-b: amp/vae/bf16" in md
    assert "interrupted" in md
    parser = parse_html(out / "report.html")
    assert_images_embedded(parser, at_least=3)


def test_runs_with_nothing_in_common_are_refused(capsys, tmp_path):
    a = make_run(tmp_path / "a", models=("resnet",))
    b = make_run(tmp_path / "b", models=("vae",))
    rc, err = report_cli(capsys, a, b, "--out", tmp_path / "cmp")
    assert rc == 2
    assert "nothing to compare" in err
    assert not (tmp_path / "cmp").exists()


def test_same_directory_names_get_distinct_labels(tmp_path):
    runs = [load_run(make_run(tmp_path / p / "2026-01-01")) for p in ("x", "y")]
    label_runs(runs)
    assert [r.label for r in runs] == ["x/2026-01-01", "y/2026-01-01"]


# --- through the real CLI ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real")
    result = run_cli("+experiment=amp", "model=transformer", *TINY, f"out_dir={root}", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return only_run_dir(root)


@pytest.mark.slow
def test_a_real_run_and_its_comparison_produce_readable_reports(real_run, tmp_path):
    parser = parse_html(real_run / "report.html")
    assert_images_embedded(parser, at_least=2)
    # a second "machine": the same trials with one trial lost, rebuilt and compared
    other = tmp_path / "other"
    shutil.copytree(real_run, other)
    trials = pd.read_csv(other / "trials.csv")
    trials.iloc[1:].to_csv(other / "trials.csv", index=False)
    (other / "summary.csv").unlink()
    assert run_cli(str(other), cwd=tmp_path, module="speedbench.report").returncode == 0
    out = tmp_path / "cmp"
    result = run_cli(str(real_run), str(other), "--out", str(out), cwd=tmp_path,
                     module="speedbench.report")
    assert result.returncode == 0, result.stderr
    assert_images_embedded(parse_html(out / "report.html"), at_least=3)
    summary = pd.read_csv(real_run / "summary.csv")
    assert not math.isnan(summary["samples_per_s"].iloc[0])


def test_the_report_and_the_readme_say_the_same_of_which_calls_the_5_percent_covers():
    """One statement of the families (report/method.FAMILIES), in the report's method text and
    in README.md; the code's families are the ones it names: the speed calls at FAMILY_LEVEL
    (the probes' stops a share of it), and the quality and time-to-target verdicts each at
    FAMILY_LEVEL over their own comparisons."""
    from speedbench.analysis import quality, to_target
    from speedbench.report import method

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert method.FAMILIES in readme
    summary = pd.DataFrame({"comparisons": [2], "family_level": [0.05], "ci_level": [0.975],
                            "noise_threshold": [0.05]})
    assert method.FAMILIES in method.family_text(summary)
    assert quality.summarise.__defaults__[-1] == intervals.FAMILY_LEVEL
    assert to_target.summarise.__defaults__[-1] == intervals.FAMILY_LEVEL
    assert 0 < intervals.STOP_SHARE < 1  # the probes' stops spend part of the speed family's


def test_one_text_for_a_ratio_with_its_interval():
    assert ratio_text(1.5, 1.36, 1.66) == "1.50x [1.36, 1.66]"
    assert ratio_text(1.5) == ratio_text(1.5, math.nan, math.nan) == "1.50x"
    assert ratio_text(1.5, None, 2.0) == ratio_text(1.5, 1.2, math.inf) == "1.50x"
    assert ratio_text(math.nan, 1.0, 2.0) == ratio_text(None) == ratio_text("x") == "-"
    assert ratio_text(1.234, 1.1, 1.4, ".3g") == "1.23x [1.1, 1.4]"
    assert ratio_text(1.5, 0.05, 20, AUTO) == "1.50x [0.05, 20.00]"
    # ends 1,000 times apart or more say nothing a reader can use (two noisy rounds)
    assert ratio_text(1.5, 1e-5, 3e8, AUTO) == "1.50x [no useful interval]"
    assert ratio_text(1.5, 0.1234, 12.34, ci_spec=".3g", sep=",") == "1.50x [0.123,12.3]"
    assert ratio_text(np.float64(0.95), 0.9, 0.99, unit="") == "0.95 [0.90, 0.99]"

