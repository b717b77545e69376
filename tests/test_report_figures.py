"""The figure functions on small reference DataFrames: PNGs written, only for data present."""
from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from speedbench.analysis.summary import summarise
from speedbench.report import plots


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def trials_frame(variants=("fp32", "fp16", "bf16"), models=("resnet", "vae"), repeats=3,
                 knob=None, values=None, statuses=None) -> pd.DataFrame:
    """Tidy trials like trials.csv: the first variant is the baseline; `knob` set per variant."""
    rng = np.random.default_rng(1)
    rows = []
    for m, model in enumerate(models):
        for i, variant in enumerate(variants):
            for t in range(repeats):
                status = (statuses or {}).get(variant, "ok")
                ok = status == "ok"
                rows.append({
                    "experiment": "exp", "model": model, "variant": variant,
                    "is_baseline": i == 0, "trial": t, "status": status, "device": "cpu",
                    "world_size": 1, "num_workers": 0, "accumulate": 1,
                    "samples_per_s": (100 + 40 * i + 10 * m) * (1 + 0.02 * rng.standard_normal())
                    if ok else math.nan,
                    "step_ms": 10.0 if ok else math.nan, "data_wait_frac": 0.1 if ok else math.nan,
                    "peak_mem_mb": 50.0 + 5 * i if ok else math.nan,
                    "final_loss": 1.0 if ok else math.nan, "host_rss_mb": 300.0,
                })
                if knob:
                    rows[-1][knob] = values[i]
    return pd.DataFrame(rows)


def phases_frame() -> pd.DataFrame:
    rows = []
    for model in ("resnet", "vae"):
        for variant, scale in (("fp32", 1.0), ("bf16", 0.7)):
            for phase, ms in (("data", 2.0), ("forward", 5.0), ("backward", 9.0),
                              ("optimizer", 1.0), ("other", 0.5)):
                rows.append({"experiment": "exp", "model": model, "variant": variant,
                             "phase": phase, "mean_ms": ms * scale, "total_ms": 10 * ms * scale,
                             "share": 0.2})
    return pd.DataFrame(rows)


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("name", ["throughput", "peak_memory", "speedup", "step_breakdown",
                                  "sweep_workers", "sweep_world_size", "compare_throughput",
                                  "forest"])
def test_each_figure_is_written_as_a_non_empty_png(name, tmp_path):
    trials = trials_frame()
    summary = summarise(trials)
    make = {
        "throughput": lambda: plots.throughput(trials),
        "peak_memory": lambda: plots.peak_memory(trials),
        "speedup": lambda: plots.speedup(summary),
        "step_breakdown": lambda: plots.step_breakdown(phases_frame()),
        "sweep_workers": lambda: plots.sweep(
            trials_frame(("w0", "w1", "w2", "w4"), knob="num_workers", values=[0, 1, 2, 4]),
            "num_workers"),
        "sweep_world_size": lambda: plots.sweep(
            trials_frame(("ws1", "ws2", "ws4"), knob="world_size", values=[1, 2, 4]), "world_size"),
        "compare_throughput": lambda: plots.compare_throughput(
            pd.concat([trials.assign(run="a"), trials.assign(run="b")])),
        "forest": lambda: plots.forest(
            pd.DataFrame({"model": ["m", "m"], "variant": ["x", "y"], "ratio": [1.5, math.nan],
                          "lo": [1.2, math.nan], "hi": [1.9, math.nan],
                          "verdict": ["faster", "oom"], "status": ["ok", "oom"]}),
            "ratio (x)", "title"),
    }[name]
    fig = make()
    assert fig.axes, "a figure without axes"
    plots.save(fig, tmp_path / f"{name}.png")
    assert_png(tmp_path / f"{name}.png")


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_speedup_figure_shows_each_verdict_and_failures_as_text():
    trials = trials_frame(variants=("fp32", "fast", "broken"),
                          statuses={"broken": "n/a: needs CUDA"})
    fig = plots.speedup(summarise(trials))
    texts = _texts(fig)
    assert any("faster" in t for t in texts)
    assert any(t.startswith("n/a: needs CUDA") for t in texts)
    assert fig.axes[-1].get_xscale() == "log"


