"""A plan's study: for each model, an explicit pipeline of phases on one clock.

    prepare -> probes -> forecasts -> plan -> rounds -> paired profile -> largest batch

Each phase is a function that takes what it needs as arguments and returns a typed result;
`study_models` runs them in that order and keeps the results in one `ModelState` per model. A
variant's status (n/a, too slow, not measured) is kept in one dict that every phase adds to and
none overwrites (the first word on a variant stands). Every phase draws its time from the
`Budget` it is handed (budget.py): every model's data and probes on an equal share of the run,
then the models' rounds, the cheapest round first, each on its share of what is left when it
starts, so that the time a quick model leaves goes to the costlier ones after it (on the
reference CPU the ResNet, whose rounds take 4x the transformer's, ran first and was decided in a
quarter of simulated amp runs; last, in two thirds: benchmarks/README.md).

What is measured comes in as a frozen `Request` (plain data, JSON both ways): exactly N rounds
or the group-sequential ones, full or screening probes, with or without the explanation, and
how much of the caller's clock. The run-level keys are read once, from the run's config, into
`Settings`; nothing writes a key after the plan is built.

What trains is behind one seam, `Instruments` (prepare a model, probe a variant, its other
seeds, one trial, a record's header): tests and benchmarks/verdict_sim.py pass their own, and
everything else is the command line's own code.
"""
from __future__ import annotations

import json
import math
import sys
import textwrap
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from speedbench import distributed, techniques
from speedbench.config import ModelSpec, Plan
from speedbench.errors import ConfigError
from speedbench.measure import isolation, launch
from speedbench.studies import arms, capacity, costs, explain_phases, probes, rounds
from speedbench.measure.budget import Budget
from speedbench.measure.data import DataOutOfTime, build_dataset
from speedbench.measure.flops import FlopsBook
from speedbench.studies.orders import plan_order_seed
from speedbench.measure.session import batching
from speedbench.measure.train import build_model
from speedbench.measure.trial import context, dataset_length, header, measure_trial
from speedbench.results import TrialWriter, schema

PROBES = ("full", "screen")
CONSOLE_WIDTH = 100  # the console's lines, as the summary table's (README)
SCREEN_PROBE_STEPS = 2  # quality-probe steps of a screen: the two that tell a hopeless option


@dataclass(frozen=True)
class Request:
    """What to measure of a plan, and how; plain data (to_json/from_json).

    `rounds`: exactly that many rounds (a screen; no looks), None: bench.repeats and the
    group-sequential looks. `probes`: "full" (bench.quality_steps and quality_seeds) or
    "screen" (SCREEN_PROBE_STEPS steps, one seed: speed alone, the far-slower test).
    `explain`: the forecasts and the paired profile, where bench.explain asks for them.
    `budget_s`: seconds of the caller's clock the measurement may take (None: what it has);
    `min_s`: seconds it gets even where the caller's clock has less left (a measurement the
    caller decided to start runs its first trials)."""

    rounds: Optional[int] = None
    probes: str = "full"
    explain: bool = True
    budget_s: Optional[float] = None
    min_s: float = 0.0

    def __post_init__(self):
        if self.probes not in PROBES:
            raise ConfigError(f"request.probes: {self.probes!r} is not one of {', '.join(PROBES)}")
        if self.rounds is not None and self.rounds < 1:
            raise ConfigError(f"request.rounds: {self.rounds} is below 1")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Request":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Settings:
    """The run-level keys a study reads, once: from the run's config (plan.config.bench), the
    request applied; `seed` and `noise_threshold`, which a variant may set, are the baseline's."""

    repeats: int  # the floor of rounds: the most any variant asks for (bench.repeats)
    target_ci: Optional[float]
    quality_steps: int
    quality_seeds: int
    explain: bool
    skip_by_forecast: bool
    find_largest_batch: bool
    too_slow_factor: Optional[float]
    time_budget_s: Optional[float]
    noise_threshold: float
    seed: int
    rounds: Optional[int] = None  # the request's exact rounds (every variant's), else None

    @classmethod
    def of(cls, plan: Plan, request: Request = Request()) -> "Settings":
        bench, base = plan.config.bench, plan.variants[plan.baseline].bench
        screen = request.probes == "screen"
        return cls(
            repeats=request.rounds or max(r.bench.repeats for r in plan.variants.values()),
            target_ci=None if request.rounds else bench.target_ci,
            quality_steps=min(bench.quality_steps, SCREEN_PROBE_STEPS) if screen
            else bench.quality_steps,
            quality_seeds=1 if screen else bench.quality_seeds,
            # the forecasts, the profile and the largest batch run in this process: not an
            # arm's (config/arms.py)
            explain=bool(bench.explain and request.explain and not plan.arms),
            skip_by_forecast=bool(bench.skip_by_forecast),
            find_largest_batch=bool(bench.find_largest_batch and not plan.arms),
            too_slow_factor=bench.too_slow_factor, time_budget_s=bench.time_budget_s,
            noise_threshold=base.noise_threshold, seed=base.seed, rounds=request.rounds)

    def repeats_of(self, recipe) -> int:
        """A variant's floor of rounds: the request's, else its bench.repeats."""
        return self.rounds or recipe.bench.repeats


