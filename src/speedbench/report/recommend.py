"""The answer first: per model, what to use, what is undecided, what to skip, and what could not
be tested here.

Built from a run's summary (summary.csv rows) alone, so it works for every report, old runs
included. Rules:
- **use**: only variants whose verdict is `faster` (significant after the run's error control);
  one per experiment (its variants are alternatives: fp16 or bf16, 1 or 2 workers), the
  largest gain; never a non-significant result;
- **undecided**: measured, but not settled by this run ("undecided: amp: bf16, 1.50x [0.90,
  2.49]; measure longer: about 14 rounds would settle 1.5x, this run had 3"): never "skip";
- **skip**: slower ("0.82x, slower here"), equivalent ("no difference here"), or stopped as
  hopeless;
- **could not test here**: n/a (with its reason), failures (oom, error, diverged), no baseline.
Each `use` gain was measured alone against that experiment's plain-PyTorch baseline; stacking
them is what `+experiment=recipe` measures. A recipe search is advised from recipe.csv: `use`
for the final recipe only when it is significantly faster than naive, and for a technique of
it only when its contribution in the presence of the others is; the rest of the stack is
`not settled`. A search the budget stopped before it decided anything opens with "not
decided: ..." and offers no recipe. An A/B of environments (arms) is advised per arm: the
version effect (another arm's baseline over the first's) on a line of its own, what to use
under each arm (its techniques against that arm's baseline), and each technique across the
arms ("amp: bf16 was 1.31x under a, 1.12x under b").

Never imports torch: report layer.
"""
from __future__ import annotations

import math
import re
import shutil
import textwrap
from dataclasses import dataclass, field

import pandas as pd

from speedbench.analysis import power
from speedbench.analysis.numbers import AUTO, ratio_text
from speedbench.report.numbers import clip, learning_lost
from speedbench.analysis.quality import DIVERGED, WORSE
from speedbench.analysis.to_target import recipe_line, verdict_line
from speedbench.report import ab_section
from speedbench.results.runs import load_recipe, load_to_target
from speedbench.results.schema import HOPELESS, NOT_MEASURED, OK, TOO_SLOW

# Verdict words: today's and those of the paired, error-controlled verdicts.
FASTER, SLOWER = "faster", "slower"
NO_DIFFERENCE = ("equivalent", "no significant difference")
# Experiments whose variants are not training recipes (the profilers): nothing to advise.
NOT_ADVICE = ("profile",)
# Measurements made for something else: the recipe search's steps (advised from recipe.csv)
# and the findings' checks (shown with the findings).
MEASURED_FOR = ("recipe", "check-")


@dataclass
class Item:
    technique: str
    text: str
    speedup: float = math.nan
    effect: str = ""  # the speed-up with its CI, for the console
    part: bool = False  # one technique of a recipe search's stack (the report lists it)


@dataclass
class Advice:
    model: str
    use: list[Item] = field(default_factory=list)
    skip: list[Item] = field(default_factory=list)
    untested: list[Item] = field(default_factory=list)
    also_faster: dict[str, list[str]] = field(default_factory=dict)  # technique -> other variants
    notes: list[str] = field(default_factory=list)  # what a recipe search set aside, and why
    unsettled: list[Item] = field(default_factory=list)  # measured, not settled: undecided
    undecided: str = ""  # "not decided: the budget ran out ...": said first
    searched: bool = False  # advised from a recipe search: its baseline is the naive recipe
    versions: list[Item] = field(default_factory=list)  # an A/B's: another arm over the first
    across_arms: list[str] = field(default_factory=list)  # "amp: bf16 was 1.31x under a, ..."


