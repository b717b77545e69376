"""The recommendation section from hand-made summaries: use / skip / could not test here."""
from __future__ import annotations

import math
import subprocess
import sys

import pandas as pd

from speedbench.report import recommend
from speedbench.report.document import Document, to_markdown

NAN = math.nan


def row(experiment, model, variant, verdict, speedup=NAN, lo=NAN, hi=NAN, status="ok",
        baseline=False, mem=100.0):
    return {"experiment": experiment, "model": model, "variant": variant,
            "is_baseline": baseline, "status": status, "samples_per_s": 10.0,
            "speedup": speedup, "speedup_lo": lo, "speedup_hi": hi, "verdict": verdict,
            "peak_mem_mb": mem}


def summary() -> pd.DataFrame:
    return pd.DataFrame([
        row("amp", "vae", "fp32", "baseline", 1.0, baseline=True),
        row("amp", "vae", "fp16", "slower", 0.02, 0.01, 0.03),
        row("amp", "vae", "bf16", "faster", 1.28, 1.15, 1.40, mem=60.0),
        row("workers", "vae", "w0", "baseline", 1.0, baseline=True),
        row("workers", "vae", "w1", "faster", 1.10, 1.02, 1.20),
        row("workers", "vae", "w2", "slower", 0.82, 0.75, 0.90),
        row("workers", "vae", "w4", "inconclusive", 1.31, 0.95, 1.80),  # big but not significant
        row("sync", "vae", "item", "baseline", 1.0, baseline=True),
        row("sync", "vae", "deferred", "equivalent", 1.01, 0.99, 1.03),
        row("pinning", "vae", "pageable", "baseline", 1.0, baseline=True),
        row("pinning", "vae", "pinned", "n/a", status="n/a: pin_memory needs CUDA"),
        row("tensor_creation", "vae", "host", "n/a", baseline=True,
            status="n/a: tensor_creation=host needs an accelerator"),
        row("tensor_creation", "vae", "device", "n/a", status="n/a: no baseline to compare with"),
        row("accumulation", "vae", "k1", "baseline", 1.0, baseline=True),
        row("accumulation", "vae", "k2", "oom", status="oom"),
        row("profile", "vae", "simple", "baseline", 1.0, baseline=True),
        row("profile", "vae", "pytorch", "faster", 1.5, 1.2, 1.8),
        row("amp", "resnet", "fp32", "baseline", 1.0, baseline=True),
        row("amp", "resnet", "bf16", "no significant difference", 1.27, 0.9, 1.6),
    ])


def test_use_only_significant_best_per_experiment():
    by_model = {a.model: a for a in recommend.advise(summary())}
    vae = by_model["vae"]
    assert [i.technique for i in vae.use] == ["amp: bf16", "workers: w1"]
    assert vae.use[0].text == "1.28x [1.15, 1.40], memory 0.60x"
    # w4's 1.31x is larger than w1's but not significant: never called best
    assert all("w4" not in i.technique for i in vae.use)
    assert by_model["resnet"].use == []


def test_skip_and_untested_say_why():
    vae = {a.model: a for a in recommend.advise(summary())}["vae"]
    skip = {i.technique: i.text for i in vae.skip}
    assert skip["workers: w2"] == "0.82x [0.75, 0.90], slower here"
    assert skip["sync: deferred"].startswith("no difference here")
    assert "workers: w4" not in skip  # measured faster, not settled: undecided, never skip
    undecided = {i.technique: i.text for i in vae.unsettled}
    assert undecided["workers: w4"].startswith("1.31x")
    assert "measure longer" in undecided["workers: w4"]
    untested = {i.technique: i.text for i in vae.untested}
    assert untested["pinning: pinned"] == "pin_memory needs CUDA"
    assert untested["tensor_creation"] == "tensor_creation=host needs an accelerator"
    assert "tensor_creation: device" not in untested  # said once, for the experiment
    assert untested["accumulation: k2"] == "failed here: oom"
    assert not any(i.technique.startswith("profile") for i in vae.use + vae.skip + vae.untested)


def test_section_and_console():
    doc = Document("t")
    recommend.add_section(doc, summary())
    md = to_markdown(doc)
    assert md.index("## Recommendation") < md.index("### vae") < md.index("use: amp: bf16")
    assert "use: nothing measured here was significantly faster" in md  # resnet
    assert "measured alone" in md
    console = recommend.console_lines(summary())
    assert console[0] == "Recommendation:"
    assert any(line.strip().startswith("vae: use amp: bf16 1.28x [1.15, 1.40]") for line in console)
    assert any("w2 (0.82x slower)" in line for line in console)
    assert len(console) <= 8