@dataclass(frozen=True)
class Prepared:
    """A model made ready: its data set, the variants n/a here (variant -> status), each
    variant's samples per optimizer step, the variants whose trials run in processes of
    their own (torchrun, or a fresh process), and of those the ones whose trials and probes
    run in an arm's worker (arms.variant_arm: an A/B's, or start-up variables')."""

    dataset: Any
    na: dict[str, str]
    per_step: dict[str, int]
    launched: frozenset[str] = frozenset()
    armed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelContext:
    """What every phase of one model's study reads; nothing here changes while it runs."""

    plan: Plan
    spec: ModelSpec
    settings: Settings
    instruments: "Instruments"
    dist_env: Any = None
    run_dir: Optional[Path] = None
    writer: Optional[TrialWriter] = None
    book: Optional[FlopsBook] = None
    bar: Any = None
    order_seed: int = 0
    comparisons: int = 1
    data_left_s: Optional[float] = None  # what the budget leaves the data's building (prepare)

    def say(self, text: str) -> None:
        """A line beside the progress bar, wrapped to the console's 100 columns."""
        self.bar.write(textwrap.fill(text, CONSOLE_WIDTH, subsequent_indent="  ",
                                     break_on_hyphens=False), sys.stderr)

    def doing(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def header(self, name: str, round_: int, position: int) -> dict:
        return self.instruments.header(self, name, round_, position)


# --- the instruments: what trains --------------------------------------------------------------
def prepare_model(mc: ModelContext) -> Prepared:
    """The model's data set, its variants n/a here (all of them without a baseline), each
    variant's samples per step and which run in processes of their own."""
    plan, spec, ctx = mc.plan, mc.spec, context(mc.plan, mc.dist_env)
    mc.doing(f"{spec.name}: making data")
    world = mc.dist_env.world_size if mc.dist_env else 1
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec, world),
                            plan.variants[plan.baseline].data.path, seed=mc.settings.seed,
                            left_s=mc.data_left_s)
    na = na_variants(plan, spec, mc.dist_env)
    if plan.baseline in na:
        # No baseline here (pinning, empty_cache without CUDA): nothing to compare the other
        # variants with, so they are not measured either.
        why = schema.reason_of(na[plan.baseline])
        for name in plan.variants:
            na.setdefault(name, schema.na(f"no baseline to compare with "
                                          f"({plan.baseline}: {why})"))
    per_step = {n: batching(spec, r, ctx).per_step for n, r in plan.variants.items()}
    launched = frozenset(n for n, r in plan.variants.items() if techniques.launched(r, ctx))
    armed = frozenset(n for n, r in plan.variants.items() if not techniques.processes(r, ctx)
                      and arms.variant_arm(plan, n, ctx) is not None)
    return Prepared(dataset, na, per_step, launched, armed)


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