def _get(row, name: str, default=math.nan):
    value = row.get(name, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def technique_name(experiment: str, variant: str) -> str:
    """`amp: bf16`; the variant alone when there is no experiment to name; under an A/B's
    arm, `amp: bf16 under b` (the variant `bf16@b`)."""
    variant, arm = (str(variant).rsplit(ab_section.SEPARATOR, 1) + [""])[:2] \
        if ab_section.SEPARATOR in str(variant) else (str(variant), "")
    under = f" under {arm}" if arm else ""
    if experiment in ("", "default", variant) or not isinstance(experiment, str):
        return f"{variant}{under}"
    return f"{experiment}: {variant}{under}"


def _word(value) -> str:
    """A text cell of the summary; '' for a missing one (NaN in a CSV)."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else str(value)


def version_item(row: dict, baseline: dict | None) -> Item:
    """An A/B's version effect: `b over a`, its speed-up with its CI and what it means (the
    report's text), and the same in a few words (`effect`: the console's)."""
    kind, text = _classify(row)
    first = _word((baseline or {}).get("arm")) or "the first arm"
    said = f"{text}, faster here" if kind == "use" else text
    memory = memory_text(row, baseline) if kind in ("use", "skip", "undecided") else ""
    effect = ratio_text(_get(row, "speedup"), _get(row, "speedup_lo"), _get(row, "speedup_hi"),
                        AUTO)
    verdict = _word(row.get("verdict")) if kind != "untested" else _short(text)
    return Item(f"{_word(row.get('arm'))} over {first}", said + (f", {memory}" if memory else ""),
                _get(row, "speedup"), f"{effect} {verdict or 'undecided'}")


def memory_text(row: dict, baseline: dict | None) -> str:
    """The memory cost of a variant: its peak over the baseline's, as a ratio."""
    ratio = _get(row, "mem_ratio")
    if not math.isfinite(ratio) and baseline is not None:
        mine, base = _get(row, "peak_mem_mb"), _get(baseline, "peak_mem_mb")
        if math.isfinite(mine) and math.isfinite(base) and base > 0:
            ratio = mine / base
    if not math.isfinite(ratio):
        return "memory not measured"
    if abs(ratio - 1) < 0.05:
        return "same memory"
    return f"memory {ratio_text(ratio)}"


def _classify(row: dict, figure: float | None = None) -> tuple[str, str]:
    """(kind, text) of one non-baseline row: kind is use / skip / undecided / untested;
    `figure`, the run's one budget figure (more_budget), is what an undecided row is told."""
    status = str(row.get("status", OK))
    verdict = str(row.get("verdict", ""))
    effect = ratio_text(_get(row, "speedup"), _get(row, "speedup_lo"), _get(row, "speedup_hi"),
                        AUTO)
    if status.startswith("n/a"):
        return "untested", status.removeprefix("n/a:").strip() or "n/a"
    if status.startswith(NOT_MEASURED):  # a limit stopped it: no call, what it measured
        measured = f"; measured {ratio_text(_get(row, 'speedup'))}, no CI" \
            if math.isfinite(_get(row, "speedup")) else ""
        return "untested", f"{status}{measured}"
    if status != OK:
        if status.startswith((TOO_SLOW, HOPELESS)):
            return "skip", f"{effect}, {status}" if effect != "-" else status
        return "untested", f"failed here: {status}"
    if verdict == FASTER and str(row.get("quality_verdict")) in (WORSE, DIVERGED):
        return "skip", (f"{effect}, but its held-out loss is {row['quality_verdict']}: "
                        f"learning lost {learning_lost(row)}")
    if verdict == FASTER:
        return "use", effect
    if verdict == SLOWER:
        return "skip", f"{effect}, slower here"
    if verdict in NO_DIFFERENCE:
        return "skip", f"no difference here ({effect})"
    if verdict == "no baseline":
        return "untested", "no baseline to compare with"
    return "undecided", f"{effect}; {measure_longer(row, figure)}" if effect != "-" else \
        "no interval; " + measure_longer({}, figure)


def rounds_needed(row: dict) -> tuple[int, int | None] | None:
    """(rounds this comparison had, rounds that would call its measured effect in most runs:
    power.rounds_for with the per-round sd its interval implies; None where no budget here
    would); None where its row has no interval to judge from."""
    rounds, lo, hi = _get(row, "rounds"), _get(row, "speedup_lo"), _get(row, "speedup_hi")
    point, level = _get(row, "speedup"), _get(row, "ci_level", 0.95)
    if not (rounds >= 2 and 0 < lo < hi and math.isfinite(point) and 0 < level < 1):
        return None
    sd = power.sd_from_interval(lo, hi, int(rounds), level)
    effect = max(point, 1 / point)
    return int(rounds), power.rounds_for(effect, sd, level) if effect > 1.005 else None


