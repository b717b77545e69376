"""The probes phase of a model's study: every variant's quality probe (quality.py), held to the
baseline's steady steps and to the budget (stopping.py), and quality.csv's rows.

The baseline goes first for its steady throughput alone (the too-slow rule's steps, no loss),
which tells a variant far slower; its loss is taken after the others, only where one of them is
left to compare with it (amp on a CPU without 16-bit instructions stops both 16-bit variants,
and the baseline's loss steps would compare with nothing). Variants in an arm (an A/B's, or
one whose techniques set variables at a process's start) are probed in its worker; variants
whose trials run over several processes (torchrun) are probed over as many, launched alike
(launched_probe: the held-out loss, not the far-slower test). The probes take at most
PROBE_SHARE of the model's budget; the rest is the rounds'. A fault in a probe (the model's
exception, its sys.exit()) is the variant's quality row's status, `error: the quality probe
failed: ...`, said once on the console; its trials go on, and record it where they meet it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace

from speedbench import distributed, techniques
from speedbench.measure import launch
from speedbench.studies import arms, costs, quality, stopping
from speedbench.measure.budget import Budget
from speedbench.measure.trial import context
from speedbench.results import atomic, schema

PROBE_SHARE = 0.4  # of a model's budget, what its quality probes may take (the rounds: the rest)
FAULT = "probe_fault"  # a probe's record that met a fault: its one-line status, nothing else


def fault_status(exc: BaseException) -> str:
    """A probe's fault as a status: `error: the quality probe failed: Type: message` (the
    first line, as a trial's row says it), or `oom (in the quality probe)`."""
    status = schema.parse_status(distributed.failure_status(exc))
    if status.kind == schema.OOM:
        return schema.format_status(schema.OOM, "in the quality probe")
    return schema.format_status(schema.ERROR, f"the quality probe failed: {status.reason}")


class Losses(list):
    """The other seeds' held-out losses, and the fault that ended them (None: none)."""

    fault: str | None = None


@dataclass
class ProbeResult:
    """What the probes found: variant -> its probe's record (throughput, first steps, loss),
    its steady steps (s), its held-out losses per seed, why it has no loss, and the statuses
    the probes set (too slow, not measured, n/a)."""

    records: dict[str, dict] = field(default_factory=dict)
    steps: dict[str, list[float]] = field(default_factory=dict)
    seed_losses: dict[str, list[float]] = field(default_factory=dict)
    no_loss: dict[str, str] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)  # variant -> its probe's fault, said
    seed_faults: dict[str, str] = field(default_factory=dict)  # ... in its other seeds

    def keep(self, name: str, got: dict | None) -> dict:
        """A variant's probe kept: its status, steps and losses apart; {} for a probe that met a
        fault (FAULT: its one-line status, quality.csv's; its trials go on and meet it or not)."""
        if got is None:
            return {}
        if FAULT in got:
            self.faults.setdefault(name, got[FAULT])
            self.no_loss[name] = got[FAULT]
            return {}
        status = str(got.get("status", ""))
        if schema.parse_status(status).kind in (schema.TOO_SLOW, schema.NOT_MEASURED, schema.NA):
            self.status[name] = got.pop("status")
        self.steps[name] = got.pop("probe_step_s", [])
        self.seed_losses[name] = got.pop("seed_losses", [])
        if "quality_status" in got:
            self.no_loss[name] = got.pop("quality_status")
        self.records[name] = got
        return got

    def withdraw_stop(self, name: str) -> None:
        """A far-slower stop the baseline's fresh steps did not confirm: the variant goes on to
        its rounds; its probe stopped before its held-out loss, and says why."""
        self.status.pop(name, None)
        self.no_loss[name] = schema.na(
            "no held-out loss: its probe stopped at a far-slower look that a fresh probe of the "
            "baseline, right after it, did not confirm (a load, not the variant)")


def _stopped(found: ProbeResult, name: str) -> bool:
    return schema.parse_status(found.status.get(name, "")).kind == schema.TOO_SLOW