def run_trial(mc: ModelContext, name: str, round_: int, position: int, dataset,
              probe: dict | None, budget: Budget) -> dict:
    """One trial's record: in this process, in processes of its own through torchrun, or in a
    worker of its arm (an A/B's, or this interpreter's started with the variables its
    techniques need at start-up: arms.variant_arm)."""
    plan, spec, recipe = mc.plan, mc.spec, mc.plan.variants[name]
    ctx = context(plan, mc.dist_env)
    nproc = techniques.processes(recipe, ctx)
    if nproc and name in plan.arms:
        return {**trial_header(mc, name, round_, position), "status": schema.na(
            "a variant over several processes (torchrun) does not run in an arm")}
    if nproc:
        return launch.launch_trial(plan, spec, name, recipe, round_, nproc, position, mc.book,
                                   techniques.environment(recipe, ctx), budget)
    arm = arms.variant_arm(plan, name, ctx)
    if arm is not None:
        return arm_trial(mc, arm, name, round_, position, probe, budget)
    return measure_trial(plan, spec, name, recipe, round_, dataset, mc.dist_env, mc.run_dir,
                         position=position, probe=probe, book=mc.book, budget=budget)


def arm_trial(mc: ModelContext, arm: arms.Arm, name: str, round_: int, position: int,
              probe: dict | None, budget: Budget) -> dict:
    """One trial in a worker of `arm`: its record, or the header and why the worker failed;
    the A/B's arm and the variant it is compared with added."""
    left = budget.left()
    record = arms.trial(mc.plan, mc.spec, arm, name, round_, position, probe,
                        left if left < math.inf else None)
    record.update(arm_columns(mc.plan, name))
    return mc.book.annotate(record) if mc.book is not None else record


def arm_columns(plan: Plan, name: str) -> dict:
    """trials.csv's `arm` and `reference` of a variant (empty without arms)."""
    arm = plan.arms.get(name)
    return {"arm": arm.name if arm else "", "reference": plan.references.get(name, "")}


def trial_header(mc: ModelContext, name: str, round_: int, position: int) -> dict:
    return {**header(mc.plan, mc.spec, name, mc.plan.variants[name], round_, mc.dist_env,
                     position), **arm_columns(mc.plan, name)}


@dataclass(frozen=True)
class Instruments:
    """The study's one seam to training: each a function of the model's context."""

    prepare: Callable[[ModelContext], Prepared] = prepare_model
    probe: Callable[..., Optional[dict]] = probes.probe_variant
    more_seeds: Callable[..., list] = probes.more_seed_losses
    trial: Callable[..., dict] = run_trial
    header: Callable[[ModelContext, str, int, int], dict] = trial_header


INSTRUMENTS = Instruments()  # the command line's


# --- one model's state and the pipeline ----------------------------------------------------------
@dataclass
class ModelState:
    """What the phases of one model returned, in the order they ran."""

    prepared: Prepared
    status: dict[str, str] = field(default_factory=dict)  # variant -> n/a, too slow, ...
    probes: Optional[probes.ProbeResult] = None
    forecasts: Optional[explain_phases.ForecastResult] = None
    prepared_s: float = 0.0  # what the data, the probes and the forecasts took
    data_built: bool = True  # False: its data ran past the model's share (not measured)
    rounds: Optional[rounds.RoundsResult] = None
    budget_need_s: float = math.nan  # the run's one budget figure, where the plan gave one

    def add_status(self, new: dict[str, str]) -> None:
        """A phase's statuses: the first word on a variant stands."""
        for name, status in new.items():
            self.status.setdefault(name, status)

    def plan_facts(self, mc: ModelContext) -> costs.RoundFacts:
        """What the cost model needs to plan the rounds."""
        return costs.RoundFacts(
            rates={n: p.get("probe_samples_per_s") for n, p in
                   (self.probes.records if self.probes else {}).items()},
            per_step=self.prepared.per_step, skipped=set(self.status),
            benches={n: r.bench for n, r in mc.plan.variants.items()})


def prepare(mc: ModelContext, budget: Budget) -> ModelState:
    """The phases before the rounds, on the model's share of the run: data, probes, forecasts.
    The data's building is held to the share (data.DataOutOfTime) and timed; where it overran,
    every variant is not measured, and the console says so."""
    prepared, built = _prepared(mc, budget)
    state = ModelState(prepared, data_built=built)
    state.add_status(state.prepared.na)
    overran = not built or budget.over()
    if overran and mc.dist_env is None:
        state.add_status(_data_overran(mc, budget))
    if mc.dist_env is None and not overran:
        state.probes = probes.run_probes(mc, state.prepared, dict(state.status), budget)
        state.add_status(state.probes.status)
        state.forecasts = explain_phases.forecasts(mc, state.prepared, dict(state.status),
                                            state.probes.steps, budget)
        state.add_status(state.forecasts.status)
    state.prepared_s = budget.spent()
    return state