def budget_factor(row: dict) -> float | None:
    """How many times this run's bench.time_budget_s would settle the row's effect (the figure
    measure_longer gives, and the console's "measure again" command uses); None: unknown."""
    rounds = rounds_needed(row)
    return None if rounds is None or rounds[1] is None else float(f"{rounds[1] / rounds[0]:.2g}")


def more_budget(summary: pd.DataFrame, budget_s: float) -> float:
    """The run's one budget figure: bench.time_budget_s for measuring the whole run again, the
    one figure the console's "measure again", the report's budget line and every undecided
    row give. The largest of what the run's plan gave (summary's budget_need_s: the plan
    line's figure, a probe's need for a variant it stopped for time) and the run's `budget_s`
    times each unsettled comparison's budget_factor; at least twice the run's where the plan
    gave none. Two significant figures."""
    rows = summary.to_dict("records") if summary is not None else []
    needs = [n for n in (_get(r, "budget_need_s") for r in rows) if math.isfinite(n)]
    factors = [budget_factor(r) for r in rows
               if not _truthy(r.get("is_baseline")) and unsettled(r)]
    figures = needs + [budget_s * f for f in factors if f is not None]
    return float(f"{max(figures + ([] if needs else [2.0 * budget_s])):.2g}")


def _by_technique(rows: list[dict], out: dict, baselines: dict, figure: float | None) -> dict:
    """The rows of each (model, experiment, arm), classified: (row, kind, text); an experiment
    without its baseline, and an A/B's version effect, go straight to `out`'s Advice."""
    per_technique: dict[tuple, list[tuple[dict, str, str]]] = {}
    for r in rows:
        advice = out.setdefault(str(r["model"]), Advice(str(r["model"])))
        if r["experiment"] in NOT_ADVICE or str(r["experiment"]).startswith(MEASURED_FOR):
            continue
        base = baselines.get((r["experiment"], r["model"]))
        if base is not None and str(base.get("status", OK)) != OK:
            # no baseline: the whole experiment could not be measured; said once
            if _truthy(r.get("is_baseline")):
                advice.untested.append(Item(str(r["experiment"]), _classify(r)[1]))
            continue
        if _truthy(r.get("is_baseline")):
            continue
        if _word(r.get("arm")) and not _word(r.get("reference")):  # an A/B's version effect
            advice.versions.append(version_item(r, base))
            continue
        kind, text = _classify(r, figure)
        per_technique.setdefault((r["model"], r["experiment"], _word(r.get("arm"))), []).append(
            (r, kind, text))
    return per_technique


def unsettled(row: dict) -> bool:
    """Whether a row is left for a larger budget: measured but not settled, or not measured
    (a limit of the run stopped it)."""
    status = str(row.get("status", OK))
    if status.startswith(NOT_MEASURED):
        return True
    return status == OK and str(row.get("verdict", "")) not in (FASTER, SLOWER, *NO_DIFFERENCE,
                                                               "no baseline", "")


def budget_advice(summary: pd.DataFrame, budget_s: float | None) -> str:
    """The run's one budget advice, for the report and the console's recommendation: '' where
    the run had no budget or left nothing unmeasured or undecided."""
    if not budget_s or summary is None or not any(
            unsettled(r) for r in summary.to_dict("records") if not _truthy(r.get("is_baseline"))):
        return ""
    return (f"budget: bench.time_budget_s={more_budget(summary, budget_s):g} for the whole run "
            f"(this run had {budget_s:g} s) measures what this run left not measured or "
            "undecided")


def measure_longer(row: dict, figure: float | None = None) -> str:
    """What would settle an undecided comparison: the rounds that call its measured effect in
    most runs, and the run's one budget figure (`figure`: more_budget) that holds them."""
    give = f"bench.time_budget_s={figure:g} for the whole run" if figure else \
        "a larger bench.time_budget_s"
    rounds = rounds_needed(row)
    if rounds is None:
        return f"measure longer ({give})"
    had, need = rounds
    if need is None:
        return (f"measure longer: this run had {had} rounds; an effect this small "
                "needs more than any budget here gives")
    point = _get(row, "speedup")
    return (f"measure longer: about {need} rounds would settle {ratio_text(max(point, 1 / point))}"
            f", this run had {had} (give {give})")


