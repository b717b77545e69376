"""The rounds of a plan: every variant of a model once per round, in a balanced random order.

The orders come from a Williams design (a Latin square balanced for first-order carry-over; for
an odd number of variants the square and its mirror image): over one block of k rounds (2k for
odd k) every variant holds every position once (twice), and follows every other variant equally
often. Each block shuffles the design's rows and assigns the variants to its letters at random,
from `order_seed`: fresh entropy per run unless `bench.order_seed` gives one (`bench.seed` fixes
the models and the data only). trials.csv records `order_seed`, `round` and `position` (the
trial's place in its round, 0 first), so `bench.order_seed=<that value>` replays a run's orders;
under torchrun rank 0's seed is used on every rank. `trial` equals `round` for older readers.
`bench.repeats` rounds are the floor; with `bench.target_ci` the rounds are group-sequential
(adaptive.wants_more_rounds): intervals.LOOKS looks (up to intervals.MAX_LOOKS where a long
budget fits more: intervals.planned_looks), the first after `bench.repeats` rounds, the later
ones spread over the model's budget at the first round's pace (bench.repeats to
intervals.MAX_SPACING times that apart: intervals.look_spacing), that stop once every
comparison is decided at the look's level, or when the next look's rounds would not fit in the
model's time budget. Each row records the schedule (`min_rounds`, `look_every`, `looks`),
from which the analysis finds the level of the look a comparison stopped at.

Before any round, every model gets its data set, the variants that cannot act here (n/a:
one row each, in round 0) and a quality probe per variant (quality.py); then the models' rounds
run, the cheapest round first (run_models). One trial is
trial.measure_trial's; a trial that needs several processes is launched through torchrun by
launch.py. After the rounds, the largest batch that fits is searched (capacity.py) when asked.
"""
from __future__ import annotations

import math
import secrets
import statistics
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from speedbench import distributed, errors, techniques
from speedbench.analysis import adaptive, intervals, power
from speedbench.config import ModelSpec, Plan
from speedbench.measure import capacity, env, explain, isolation, launch, quality, stopping
from speedbench.measure.budget import Budget
from speedbench.measure.data import build_dataset
from speedbench.measure.flops import FlopsBook
from speedbench.measure.session import batching
from speedbench.measure.train import build_model
from speedbench.measure.trial import context, dataset_length, header, measure_trial
from speedbench.results import TrialWriter, atomic, schema


def williams_rows(k: int) -> list[list[int]]:
    """A Williams design for k letters: k sequences (k even) or 2k (k odd: the square and its
    mirror image) in which every letter holds every position, and follows every other letter,
    equally often. Row i is the first row 0, 1, k-1, 2, k-2, ... plus i (mod k)."""
    first, low, high = [0], 1, k - 1
    while len(first) < k:
        first.append(low)
        low += 1
        if len(first) < k:
            first.append(high)
            high -= 1
    rows = [[(x + i) % k for x in first] for i in range(k)]
    return rows + [row[::-1] for row in rows] if k % 2 else rows


def round_order(names: list[str], order_seed: int, round_: int, stream: int = 0) -> list[str]:
    """The variants in the order round `round_` runs them: a row of the Williams design of the
    round's block, the block's rows in a random order and the variants given to the letters at
    random, both drawn from (order_seed, stream, block). `stream` tells the models apart."""
    rows = williams_rows(len(names))
    block, row = divmod(round_, len(rows))
    rng = np.random.default_rng([order_seed, stream, block])
    letters, shuffled = rng.permutation(len(names)), rng.permutation(len(rows))
    return [names[letters[x]] for x in rows[shuffled[row]]]


def fresh_order_seed(dist_env: distributed.DistEnv | None = None) -> int:
    """Fresh entropy for a run's orders (63 bits), the same on every torchrun rank. A rank
    that dies before this first collective fails the job in one line, like a failed trial
    (there is no trial yet to write a row for)."""
    try:
        return distributed.same_on_every_rank(secrets.randbits(63), dist_env)
    except Exception as exc:
        if dist_env is None:
            raise
        distributed.report_failure(exc, dist_env, "agreeing on the round order")
        raise


def plan_order_seed(plan: Plan, dist_env: distributed.DistEnv | None = None) -> int:
    """The plan's order seed: bench.order_seed (the baseline's) to replay, else fresh."""
    seed = plan.variants[plan.baseline].bench.order_seed
    return fresh_order_seed(dist_env) if seed is None else seed


