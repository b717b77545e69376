"""The best recipe for this machine: greedy forward selection, then leave-one-out ablation.

Pure logic, no torch: everything it knows about training comes from a *measurer*, a callable
that takes recipes (label -> overrides) and measures them side by side in shuffled rounds,
returning per-round throughput per label (see `Measurer`). The real one runs speedbench's
trials; the tests use a synthetic one with known effects and noise.

The search:
1. starts from the naive recipe (the "before" code of the speed-tip articles, restricted to
   what can act here: see `restrict_naive`);
2. each step first *screens*: every remaining candidate option on top of the current recipe
   (less those its forecast, where one is given, sets aside for this step: see `Forecast`),
   together with the current recipe itself, in one measurement of a few paired rounds
   (`screen_rounds`); per-round ratios to the current recipe rank the options;
3. then *confirms*: the `confirm_top` best-ranked options (2) are measured again against the
   current recipe, in a fresh paired measurement with rounds added until the CIs are narrow
   (the measurer's adaptive rounds). Their gains are that fresh measurement's, so picking the
   screen's winners does not bias them; the CIs are Bonferroni-adjusted over the options
   confirmed together. An option is added only on significance: the lower bound of its CI
   must clear 1 + `min_gain` (a point estimate above it is not enough); of those, the fastest.
   (Screening and deciding in one measurement, Bonferroni over every option of the step, needed
   a t quantile of ~24 at 3 rounds and ~7 at 5: on a 2-core CPU it found nothing beyond bf16);
4. options of one group are mutually exclusive, so the group leaves the pool once chosen; an
   option that was n/a, failed or was hopeless (its own measurer's verdict, or a screening CI,
   Bonferroni-adjusted over the step's options, entirely below `hopeless_below`, 0.5x) is
   dropped for good, never retried;
5. stops when no option is confirmed, when the pool is empty, or when the next screen or
   confirmation (with the closing measurement kept in reserve) would not fit in the time
   budget (its part of the run's clock, measure/budget.py), estimated from what the
   measurements so far took (studies/costs.py's `MeasurementCosts`; a one-trial pilot of
   the naive recipe gives the first figures). A search the budget stopped before it decided anything says so
   (`SearchResult.undecided`) and estimates the time one step and its closing need;
6. a closing measurement runs the naive recipe, each prefix of the chosen stack and each
   leave-one-out recipe side by side, giving the waterfall (cumulative speed-up over naive,
   paired, with CI) and the ablation (each chosen option's marginal contribution in the
   presence of the others: final over final-without-it, with CI). When only part of it fits,
   it measures the final recipe against naive alone. A speed-up is never a product of step
   gains: those were chosen for being large, so they are shown as gains "when added",
   conditional on selection.

Every interval is intervals.paired_ratio_ci, the summary's Student t interval on the logs of
per-round ratios. Error control is the run's (`Spending`): the search gets a share of the
run's alpha, fixed before it starts and spent in advance over its measurements, each
measurement Bonferroni-adjusted over its own comparisons; the level each measurement used is
returned (`SearchResult.levels`) so that summary.csv states the same intervals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np
import pandas as pd

from speedbench.analysis import intervals, quality
from speedbench.analysis.numbers import ratio_text
from speedbench.measure.budget import Budget
from speedbench.studies.costs import MeasurementCosts
from speedbench.results.schema import HOPELESS, OK, REFUSED, format_status

NAIVE = "naive"
Overrides = dict[str, Any]  # flat recipe keys (dotted for nested ones) -> values


@dataclass(frozen=True)
class Option:
    """One way to apply a technique, e.g. group `precision`, name `bf16`."""

    group: str
    name: str
    overrides: Mapping[str, Any]

    @property
    def label(self) -> str:
        return self.name if self.name.startswith(self.group) else f"{self.group}={self.name}"


@dataclass
class Group:
    """Mutually exclusive options of one technique (fp16 vs bf16; 1, 2 or 4 workers).

    `naive` holds the group's keys in the articles' "before" code; `trades_memory` marks
    techniques that buy memory with time (checkpointing, accumulation): they are candidates
    only when the user sets a memory limit.
    """

    name: str
    options: list[Option]
    naive: Mapping[str, Any] = field(default_factory=dict)
    trades_memory: bool = False


@dataclass
class Arm:
    """What a measurer returns per label: status and one throughput per round (NaN where that
    round has none). Rounds are aligned across the labels of one measurement: that is the
    pairing."""

    status: str  # "ok", or why not: "n/a: ...", "error: ...", "oom", "hopeless: ..."
    samples_per_s: list[float] = field(default_factory=list)
    # per round, the most of the CPU other processes took during its trials (NaN: unknown)
    others_cpu_share: list[float] = field(default_factory=list)
    peak_mem_mb: float = math.nan
    trial_s: float = math.nan  # seconds one of its trials took, warm-up included, if known
    # its held-out loss against the measurement's first label (analysis/quality.py): the
    # verdict ("" where not measured) and its figures
    quality: str = ""
    quality_note: str = ""


class Measurer(Protocol):
    def __call__(self, recipes: dict[str, Overrides], *, step: str,
                 time_left_s: Optional[float], rounds: Optional[int] = None) -> dict[str, Arm]:
        """Measure the recipes side by side, in rounds shuffled per round. `step` names the
        search step (for progress and records); `time_left_s` may cut the rounds short;
        `rounds` asks for exactly that many (a screen), None for the measurer's own rule
        (a minimum, then more while a CI is wide)."""


class Forecast(Protocol):
    def __call__(self, current: Overrides, options: list["Option"], *,
                 time_left_s: Optional[float]) -> dict[str, str]:
        """Before a screen: option label -> why it cannot gain 1 + min_gain on top of the
        `current` recipe (its forecast, an upper bound), for the options to set aside in
        this step; they are forecast again on the next step's recipe."""