def confirmed(steady_s: list[float], per_step: int, ref: stopping.Reference,
              fresh_base_s: list[float]) -> bool:
    """Whether a far-slower stop holds against the baseline's fresh steps too, taken right
    after the variant's probe: the test of stopping.far_slower with them as the reference. A
    load episode that slowed the variant's probe alone slows these as well, and the stop is
    withdrawn; without fresh steps (the baseline's probe failed) it stands."""
    if len(fresh_base_s) < 2:
        return True
    return stopping.far_slower(steady_s, per_step, replace(ref, step_s=list(fresh_base_s))) \
        is not None


def probe_steps(quality_steps: int, base_per_step: int, per_step: int) -> int:
    """Optimizer steps that see as many samples as `quality_steps` steps of the baseline."""
    samples = quality_steps * base_per_step
    return max(1, round(samples / per_step)) if samples else 0


def run_probes(mc, prepared, status: dict[str, str], budget: Budget) -> ProbeResult:
    """The quality probe of every variant measured in this process (`status`: the variants
    already n/a), within PROBE_SHARE of `budget`; quality.csv's rows written."""
    plan, base, settings = mc.plan, mc.plan.baseline, mc.settings
    probe_budget = budget.part(PROBE_SHARE)  # the rest is the rounds'
    found = ProbeResult()
    skipped = lambda n: n in status or n in found.status  # noqa: E731
    probed = [n for n in plan.variants if not skipped(n)]
    others = [n for n in probed if n != base]
    # the baseline's throughput first, for the far-slower test; not where its probe is
    # launched (torchrun): a launch's steps hold no variant to anything
    rate_first = bool(others) and settings.too_slow_factor is not None \
        and not _over_processes(mc, base)

    def probe(name: str, ref, steps: int | None = None) -> dict | None:
        mc.doing(f"{mc.spec.name} {name}: quality probe")
        if steps is None:
            steps = probe_steps(settings.quality_steps, prepared.per_step[base],
                                prepared.per_step[name])
        return mc.instruments.probe(mc, name, prepared.dataset, ref, steps, probe_budget.left())

    base_rate = math.nan
    if base in probed:  # held to nothing: its trials run, cut by the deadline if need be
        got = found.keep(base, probe(base, None, steps=0 if rate_first else None))
        base_rate = got.get("probe_samples_per_s", math.nan)
    ref = reference(mc, found.steps.get(base, []), prepared.per_step[base], budget)
    for name in others:
        found.keep(name, probe(name, ref))
        if _stopped(found, name) and not skipped(base) and base in probed:
            # paired: a load that covered this probe covers the baseline's fresh steps too
            fresh = (probe(base, None, steps=0) or {}).get("probe_step_s", [])
            if not confirmed(found.steps.get(name, []), prepared.per_step[name], ref, fresh):
                found.withdraw_stop(name)
    if rate_first and not skipped(base) and any(
            n in found.records and not skipped(n) for n in others):
        got = found.keep(base, probe(base, None))
        if got:  # the throughput the others were held to
            got["probe_samples_per_s"] = base_rate
    _more_seeds(mc, prepared, found, skipped, probe_budget)
    for name, why in found.faults.items():  # once each, on the console as in quality.csv
        mc.say(f"{mc.spec.name}, variant {name}: {why}; its trials go on")
    if mc.run_dir is not None:
        rows = [r for name in plan.variants
                for r in quality_rows(mc, name, found, {**status, **found.status}, prepared)]
        atomic.append_rows(mc.run_dir / "quality.csv", schema.QUALITY_COLUMNS, rows)
    return found


def reference(mc, base_steps: list[float], base_per_step: int, budget: Budget
              ) -> stopping.Reference:
    """What the probes are held to (stopping.py): the baseline's steady probe steps (none
    before its probe), the run's far-slower test, and the seconds the rounds have: what the
    probes leave of the model's budget, or what it has left when a probe is judged where that
    is less (Reference.rounds_left)."""
    b = mc.plan.variants[mc.plan.baseline].bench
    others = costs.trial_seconds(statistics.median(base_steps), b) if base_steps else 0.0
    return stopping.Reference(
        base_steps, base_per_step, mc.settings.too_slow_factor,
        stopping.stop_level(mc.comparisons),
        (budget.seconds or math.inf) * (1 - PROBE_SHARE), others, rounds=mc.settings.rounds,
        left=budget.left)