def na_variants(plan: Plan, spec: ModelSpec, dist_env: distributed.DistEnv | None) -> dict:
    """variant -> why it cannot be measured here (n/a), for the variants that cannot. Asked
    once before the first round, so that the rounds can be shuffled and a variant without a
    baseline is known from the start. (Each trial asks again, of its own fresh model.)"""
    ctx = context(plan, dist_env)
    try:
        with isolation.isolated(spec.name) as watch:  # what its code changes is put back
            ctx.model = build_model(spec, plan.variants[plan.baseline].bench.seed)
            watch.built()
    except Exception:  # each trial builds it again and records why it cannot be built
        return {}
    skip = {}
    for name, recipe in plan.variants.items():
        with techniques.global_state(recipe, ctx):
            reason = techniques.not_applicable(recipe, ctx)
        if reason:
            skip[name] = reason
    return skip


MAX_STOPS = 2  # a variant's trials a limit may stop before it is left out of the rounds
PROBE_SHARE = 0.4  # of a model's budget, what its quality probes may take (the rounds: the rest)
# The per-round sd of a paired log speed-up the plan assumes: measured on the reference models'
# bf16/fp32 trials on a quiet 2-core CPU, 5-step windows, 0.13 (VAE) to 0.29 (transformer)
# (benchmarks/step_noise.py): the trials' levels move ~10 % between trials, bare loops too
ROUND_SD = 0.15