@dataclass
class Comparison:
    label: str
    speedup: float
    lo: float
    hi: float
    verdict: str
    rounds: int


@dataclass
class StepRecord:
    """One step of the forward selection: every option's gain over the current recipe."""

    index: int
    base: Overrides
    comparisons: dict[str, Comparison]  # option label -> its screened gain on top of `base`
    chosen: Optional[str]
    excluded: dict[str, str]  # option label -> status, found in this step
    elapsed_s: float
    level: float  # the screen's per-comparison CI level after Bonferroni adjustment
    confirmations: dict[str, Comparison] = field(default_factory=dict)  # fresh measurements
    set_aside: dict[str, str] = field(default_factory=dict)  # label -> its forecast, unscreened


@dataclass
class SearchResult:
    naive: Overrides
    chosen: list[Option]
    final: Overrides
    steps: list[StepRecord]
    waterfall: list[dict]  # label, option, speedup, lo, hi (cumulative over naive), step_gain...
    ablation: list[dict]  # option, marginal, lo, hi, verdict
    excluded: dict[str, str]  # option label -> why it was dropped
    stopped: str  # why forward selection ended
    notes: list[str]
    elapsed_s: float
    levels: dict[str, float] = field(default_factory=dict)  # measurement -> its CI level
    undecided: str = ""  # "not decided: the budget ran out ..." when nothing was decided


# --- statistics on paired rounds ---------------------------------------------------------------
def rounds_of(arm: Arm, reference: Arm) -> tuple[np.ndarray, np.ndarray]:
    """(arm, reference) throughputs on the rounds both have, aligned, less the rounds a burst
    of other processes hit: intervals.paired's pairs."""
    n = min(len(arm.samples_per_s), len(reference.samples_per_s))
    a = np.asarray(arm.samples_per_s[:n], float)
    b = np.asarray(reference.samples_per_s[:n], float)
    both = np.flatnonzero(np.isfinite(a) & np.isfinite(b))
    share = pd.Series(np.fmax(_shares(arm, n), _shares(reference, n))[both], index=both)
    keep = np.setdiff1d(both, intervals.bursts_in(share).to_numpy(int))
    return a[keep], b[keep]


def _shares(arm: Arm, n: int) -> np.ndarray:
    """The arm's others_cpu_share per round, NaN-padded to n rounds."""
    known = np.asarray(arm.others_cpu_share[:n], float)
    return np.concatenate([known, np.full(n - len(known), np.nan)])


def paired_rounds(arm: Arm, reference: Arm) -> int:
    """How many rounds both measured."""
    return len(intervals.paired_log_ratios(*rounds_of(arm, reference)))