def _prepared(mc: ModelContext, budget: Budget) -> tuple[Prepared, bool]:
    """The instruments' prepare, its data held to what `budget` leaves, and whether its data
    was built; a model whose data ran past it is Prepared without a data set."""
    left = budget.left()
    try:
        return mc.instruments.prepare(replace(mc, data_left_s=left if left < math.inf
                                              else None)), True
    except DataOutOfTime as exc:
        why = schema.format_status(schema.NOT_MEASURED, f"{exc}; give a larger "
                                   "bench.time_budget_s")
        return Prepared(None, {n: why for n in mc.plan.variants},
                        {n: 1 for n in mc.plan.variants}), False


NO_SHARE_S = 0.5  # a model's share of the budget under this: none was left for it


def _data_overran(mc: ModelContext, budget: Budget) -> dict[str, str]:
    """Every variant not measured, said once on the console: preparing the model (its data,
    mostly) used all of its share of the budget, or none was left for it (the run's start-up,
    its matmul peaks and the models before it took the budget: '0 s, all of its 0 s share')."""
    took = f"preparing its data took {budget.spent():.0f} s, all of its " \
        f"{budget.seconds:.0f} s share of bench.time_budget_s"
    if budget.seconds is not None and budget.seconds < NO_SHARE_S:
        took = ("bench.time_budget_s had nothing left for it: the run's start-up, its matmul "
                "peaks and the models before it took the budget")
    mc.say(f"{mc.spec.name}: {took}: not measured (a larger budget lets it run)")
    why = schema.format_status(schema.NOT_MEASURED, f"{took}; give a larger "
                               "bench.time_budget_s")
    return {n: why for n in mc.plan.variants}


def measure(mc: ModelContext, state: ModelState, budget: Budget) -> None:
    """The phases after: the plan's line, the rounds, the paired profile, the largest batch."""
    base_explained = state.forecasts is not None and state.forecasts.explainer is not None
    step_s = costs.step_seconds(state.probes.steps if state.probes else {}, [])
    reserve = explain_phases.reserve_for(mc, state.prepared, state.status, step_s, budget) \
        if base_explained else 0.0
    left = max(0.0, budget.left() - reserve)
    round_s = costs.round_seconds(state.plan_facts(mc), mc.settings)[0]
    if mc.dist_env is None:
        mc.say(costs.plan_line(mc.spec.name, state.plan_facts(mc), mc.settings, mc.comparisons,
                               state.prepared_s, left))
    # where one round at most fits, the baseline runs first in it: a variant measured without
    # its baseline compares with nothing
    one_round = mc.dist_env is None and round_s > 0 and left < 2 * round_s
    state.rounds = rounds.run_rounds(mc, state, budget, reserve, baseline_first=one_round)
    state.add_status(state.rounds.status)
    if base_explained:
        explain_phases.paired_profile(mc, state.forecasts.explainer, state.prepared, state.rounds.rows,
                               costs.step_seconds(state.probes.steps, state.rounds.rows),
                               budget)
    if mc.settings.find_largest_batch and mc.run_dir and state.data_built:
        capacity.largest_batch(mc, state.prepared.dataset)


def study_models(contexts: list[ModelContext], budget: Budget, advise: bool = True
                 ) -> list[ModelState]:
    """Every model's data and probes on an equal share of the run; then their rounds, the
    cheapest round first, each on its share of what is left when it starts. `advise`: say the
    run's one budget figure (not for a part of a run: a recipe search's step, a check)."""
    share = budget.left() / max(len(contexts), 1)
    states, budgets = [], []
    for mc in contexts:  # each model's share from when it starts
        budgets.append(Budget(min(share, budget.left()), budget.clock))
        states.append(prepare(mc, budgets[-1]))
    if advise and contexts and contexts[0].dist_env is None:  # one advice for the whole run
        say_run_budget(contexts, states, budgets)
    # a model no probe timed (under torchrun, or launched) keeps its place: the order is
    # the same on every rank
    order = sorted(range(len(contexts)), key=lambda i: costs.round_seconds(
        states[i].plan_facts(contexts[i]), contexts[i].settings)[0]
        if contexts[i].dist_env is None else 0.0)
    for k, i in enumerate(order):
        measure(contexts[i], states[i], budget.part(1 / (len(order) - k)))
        states[i].prepared = replace(states[i].prepared, dataset=None)  # not needed again
    return states


