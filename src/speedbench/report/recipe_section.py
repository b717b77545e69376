"""The recipe search's section of a report (from recipe.csv and recipe.yaml; no torch).

Per model: the waterfall (figure and table), the ablation, what to change in your own loop
(the snippets of the run's techniques.json), the command that re-runs the final recipe, and how
the search went step by step.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml

from speedbench.analysis.numbers import ratio_text
from speedbench.report import plots, waterfall
from speedbench.report.document import Document, slug
from speedbench.results import runs

ANY = "*"  # a snippet for any value but the key's default (speedbench.techniques.base.ANY)

METHOD = ("The search starts from the naive recipe (the articles' before-code, where it can act "
          "here) and adds techniques step by step. Each step first screens every remaining "
          "option on top of what it has: all of them and the current recipe side by side, in a "
          "few shuffled, paired rounds, which rank them. Then it confirms the two best in a "
          "fresh measurement against the current recipe, with rounds added until their "
          "intervals are narrow: each gain is the geometric mean of its per-round ratios to the "
          "current recipe, with a t interval. An option is added only when its whole interval "
          "clears 1 + the minimal gain: on significance, never on the point estimate. Every "
          "interval is at a level set before the search started: the run's 5 % family-wise "
          "error is shared out in advance over the steps and the closing measurement, so the "
          "chance of any false call in the whole run stays at most 5 %. It stops when no "
          "option is confirmed, or when the time budget, measured per trial, would not cover "
          "the next screen or confirmation. A closing measurement then runs naive, each stage "
          "of the stack and each leave-one-out recipe side by side: the cumulative speed-ups "
          "over naive and each technique's contribution in the presence of the others, all "
          "measured directly. A gain \"when added\" is conditional on selection (the option "
          "was chosen for being large, so it is biased upwards) and is never multiplied into a "
          "speed-up. (The experiment tables further down, recipe-step<N>, "
          "recipe-step<N>-confirm and recipe, hold the same trials and the same intervals.)")


GAIN_WHEN_ADDED = "gain when added [CI], conditional on selection"


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def add(doc: Document, recipe: pd.DataFrame, run_path: Path, out_dir: Path) -> None:
    doc.heading("The best recipe for this machine")
    doc.para(METHOD)
    yaml_doc = runs.load_recipe_yaml(run_path)
    snippets = load_snippets(Path(run_path))
    for model, rows in recipe.groupby("model", sort=False):
        tables = {name: g for name, g in rows.groupby("table", sort=False)}
        doc.heading(f"Recipe: {model}", 3)
        undecided = tables.get("undecided")
        if _present(undecided):
            doc.para(str(undecided["label"].iloc[0]) + ". What the screens saw ranks the "
                     "options only; no recipe is offered.")
        _waterfall(doc, tables.get("waterfall"), str(model), out_dir)
        _ablation(doc, tables.get("ablation"))
        _snippets(doc, tables.get("chosen"), snippets)
        entry = yaml_doc.get(str(model)) if isinstance(yaml_doc, dict) else None
        if isinstance(entry, dict) and entry.get("command") and entry.get("chosen"):
            doc.para("Re-run the final recipe (recipe.yaml holds its overrides): "
                     f"{entry['command']}")
        _screens(doc, tables.get("step"))
        _confirmations(doc, tables.get("confirm"))
        doc.bullets(_log(tables))


def _present(table) -> bool:
    return table is not None and len(table) > 0


def _waterfall(doc: Document, wf, model: str, out_dir: Path) -> None:
    if not _present(wf):
        return
    if len(waterfall.measured(wf)) > 1:
        fig_path = f"plots/recipe-{slug(model)}-waterfall.png"
        plots.save(waterfall.figure(wf, model), out_dir / fig_path)
        doc.figures([(f"{model}: naive, then each stage of the stack the search built: "
                      "cumulative speed-up over naive, measured side by side, with its "
                      "adjusted CI.", fig_path)])
    doc.table(pd.DataFrame({
        "stage": wf["label"],
        "speed-up over naive [CI], measured": [ratio_text(r.speedup, r.lo, r.hi) if i == 0 or
                                               _finite(r.lo) else "not measured"
                                               for i, r in enumerate(wf.itertuples())],
        GAIN_WHEN_ADDED: [ratio_text(r.step_gain, r.step_lo, r.step_hi) for r in wf.itertuples()],
    }))


def _ablation(doc: Document, ab) -> None:
    if not _present(ab):
        return
    doc.para("Leave one out: the final recipe over the final recipe without each "
             "technique, i.e. what each contributes in the presence of the others.")
    doc.table(pd.DataFrame({
        "technique": ab["option"],
        "contribution [CI]": [ratio_text(r.speedup, r.lo, r.hi) for r in ab.itertuples()],
        "verdict": ab["verdict"].map(_text),
        GAIN_WHEN_ADDED: [ratio_text(r.step_gain) for r in ab.itertuples()],
    }))


def load_snippets(run_path: Path) -> Optional[list[dict]]:
    """Every technique's snippets from the run's techniques.json, or None when it has none
    (a run from before the file, or an unreadable one)."""
    try:
        return [s for t in runs.load_techniques(run_path)["techniques"] for s in t["snippets"]]
    except (KeyError, TypeError):
        return None


def snippets_for(overrides: dict, snippets: list[dict]) -> list[tuple[str, str]]:
    """(title, code) for each override with a snippet: its own value's, else the key's ANY
    one for a value other than the default."""
    out = []
    for key, value in overrides.items():
        mine = [s for s in snippets if s["key"] == key]
        match = [s for s in mine if s["value"] == value] \
            or [s for s in mine if s["value"] == ANY and value != s["default"]]
        if match:
            out.append(tuple(match[0][part].replace("{value}", str(value))
                             for part in ("title", "code")))
    return out


def _snippets(doc: Document, chosen, snippets: Optional[list[dict]]) -> None:
    if not _present(chosen):
        return
    if snippets is None:
        doc.para("This run has no techniques.json, so the code to change in your own loop "
                 "is not shown.")
        return
    doc.para("What to change in your own training loop:")
    for r in chosen.itertuples():
        overrides = yaml.safe_load(r.overrides) if isinstance(r.overrides, str) else {}
        for title, code in snippets_for(overrides or {}, snippets):
            doc.code(code, f"{r.option}: {title}")


def _screens(doc: Document, steps) -> None:
    if not _present(steps):
        return
    log = steps.pivot_table(index="option", columns="step", values="speedup",
                            aggfunc="first", sort=False)
    table = pd.DataFrame({"option": log.index})
    for step in log.columns:
        table[f"step {int(step)}"] = [ratio_text(log.loc[o, step]) for o in log.index]
    doc.para("The screens, step by step: each option's gain over the recipe of that "
             "step, from a few rounds; they rank the options, the confirmations below "
             "decide.")
    doc.table(table)


def _confirmations(doc: Document, confirm) -> None:
    if not _present(confirm):
        return
    doc.para("The confirmations: the screen's two best, measured afresh against the "
             "recipe of that step (chosen: added at that step).")
    doc.table(pd.DataFrame({
        "step": confirm["step"].map(lambda x: f"{int(x)}" if pd.notna(x) else "-"),
        "option": confirm["option"],
        "gain [CI]": [ratio_text(r.speedup, r.lo, r.hi) for r in confirm.itertuples()],
        "rounds": confirm["rounds"].map(lambda x: f"{int(x)}" if pd.notna(x) else "-"),
        "verdict": [_text(r.verdict) or _text(r.status) for r in confirm.itertuples()],
    }))


def _log(tables: dict) -> list[str]:
    """How the search ended, what it set aside, and its notes."""
    lines = []
    stopped = tables.get("stopped")
    if _present(stopped):
        r = stopped.iloc[0]
        lines.append(f"search stopped: {r['label']} (after {float(r['speedup']):.0f} s)")
    excluded = tables.get("excluded")
    for r in (excluded.itertuples() if excluded is not None else []):
        lines.append(f"set aside, not retried: {r.option}: {r.status}")
    notes = tables.get("note")
    lines += [str(n) for n in (notes["label"] if notes is not None else [])]
    return lines