def advise(summary: pd.DataFrame, recipe: pd.DataFrame | None = None,
           budget_s: float | None = None) -> list[Advice]:
    """One Advice per model of the summary, models in order of appearance. With a recipe
    search's table (recipe.csv), its models are advised from the search instead. `budget_s`:
    the run's bench.time_budget_s, whose one figure (more_budget) undecided rows are told."""
    if summary is None or summary.empty:
        return []
    figure = more_budget(summary, budget_s) if budget_s else None
    out: dict[str, Advice] = {}
    searched = set()
    if recipe is not None and len(recipe):
        for model, rows in recipe.groupby("model", sort=False):
            out[str(model)] = advise_recipe(str(model), rows, summary)
            searched.add(str(model))
    rows = [r for r in summary.to_dict("records") if str(r["model"]) not in searched]
    baselines = {(r["experiment"], r["model"]): r for r in rows if _truthy(r.get("is_baseline"))}
    per_technique = _by_technique(rows, out, baselines, figure)
    for (model, experiment, arm), items in per_technique.items():
        advice = out[str(model)]
        winners = sorted([(r, t) for r, k, t in items if k == "use"],
                         key=lambda x: -_get(x[0], "speedup"))
        if winners:
            best, text = winners[0]
            name = technique_name(experiment, best["variant"])
            memory = memory_text(best, baselines.get((experiment, model)))
            advice.use.append(Item(name, f"{text}, {memory}", _get(best, "speedup"), text))
            if len(winners) > 1:
                advice.also_faster[name] = [f"{r['variant']} {ratio_text(_get(r, 'speedup'))}"
                                            for r, _ in winners[1:]]
        for r, kind, text in items:
            name = technique_name(experiment, r["variant"])
            if kind == "skip":
                advice.skip.append(Item(name, text, _get(r, "speedup")))
            elif kind == "undecided":
                advice.unsettled.append(Item(name, text, _get(r, "speedup")))
            elif kind == "untested":
                advice.untested.append(Item(name, text))
    for name, advice in out.items():
        if advice.versions:  # each technique across the arms
            advice.across_arms = ab_section.technique_sentences(summary, model=name)
        if name not in searched:  # a search's advice keeps its order: the recipe, then its parts
            advice.use.sort(key=lambda i: -i.speedup)
            advice.skip.sort(key=lambda i: i.speedup if math.isfinite(i.speedup) else math.inf)
    return list(out.values())


def advise_recipe(model: str, rows: pd.DataFrame, summary: pd.DataFrame) -> Advice:
    """Advice from a recipe search: use the final stack when it is significantly faster than
    naive, each technique when its contribution in the presence of the others is; skip what
    the last step it was measured in found not faster; could-not-test what was n/a or
    failed."""
    advice = Advice(model, searched=True)
    table = {name: g for name, g in rows.groupby("table", sort=False)}
    undecided = table.get("undecided", pd.DataFrame()).get("label", [])
    advice.undecided = str(undecided.iloc[0]) if len(undecided) else ""
    waterfall = table.get("waterfall", pd.DataFrame())
    chosen = list(table.get("chosen", pd.DataFrame()).get("option", []))
    if chosen and len(waterfall):
        _stack(advice, chosen, waterfall, table.get("ablation", pd.DataFrame()), summary)
    # per option, its latest figure: a confirmation outranks the screen of its step
    steps = pd.concat([table.get("step", pd.DataFrame()).assign(_confirmed=0),
                       table.get("confirm", pd.DataFrame()).assign(_confirmed=1)])
    if len(steps) and "status" in steps:
        steps = steps[steps["status"].fillna(OK) == OK]
    if len(steps):
        for option, g in steps.groupby("option", sort=False):
            if option in chosen:
                continue
            last = g.sort_values(["step", "_confirmed"]).iloc[-1].to_dict()
            kind, text = _classify({**last, "status": OK, "speedup_lo": last.get("lo"),
                                    "speedup_hi": last.get("hi")})
            where = f" (step {int(last['step'])})"
            if kind == "use":
                text = f"{text}, not added: its CI did not clear 1 + the minimal gain, or " \
                       "another option was faster"
            # an undecided search advises nothing: what it saw is not settled
            undecided = advice.undecided or kind == "undecided"
            (advice.unsettled if undecided else advice.skip).append(
                Item(str(option), text + where, _get(last, "speedup")))
    for r in table.get("excluded", pd.DataFrame()).to_dict("records"):
        kind, text = _classify({"status": r.get("status"), "verdict": ""})
        (advice.skip if kind == "skip" else advice.untested).append(Item(str(r["option"]), text))
    advice.skip.sort(key=lambda i: i.speedup if math.isfinite(i.speedup) else math.inf)
    advice.notes = [str(n) for n in table.get("note", pd.DataFrame()).get("label", [])]
    return advice