def compare_at(pairs: dict[str, tuple[np.ndarray, np.ndarray]], level: float,
               threshold: float) -> dict[str, tuple[float, float, float, str]]:
    """Each label's (speed-up, lo, hi, verdict) from its (arm, reference) rounds, every CI at
    `level`: intervals.paired_ratio_ci and intervals.classify, the summary's own rule."""
    out = {}
    for label, (a, b) in pairs.items():
        s, lo, hi = intervals.paired_ratio_ci(a, b, level)
        out[label] = (s, lo, hi, intervals.classify(s, lo, hi, threshold))
    return out


# --- the candidates ---------------------------------------------------------------------------------
def restrict_naive(groups: list[Group], cannot_act: Callable[[Overrides], Optional[str]],
                   ) -> tuple[Overrides, list[Group], list[str]]:
    """The naive recipe from the groups' "before" keys, each kept only where it can act here.

    A group whose before-code cannot act here (tensors created on the host when host and device
    are one) starts from its first option that can; the group is then no candidate. Returns the
    naive overrides, the groups still searchable, and a note per group set aside."""
    naive: Overrides = {}
    kept, notes = [], []
    for g in groups:
        reason = cannot_act(dict(g.naive)) if g.naive else None
        if reason is None:
            naive.update(g.naive)
            kept.append(g)
            continue
        usable = next((o for o in g.options if cannot_act(dict(o.overrides)) is None), None)
        if usable is not None:
            naive.update(usable.overrides)
        notes.append(f"{g.name}: the before-code ({_fmt(g.naive)}) cannot act here "
                     f"({reason.removeprefix('n/a: ')}); the naive recipe uses "
                     + (_fmt(usable.overrides) if usable else "speedbench's default") + " instead")
    return naive, kept, notes


def eligible_groups(groups: list[Group], max_memory_mb: Optional[float]) -> list[Group]:
    """Speed-for-memory techniques enter only under a memory limit."""
    return [g for g in groups if not g.trades_memory or max_memory_mb is not None]