def say_run_budget(contexts: list[ModelContext], states: list[ModelState],
                   budgets: list[Budget]) -> None:
    """The run's one budget figure, said once after every model's probes and before any
    round (costs.run_budget_line), and kept on each model's rows (budget_need_s), where the
    report and "measure again" take it from (recommend.more_budget)."""
    figures = [costs.verdict_budget_s(st.plan_facts(mc), mc.settings, mc.comparisons,
                                      st.prepared_s, _after_prepare(own, st))
               for mc, st, own in zip(contexts, states, budgets)]
    needs = [r.get("budget_need_s") for st in states if st.probes
             for r in st.probes.records.values()]  # the variants a probe stopped for time
    budget_s = contexts[0].settings.time_budget_s
    figure = costs.run_budget_figure(figures + needs, budget_s)
    if figure is not None:
        contexts[0].say(costs.run_budget_line([figure], budget_s))
        for state in states:
            state.budget_need_s = figure


def _after_prepare(own: Budget, state: ModelState) -> float:
    """What a model's share had left when its data and probes were done."""
    return math.inf if own.seconds is None else max(0.0, own.seconds - state.prepared_s)


# --- a plan ----------------------------------------------------------------------------------------
def progress_bar(plan: Plan, show: bool, settings: Settings | None = None):
    """The plan's progress bar: trials done of the floor's, and the time so far. No ETA: the
    data and probes come before the first trial, a variant's trials can take 20x another's and
    adaptive rounds add more, so a rate per trial forecast hours for a 140 s run; the run's
    budget (bench.time_budget_s) bounds it instead."""
    settings = settings or Settings.of(plan)
    total = sum(min(settings.repeats_of(r), settings.repeats) for r in plan.variants.values()) \
        * len(plan.models)
    return tqdm(total=total, desc=plan.experiment, unit="trial", file=sys.stderr,
                dynamic_ncols=True, disable=not show, smoothing=0,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} trials [{elapsed}{postfix}]")


def planned_comparisons(plan: Plan) -> int:
    """The speed-up comparisons a plan asks for: each non-baseline variant on each model."""
    return (len(plan.variants) - 1) * len(plan.models)


def measure_plan(plan: Plan, run_dir: Path | None, progress: bool = True,
                 dist_env: distributed.DistEnv | None = None, writer: TrialWriter | None = None,
                 book: FlopsBook | None = None, comparisons: int | None = None,
                 budget: Budget | None = None, request: Request = Request(),
                 instruments: Instruments | None = None) -> TrialWriter | None:
    """Every trial of the plan, rows appended to trials.csv as they end (to `writer`'s, when a
    suite gathers several plans in one file). Under torchrun every rank runs every trial; rank 0
    alone (the one given a run_dir) writes. `book` holds the run's FLOP counts and peaks
    (shared by a suite's plans: the peaks are measured once per run). `comparisons`: the run's
    family, which the stopping rule judges CIs for (default: this plan's). `budget`: the
    caller's clock (default: bench.time_budget_s from now), of which `request.budget_s` at most
    is taken. `instruments`: what trains (default: INSTRUMENTS, the command line's)."""
    if writer is None and run_dir:
        writer = TrialWriter(run_dir / "trials.csv", techniques.column_names())
    book = book or FlopsBook(torch.device(plan.device), plan.config.bench.peak_s)
    settings = Settings.of(plan, request)
    bar = progress_bar(plan, progress and distributed.is_main(dist_env), settings)
    budget = (budget or Budget(plan.config.bench.time_budget_s)).cap(request.budget_s)
    if budget.left() < request.min_s:
        budget = Budget(request.min_s, budget.clock)
    if writer:  # the matmul peaks: once per run and dtype, before any trial, on its clock
        bar.set_postfix_str("matmul peak")
        book.measure_peaks((techniques.matmul_dtype(r) for r in plan.variants.values()), budget)
    seed = plan_order_seed(plan, dist_env)
    contexts = [ModelContext(plan, spec, settings, instruments or INSTRUMENTS, dist_env, run_dir,
                             writer, book, bar, seed, comparisons or planned_comparisons(plan))
                for spec in plan.models]
    study_models(contexts, budget, advise=request.budget_s is None)
    bar.close()
    return writer