def _stack(advice: Advice, chosen: list[str], waterfall: pd.DataFrame, ablation: pd.DataFrame,
           summary: pd.DataFrame) -> None:
    """The final recipe and its techniques: `use` where significant, else `not settled`."""
    last = waterfall.iloc[-1].to_dict()
    effect = ratio_text(_get(last, "speedup"), _get(last, "lo"), _get(last, "hi"), AUTO)
    name = "the recipe " + " + ".join(chosen)
    if str(last.get("verdict")) == FASTER:
        text = f"{effect} over naive, {_closing_memory(advice.model, chosen, summary)}"
        advice.use.append(Item(name, text, _get(last, "speedup"), effect))
    else:
        advice.unsettled.append(Item(name, f"{effect} over naive, not significantly faster" if
                                     effect != "-" else "not measured against naive"))
    marginal = {r["option"]: r for r in ablation.to_dict("records")}
    for option in chosen:
        a = marginal.get(option, {})
        w = waterfall[waterfall["option"] == option]
        w = w.iloc[0].to_dict() if len(w) else {}
        when = ratio_text(_get(w, "step_gain"), _get(w, "step_lo"), _get(w, "step_hi"), AUTO)
        added = f"{when} when added (conditional on its selection)"
        if str(a.get("verdict")) == FASTER:
            effect = ratio_text(_get(a, "speedup"), _get(a, "lo"), _get(a, "hi"), AUTO)
            advice.use.append(Item(f"  {option}", f"{effect} with the others, significant; "
                                   f"{added}", math.inf, effect, part=True))
        elif math.isfinite(_get(a, "speedup")):
            effect = ratio_text(_get(a, "speedup"), _get(a, "lo"), _get(a, "hi"), AUTO)
            advice.unsettled.append(Item(option, f"{effect} with the others, not significant; "
                                         f"{added}"))
        else:
            advice.unsettled.append(Item(option, f"contribution with the others not measured; "
                                         f"{added}"))


def _closing_memory(model: str, chosen: list[str], summary: pd.DataFrame) -> str:
    """The final recipe's peak memory over naive's, from the closing measurement's rows."""
    if "experiment" not in summary:
        return "memory not measured"
    closing = summary[(summary["experiment"] == "recipe") & (summary["model"] == model)]
    final = closing[closing["variant"] == " + ".join(chosen)]
    naive = closing[closing["variant"] == "naive"]
    if not len(final):
        return "memory not measured"
    return memory_text(final.iloc[0].to_dict(), naive.iloc[0].to_dict() if len(naive) else None)


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


STACKING = ("Each gain above was measured alone, against plain PyTorch; gains do not simply "
            "multiply. `+experiment=recipe` measures the best combination on this machine.")


def lines(advice: Advice) -> list[str]:
    """The recommendation for one model as report bullets."""
    out = [advice.undecided] if advice.undecided else []
    out += [f"version: {i.technique}, {i.text}" for i in advice.versions]
    for item in advice.use:
        also = advice.also_faster.get(item.technique)
        out.append(f"use: {item.technique}, {item.text}"
                   + (f" (also faster: {', '.join(also)})" if also else ""))
    if not advice.use and not advice.undecided and nothing_used(advice):
        out.append(nothing_used(advice))
    out += [f"undecided: {i.technique}, {i.text}" for i in advice.unsettled]
    out += [f"skip: {i.technique}, {i.text}" for i in advice.skip]
    out += [f"could not test here: {i.technique}, {i.text}" for i in advice.untested]
    out += [f"under each arm: {s}" for s in advice.across_arms]
    out += [f"note: {n}" for n in advice.notes]
    return out