def _more_seeds(mc, prepared, found: ProbeResult, skipped, probe_budget: Budget) -> None:
    """The probe's other seeds, once every first seed has run: only where a variant other
    than the baseline is left to compare (on a CPU without 16-bit instructions, amp stops
    both 16-bit variants, and the baseline's extra seeds would compare with nothing)."""
    alive = [n for n, losses in found.seed_losses.items() if losses and not skipped(n)]
    if not any(n != mc.plan.baseline for n in alive):
        return
    share = probe_budget.left() / len(alive)
    base_per_step = prepared.per_step[mc.plan.baseline]
    for name in alive:
        if len(found.seed_losses[name]) >= mc.settings.quality_seeds:
            continue  # a launched probe ran its seeds in its own processes
        mc.doing(f"{mc.spec.name} {name}: quality seeds")
        steps = probe_steps(mc.settings.quality_steps, base_per_step, prepared.per_step[name])
        got = mc.instruments.more_seeds(mc, name, prepared.dataset, steps, share)
        found.seed_losses[name] += got
        if getattr(got, "fault", None):  # the seeds after the fault have no loss, and say why
            found.faults.setdefault(name, got.fault)
            found.seed_faults[name] = got.fault


def quality_rows(mc, name: str, found: ProbeResult, status: dict[str, str], prepared
                 ) -> list[dict]:
    """quality.csv's rows of a variant: a loss per seed, or one row saying why it has none."""
    plan = mc.plan
    head = {"experiment": plan.experiment, "model": mc.spec.name, "variant": name,
            "is_baseline": name == plan.baseline, "reference": plan.references.get(name, "")}
    got, seed = found.records.get(name, {}), plan.variants[name].bench.seed
    losses = found.seed_losses.get(name)
    if losses:
        rows = [{**head, "seed": seed + k, "steps": got["quality_steps"],
                 "samples": got["quality_samples"], "loss": loss,
                 **quality.loss_columns(loss), "status": schema.OK}
                for k, loss in enumerate(losses)]
        if name in found.seed_faults:  # the seeds from this one on: no loss, and why
            rows.append({**head, "seed": seed + len(losses), "status": found.seed_faults[name]})
        return rows
    if name in status:
        why = status[name]
    elif name in found.no_loss:
        why = found.no_loss[name]
    elif got and got.get("quality_steps") == 0 and mc.settings.quality_steps:
        why = schema.na("no other variant was left to compare with: the baseline's held-out "
                        "loss was not taken")
    elif not mc.settings.quality_steps:
        why = schema.na("no held-out loss: bench.quality_steps=0")
    else:  # (a fault or a limit says its own reason: found.no_loss)
        why = schema.na("no held-out loss: the quality probe did not run")
    return [{**head, "seed": seed, "status": why}]


# --- the instruments: one probe, the other seeds -------------------------------------------------
def probe_variant(mc, name: str, dataset, ref: stopping.Reference | None, steps: int,
                  left_s: float) -> dict | None:
    """One variant's quality probe, held to `ref` (the baseline's, the budget's); `steps` 0:
    its throughput alone, no loss. On a fault (the model's exception, its sys.exit()), {FAULT:
    its one-line status}: quality.csv's row says it, and the variant's trials go on."""
    arm = arms.variant_arm(mc.plan, name, context(mc.plan, mc.dist_env))
    if arm is not None:  # in its arm's worker
        return arm_probe(mc, arm, name, ref, steps, left_s)
    if _over_processes(mc, name):
        return launched_probe(mc, name, steps, left_s)
    return probe_here(mc, name, dataset, ref, steps, left_s)


def _over_processes(mc, name: str) -> int:
    """The processes a variant's trials run over through torchrun (0: this one, or an arm)."""
    return techniques.processes(mc.plan.variants[name], context(mc.plan, mc.dist_env))