class ModelRounds:
    """The rounds of one model of a plan, and what comes before and after them."""

    def __init__(self, plan: Plan, spec: ModelSpec, dist_env, run_dir: Path | None,
                 writer: TrialWriter | None, book: FlopsBook, bar, order_seed: int = 0,
                 comparisons: int | None = None, budget: Budget | None = None):
        self.plan, self.spec, self.dist_env, self.run_dir = plan, spec, dist_env, run_dir
        # the model's part of the run's bench.time_budget_s: data, probes, rounds
        self.budget = budget or Budget(plan.variants[plan.baseline].bench.time_budget_s)
        self.order_seed, self.comparisons = order_seed, comparisons or planned_comparisons(plan)
        self.writer, self.book, self.bar = writer, book, bar
        self.first = plan.variants[plan.baseline]
        self.repeats = max(r.bench.repeats for r in plan.variants.values())
        self.ctx = context(plan, dist_env)
        self.dataset = None
        self.skip: dict[str, str] = {}  # variant -> its n/a or too-slow status
        self.stops: dict[str, int] = {}  # variant -> its trials a limit stopped (not measured)
        self.written: set[str] = set()  # the variants with a row in trials.csv
        self.probes: dict[str, dict] = {}  # variant -> its quality probe
        self.probe_steps: dict[str, list[float]] = {}  # variant -> its probe's steady steps (s)
        self.seed_losses: dict[str, list[float]] = {}  # variant -> the probe's held-out losses
        self.no_loss: dict[str, str] = {}  # variant -> why its probe has no loss (a time limit)
        self.rows: list[dict] = []  # the measured records, for the adaptive rule
        # Looks at the rounds: one without bench.target_ci or under torchrun (every rank would
        # have to decide alike); else planned after the first round (None until then).
        sequential = self.first.bench.target_ci is not None and dist_env is None
        self.looks: int | None = None if sequential else 1
        self.spacing = self.repeats  # rounds between two later looks (intervals.look_spacing)
        # bench.explain (explain.py): the forecasts before the rounds, the paired profile
        # after them, and the seconds kept back from the rounds for it
        self.explainer: explain.Explainer | None = None
        self.forecasts: dict[str, tuple] = {}  # variant -> (technique, Bound or why none)
        self.explain_reserve = 0.0
        self.prepared_s = 0.0  # what the data and the probes took

    def prepare(self) -> None:
        """The data set, the n/a variants (all of them without a baseline) and the probes."""
        plan, spec = self.plan, self.spec
        self.bar.set_postfix_str(f"{spec.name}: making data")
        world = self.dist_env.world_size if self.dist_env else 1
        self.dataset = build_dataset(spec.dataset, dataset_length(plan, spec, world),
                                     self.first.data.path, seed=self.first.bench.seed)
        self.skip = na_variants(plan, spec, self.dist_env)
        if plan.baseline in self.skip:
            # No baseline here (pinning, empty_cache without CUDA): nothing to compare the other
            # variants with, so they are not measured either.
            why = schema.reason_of(self.skip[plan.baseline])
            for name in plan.variants:
                self.skip.setdefault(name, schema.na(f"no baseline to compare with "
                                                     f"({plan.baseline}: {why})"))
        if self.dist_env is None:
            self._probe_all()
            self._forecast()
        self.prepared_s = self.budget.spent()

    def plan_rounds(self, budget: Budget) -> None:
        """The rounds' part of the run (`budget`, from now), the paired profile's seconds kept
        back from it, and the plan's line beside the progress bar."""
        self.budget = budget
        if self.explainer is not None:
            self.explain_reserve = self._explain_reserve()
        if self.dist_env is None:
            self.bar.write(self.estimate(), sys.stderr)

    def _forecast(self) -> None:
        """bench.explain: the baseline's profiled steps, untimed, and each variant's forecast
        from them (explain.py); the seconds its paired profile will need after the rounds are
        kept back from them by plan_rounds, against the rounds' budget."""
        base = self.plan.baseline
        if not self.first.bench.explain or base in self.skip or self._launched(self.first):
            return
        self.bar.set_postfix_str(f"{self.spec.name}: forecasts")
        self.explainer = explain.Explainer(self.plan, self.spec, self.ctx, self.dataset,
                                           self.run_dir, dict(self.book.peaks))
        steps = self._step_seconds()
        na = {n: s for n, s in self.skip.items() if schema.parse_status(s).kind == schema.NA}
        # a variant the probes stopped still gets its forecast: it says what it could have been
        self.forecasts = self.explainer.forecast(self.budget, steps.get(base, math.nan), na)
        said = [f"{n} at most {b.speedup:.3g}x" for n, (_, b) in self.forecasts.items()
                if isinstance(b, techniques.Bound)]
        if said:  # before any round: what each could gain at best
            self.bar.write(f"{self.spec.name}: forecasts: {', '.join(said)}", sys.stderr)
        if self.first.bench.skip_by_forecast:
            self._skip_by_forecast(steps)

    def _explain_reserve(self) -> float:
        """The seconds the paired profile will need after the rounds, kept back from them."""
        others = [n for n in self.plan.variants if n != self.plan.baseline and n not in self.skip
                  and not self._launched(self.plan.variants[n])]
        return explain.reserve_s(self.plan, others, self._step_seconds(), self.budget.left())

    def _skip_by_forecast(self, steps: dict[str, float]) -> None:
        """bench.skip_by_forecast: a variant that cannot gain the noise threshold here (its
        forecast, an upper bound) is not measured; the rounds it would have had are spared."""
        threshold, spared = self.first.bench.noise_threshold, []
        for name, (_, bound) in self.forecasts.items():
            why = bound.under(threshold) if isinstance(bound, techniques.Bound) else ""
            if name in self.skip or not why:
                continue
            self.skip[name] = schema.format_status(
                schema.NOT_MEASURED, f"by its forecast: {why} (bench.skip_by_forecast=false "
                "measures it)")
            step_s = steps.get(name, steps.get(self.plan.baseline, math.nan))
            trial_s = stopping.trial_seconds(step_s, self.plan.variants[name].bench)
            spared.append(f"{name} (about {self.repeats * trial_s:.0f} s of rounds)")
        if spared:
            self.bar.write(f"{self.spec.name}: not measured, by their forecasts: "
                           + ", ".join(spared), sys.stderr)

    def _step_seconds(self) -> dict[str, float]:
        """variant -> seconds of a plain step: the rounds' median where measured, else the
        probe's steady steps' median."""
        out = {n: statistics.median(s) for n, s in self.probe_steps.items() if s}
        for name in self.plan.variants:
            ms = [r["step_ms"] for r in self.rows
                  if r["variant"] == name and r.get("status") == schema.OK and r.get("step_ms")]
            if ms:
                out[name] = statistics.median(ms) / 1000
        return out

    def explain(self) -> None:
        """bench.explain: after the rounds, the paired profile of the baseline and of every
        variant measured in this process (explain.py), on what the rounds left of the budget."""
        base = self.plan.baseline
        ok = {r["variant"] for r in self.rows if r.get("status") == schema.OK}
        if self.explainer is None or base not in ok:
            return
        measured = [n for n in self.plan.variants if n != base and n in ok
                    and not self._launched(self.plan.variants[n])]
        self.bar.set_postfix_str(f"{self.spec.name}: explaining")
        self.explainer.paired(self.budget, measured, self._step_seconds())

    def rounds(self) -> Iterator[int]:
        """At least one round, then up to `repeats` while the next one fits in what is left of
        bench.time_budget_s (the data and the probes spent some of it) at the pace so far;
        then, with bench.target_ci (the baseline's), group-sequential looks
        (adaptive.wants_more_rounds), as many as the budget allows at the first round's pace
        (intervals.planned_looks). Not under torchrun: every rank would have to take the same
        decision, so there the `repeats` rounds all run."""
        started, round_ = self.budget.clock(), 0
        budget = max(0.0, self.budget.left() - self.explain_reserve)  # the rest explains
        while self._another_round(round_, self.budget.clock() - started, budget):
            if round_ >= self.repeats:
                self.bar.total += len(self.plan.variants)
            yield round_
            round_ += 1
            if self.looks is None:  # after the first round: its pace plans the looks
                round_s = self.budget.clock() - started
                self.looks = intervals.planned_looks(budget, self.repeats, round_s)
                self.spacing = intervals.look_spacing(budget, self.repeats, round_s,
                                                      self.looks)
        if self.looks and self.looks > 1 and not self._nothing_left():
            look = intervals.look_of(round_, self.repeats, self.looks, self.spacing)
            level = intervals.sequential_level(self.comparisons, look, self.looks)
            self.bar.write(f"{self.spec.name}: {round_} rounds, look {look} of {self.looks} "
                           f"(CIs at {level:.2%}): " + adaptive.halfwidth_note(self.rows, level))

    def _another_round(self, round_: int, elapsed: float, budget: float) -> bool:
        """Whether round `round_` runs; `elapsed`: the rounds' time so far, `budget`: the
        seconds of the model's budget the rounds may take."""
        if round_ == 0:
            return True  # a speed-up needs one round at least
        if self._nothing_left():
            return False
        if round_ < self.repeats:
            if self.dist_env is not None or elapsed * (round_ + 1) / round_ <= budget:
                return True
            self.bar.write(f"{self.spec.name}: {round_} of {self.repeats} rounds: another "
                           f"would overrun its {self.budget.seconds:.0f} s of bench.time_budget_s"
                           f"={self.first.bench.time_budget_s:g} s (wider CIs)", sys.stderr)
            return False
        return self.looks > 1 and adaptive.wants_more_rounds(
            self.rows, self.first.bench, round_, elapsed, self.comparisons, self.repeats,
            self.looks, budget_s=budget, every=self.spacing)

    def _nothing_left(self) -> bool:
        """Whether every variant but the baseline is n/a or stopped: nothing to compare."""
        others = [v for v in self.plan.variants if v != self.plan.baseline]
        return bool(others) and all(v in self.skip for v in others)

    def round_seconds(self) -> tuple[float, int]:
        """(seconds of a round from the probes' steady steps, variants left to measure that no
        probe timed)."""
        round_s, unknown = 0.0, 0
        for name, recipe in self.plan.variants.items():
            rate = self.probes.get(name, {}).get("probe_samples_per_s", math.nan)
            if name in self.skip:
                continue
            if not rate > 0:
                unknown += 1  # launched in processes of its own, or its probe failed
                continue
            round_s += stopping.trial_seconds(self.per_step(name) / rate, recipe.bench)
        return round_s, unknown

    def estimate(self) -> str:
        """The plan, from the probes' steady steps (before any round): what a round takes, the
        rounds what is left of the model's budget buys, the smallest effect they call in most
        runs (power.py, with ROUND_SD) and the bench.time_budget_s a 1.1x verdict needs."""
        round_s, unknown = self.round_seconds()
        spent = self.prepared_s
        left = max(0.0, self.budget.left() - self.explain_reserve)  # the rest explains
        head = f"{self.spec.name}: data and probes took {spent:.0f} s"
        if not round_s > 0:
            return head + "; no probe timed a round: rounds run while the budget lasts"
        uncounted = f" (not counting {unknown} variant(s) without a probe)" if unknown else ""
        # adaptive rounds stop at their last look, the later looks spread over the budget
        if self.looks is None:
            looks = intervals.planned_looks(left, self.repeats, round_s)
            most = intervals.most_rounds(self.repeats, looks, intervals.look_spacing(
                left, self.repeats, round_s, looks))
        else:
            most = self.repeats
        by_time = int(left // round_s) if math.isfinite(left) else most
        fit = min(by_time, most)
        text = (f"{head}; about {fit} rounds of {round_s:.1f} s{uncounted} fit in the "
                + (f"{left:.0f} s left" if math.isfinite(left) else "plan (no time budget)"))
        if fit < 2:
            text += ": fewer than 2, so no interval"
        else:
            level = intervals.sequential_level(self.comparisons)
            small = power.smallest_call(fit, ROUND_SD, level, self.first.bench.noise_threshold)
            text += f": effects under about {small:.0%} will likely stay inconclusive"
        need = power.rounds_for(1.1, ROUND_SD, intervals.sequential_level(self.comparisons))
        if need and need > fit:  # what stops short of it: the rounds' cap, the budget, or both
            give = []
            # the most rounds any budget buys (the later looks at their widest spacing)
            per = intervals.most_rounds(1, intervals.MAX_LOOKS, intervals.MAX_SPACING) \
                if self.looks is None else 1  # rounds per bench.repeats
            if need > self.repeats * per:
                give.append(f"bench.repeats={math.ceil(need / per)}")
            if need > by_time:
                total = self.first.bench.time_budget_s * (spent + need * round_s) / (spent + left)
                give.append(f"bench.time_budget_s={float(f'{total:.2g}'):g}")
            text += f"; a verdict on 1.1x needs about {need} rounds: give {' and '.join(give)}"
        return text

    def order(self, round_: int) -> list[tuple[int, str]]:
        """(position, variant) of a round, in the balanced random order; a variant whose
        repeats are spent sits out the rounds up to the plan's most repeats."""
        stream = [m.name for m in self.plan.models].index(self.spec.name)
        names = round_order(list(self.plan.variants), self.order_seed, round_, stream)
        return [(position, name) for position, name in enumerate(names)
                if not self.repeats > round_ >= self.plan.variants[name].bench.repeats]

    def run_round(self, round_: int) -> None:
        # past the minimum, rounds go on while a CI is wide: no fixed total to show
        of = f"/{self.repeats}" if round_ < self.repeats else " (a comparison is undecided)"
        for position, name in self.order(round_):
            errors.stop_if_asked()  # a Ctrl-C whose first raise was lost in a finalizer
            self.bar.set_postfix_str(f"{self.spec.name} {name} round {round_ + 1}{of}")
            if name not in self.skip and self.budget.over() and not self._measured(name):
                # no trial starts past the deadline: one row says why it has none
                self.skip[name] = schema.format_status(
                    schema.NOT_MEASURED, "the run's bench.time_budget_s ran out before its "
                    "first trial; give more (the plan above says how much)")
            if name in self.skip:
                if not self._measured(name) and name not in self.written:
                    # a variant with no trial (n/a, stopped, out of time) gets one row
                    self._write({**self._header(name, round_, position),
                                 **self.probes.get(name, {}), "status": self.skip[name]})
            elif self.budget.over():
                pass  # the deadline passed in this round: its other trials do not start
            elif not self._nothing_to_compare(name, round_):
                cpu = env.CpuWindow()  # what other processes took of the CPU meanwhile
                record = self.measure(name, round_, position)
                record["others_cpu_share"] = cpu.others()
                self._after(name, record["status"])
                self._write(record)
                self.rows.append(record)
            self.bar.update()

    def _measured(self, name: str) -> bool:
        """Whether a trial of the variant has been run."""
        return any(r["variant"] == name for r in self.rows)

    def _after(self, name: str, status: str) -> None:
        """A variant n/a in a trial is not measured again; one a limit stopped (`not measured`:
        a step past bench.max_trial_s, a machine's hiccup as often as the variant's own
        slowness) is tried in the next round, and left out after MAX_STOPS such trials."""
        kind = schema.parse_status(status).kind
        if name == self.plan.baseline and schema.parse_status(status).failed and not any(
                r["variant"] == name for r in self.rows):
            self._baseline_failed(status)
        if kind == schema.NOT_MEASURED:
            self.stops[name] = self.stops.get(name, 0) + 1
        if kind in (schema.NA, schema.TOO_SLOW) or self.stops.get(name, 0) >= MAX_STOPS:
            self.skip[name] = status

    def _baseline_failed(self, status: str) -> None:
        """The baseline's first trial failed: the model's other trials would compare with
        nothing (and fail alike, as often as not), so none is run; said once."""
        self.skip[self.plan.baseline] = status
        for other in self.plan.variants:
            self.skip.setdefault(other, schema.format_status(
                schema.NOT_MEASURED, "the baseline's first trial failed, so the model's "
                                     "trials stopped"))
        self.bar.write(f"{self.spec.name}: the baseline's first trial failed ({status}); the "
                       "model's other trials were not run", sys.stderr)

    def measure(self, name: str, round_: int, position: int) -> dict:
        """One trial's record: in this process, or in processes of its own through torchrun."""
        plan, spec, recipe = self.plan, self.spec, self.plan.variants[name]
        try:
            nproc = techniques.processes(recipe, self.ctx)
            env = techniques.environment(recipe, self.ctx)
            if nproc or env:  # torchrun, or a fresh process started with `env`
                return launch.launch_trial(plan, spec, name, recipe, round_, nproc, position,
                                           self.book, env)
            return measure_trial(plan, spec, name, recipe, round_, self.dataset, self.dist_env,
                                 self.run_dir, position=position, probe=self.probes.get(name),
                                 book=self.book, budget=self.budget)
        except Exception as exc:  # under torchrun: a failed rank fails the job
            if self.dist_env is None:
                raise
            status = distributed.report_failure(
                exc, self.dist_env, f"model {spec.name}, variant {name}, trial {round_}")
            self._write({**self._header(name, round_, position), "status": status})
            raise

    def largest_batch(self) -> None:
        """capacity.csv's row for this model, when the baseline asks for it."""
        if not (self.first.bench.find_largest_batch and self.run_dir):
            return
        self.bar.set_postfix_str(f"{self.spec.name}: largest batch that fits")
        plan, spec, device = self.plan, self.spec, torch.device(self.plan.device)
        if self.dist_env is None:
            row = capacity.probe(plan.experiment, spec, plan.baseline, self.first, device,
                                 self.dataset)
        else:  # every rank would search its own device, and time it differently
            row = {**capacity.head(plan.experiment, spec, plan.baseline),
                   "status": schema.na("the largest batch that fits is searched without torchrun")}
        capacity.append(self.run_dir / "capacity.csv", row)

    def _probe_all(self) -> None:
        """The quality probe of every variant measured in this process; a variant stopped as
        too slow (or n/a) joins `skip`. The baseline goes first for its steady throughput
        alone (the too-slow rule's steps, no loss), which tells a variant far slower
        (quality.py); its loss is taken after the others, only where one of them is left to
        compare with it (amp on a CPU without 16-bit instructions stops both 16-bit variants,
        and the baseline's loss steps would compare with nothing). Variants launched in
        processes of their own (torchrun, or a fresh one) keep their timed window's loss."""
        plan, base = self.plan, self.plan.baseline
        self.probe_budget = self.budget.part(PROBE_SHARE)  # the rest is the rounds'
        probed = [n for n in plan.variants
                  if n not in self.skip and not self._launched(plan.variants[n])]
        others = [n for n in probed if n != base]
        rate_first = bool(others) and self.first.bench.too_slow_factor is not None
        base_rate = math.nan
        if base in probed:  # held to nothing: its trials run, cut by the deadline if need be
            got = self._keep(base, self._probe(base, None, steps=0 if rate_first else None))
            base_rate = got.get("probe_samples_per_s", math.nan)
        ref = self._reference()
        for name in others:
            self._keep(name, self._probe(name, ref))
        if rate_first and base not in self.skip and any(
                n in self.probes and n not in self.skip for n in others):
            got = self._keep(base, self._probe(base, None))
            if got:  # the throughput the others were held to
                got["probe_samples_per_s"] = base_rate
        self._more_seeds()
        if self.run_dir is not None:
            atomic.append_rows(self.run_dir / "quality.csv", schema.QUALITY_COLUMNS,
                               [r for name in plan.variants for r in self._quality_rows(name)])

    def _keep(self, name: str, got: dict | None) -> dict:
        """A variant's probe kept: its too-slow or n/a status in `skip`, its losses; {} for a
        probe that met a fault (its trials will record it)."""
        if got is None:
            return {}
        status = str(got.get("status", ""))
        if schema.parse_status(status).kind in (schema.TOO_SLOW, schema.NOT_MEASURED, schema.NA):
            self.skip[name] = got.pop("status")
        self.probe_steps[name] = got.pop("probe_step_s", [])
        self.seed_losses[name] = got.pop("seed_losses", [])
        if "quality_status" in got:
            self.no_loss[name] = got.pop("quality_status")
        self.probes[name] = got
        return got

    def _more_seeds(self) -> None:
        """The probe's other seeds, once every first seed has run: only where a variant other
        than the baseline is left to compare (on a CPU without 16-bit instructions, amp stops
        both 16-bit variants, and the baseline's extra seeds would compare with nothing)."""
        alive = [n for n, losses in self.seed_losses.items() if losses and n not in self.skip]
        if not any(n != self.plan.baseline for n in alive):
            return
        share = self.probe_budget.left() / len(alive)
        for name in alive:
            recipe = self.plan.variants[name]
            self.bar.set_postfix_str(f"{self.spec.name} {name}: quality seeds")
            try:
                self.seed_losses[name] += quality.more_seeds(
                    self.spec, recipe, self.ctx, self.dataset,
                    quality.probe_steps(self.spec, recipe, self.first, self.ctx),
                    self.first.bench.quality_seeds, left_s=share)
            except Exception:  # its trials will meet the fault and record it
                continue

    def _quality_rows(self, name: str) -> list[dict]:
        """quality.csv's rows of a variant: a loss per seed, or one row saying why it has none."""
        head = {"experiment": self.plan.experiment, "model": self.spec.name, "variant": name,
                "is_baseline": name == self.plan.baseline}
        got, seed = self.probes.get(name, {}), self.plan.variants[name].bench.seed
        losses = self.seed_losses.get(name)
        if losses:
            return [{**head, "seed": seed + k, "steps": got["quality_steps"],
                     "samples": got["quality_samples"], "loss": loss,
                     **quality.loss_columns(loss), "status": schema.OK}
                    for k, loss in enumerate(losses)]
        if name in self.skip:
            status = self.skip[name]
        elif name in self.no_loss:
            status = self.no_loss[name]
        elif got and got.get("quality_steps") == 0 and self.first.bench.quality_steps:
            status = schema.na("no other variant was left to compare with: the baseline's "
                               "held-out loss was not taken")
        elif self._launched(self.plan.variants[name]):
            status = schema.na("the quality probe trains in this process; this variant needs "
                               "processes of its own")
        else:
            status = schema.na("no held-out loss (bench.quality_steps=0, a fault, or the "
                               "probe's time limit)")
        return [{**head, "seed": seed, "status": status}]

    def _launched(self, recipe) -> bool:
        """Whether this recipe's trials run in processes of their own (torchrun, or fresh)."""
        return bool(techniques.processes(recipe, self.ctx)
                    or techniques.environment(recipe, self.ctx))

    def per_step(self, name: str) -> int:
        """Samples one optimizer step of a variant takes (its batch, accumulation, devices)."""
        return batching(self.spec, self.plan.variants[name], self.ctx).per_step

    def _reference(self) -> stopping.Reference:
        """What the probes are held to (stopping.py): the baseline's steady probe steps (none
        before its probe), the run's far-slower test, and the seconds the rounds have (what
        the probes leave)."""
        b = self.first.bench
        steps = self.probe_steps.get(self.plan.baseline, [])
        others = stopping.trial_seconds(statistics.median(steps), b) if steps else 0.0
        return stopping.Reference(
            steps, self.per_step(self.plan.baseline), b.too_slow_factor,
            stopping.stop_level(self.comparisons), (self.budget.seconds or math.inf)
            * (1 - PROBE_SHARE), others)

    def _probe(self, name: str, ref: stopping.Reference | None, steps: int | None = None
               ) -> dict | None:
        """One variant's quality probe, held to `ref` (the baseline's, the budget's); `steps`
        0: its throughput alone, no loss. None on a fault."""
        recipe = self.plan.variants[name]
        self.bar.set_postfix_str(f"{self.spec.name} {name}: quality probe")
        if steps is None:
            steps = quality.probe_steps(self.spec, recipe, self.first, self.ctx)
        try:
            return quality.quality_probe(
                self.spec, recipe, self.ctx, self.dataset, steps, ref,
                what=f"model {self.spec.name}, variant {name}", left_s=self.probe_budget.left())
        except Exception:  # its trials will meet the fault and record it
            return None

    def _nothing_to_compare(self, name: str, round_: int) -> bool:
        """After the first round, the baseline's repeats are spared when every other variant
        is n/a or stopped (one may become so during a round)."""
        return round_ > 0 and name == self.plan.baseline and self._nothing_left()

    def _header(self, name: str, round_: int, position: int) -> dict:
        return header(self.plan, self.spec, name, self.plan.variants[name], round_,
                      self.dist_env, position)

    def _write(self, record: dict) -> None:
        # bench.order_seed=<order_seed> replays the orders; the looks give the CI's level
        record.update(order_seed=self.order_seed, min_rounds=self.repeats,
                      look_every=self.spacing, looks=self.looks)
        self.written.add(record["variant"])
        if self.writer:
            self.writer.append(record)


def progress_bar(plan: Plan, show: bool):
    """The plan's progress bar. Its ETA comes from the mean time per trial so far
    (smoothing=0): a variant's trials can take 20x another's, and tqdm's default moving
    average then swings from minutes to many."""
    repeats = max(r.bench.repeats for r in plan.variants.values())
    total = sum(min(r.bench.repeats, repeats) for r in plan.variants.values()) * len(plan.models)
    return tqdm(total=total, desc=plan.experiment, unit="trial", file=sys.stderr,
                dynamic_ncols=True, disable=not show, smoothing=0)


def planned_comparisons(plan: Plan) -> int:
    """The speed-up comparisons a plan asks for: each non-baseline variant on each model."""
    return (len(plan.variants) - 1) * len(plan.models)


def measure_plan(plan: Plan, run_dir: Path | None, progress: bool = True,
                 dist_env: distributed.DistEnv | None = None, writer: TrialWriter | None = None,
                 book: FlopsBook | None = None, comparisons: int | None = None,
                 budget: Budget | None = None) -> TrialWriter | None:
    """Every trial of the plan, rows appended to trials.csv as they end (to `writer`'s, when a
    suite gathers several plans in one file). Under torchrun every rank runs every trial; rank 0
    alone (the one given a run_dir) writes. `book` holds the run's FLOP counts and peaks
    (shared by a suite's plans: the peaks are measured once per run). `comparisons`: the run's
    family, which the stopping rule judges CIs for (default: this plan's). `budget`: the wall
    time the plan may take (default: its bench.time_budget_s from now), each model taking its
    share of what is left when it starts."""
    if writer is None and run_dir:
        writer = TrialWriter(run_dir / "trials.csv", techniques.column_names())
    book = book or FlopsBook(torch.device(plan.device), plan.config.bench.peak_s)
    bar = progress_bar(plan, progress and distributed.is_main(dist_env))
    if writer:  # the matmul peaks: once per run and dtype, before any trial
        bar.set_postfix_str("matmul peak")
        book.measure_peaks(techniques.matmul_dtype(r) for r in plan.variants.values())
    budget = budget or Budget(plan.variants[plan.baseline].bench.time_budget_s)
    seed = plan_order_seed(plan, dist_env)
    run_models([ModelRounds(plan, spec, dist_env, run_dir, writer, book, bar, seed, comparisons)
                for spec in plan.models], budget)
    bar.close()
    return writer


def run_models(models: list[ModelRounds], budget: Budget) -> None:
    """Each model's data and probes, on an equal share of the run; then their rounds, the
    cheapest round first, each on its share of what is left when it starts: the time a model
    that decides quickly leaves goes to the costlier ones after it (on the reference CPU the
    ResNet, whose rounds take 4x the transformer's, ran first and was decided in a quarter of
    simulated amp runs; last, in two thirds: benchmarks/README.md)."""
    share = budget.left() / max(len(models), 1)
    for model in models:
        model.budget = Budget(min(share, budget.left()), budget.clock)
        model.prepare()
    # a model no probe timed (under torchrun, or launched) keeps its place: the order is
    # the same on every rank
    ordered = sorted(models, key=lambda m: m.round_seconds()[0] if m.dist_env is None else 0.0)
    for i, model in enumerate(ordered):
        model.plan_rounds(budget.part(1 / (len(ordered) - i)))
        for round_ in model.rounds():
            model.run_round(round_)
        model.explain()
        model.largest_batch()
        model.dataset = None  # its data are not needed again