def test_axes_are_labelled_with_units():
    trials = trials_frame()
    assert plots.throughput(trials).axes[0].get_ylabel() == "throughput (samples/s)"
    assert "(MB)" in plots.peak_memory(trials).axes[0].get_ylabel()
    assert "(ms)" in plots.step_breakdown(phases_frame()).axes[0].get_ylabel()


def test_world_size_sweep_draws_the_ideal_scaling_line():
    trials = trials_frame(("ws1", "ws2", "ws4"), models=("resnet",), knob="world_size",
                          values=[1, 2, 4])
    ax = plots.sweep(trials, "world_size").axes[0]
    ideal = [ln for ln in ax.get_lines() if "ideal" in ln.get_label()]
    assert len(ideal) == 1
    x, y = ideal[0].get_data()
    assert list(x) == [1, 2, 4] and y[2] == pytest.approx(4 * y[0])


def test_sweep_only_where_a_knob_takes_many_values_one_per_variant():
    assert not plots.sweep_knob(trials_frame(), "num_workers")  # one value
    assert not plots.sweep_knob(trials_frame(("a", "b"), knob="num_workers", values=[0, 2]),
                                "num_workers")  # two values: bars say it better
    assert plots.sweep_knob(trials_frame(("a", "b", "c"), knob="accumulate", values=[1, 2, 4]),
                            "accumulate")
    # two variants share a value: a curve would mix them
    assert not plots.sweep_knob(trials_frame(("a", "b", "c", "d"), knob="num_workers",
                                             values=[0, 2, 2, 4]), "num_workers")


def test_figures_for_draws_only_what_the_data_holds():
    trials = trials_frame()
    summary = summarise(trials)
    assert set(plots.figures_for(trials, summary)) == {"speedup", "throughput", "memory"}
    no_mem = trials.assign(peak_mem_mb=math.nan)
    assert "memory" not in plots.figures_for(no_mem, summarise(no_mem))
    sweep = trials_frame(("w0", "w1", "w2", "w4"), knob="num_workers", values=[0, 1, 2, 4])
    got = plots.figures_for(sweep, summarise(sweep), phases_frame(),
                            {"num_workers": "DataLoader workers"})
    assert {"phases", "sweep-num_workers"} <= set(got)
    assert got["sweep-num_workers"][1].axes[0].get_xlabel() == "DataLoader workers"
    # a column the run does not list among its settings is no sweep; world_size always is
    assert "sweep-num_workers" not in plots.figures_for(sweep, summarise(sweep))
    sizes = trials_frame(("ws1", "ws2", "ws4"), knob="world_size", values=[1, 2, 4])
    assert "sweep-world_size" in plots.figures_for(sizes, summarise(sizes))
    only_base = trials_frame(variants=("fp32",))
    assert "speedup" not in plots.figures_for(only_base, summarise(only_base))


def test_strings_from_configs_are_drawn_as_plain_text(tmp_path):
    """A `$` in a variant name would be mathtext and fail at savefig without parse_math off."""
    trials = trials_frame(variants=("base", "$x_{$", "<script>"))
    for fig in (plots.throughput(trials), plots.speedup(summarise(trials))):
        plots.save(fig, tmp_path / "f.png")
        assert_png(tmp_path / "f.png")


# --- the report's order, the console table, ticks, and the environment a newcomer reads ---------

def test_report_puts_the_recommendation_first_then_figures_then_claims_then_environment(tmp_path):
    from test_report import make_run

    from speedbench.report.render import write_report

    run = make_run(tmp_path / "run")
    md = write_report(run).read_text()
    order = [md.index(h) for h in ("## Recommendation", "## Experiment: amp", "![",
                                   "## The articles' claims", "## Environment",
                                   "## How this was measured")]
    assert order == sorted(order), order
    first = md[md.index("## Recommendation"):md.index("## Experiment: amp")]
    assert "bf16" in first and "resnet" in first  # measured faster on resnet: recommended
    # every figure has a sentence under it
    captions = [line[2:line.index("](")] for line in md.splitlines() if line.startswith("![")]
    assert captions and all(c.endswith(".") and len(c.split()) >= 8 for c in captions), captions