def _fmt(overrides: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "nothing"


def _apply(base: Overrides, *options: Option) -> Overrides:
    out = dict(base)
    for o in options:
        out.update(o.overrides)
    return out


# --- the search ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spending:
    """The search's share of the run's family-wise error, spent in advance: a fifth for the
    closing measurement, the rest over the steps, step k getting 1/(k(k+1)) of it (these sum
    to 1 however many steps come, and early steps, which decide the most, get the most), a
    tenth of a step's share to its screen (it only sets aside options surely less than half
    as fast) and the rest to its confirmation. Fixed before anything is measured, so the shares add up to at most `alpha`
    whatever the search finds."""

    alpha: float

    def closing(self) -> float:
        return self.alpha / 5

    def screen(self, step: int) -> float:
        return self._step(step) / 10

    def confirm(self, step: int) -> float:
        return self._step(step) * 9 / 10

    def _step(self, step: int) -> float:
        return self.alpha * 4 / 5 / (step * (step + 1))


def significant_gain(lo: float, min_gain: float) -> bool:
    """The search's rule: an option is added only when its whole CI clears 1 + min_gain."""
    return bool(np.isfinite(lo) and lo > 1 + min_gain)


@dataclass(frozen=True)
class Rules:
    """The search's decision settings (see `search`); `min_rounds` is the measurer's minimum
    of rounds in a confirmation or the closing measurement (bench.repeats)."""

    alpha: float = 0.05
    min_gain: float = 0.02
    hopeless_below: float = 0.5
    screen_rounds: Optional[int] = 3
    confirm_top: int = 2
    max_memory_mb: Optional[float] = None
    min_rounds: int = 5

    def fits_memory(self, arm: Arm) -> bool:
        return self.max_memory_mb is None or not (arm.peak_mem_mb > self.max_memory_mb)


def search(groups: list[Group], naive: Overrides, measure: Measurer, *,
           budget: Optional[Budget] = None, max_memory_mb: Optional[float] = None,
           alpha: float = 0.05, min_gain: float = 0.02, hopeless_below: float = 0.5,
           screen_rounds: Optional[int] = 3, confirm_top: int = 2, min_rounds: int = 5,
           progress: Callable[[str], None] = lambda msg: None,
           forecast: Optional[Forecast] = None) -> SearchResult:
    """Greedy forward selection from `naive` (screen, then confirm the best), then the closing
    waterfall/ablation measurement. `alpha` is this search's share of the run's family-wise
    error. `forecast`, where given, sets aside before each screen the options that cannot
    gain enough on the current recipe (their time is spared, not their chance: they are
    forecast again at every step)."""
    budget = budget or Budget(None)
    rules = Rules(alpha, min_gain, hopeless_below, screen_rounds, confirm_top, max_memory_mb,
                  min_rounds)
    forward = _Forward(groups, naive, measure, budget, rules, progress)
    forward.forecast = forecast
    stopped = "no candidate left"
    while any(forward.pool.values()):
        why = forward.step()
        if why is not None:
            stopped = why
            break
    waterfall, ablation = _close(forward)
    return SearchResult(naive=naive, chosen=forward.chosen,
                        final=_apply(naive, *forward.chosen), steps=forward.steps,
                        waterfall=waterfall, ablation=ablation, excluded=forward.excluded,
                        stopped=stopped, notes=forward.notes, elapsed_s=budget.spent(),
                        levels=forward.levels, undecided=forward.undecided(stopped))


class _Forward:
    """The forward selection's state: the options left per group, those dropped for good, the
    chosen stack, every step's record and the CI level of every measurement."""

    def __init__(self, groups: list[Group], naive: Overrides, measure: Measurer, budget: Budget,
                 rules: Rules, progress: Callable[[str], None]):
        self.naive, self.measure, self.budget = naive, measure, budget
        self.costs = MeasurementCosts()  # learned from what the measurements took
        self.rules, self.progress = rules, progress
        self.spend = Spending(rules.alpha)
        self.pool = {g.name: list(g.options) for g in eligible_groups(groups, rules.max_memory_mb)}
        self.excluded: dict[str, str] = {}
        self.chosen: list[Option] = []
        self.steps: list[StepRecord] = []
        self.notes: list[str] = []
        self.levels: dict[str, float] = {}  # measurement ("step 1", "closing"...) -> CI level
        self.out_of_budget = False
        self.needs_s = math.nan  # what the step the budget stopped would have needed
        self.forecast: Optional[Forecast] = None
        if rules.max_memory_mb is None and any(g.trades_memory for g in groups):
            self.notes.append("techniques that trade speed for memory ("
                              + ", ".join(g.name for g in groups if g.trades_memory)
                              + ") were not candidates: set recipe.max_memory_mb to let them in")

    def reserve(self) -> float:
        """Seconds kept back for the closing: at least the final recipe against naive."""
        return self.costs.cost(2, self.rules.min_rounds)

    def screen_cost(self, options: int) -> float:
        return self.costs.cost(options + 1, self.rules.screen_rounds or self.rules.min_rounds)

    def confirm_cost(self, options: int) -> float:
        return self.costs.cost(options + 1, self.rules.min_rounds)

    def fits(self, seconds: float) -> bool:
        return seconds <= self.budget.left()

    def left_s(self) -> Optional[float]:
        """Seconds the search has left (None: no limit)."""
        return None if self.budget.seconds is None else self.budget.left()

    def measured(self, recipes: dict[str, Overrides], **how) -> dict[str, Arm]:
        """One measurement of `recipes`, its time learned by the cost model."""
        t0 = self.budget.clock()
        arms = self.measure(recipes, **how)
        self.costs.record(self.budget.clock() - t0, {
            k: (int(np.isfinite(a.samples_per_s).sum()) if a.samples_per_s else 0, a.trial_s)
            for k, a in arms.items()})
        return arms

    def step(self) -> Optional[str]:
        """One step: screen every option left, confirm the best, add the winner. Returns why
        the selection stops, or None to go on."""
        n, budget = len(self.steps) + 1, self.budget
        current = _apply(self.naive, *self.chosen)
        options = [o for opts in self.pool.values() for o in opts]
        if budget.seconds is not None and not self.costs.known:
            why = self._pilot(current)
            if why:
                return why
        aside = self._set_aside(n, current, options)
        options = [o for o in options if o.label not in aside]
        if not options:
            return (f"step {n}: no option left is forecast to gain "
                    f"{self.rules.min_gain:.0%} on the current recipe")
        if not self.fits(self.screen_cost(len(options)) + self.reserve()):
            return self._over_budget(f"step {n}'s screen ({len(options)} options)",
                                     self.screen_cost(len(options))
                                     + self.confirm_cost(self.rules.confirm_top))
        self.progress(f"step {n}: screening {len(options)} options on top of "
                      f"{' + '.join(o.label for o in self.chosen) or 'naive'}")
        recipes = {"current": current, **{o.label: _apply(current, o) for o in options}}
        t0 = budget.clock()
        arms = self.measured(recipes, step=f"step {n}", time_left_s=self.left_s(),
                             rounds=self.rules.screen_rounds)
        ref = arms.get("current")
        if ref is None or ref.status != OK:
            return (f"the current recipe could not be measured in step {n} "
                    f"({ref.status if ref else 'missing'})")
        record, ranked = self._screen(n, current, options, arms)
        record.set_aside = aside
        best, why = self._decide(record, ranked, recipes)
        record.elapsed_s = budget.clock() - t0
        if best is None:  # options left open: measured again where the budget fits it
            t0 = budget.clock()
            best, record, why = self._reconfirm(record, recipes, why)
            record.elapsed_s = budget.clock() - t0 if record.index != n else record.elapsed_s
        if best is None:
            return why
        record.chosen = best.label
        option = next(o for o in options if o.label == best.label)
        self.chosen.append(option)
        self.pool.pop(option.group)
        self.progress(f"step {n}: added {option.label} "
                      f"({ratio_text(best.speedup, best.lo, best.hi)})")
        return None

    def _set_aside(self, n: int, current: Overrides, options: list[Option]) -> dict[str, str]:
        """The options this step's forecast sets aside (label -> why), said and noted."""
        if self.forecast is None or not options \
                or not self.fits(self.screen_cost(1) + self.reserve()):
            return {}  # no screen fits: the budget stops the search, not a forecast
        aside = self.forecast(current, options, time_left_s=self.left_s())
        if aside:
            self.progress(f"step {n}: not screened, by their forecasts: {', '.join(aside)}")
            self.notes += [f"step {n}: {label} not screened, by its forecast: {why}"
                           for label, why in aside.items()]
        return aside

    def _pilot(self, current: Overrides) -> Optional[str]:
        """One trial of the current recipe: the first measured time per trial, so that the
        first screen is started only when it fits."""
        self.progress("pilot: one trial of the naive recipe, to size the first screen")
        arms = self.measured({"current": current}, step="pilot", time_left_s=self.left_s(),
                             rounds=1)
        ref = arms.get("current")
        if ref is not None and ref.status.startswith("not measured") and self.budget.over():
            # the budget, not the recipe: nothing was decided, and nothing sizes a screen
            self.out_of_budget = True
            return f"time budget: the pilot's trial did not fit ({ref.status})"
        if ref is None or ref.status != OK or not self.costs.known:
            return ("the naive recipe could not be measured "
                    f"({ref.status if ref else 'missing'})")
        return None

    def _over_budget(self, what: str, seconds: float) -> str:
        """Why the budget stops the search here; remembers what a step would have needed."""
        self.out_of_budget = True
        self.needs_s = self.budget.spent() + seconds + self.reserve()
        return (f"time budget: {what} and the closing would need about "
                f"{seconds + self.reserve():.0f} s, "
                f"{self.left_s() or 0:.0f} s were left")

    def undecided(self, stopped: str) -> str:
        """Non-empty when the budget ended the search before it decided anything: what to say
        first."""
        if self.chosen:
            return ""
        if not self.out_of_budget:
            return underpowered(self.steps, 1 + self.rules.min_gain)
        where = "after screening" if self.steps else "before the first screen"
        needs = f"about {self.needs_s:.0f} s" if math.isfinite(self.needs_s) else \
            "more than that (not even one trial of the naive recipe fitted)"
        give = f": give recipe.budget_s={math.ceil(self.needs_s / 10) * 10}" \
            if math.isfinite(self.needs_s) else ""
        return (f"not decided: the budget ran out {where}; a full search needs {needs} (its "
                f"budget was {self.budget.seconds:.0f} s{give})")

    def _reconfirm(self, record: StepRecord, recipes: dict[str, Overrides], why: str
                   ) -> tuple[Optional[Comparison], StepRecord, str]:
        """A confirmation that left options open (open_options) is measured once more, afresh,
        where the budget fits it, as the next step (its own record and its share of the error:
        the steps' shares sum within alpha however many come). Returns (the option to add or
        None, the record that decided, why none)."""
        open_ = open_options(record.confirmations.values(), 1 + self.rules.min_gain)
        if not open_ or not self.fits(self.confirm_cost(len(open_)) + self.reserve()):
            return None, record, why
        again = StepRecord(len(self.steps) + 1, record.base, {}, None, {}, 0.0, math.nan)
        self.steps.append(again)
        self.progress(f"step {again.index}: step {record.index}'s confirmation left "
                      + ", ".join(c.label for c in open_) + " open: measured again")
        best, why = self._decide(again, open_, recipes)
        return best, again, why

    def _screen(self, n: int, current: Overrides, options: list[Option],
                arms: dict[str, Arm]) -> tuple[StepRecord, list[Comparison]]:
        """The screen's record, and the options worth confirming, best first."""
        ref = arms["current"]
        found = {o.label: arms[o.label].status if o.label in arms else "error: not measured"
                 for o in options if o.label not in arms or arms[o.label].status != OK}
        ok = [o for o in options if o.label not in found]
        level = intervals.comparison_level(len(ok), self.spend.screen(n))
        self.levels[f"step {n}"] = level
        results = compare_at({o.label: rounds_of(arms[o.label], ref) for o in ok}, level,
                             self.rules.min_gain)
        comparisons = {lab: Comparison(lab, s, lo, hi, v, paired_rounds(arms[lab], ref))
                       for lab, (s, lo, hi, v) in results.items()}
        # hopeless: surely less than half as fast; not worth another step's time
        for c in comparisons.values():
            if c.hi < self.rules.hopeless_below:
                found[c.label] = format_status(
                    HOPELESS, f"{ratio_text(c.speedup, c.lo, c.hi)} in step {n}, not retried")
        self._drop(found)
        record = StepRecord(n, current, comparisons, None, found, 0.0, level)
        self.steps.append(record)
        # The screen ranks; only a fresh measurement decides. Any option the screen saw above 1
        # may be confirmed: 3 rounds cannot tell a 1.04x from a 1.08x.
        ranked = sorted((c for c in comparisons.values() if c.label not in found
                         and c.speedup > 1 and self.rules.fits_memory(arms[c.label])),
                        key=lambda c: -c.speedup)
        return record, ranked

    def _drop(self, statuses: dict[str, str]) -> None:
        """Options that were n/a, failed or hopeless leave the pool for good."""
        self.excluded.update(statuses)
        for name in self.pool:
            self.pool[name] = [o for o in self.pool[name] if o.label not in statuses]

    def _decide(self, record: StepRecord, ranked: list[Comparison], recipes: dict[str, Overrides],
                ) -> tuple[Optional[Comparison], str]:
        """Confirm the screen's best in a fresh measurement; the option to add, or why none."""
        top = ranked[:self.rules.confirm_top]
        if not top:
            return None, "no remaining option was faster in the screen"
        confirm = self.confirm_cost(len(top))
        if not self.fits(confirm + self.reserve()):
            return None, self._over_budget(f"confirming step {record.index}'s best", confirm)
        self.progress(f"step {record.index}: confirming " + ", ".join(
            f"{c.label} (screened {ratio_text(c.speedup)})" for c in top))
        left = self.left_s()  # its extra rounds may not eat the closing's reserve
        arms = self.measured({"current": recipes["current"],
                              **{c.label: recipes[c.label] for c in top}},
                             step=f"step {record.index} confirm",
                             time_left_s=None if left is None else left - self.reserve())
        return self._confirm(arms, top, record)

    def _confirm(self, arms: dict[str, Arm], top: list[Comparison],
                 record: StepRecord) -> tuple[Optional[Comparison], str]:
        """The confirmation measurement's verdicts (fresh rounds, CIs Bonferroni-adjusted over
        the options confirmed together, within the step's share) and the option to add: the
        fastest one whose CI clears 1 + min_gain."""
        ref = arms.get("current") or Arm("error: not measured")
        if ref.status != OK:
            for c in top:
                record.confirmations[c.label] = _failed(c.label, ref.status)
            return None, f"the current recipe could not be measured ({ref.status})"
        level = intervals.comparison_level(len(top), self.spend.confirm(record.index))
        self.levels[f"step {record.index} confirm"] = level
        winners = []
        for c in top:
            arm = arms.get(c.label) or Arm("error: not measured")
            if arm.status != OK:  # failed on its own: never retried
                record.confirmations[c.label] = _failed(c.label, arm.status)
                record.excluded[c.label] = arm.status
                self._drop({c.label: arm.status})
                continue
            (s, lo, hi, verdict), = compare_at({c.label: rounds_of(arm, ref)}, level,
                                               self.rules.min_gain).values()
            confirmed = Comparison(c.label, s, lo, hi, verdict, paired_rounds(arm, ref))
            record.confirmations[c.label] = confirmed
            if arm.quality == quality.WORSE:  # faster or not, it trains worse: never retried
                why = format_status(REFUSED, f"held-out loss significantly worse than the "
                                             f"current recipe's ({arm.quality_note})")
                record.excluded[c.label] = why
                self._drop({c.label: why})
            elif significant_gain(lo, self.rules.min_gain) and self.rules.fits_memory(arm):
                winners.append(confirmed)
        best = max(winners, key=lambda c: c.speedup, default=None)
        return best, (f"no remaining option was significantly faster (CI above "
                      f"{ratio_text(1 + self.rules.min_gain)}) without a worse held-out loss")


def underpowered(steps: list[StepRecord], bar: float) -> str:
    """Non-empty when the search's last confirmation left an option open (open_options): it
    stopped underpowered, not on a verdict."""
    open_ = open_options(steps[-1].confirmations.values(), bar) if steps else []
    if not open_:
        return ""
    said = ", ".join(f"{c.label} {ratio_text(c.speedup, c.lo, c.hi)}" for c in open_)
    return (f"not decided: {said} measured faster in its confirmation but not settled in "
            f"{max(c.rounds for c in open_)} rounds; a longer search (recipe.step_budget_s, "
            "recipe.budget_s) confirms or rules it out")


def open_options(confirmed, bar: float) -> list[Comparison]:
    """The confirmed options measured above `bar` (1 + min_gain) whose interval neither
    settles them (its low end above the bar) nor rules them out (its high end below it)."""
    return [c for c in confirmed if math.isfinite(c.lo) and c.speedup > bar and c.hi > bar
            and not c.lo > bar]


def _failed(label: str, status: str) -> Comparison:
    return Comparison(label, math.nan, math.nan, math.nan, status, 0)


def _waterfall(chosen: list[Option], step_gain: dict[str, Comparison]) -> list[dict]:
    """The waterfall's rows, each with its gain when added (conditional on selection); the
    closing measurement fills the cumulative speed-ups over naive."""
    waterfall = [{"label": NAIVE, "option": "", "speedup": 1.0, "lo": math.nan, "hi": math.nan,
                  "step_gain": math.nan, "step_lo": math.nan, "step_hi": math.nan}]
    for o in chosen:
        g = step_gain[o.label]
        waterfall.append({"label": f"+ {o.label}", "option": o.label, "speedup": math.nan,
                          "lo": math.nan, "hi": math.nan, "step_gain": g.speedup,
                          "step_lo": g.lo, "step_hi": g.hi})
    return waterfall


def _closing_recipes(forward: _Forward) -> tuple[list[str], dict[str, str], dict[str, Overrides]]:
    """Labels people read in trials.csv ("naive", "bf16", "bf16 + workers=2", "without bf16")
    and their recipes: naive, each prefix of the stack and each leave-one-out."""
    chosen = forward.chosen
    prefix = [NAIVE] + [" + ".join(o.label for o in chosen[:i]) for i in range(1, len(chosen) + 1)]
    without = {o.label: f"without {o.label}" for o in chosen}
    recipes = {prefix[i]: _apply(forward.naive, *chosen[:i]) for i in range(len(chosen) + 1)}
    for o in chosen:
        recipes[without[o.label]] = _apply(forward.naive, *[c for c in chosen if c is not o])
    return prefix, without, recipes


def _close(forward: _Forward) -> tuple[list[dict], list[dict]]:
    """Waterfall and ablation from one closing measurement, every figure measured: the whole
    closing when it fits, else the final recipe against naive alone (no ablation), else no
    cumulative figure at all, said in the notes. Nothing chosen: no waterfall."""
    chosen, costs, notes, rules = forward.chosen, forward.costs, forward.notes, forward.rules
    if not chosen:
        return [], []
    step_gain = {s.chosen: s.confirmations[s.chosen] for s in forward.steps if s.chosen}
    waterfall = _waterfall(chosen, step_gain)
    prefix, without, recipes = _closing_recipes(forward)
    unique = _unique(recipes)  # a prefix equals a leave-one-out (the last option's): once
    wanted = list(dict.fromkeys(unique.values()))
    if not forward.fits(costs.cost(len(wanted), rules.min_rounds)):
        wanted = [NAIVE, prefix[-1]]
        notes.append("only the final recipe against naive fitted in the time budget: no "
                     "cumulative figure for the stages between, and no ablation")
        if not forward.fits(costs.cost(len(wanted), rules.min_rounds)):
            notes.append("the closing measurement did not fit in the time budget: the final "
                         "recipe was not measured against naive")
            return waterfall, []
    forward.progress(f"closing: {', '.join(wanted)}")
    measured = forward.measured({lab: recipes[lab] for lab in wanted}, step="closing",
                                time_left_s=forward.left_s())
    arms = {lab: measured.get(unique[lab], Arm("error: not measured")) for lab in recipes}
    if not (arms[NAIVE].status == OK and arms[prefix[-1]].status == OK):
        notes.append("the closing measurement failed for the naive or the final recipe: "
                     "no cumulative speed-ups, no ablation")
        return waterfall, []
    ablate = len(wanted) > 2 or len(chosen) == 1
    # the family of this measurement: every recipe against naive (summary.csv's rows) and
    # each leave-one-out (with one option chosen, that is the final recipe against naive),
    # within the closing's share
    against_naive = sum(a.status == OK for lab, a in measured.items() if lab != NAIVE)
    extra = len(chosen) if ablate and len(chosen) > 1 else 0
    level = intervals.comparison_level(against_naive + extra, forward.spend.closing())
    forward.levels["closing"] = level
    cum = compare_at({prefix[i]: rounds_of(arms[prefix[i]], arms[NAIVE])
                      for i in range(1, len(chosen) + 1)
                      if prefix[i] in measured and arms[prefix[i]].status == OK},
                     level, rules.min_gain)
    for i, row in enumerate(waterfall[1:], start=1):
        if prefix[i] in cum:
            row["speedup"], row["lo"], row["hi"], row["verdict"] = cum[prefix[i]]
    if not ablate:
        return waterfall, []
    return waterfall, _ablation(chosen, arms[prefix[-1]], {o.label: arms[without[o.label]]
                                                           for o in chosen},
                                step_gain, level, rules.min_gain)


def _ablation(chosen: list[Option], final: Arm, without: dict[str, Arm],
              step_gain: dict[str, Comparison], level: float, min_gain: float) -> list[dict]:
    """Each chosen option's marginal contribution: final / final-without-it, paired."""
    marg = compare_at({o.label: rounds_of(final, without[o.label]) for o in chosen
                       if without[o.label].status == OK}, level, min_gain)
    ablation = []
    for o in chosen:
        s, lo, hi, v = marg.get(o.label, (math.nan, math.nan, math.nan,
                                         without[o.label].status))
        ablation.append({"option": o.label, "group": o.group, "marginal": s, "lo": lo, "hi": hi,
                         "verdict": v, "step_gain": step_gain[o.label].speedup,
                         "overrides": dict(o.overrides)})
    return ablation


def _unique(recipes: dict[str, Overrides]) -> dict[str, str]:
    """label -> the first label with identical overrides (measured once, in its place)."""
    first: dict[tuple, str] = {}
    out = {}
    for label, overrides in recipes.items():
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        out[label] = first.setdefault(key, label)
    return out