def launched_probe(mc, name: str, steps: int, left_s: float) -> dict:
    """probe_variant over the processes a variant's trials run over (torchrun, launched as
    its trials are), all of bench.quality_seeds at once: every rank trains on the probe's
    batches (the same on each, as in one process), so the held-out loss judges the numerics
    the processes change (a communication hook's compression), not the data's sharding. Held
    to nothing: its steps' times include the ranks' waits, and its throughput is not kept
    (the rounds' cost is learned from their trials). {FAULT: why} where the launch failed."""
    recipe, ctx = mc.plan.variants[name], context(mc.plan, mc.dist_env)
    if left_s <= 0:  # no launch: quality_probe's own line for a probe left no time
        return quality.quality_probe(mc.spec, recipe, ctx, None, steps, left_s=left_s)
    got = launch.launch_call(
        mc.plan, mc.spec, name, recipe, _over_processes(mc, name), probe_on_rank,
        {"steps": steps, "seeds": mc.settings.quality_seeds,
         "what": f"model {mc.spec.name}, variant {name}"},
        techniques.environment(recipe, ctx), Budget(None if math.isinf(left_s) else left_s))
    if "probe" not in got:
        status = schema.parse_status(got["status"])
        said = "failed" if status.kind == schema.ERROR else "was stopped"
        return {FAULT: schema.format_status(status.kind or schema.ERROR,
                                            f"the quality probe {said}: {status.reason}")}
    probe = got["probe"]
    probe.update(probe_samples_per_s=math.nan, probe_step_s=[])
    return probe


def probe_on_rank(plan, spec, name: str, recipe, dataset, dist_env, budget: Budget | None,
                  steps: int, seeds: int, what: str) -> dict:
    """A launched probe's work on one rank (launch.launch_call): {"probe": its record}."""
    left = None if budget is None else budget.limit(None)
    return {"probe": quality.quality_probe(spec, recipe, context(plan, dist_env), dataset,
                                           steps, None, seeds=seeds, what=what, left_s=left)}


def probe_here(mc, name: str, dataset, ref: stopping.Reference | None, steps: int,
               left_s: float) -> dict | None:
    """probe_variant in this process (an arm's worker runs this one)."""
    try:
        return quality.quality_probe(
            mc.spec, mc.plan.variants[name], context(mc.plan, mc.dist_env), dataset, steps,
            ref, what=f"model {mc.spec.name}, variant {name}", left_s=left_s)
    except Exception as exc:
        return {FAULT: fault_status(exc)}


def arm_probe(mc, arm: arms.Arm, name: str, ref: stopping.Reference | None, steps: int,
              left_s: float) -> dict | None:
    """probe_variant in the variant's arm (arms.call): the same probe, held to the same
    reference (its seconds left as of now), or {FAULT: why its worker failed}."""
    plain = None
    if ref is not None:
        plain = {k: _finite(v) if isinstance(v, float) else v
                 for k, v in asdict(ref).items() if k != "left"}
        plain["rounds_s"] = _finite(ref.rounds_left())
    got = arms.call(mc.plan, mc.spec, arm, name, "probe",
                    {"ref": plain, "steps": steps, "left_s": _finite(left_s)}, _finite(left_s))
    if "probe" not in got:
        return {FAULT: got["status"]}
    probe = got["probe"]
    if probe and "seed_losses" in probe:  # [loss, initial, chance]: arm_worker.triple
        probe["seed_losses"] = [quality.SeedLoss(*x) for x in probe["seed_losses"]]
    return probe


def _finite(x: float | None) -> float | None:
    """JSON's number, or None for no limit (inf)."""
    return None if x is None or math.isinf(x) else x


def more_seed_losses(mc, name: str, dataset, steps: int, left_s: float) -> list[float]:
    """The held-out losses of the probe's other seeds (quality.more_seeds), within `left_s`;
    on a fault none, and the fault (Losses.fault) that quality.csv's row says."""
    arm = arms.variant_arm(mc.plan, name, context(mc.plan, mc.dist_env))
    if arm is not None:  # in its arm's worker
        got = arms.call(mc.plan, mc.spec, arm, name, "more_seeds",
                        {"steps": steps, "seeds": mc.settings.quality_seeds,
                         "left_s": _finite(left_s)}, _finite(left_s))
        losses = Losses(quality.SeedLoss(*x) for x in got.get("losses", []))
        losses.fault = got.get("fault") or got.get("status")
        return losses
    return more_seeds_here(mc, name, dataset, steps, left_s)


def more_seeds_here(mc, name: str, dataset, steps: int, left_s: float) -> list[float]:
    """more_seed_losses in this process (an arm's worker runs this one)."""
    try:
        return quality.more_seeds(mc.spec, mc.plan.variants[name],
                                  context(mc.plan, mc.dist_env), dataset, steps,
                                  mc.settings.quality_seeds, left_s=left_s)
    except Exception as exc:
        got = Losses()
        got.fault = fault_status(exc)
        return got