@pytest.mark.parametrize("width", [80, 100, 120])
def test_console_table_fits_the_terminal_and_at_most_100_columns(width):
    from speedbench.report.render import console_table

    summary = summarise(trials_frame(
        variants=("fp32", "a_rather_long_variant_name", "bf16", "pinned"),
        models=("transformer", "resnet"), statuses={"pinned": "n/a: pinned memory needs CUDA"}))
    summary = summary.assign(achieved_tflops=0.000724, peak_tflops=0.19, peak_fraction=0.0038,
                             mem_ratio=0.9, experiment=["exp", "exp2"] * (len(summary) // 2))
    text = console_table(summary, width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= min(width, 100)
    assert "no significant difference" not in text.splitlines()[1]  # short words in the table
    assert any(line.startswith("verdict:") for line in lines)  # ... explained in a legend
    assert "[1] n/a: pinned memory needs CUDA" in text


def test_log_ticks_stay_readable_on_wide_and_narrow_ranges():
    for lo, hi in ((0.003, 2.0), (0.03, 1.9), (0.64, 1.94), (1e-5, 3.0)):
        ticks = plots._ratio_ticks(lo, hi)
        assert 4 <= len(ticks) <= 11, (lo, hi, ticks)
        assert all(lo <= t <= hi for t in ticks) and 1.0 in ticks
    assert 0.03 in plots._ratio_ticks(0.003, 2.0)  # not only powers of ten


def test_gflops_use_three_significant_digits_and_peaks_are_compared_per_kind():
    from speedbench.report.render import peak_note, summary_table

    trials = trials_frame().assign(peak_kind=lambda d: d["variant"])
    summary = summarise(trials).assign(
        achieved_tflops=[0.000724, 0.0921, 0.5] * 2, peak_tflops=[0.2, 0.04, 1.5] * 2,
        peak_fraction=[0.0036, 2.3, 0.33] * 2)
    table = summary_table(summary)
    assert table["GFLOP/s"].tolist()[:3] == ["0.724", "92.1", "500"]
    assert table["peak GFLOP/s"].tolist()[:3] == ["200", "40", "1,500"]
    note = peak_note(summary, trials)
    assert "bf16 1,500 GFLOP/s (7.5x fp32's), of which the models reach 33%" in note, note
    assert "fp32 200 GFLOP/s, of which the models reach 0.36%" in note, note


def test_cpu_flags_are_read_and_their_differences_compared(tmp_path):
    from test_report import ENV, make_run

    from speedbench.measure import env
    from speedbench.report.compare import flag_differences
    from speedbench.results.runs import label_runs, load_run

    xeon = "processor: 0\nflags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"
    epyc = "processor: 0\nflags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16\n"
    assert env.cpu_flags(xeon) == ["sse4_2", "avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                   "amx_tile", "amx_bf16"]
    assert env.cpu_flags("Features\t: fp asimd sve bf16\n") == ["asimd", "sve", "bf16"]
    a = load_run(make_run(tmp_path / "a", env={**ENV, "cpu_flags": env.cpu_flags(epyc)}))
    b = load_run(make_run(tmp_path / "b", env={**ENV, "cpu_flags": env.cpu_flags(xeon)}))
    label_runs([a, b])
    diff = flag_differences([a, b]).set_index("CPU flag")
    assert set(diff.index) == {"avx512_fp16", "amx_tile", "amx_bf16"}
    assert diff.loc["amx_bf16"].tolist() == ["no", "yes"]


def test_load_average_at_the_end_is_added_to_env_json(tmp_path):
    import json

    from speedbench.measure import env

    path = tmp_path / "env.json"
    path.write_text(json.dumps({"device": "cpu"}))
    env.record_end(path)
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and len(data["load_average_end"]) == 3


def test_bar_panels_come_in_the_summarys_order_not_the_first_rounds():
    """Trials come in the random order of the rounds; every bar figure shows the models and
    variants in the summary's order (the table's and the speed-up plot's)."""
    trials = trials_frame()
    summary = summarise(trials)
    shuffled = trials.sample(frac=1.0, random_state=3)
    assert list(dict.fromkeys(shuffled["model"])) != ["resnet", "vae"] or list(
        dict.fromkeys(shuffled.loc[shuffled["model"] == "resnet", "variant"])) != [
        "fp32", "fp16", "bf16"]  # the draw is out of order
    figures = plots.figures_for(shuffled, summary)
    for name in ("throughput", "memory"):
        axes = figures[name][1].axes
        assert [ax.get_title() for ax in axes] == ["resnet", "vae"], name
        for ax in axes:
            assert [t.get_text() for t in ax.get_xticklabels()] == ["fp32", "fp16", "bf16"]
    plt.close("all")


def test_noise_warnings_are_short_and_end_with_a_command_to_paste(tmp_path):
    from speedbench.report.render import console_warnings, report_line

    summary = summarise(trials_frame()).assign(round_sd=0.9, unsteady=0)
    lines = console_warnings(summary, "amp", ["model=resnet", "bench.repeats=3"], width=80)
    assert lines and all(len(line) <= 80 for line in lines)
    command = lines[lines.index("  measure again:") + 1:]
    assert command == [f"    speedbench +experiment=amp model=resnet bench.repeats={2 * 3}"]
    long = console_warnings(summary, "amp", [f"models.resnet.small.knob{i}=1" for i in range(9)],
                            width=80)
    command = long[long.index("  measure again:") + 1:]
    assert len(command) > 1 and all(len(line) <= 80 for line in long)
    assert all(line.endswith(" \\") for line in command[:-1])
    pasted = " ".join(line.strip().rstrip("\\").strip() for line in command)
    assert pasted.split() == ["speedbench", "+experiment=amp",
                              *[f"models.resnet.small.knob{i}=1" for i in range(9)], "bench.repeats=6"]
    assert console_warnings(summary.assign(round_sd=0.01), "amp", []) == []
    line = report_line(tmp_path, 12, 3.4)
    assert line.endswith(str(tmp_path.resolve() / "report.html")) and line.startswith("12 trials")


def test_the_command_to_measure_again_doubles_the_rounds_of_the_data_or_of_the_config():
    """bench.repeats in the command: twice the rounds the run measured (3 here), else twice
    the run's bench.repeats; never a number made up when neither is known."""
    from speedbench.report.render import console_warnings

    summary = summarise(trials_frame()).assign(round_sd=0.9, unsteady=0)

    def command(s, **kw):
        return console_warnings(s, "amp", [], width=200, **kw)[-1].split()

    assert "bench.repeats=6" in command(summary, repeats=5)
    no_count = summary.drop(columns="trials")
    assert "bench.repeats=10" in command(no_count, repeats=5)
    assert not any(w.startswith("bench.repeats=") for w in command(no_count))


def test_the_command_to_measure_again_gives_the_budget_the_recommendation_gives():
    """With the run's budget known, the command raises bench.time_budget_s (the run's budget
    holds its rounds; more repeats would not fit) by the factor the recommendation's "measure
    longer" names for the least settled comparison, at least twice; the old value is dropped."""
    from speedbench.report import recommend
    from speedbench.report.render import console_warnings

    summary = summarise(trials_frame()).assign(round_sd=0.9, unsteady=0)
    words = console_warnings(summary, "amp", ["bench.time_budget_s=150"], width=300,
                             budget_s=150)[-1].split()
    given = [w for w in words if w.startswith("bench.time_budget_s=")]
    factors = [recommend.budget_factor(r) for r in summary.to_dict("records")
               if not r["is_baseline"] and recommend.unsettled(r)]  # decided rows need none
    expected = 150 * max([2.0] + [f for f in factors if f is not None])
    assert given == [f"bench.time_budget_s={float(f'{expected:.2g}'):g}"]
    assert not any(w.startswith("bench.repeats=") for w in words)
    wide = summary.copy()  # an unsettled 1.1x: many more rounds than twice
    wide.loc[wide["variant"] == "bf16", ["speedup", "speedup_lo", "speedup_hi", "verdict"]] = \
        [1.1, 0.6, 2.0, "inconclusive"]
    factor = max(f for f in map(recommend.budget_factor, wide.to_dict("records")) if f)
    assert factor > 2
    assert f"bench.time_budget_s={float(f'{150 * factor:.2g}'):g}" in console_warnings(
        wide, "amp", [], width=300, budget_s=150)[-1].split()
    figure = recommend.more_budget(wide, 150)  # the recommendation names the same figure
    assert f"bench.time_budget_s={figure:g}" in console_warnings(wide, "amp", [], width=300,
                                                                  budget_s=150)[-1].split()
    for row in wide.to_dict("records"):
        if recommend.budget_factor(row):
            assert f"(give bench.time_budget_s={figure:g} for the whole run)" in \
                recommend.measure_longer(row, figure)


# --- the run's settings columns and the views its techniques ask for ---------------------------
LOADER = {"name": "loader", "host_sweep": {"column": "num_workers", "title": "DataLoader workers"},
          "fields": [{"key": "data.num_workers", "doc": "worker processes",
                      "column": "num_workers"},
                     {"key": "data.pin_memory", "doc": "page-locked batches",
                      "column": "pin_memory"}]}


def workers_run(tmp_path, techniques_json: dict | None):
    """A run of four variants that vary num_workers, with techniques.json if given."""
    from test_report import make_run

    from speedbench.results.runs import load_run

    run_dir = make_run(tmp_path / "run", variants=("w0", "w1", "w2", "w4"))
    trials = pd.read_csv(run_dir / "trials.csv")
    trials["num_workers"] = trials["variant"].str[1:].astype(int)
    trials.to_csv(run_dir / "trials.csv", index=False)
    if techniques_json is not None:
        (run_dir / "techniques.json").write_text(json.dumps(techniques_json))
    return load_run(run_dir)


def test_settings_columns_come_from_techniques_json_or_the_config(tmp_path):
    from speedbench.report import settings

    run = workers_run(tmp_path, {"techniques": [LOADER]})
    # pin_memory is not in trials.csv
    assert settings.columns(run) == {"num_workers": "worker processes (num_workers)"}
    assert settings.host_sweeps(run) == [LOADER["host_sweep"]]
    # Without techniques.json: a non-generic column named after a config key is a setting.
    run.techniques = []
    run.cfg = {"data": {"num_workers": 0}, "bench": {"steps": 2}}
    assert settings.columns(run) == {"num_workers": "num_workers"}
    assert settings.host_sweeps(run) == []
    run.cfg = {}
    assert settings.columns(run) == {}


@pytest.mark.parametrize("techniques_json", [True, False])
def test_the_host_sweep_view_is_drawn_where_a_technique_asks_for_it(tmp_path, techniques_json):
    """With the registry's own techniques.json the loader's view and the sweep figure appear;
    a run without the file shows neither (its config names no worker key)."""
    from speedbench import techniques
    from speedbench.report.render import write_report

    run = workers_run(tmp_path, techniques.metadata() if techniques_json else None)
    md = write_report(run.path).read_text()
    assert ("### DataLoader workers" in md) is techniques_json
    assert ("Highest median throughput per model: resnet: num_workers=" in md) \
        is techniques_json
    assert ((run.path / "plots" / "amp-host-num_workers.png").exists()) is techniques_json
    assert ((run.path / "plots" / "amp-sweep-num_workers.png").exists()) is techniques_json
