"""The rounds phase of a model's study: every variant once per round, in a balanced random
order (orders.py), until the floor and the looks are done or the budget is spent.

`bench.repeats` rounds are the floor; with `bench.target_ci` the rounds are group-sequential
(adaptive.wants_more_rounds): intervals.LOOKS looks (up to intervals.MAX_LOOKS where a long
budget fits more: intervals.planned_looks), the first after `bench.repeats` rounds, the later
ones spread over the model's budget at the first round's pace (bench.repeats to
intervals.MAX_SPACING times that apart: intervals.look_spacing), that stop once every
comparison is decided at the look's level, or when the next look's rounds would not fit in the
model's time budget. Each row records the schedule (`min_rounds`, `look_every`, `looks`),
from which the analysis finds the level of the look a comparison stopped at; and `order_seed`,
`round` and `position` (`trial` equals `round` for older readers), which replay the orders.
One trial is the instruments' (study.run_trial: trial.measure_trial's, or launch.py's through
torchrun).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from speedbench import distributed, errors
from speedbench.analysis import adaptive, intervals
from speedbench.measure import env
from speedbench.measure.budget import Budget
from speedbench.studies.orders import round_order
from speedbench.results import schema

MAX_STOPS = 2  # a variant's trials a limit may stop before it is left out of the rounds


@dataclass
class RoundsResult:
    """The rounds' records, and the statuses they set (a variant stopped, failed or out of
    time)."""

    rows: list[dict] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    looks: int = 1
    spacing: int = 1


def run_rounds(mc, state, budget: Budget, reserve_s: float = 0.0,
               baseline_first: bool = False) -> RoundsResult:
    """The model's rounds on `budget`, `reserve_s` of it kept back for the paired profile;
    `baseline_first`: the first round starts with the baseline (where one round at most fits)."""
    run = Rounds(mc, state, budget, reserve_s, baseline_first)
    for round_ in run.rounds():
        run.run_round(round_)
    return run.result


class Rounds:
    """One model's rounds: which run, in which order, and what each trial's status means."""

    def __init__(self, mc, state, budget: Budget, reserve_s: float, baseline_first: bool = False):
        self.mc, self.plan, self.budget, self.reserve_s = mc, mc.plan, budget, reserve_s
        self.baseline_first = baseline_first
        self.dataset = state.prepared.dataset
        self.probes = state.probes.records if state.probes else {}
        self.known = dict(state.status)  # the earlier phases' statuses
        self.budget_need_s = state.budget_need_s  # the run's one figure, on every row
        self.repeats = mc.settings.repeats
        # Looks at the rounds: one without bench.target_ci or under torchrun (every rank would
        # have to decide alike); else planned after the first round (None until then).
        sequential = mc.settings.target_ci is not None and mc.dist_env is None
        self.result = RoundsResult(looks=None if sequential else 1, spacing=self.repeats)
        self.stops: dict[str, int] = {}  # variant -> its trials a limit stopped
        self.written: set[str] = set()  # the variants with a row in trials.csv

    def status(self, name: str) -> str | None:
        return self.known.get(name) or self.result.status.get(name)

    def rounds(self):
        """At least one round, then up to `repeats` while the next one fits in what is left of
        the budget at the pace so far; then, with bench.target_ci, group-sequential looks
        (adaptive.wants_more_rounds), as many as the budget allows at the first round's pace
        (intervals.planned_looks). Not under torchrun: every rank would have to take the same
        decision, so there the `repeats` rounds all run."""
        out, clock = self.result, self.budget.clock
        started, round_ = clock(), 0
        budget = max(0.0, self.budget.left() - self.reserve_s)  # the rest explains
        while self._another_round(round_, clock() - started, budget):
            if round_ >= self.repeats:
                self.mc.bar.total += len(self.plan.variants)
            yield round_
            round_ += 1
            if out.looks is None:  # after the first round: its pace plans the looks
                round_s = clock() - started
                out.looks = intervals.planned_looks(budget, self.repeats, round_s)
                out.spacing = intervals.look_spacing(budget, self.repeats, round_s, out.looks)
        if out.looks and out.looks > 1 and not self.nothing_left():
            look = intervals.reported_look(round_, self.repeats, out.looks, out.spacing)
            level = intervals.sequential_level(self.mc.comparisons, look, out.looks)
            self.mc.say(f"{self.mc.spec.name}: {round_} rounds, look {look} of {out.looks} "
                        f"(CIs at {level:.2%}): " + adaptive.halfwidth_note(out.rows, level))

    def _another_round(self, round_: int, elapsed: float, budget: float) -> bool:
        """Whether round `round_` runs; `elapsed`: the rounds' time so far, `budget`: the
        seconds of the model's budget the rounds may take."""
        if round_ == 0:
            return True  # a speed-up needs one round at least
        if self.nothing_left():
            return False
        if round_ < self.repeats:
            if self.mc.dist_env is not None or elapsed * (round_ + 1) / round_ <= budget:
                return True
            self.mc.say(f"{self.mc.spec.name}: {round_} of {self.repeats} rounds: another would "
                        f"overrun its {self.budget.seconds:.0f} s of bench.time_budget_s="
                        f"{self.mc.settings.time_budget_s:g} s (wider CIs)")
            return False
        out = self.result
        return out.looks > 1 and adaptive.wants_more_rounds(
            out.rows, self.mc.settings, round_, elapsed, self.mc.comparisons, self.repeats,
            out.looks, budget_s=budget, every=out.spacing)

    def nothing_left(self) -> bool:
        """Whether every variant but the baseline is n/a or stopped: nothing to compare."""
        others = [v for v in self.plan.variants if v != self.plan.baseline]
        return bool(others) and all(self.status(v) for v in others)

    def order(self, round_: int) -> list[tuple[int, str]]:
        """(position, variant) of a round, in the balanced random order; a variant whose
        repeats are spent sits out the rounds up to the plan's most repeats."""
        stream = [m.name for m in self.plan.models].index(self.mc.spec.name)
        names = round_order(list(self.plan.variants), self.mc.order_seed, round_, stream)
        if round_ == 0 and self.baseline_first:
            names.remove(self.plan.baseline)
            names.insert(0, self.plan.baseline)
        return [(position, name) for position, name in enumerate(names)
                if not self.repeats > round_ >= self.mc.settings.repeats_of(
                    self.plan.variants[name])]

    def run_round(self, round_: int) -> None:
        # past the minimum, rounds go on while a CI is wide: no fixed total to show
        of = f"/{self.repeats}" if round_ < self.repeats else " (a comparison is undecided)"
        for position, name in self.order(round_):
            errors.stop_if_asked()  # a Ctrl-C whose first raise was lost in a finalizer
            self.mc.doing(f"{self.mc.spec.name} {name} round {round_ + 1}{of}")
            if not self.status(name) and self.budget.over() and not self._measured(name):
                # no trial starts past the deadline: one row says why it has none
                self.result.status[name] = schema.format_status(
                    schema.NOT_MEASURED, "the run's bench.time_budget_s ran out before its "
                    f"first trial (this model's rounds had {self.budget.seconds:.3g} s of it); "
                    "give a larger bench.time_budget_s")
            if self.status(name):
                if not self._measured(name) and name not in self.written:
                    # a variant with no trial (n/a, stopped, out of time) gets one row
                    self._write({**self.mc.header(name, round_, position),
                                 **self.probes.get(name, {}), "status": self.status(name)})
            elif self.budget.over():
                pass  # the deadline passed in this round: its other trials do not start
            elif not (round_ > 0 and name == self.plan.baseline and self.nothing_left()):
                # (after the first round the baseline's repeats are spared when nothing is
                # left to compare with it)
                cpu = env.CpuWindow()  # what other processes took of the CPU meanwhile
                record = self._trial(name, round_, position)
                # (instruments that know their own share, the simulation's, keep it)
                record.setdefault("others_cpu_share", cpu.others())
                self._after(name, record["status"])
                self._write(record)
                self.result.rows.append(record)
            self.mc.bar.update()

    def _trial(self, name: str, round_: int, position: int) -> dict:
        """One trial's record from the instruments; under torchrun a failed rank fails the
        job, after its row is written."""
        mc = self.mc
        try:
            return mc.instruments.trial(mc, name, round_, position, self.dataset,
                                        self.probes.get(name), self.budget)
        except Exception as exc:
            if mc.dist_env is None:
                raise
            status = distributed.report_failure(
                exc, mc.dist_env, f"model {mc.spec.name}, variant {name}, trial {round_}")
            self._write({**mc.header(name, round_, position), "status": status})
            raise

    def _measured(self, name: str) -> bool:
        """Whether a trial of the variant has been run."""
        return any(r["variant"] == name for r in self.result.rows)

    def _after(self, name: str, status: str) -> None:
        """A variant n/a in a trial is not measured again; one a limit stopped (`not measured`:
        a step past bench.max_trial_s, a machine's hiccup as often as the variant's own
        slowness) is tried in the next round, and left out after MAX_STOPS such trials."""
        kind = schema.parse_status(status).kind
        if name == self.plan.baseline and schema.parse_status(status).failed \
                and not self._measured(name):
            self._baseline_failed(status)
        if kind == schema.NOT_MEASURED:
            self.stops[name] = self.stops.get(name, 0) + 1
        if kind in (schema.NA, schema.TOO_SLOW) or self.stops.get(name, 0) >= MAX_STOPS:
            self.result.status.setdefault(name, status)

    def _baseline_failed(self, status: str) -> None:
        """The baseline's first trial failed: the model's other trials would compare with
        nothing (and fail alike, as often as not), so none is run; said once."""
        self.result.status.setdefault(self.plan.baseline, status)
        for other in self.plan.variants:
            if not self.status(other):
                self.result.status[other] = schema.format_status(
                    schema.NOT_MEASURED, "the baseline's first trial failed, so the model's "
                                         "trials stopped")
        self.mc.say(f"{self.mc.spec.name}: the baseline's first trial failed ({status}); the "
                    "model's other trials were not run")

    def _write(self, record: dict) -> None:
        # bench.order_seed=<order_seed> replays the orders; the looks give the CI's level
        record.update(order_seed=self.mc.order_seed, min_rounds=self.repeats,
                      look_every=self.result.spacing, looks=self.result.looks)
        if math.isfinite(self.budget_need_s):
            record["budget_need_s"] = max(record.get("budget_need_s") or 0.0, self.budget_need_s)
        self.written.add(record["variant"])
        if self.mc.writer:
            self.mc.writer.append(record)