def test_a_console_reason_keeps_its_figure_when_it_has_an_aside():
    reason = ("not measured: its steady probe steps took (lower median of 3) 18 s; two rounds "
              "need 40 s of the 30 s left")
    untested = pd.DataFrame([row("amp", "m", "fp32", "baseline", 1.0, baseline=True),
                             row("amp", "m", "fp16", "not measured", status=reason)])
    console = " ".join(x.strip() for x in recommend.console_lines(untested))
    line = console[console.index("could not test:"):]
    # cut at the aside, the reason read "its steady probe steps took)": no figure at all
    assert "took 18 s" in line and "(lower median" not in line


def test_old_verdict_words_and_empty():
    assert recommend.advise(pd.DataFrame()) == []
    old = pd.DataFrame([row("amp", "m", "fp32", "baseline", 1.0, baseline=True),
                        row("amp", "m", "bf16", "too few trials", 1.3)])
    a = recommend.advise(old)[0]
    assert a.use == [] and a.skip == []
    assert a.unsettled[0].text == "1.30x; measure longer (a larger bench.time_budget_s)"


def test_report_layer_does_not_import_torch():
    code = ("import sys; import speedbench.report.recommend, speedbench.report.waterfall, "
            "speedbench.report.recipe_section; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_waterfall_figure(tmp_path):
    """Each bar is a measured cumulative speed-up with its CI; a stage the closing measurement
    did not measure is left out, never drawn from a product of step gains."""
    from speedbench.report import waterfall
    rows = pd.DataFrame([
        {"model": "vae", "label": "naive", "speedup": 1.0, "lo": NAN, "hi": NAN, "step_gain": NAN},
        {"model": "vae", "label": "+ precision=bf16", "speedup": 1.3, "lo": 1.2, "hi": 1.4,
         "step_gain": 1.3},
        {"model": "vae", "label": "+ workers=2", "speedup": 1.55, "lo": 1.4, "hi": 1.7,
         "step_gain": 1.2},
        {"model": "t", "label": "naive", "speedup": 1.0, "lo": NAN, "hi": NAN, "step_gain": NAN},
        {"model": "t", "label": "+ sync=deferred", "speedup": NAN, "lo": NAN, "hi": NAN,
         "step_gain": 1.1},  # closing measurement missing: not drawn
    ])
    figs = waterfall.figures(rows)
    assert set(figs) == {"vae", "t"}
    ax = figs["vae"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][-1] == "+ workers=2"
    assert any("1.55x\n[1.40, 1.70]" in t.get_text() for t in ax.texts)
    assert not any("1.10x" in t.get_text() for t in figs["t"].axes[0].texts)
    assert [t.get_text() for t in figs["t"].axes[0].get_xticklabels()] == ["naive"]
    from speedbench.report.plots import save
    save(figs["vae"], tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 1000


def _techniques_json(run_dir):
    from speedbench import results, techniques
    results.write_json(techniques.metadata(), run_dir / "techniques.json")
    return run_dir


def test_snippets_come_from_the_runs_techniques_json(tmp_path):
    from speedbench.report.recipe_section import load_snippets, snippets_for
    snippets = load_snippets(_techniques_json(tmp_path))
    got = snippets_for({"precision": "bf16", "data.num_workers": 2,
                        "data.persistent_workers": True, "sync": "deferred"}, snippets)
    assert [t for t, _ in got] == ["bf16 autocast (no loss scaling needed)",
                                   "2 DataLoader workers",
                                   "no host read every step: accumulate the loss on the device"]
    assert "torch.bfloat16" in got[0][1] and "num_workers=2," in got[1][1] \
        and "detach" in got[2][1]
    assert snippets_for({"precision": "fp32", "data.num_workers": 0, "accumulate": 1},
                        snippets) == []
    assert load_snippets(tmp_path / "old-run") is None


def _a_value(field, listed):
    """A value of `field` that the snippets list under ANY: not the default, not listed."""
    others = [c for c in field.choices or () if c != field.default and c not in listed]
    if others:
        return others[0]
    if isinstance(field.default, str):  # a free-form text key (fsdp_reshard's "true"/"false"/n)
        return "2"
    return (field.default or 0) + 3  # a null default: any number


def test_every_snippet_is_python_and_is_found_for_its_value(tmp_path):
    from speedbench.report.recipe_section import ANY, load_snippets, snippets_for
    from speedbench.techniques import REGISTRY
    snippets = load_snippets(_techniques_json(tmp_path))
    checked = 0
    for tech in REGISTRY:
        fields = {f.key: f for f in tech.fields}
        for key, by_value in tech.snippets.items():
            for value in by_value:
                if value == ANY:
                    value = _a_value(fields[key], by_value)
                fields[key].validate(value)
                [(title, code)] = snippets_for({key: value}, snippets)
                assert title == by_value.get(value, by_value.get(ANY))[0].replace(
                    "{value}", str(value)) and "{value}" not in code
                compile(code.replace("...", "pass"), f"{key}={value}", "exec")
                checked += 1
    assert checked == sum(len(v) for t in REGISTRY for v in t.snippets.values()) >= 16


def test_a_run_without_techniques_json_shows_no_snippets_and_says_so(tmp_path):
    from speedbench.report import recipe_section
    chosen = pd.DataFrame([{"model": "vae", "table": "chosen", "option": "precision=bf16",
                            "overrides": "{precision: bf16}"}])
    for run_dir, shown in ((tmp_path / "old", False), (_techniques_json(tmp_path), True)):
        run_dir.mkdir(exist_ok=True)
        doc = Document("t")
        recipe_section.add(doc, chosen, run_dir, tmp_path)
        md = to_markdown(doc)
        assert ("torch.bfloat16" in md) is shown
        assert ("no techniques.json" in md) is not shown


def test_a_recipe_search_is_advised_from_recipe_csv():
    rec = pd.DataFrame([
        {"model": "vae", "table": "waterfall", "step": 0, "label": "naive", "speedup": 1.0},
        {"model": "vae", "table": "waterfall", "step": 1, "label": "+ precision=bf16",
         "option": "precision=bf16", "speedup": 1.3, "lo": 1.2, "hi": 1.4, "step_gain": 1.3,
         "verdict": "faster"},
        {"model": "vae", "table": "waterfall", "step": 2, "label": "+ workers=w2",
         "option": "workers=w2", "speedup": 1.5, "lo": 1.4, "hi": 1.6, "step_gain": 1.15,
         "verdict": "faster"},
        {"model": "vae", "table": "ablation", "option": "precision=bf16", "speedup": 1.45,
         "lo": 1.3, "hi": 1.6, "verdict": "faster"},
        {"model": "vae", "table": "ablation", "option": "workers=w2", "speedup": 1.15,
         "lo": 1.05, "hi": 1.25, "verdict": "faster"},
        {"model": "vae", "table": "step", "step": 1, "option": "sync=deferred", "speedup": 1.2,
         "lo": 0.9, "hi": 1.5, "verdict": "inconclusive"},
        {"model": "vae", "table": "step", "step": 2, "option": "sync=deferred", "speedup": 0.8,
         "lo": 0.7, "hi": 0.9, "verdict": "slower"},
        {"model": "vae", "table": "step", "step": 1, "option": "precision=bf16", "speedup": 1.3,
         "lo": 1.2, "hi": 1.4, "verdict": "chosen"},
        {"model": "vae", "table": "excluded", "option": "pinning=pinned",
         "status": "n/a: pin_memory needs CUDA"},
        {"model": "vae", "table": "excluded", "option": "precision=fp16",
         "status": "too slow: 38 s/step, 100x slower, stopped after 1 step"},
        {"model": "vae", "table": "chosen", "option": "precision=bf16"},
        {"model": "vae", "table": "chosen", "option": "workers=w2"},
        {"model": "vae", "table": "note", "label": "accumulation was not a candidate"},
    ])
    summ = pd.concat([summary(), pd.DataFrame([
        row("recipe", "vae", "naive", "baseline", 1.0, baseline=True, mem=100.0),
        row("recipe", "vae", "precision=bf16 + workers=w2", "faster", 1.5, 1.4, 1.6, mem=70.0),
        row("recipe-step1", "vae", "current", "baseline", 1.0, baseline=True)])])
    advice = {a.model: a for a in recommend.advise(summ, rec)}
    vae, resnet = advice["vae"], advice["resnet"]
    assert vae.use[0].technique == "the recipe precision=bf16 + workers=w2"
    assert vae.use[0].text == "1.50x [1.40, 1.60] over naive, memory 0.70x"
    assert [i.technique.strip() for i in vae.use[1:]] == ["precision=bf16", "workers=w2"]
    assert vae.use[1].text.startswith("1.45x [1.30, 1.60] with the others")
    skip = {i.technique: i.text for i in vae.skip}
    assert skip["sync=deferred"] == "0.80x [0.70, 0.90], slower here (step 2)"  # its last step
    assert skip["precision=fp16"].startswith("too slow")
    assert {i.technique: i.text for i in vae.untested} == {"pinning=pinned": "pin_memory needs CUDA"}
    assert vae.notes == ["accumulation was not a candidate"]
    assert resnet.use == []  # models outside the search keep the per-experiment advice
    doc = Document("t")
    recommend.add_section(doc, summ, rec)
    md = to_markdown(doc)
    assert "use: the recipe precision=bf16 + workers=w2" in md and "recipe-step1" not in md


def _search(waterfall_verdict: str, ablation_verdict: str, undecided: str = "") -> pd.DataFrame:
    rows = [{"model": "vae", "table": "waterfall", "step": 0, "label": "naive", "speedup": 1.0},
            {"model": "vae", "table": "waterfall", "step": 1, "label": "+ optimizer=fused",
             "option": "optimizer=fused", "speedup": 1.16, "lo": 1.00, "hi": 1.35,
             "step_gain": 1.2, "step_lo": 1.1, "step_hi": 1.3, "verdict": waterfall_verdict},
            {"model": "vae", "table": "ablation", "option": "optimizer=fused", "speedup": 1.16,
             "lo": 1.00, "hi": 1.35, "verdict": ablation_verdict},
            {"model": "vae", "table": "chosen", "option": "optimizer=fused"}]
    if undecided:
        rows = [{"model": "vae", "table": "step", "step": 1, "option": "sync=deferred",
                 "speedup": 1.1, "lo": 0.8, "hi": 1.4, "verdict": "inconclusive"},
                {"model": "vae", "table": "undecided", "label": undecided}]
    return pd.DataFrame(rows)


def test_use_only_for_a_significant_contribution():
    """An inconclusive recipe or contribution is 'not settled', never next to 'use'; the gain
    when added is labelled conditional on selection."""
    summ = pd.DataFrame([row("recipe", "vae", "naive", "baseline", 1.0, baseline=True)])
    (advice,) = recommend.advise(summ, _search("inconclusive", "inconclusive"))
    text = "\n".join(recommend.lines(advice))
    assert advice.use == []
    assert "nothing settled yet: what was measured is undecided against the naive recipe" in text
    assert "undecided: the recipe optimizer=fused, 1.16x [1.00, 1.35] over naive" in text
    assert "when added (conditional on its selection)" in text
    for line in text.splitlines():
        assert not (line.startswith("use:") and "inconclusive" in line)
    (advice,) = recommend.advise(summ, _search("faster", "faster"))
    assert [i.technique.strip() for i in advice.use] == ["the recipe optimizer=fused",
                                                         "optimizer=fused"]


def test_an_undecided_search_says_so_first_and_offers_no_recipe():
    why = ("not decided: the budget ran out after screening; a full search needs about 410 s "
           "(recipe.budget_s was 240)")
    summ = pd.DataFrame([row("recipe-step1", "vae", "current", "baseline", 1.0, baseline=True)])
    (advice,) = recommend.advise(summ, _search("", "", undecided=why))
    out = recommend.lines(advice)
    assert out[0] == why
    assert not any(line.startswith("use:") for line in out)
    assert not any("final recipe" in line for line in out)
    assert any(line.startswith("undecided: sync=deferred") for line in out)


def test_a_host_setting_is_called_best_only_when_significant():
    from speedbench.report import host_sweep
    trials = pd.DataFrame([
        {"experiment": "workers", "model": "m", "variant": v, "status": "ok",
         "data.num_workers": n, "samples_per_s": tp, "data_wait_frac": 0.1, "host_rss_mb": 100.0}
        for v, n, tp in (("w0", 0, 10.0), ("w2", 2, 12.0))])
    s = host_sweep.sweep(trials, "data.num_workers")
    verdicts = pd.DataFrame([row("workers", "m", "w0", "baseline", 1.0, baseline=True),
                             row("workers", "m", "w2", "inconclusive", 1.2, 0.9, 1.6)])
    text = host_sweep.best_settings(host_sweep.with_verdicts(s, verdicts), "data.num_workers")
    assert "data.num_workers=2" in text and "no setting is called best" in text
    assert "the best setting" not in text
    verdicts.loc[1, "verdict"] = "faster"
    text = host_sweep.best_settings(host_sweep.with_verdicts(s, verdicts), "data.num_workers")
    assert "the best setting: significantly faster" in text