def nothing_used(advice: Advice) -> str:
    """The first line of a model with nothing to use: nothing measured at all, nothing settled
    (neither is advice to use nothing, so neither says `use:`), or nothing faster; '' for an
    A/B of the baseline recipe alone (its version line is the answer)."""
    against = "the naive recipe" if advice.searched else \
        "its arm's baseline" if advice.versions else "plain PyTorch"
    if advice.versions and not (advice.skip or advice.unsettled or advice.untested):
        return ""  # an A/B of the baseline recipe alone: its version line says it all
    if not (advice.skip or advice.unsettled):
        return "nothing measured: no technique could be measured for this model (see could not " \
            "test here)"
    if advice.unsettled and not advice.skip:
        return f"nothing settled yet: what was measured is undecided against {against}"
    if advice.unsettled:  # a skip beside an undecided one: the undecided may still pay off
        return (f"nothing settled yet: nothing was significantly faster than {against}; "
                f"{len(advice.unsettled)} undecided")
    return f"use: nothing measured here was significantly faster than {against}"


def add_section(doc, summary: pd.DataFrame, recipe: pd.DataFrame | None = None,
                title: str = "Recommendation", runs: pd.DataFrame | None = None,
                budget_s: float | None = None) -> None:
    """The report's first section: the run's one budget advice (budget_advice, where it left
    something), then per model, use / skip / could not test here; a recipe search's
    time-to-target check of its final recipe (`runs`: to_target.csv) after it."""
    advice = advise(summary, recipe, budget_s)
    if not advice:
        return
    doc.heading(title)
    budget = budget_advice(summary, budget_s) if recipe is None else ""
    if budget:
        doc.para(budget[:1].upper() + budget[1:] + ".")
    for a in advice:
        if len(advice) > 1:
            doc.heading(f"{a.model}", 3)
        target = recipe_line(runs, a.model) if a.searched else verdict_line(runs, a.model)
        doc.bullets(lines(a) + ([target] if target else []))
    if any(len(a.use) > 1 and not a.notes and not a.use[0].technique.startswith("the recipe")
           for a in advice):
        doc.para(STACKING)


def console_lines(summary: pd.DataFrame, run_dir=None, width: int = 3,
                  budget_s: float | None = None) -> list[str]:
    """The same recommendation in a few lines: per model, the `use` list in full and the first
    `width` skips and untested techniques, the rest counted; the run's one budget advice last
    (`budget_s`, the run's bench.time_budget_s)."""
    out = []
    runs = load_to_target(run_dir) if run_dir is not None else None
    recipe = load_recipe(run_dir)
    for a in advise(summary, recipe, budget_s):
        use = "; ".join(f"{i.technique} {i.effect}" for i in a.use if not i.part)
        out.append(f"{a.model}: {a.undecided}" if a.undecided else
                   f"{a.model}: use {use}" if use else f"{a.model}: {nothing_used(a)}".rstrip())
        target = recipe_line(runs, a.model) if a.searched else verdict_line(runs, a.model)
        if target:
            out.append(f"  {target}")
        out += [f"  version: {i.technique} {i.effect}" for i in a.versions]
        for label, items in (("undecided", a.unsettled), ("skip", a.skip),
                             ("could not test", a.untested)):
            if items:
                shown = [f"{i.technique} ({_short(i.text)})" for i in items[:width]]
                more = f" and {len(items) - width} more" if len(items) > width else ""
                out.append(f"  {label}: {', '.join(shown)}{more}")
    if not out:
        return []
    budget = budget_advice(summary, budget_s) if recipe is None else ""
    out += [budget] if budget else []
    # within the console table's width (100 columns, or the terminal's when narrower)
    columns = max(60, min(100, shutil.get_terminal_size((100, 24)).columns))
    wrapped = ["Recommendation:"]
    for line in out:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        wrapped += textwrap.wrap("  " + line, columns, subsequent_indent=indent,
                                 break_long_words=True, break_on_hyphens=False)
    return wrapped


def _short(text: str) -> str:
    """`0.82x, slower here` -> `0.82x slower`; reasons without their asides, cut to 60 columns."""
    if text.startswith("no difference here"):
        return "no difference"
    if text.endswith("slower here"):
        return text.split(" [")[0].split(",")[0] + " slower"
    # drop parenthesised asides rather than cut at the first one: "its steady probe steps took
    # (lower median of 3) 18 s" must not end as "its steady probe steps took"
    return clip(re.sub(r" \([^()]*\)", "", text), 60)
