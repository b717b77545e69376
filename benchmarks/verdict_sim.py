"""Error rates of speedbench's verdicts, simulated through the code the command line runs: whole
runs, every model of them.

Each simulated run drives every phase of a model's study through study.study_models, as the
CLI does, on one simulated clock and one budget (every model's probes on an equal share, then
the rounds, the cheapest round first, each on its share of what is left): the quality probes,
whose simulated steps are judged by the real stopping rules (quality._stopped: the far-slower
test and the budget check of studies/stopping.py), the plan, the balanced orders, the rounds
loop and its group-sequential looks; then analysis.summary.summarise over all the models' rows,
as run.py does (the family is the run's). Only the instruments (study.Instruments: the steps of
a probe, a trial, the clock) are simulated.

The noise is fitted to real measurements:
- per trial: the committed reference trials (results/reference/*/trials.csv, every measurement
  with 5+ complete rounds): a two-way fit (round + variant) of log throughput gives the
  per-trial sd, the sd of the round effect (what pairing removes) and the standardised
  residuals, which the simulation resamples; with benchmarks/data/step_times.csv (made by
  benchmarks/step_noise.py) the per-trial sd is that of the trial estimate the runs use;
- per probe step: the standardised log step times of that file (their tails included), where
  it exists, else a lognormal of sd STEP_SD; a probe is a fresh model, whose steps share a
  level drawn from the trial level fitted on that file (`level_sd`);
- with `--load`: load episodes (Load) that slow every step of the probes and trials running
  while they last.

    python benchmarks/verdict_sim.py              # the tables in benchmarks/README.md
    python benchmarks/verdict_sim.py --runs 200   # quicker, rougher
    python benchmarks/verdict_sim.py --load       # A/A quiet and with load episodes
    python benchmarks/verdict_sim.py --forecasts  # the recipe search's forecast screen
    python benchmarks/verdict_sim.py --bursts     # burst rounds kept and left out

tests/test_verdicts_sim.py runs a small version.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speedbench.analysis import intervals  # noqa: E402
from speedbench.analysis.summary import summarise  # noqa: E402
from speedbench.studies import quality, stopping, study  # noqa: E402
from speedbench.measure.budget import Budget  # noqa: E402
from speedbench.studies.costs import trial_seconds  # noqa: E402
from speedbench.measure.timing import typical_step_s  # noqa: E402
from speedbench.results.schema import STOPPED_SLOWER  # noqa: E402

STEPS = ROOT / "benchmarks" / "data" / "step_times.csv"
STEP_SD = 0.1  # per probe step, log scale, without step_times.csv
CALLS = (intervals.FASTER, intervals.SLOWER, STOPPED_SLOWER)


# ---- the noise model, fitted to real trials ----

def _two_way(y: pd.DataFrame) -> tuple[float, float, np.ndarray]:
    """(per-trial sd, round sd, standardised residuals) of a rounds x arms table of logs."""
    r, v = y.shape
    e = y.sub(y.mean(axis=1), axis=0).sub(y.mean(axis=0), axis=1) + y.values.mean()
    var_e = float((e.values ** 2).sum()) / ((r - 1) * (v - 1))
    var_round = max(0.0, float(y.mean(axis=1).var(ddof=1)) - var_e / v)
    z = e.values.ravel() / math.sqrt(var_e * (r - 1) * (v - 1) / (r * v))
    return math.sqrt(var_e), math.sqrt(var_round), z


def fit(paths=None, min_rounds: int = 5, steps: Path | None = STEPS) -> dict:
    """The noise model: per-trial sd, round-effect sd and pooled standardised residuals (log
    throughput) of the reference measurements with at least `min_rounds` complete rounds; with
    `steps` (step_noise.py's file), the per-trial sd of the trial estimate the runs use
    (timing.typical_step_s) and the probe steps' standardised log residuals."""
    paths = paths or sorted((ROOT / "results" / "reference").glob("*/trials.csv"))
    trial_sd, round_sd, residuals = [], [], []
    for path in paths:
        t = pd.read_csv(path)
        t = t[t["status"] == "ok"]
        key = "round" if "round" in t else "trial"
        for _, g in t.groupby(["experiment", "model"]):
            y = np.log(g.pivot_table(index=key, columns="variant", values="samples_per_s",
                                     aggfunc="median")).dropna()
            if y.shape[0] < min_rounds or y.shape[1] < 2:
                continue
            sd, rsd, z = _two_way(y)
            trial_sd.append(sd)
            round_sd.append(rsd)
            residuals.append(z)
    z = np.concatenate(residuals)
    noise = {"trial_sd": float(np.median(trial_sd)), "round_sd": float(np.median(round_sd)),
             "residuals": (z - z.mean()) / z.std(), "measurements": len(trial_sd),
             "step_residuals": None, "source": "reference trials.csv (window means)"}
    if steps is not None and Path(steps).is_file():
        noise.update(_fit_steps(pd.read_csv(steps)))
    return noise


def _fit_steps(steps: pd.DataFrame) -> dict:
    """The per-trial sd of typical_step_s's estimate over speedbench's trials of each (model,
    precision) (a two-way fit with the round), and the probe steps' standardised log
    residuals (each step's log time less its trial's median)."""
    ours = steps[steps["harness"] == "speedbench"]
    est = (ours.groupby(["model", "precision", "round"])["step_ms"]
           .apply(lambda s: typical_step_s(list(s))).rename("est").reset_index())
    sds = []
    for _, g in est.groupby("model"):
        y = np.log(g.pivot_table(index="round", columns="precision", values="est")).dropna()
        if y.shape[0] >= 3 and y.shape[1] >= 2:
            sds.append(_two_way(y)[0])
    logs = np.log(ours["step_ms"])
    resid = (logs - logs.groupby([ours["model"], ours["precision"], ours["round"]])
             .transform("median")).to_numpy()
    resid = resid / resid.std()
    out = {"step_residuals": resid, "step_sd": float(np.log(ours["step_ms"]).groupby(
        [ours["model"], ours["precision"], ours["round"]]).std().median()),
        "level_sd": _level_sd(ours)}
    if sds:
        out.update(trial_sd=float(np.median(sds)), source="step_times.csv (typical step)")
    return out


def _level_sd(ours: pd.DataFrame) -> float:
    """The sd of a fresh model's level (its mean log step after the first, over trials),
    beyond what its steps' own noise explains; the median over (model, precision)."""
    logs = ours[ours["step"] >= 1].assign(lg=lambda d: np.log(d["step_ms"]))
    sds = []
    for _, g in logs.groupby(["model", "precision"]):
        per = g.groupby("round")["lg"]
        excess = per.mean().var(ddof=1) - per.var(ddof=1).mean() / per.size().mean()
        sds.append(math.sqrt(max(0.0, excess)))
    return float(np.median(sds))


# ---- one simulated run: every model through the CLI's study ----

class _Bar:
    total = 0

    def write(self, *_): ...

    def set_postfix_str(self, *_): ...

    def update(self, *_): ...


@dataclass
class SimModel:
    """A model of a simulated run: its baseline step (s), samples per step, and each variant's
    true speed relative to the baseline (1.0: identical; 0.04: 25 times slower)."""

    name: str
    step_s: float
    speeds: dict[str, float]
    per_step: int = 32
    one_time: float = 2.0  # the first step's time, in steady steps


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Load:
    """Load episodes on a shared machine: they start at `per_minute` a minute (Poisson), last
    `seconds` (uniform), and multiply every step meanwhile by a factor drawn log-uniformly in
    `factor` (a transformer step went from 50 ms to 1.8 s and 60 s within 20 minutes on the
    audit's shared host: 5-50x for a stretch of seconds is the scenario)."""

    per_minute: float = 1.0
    seconds: tuple[float, float] = (5.0, 30.0)
    factor: tuple[float, float] = (5.0, 50.0)
    episodes: list = field(default_factory=list)
    until: float = 0.0

    def at(self, t: float, rng) -> float:
        """The slowdown at simulated time `t` (1.0 outside every episode)."""
        while self.until <= t:  # draw the episodes up to t, lazily
            start = self.until + rng.exponential(60.0 / self.per_minute)
            f = math.exp(rng.uniform(*np.log(self.factor)))
            self.episodes.append((start, start + rng.uniform(*self.seconds), f))
            self.until = start
        return max([f for s, e, f in self.episodes if s <= t < e], default=1.0)


class SimTraining:
    """The instruments of one simulated model (study.Instruments): trials' and probe steps'
    times drawn from the noise model on a simulated clock. Everything else, every phase of the
    study, is the command line's own code. A probe is a fresh model: its steps share a level
    drawn from the fitted trial level (noise["level_sd"]); `load`: episodes that slow every
    step while they last."""

    def __init__(self, model: SimModel, noise: dict, rng, clock: Clock,
                 position_effect: float = 0.0, load: Load | None = None):
        self.model, self.noise, self.rng, self.clock = model, noise, rng, clock
        self.position_effect, self.round_effect = position_effect, {}
        self.load = load

    def slowdown(self) -> float:
        return self.load.at(self.clock.now, self.rng) if self.load else 1.0

    def instruments(self) -> study.Instruments:
        return study.Instruments(prepare=self.prepare, probe=self.probe,
                                 more_seeds=self.more_seeds, trial=self.trial,
                                 header=self.header)

    def prepare(self, mc) -> study.Prepared:
        """No data set and no n/a check: every variant acts, in this process."""
        return study.Prepared(None, {}, {n: self.model.per_step for n in self.model.speeds})

    def header(self, mc, name: str, round_: int, position: int) -> dict:
        return {"experiment": "sim", "model": self.model.name, "variant": name,
                "is_baseline": name == mc.plan.baseline, "trial": round_, "round": round_,
                "position": position}

    def _step(self, name: str, level: float = 0.0) -> float:
        """One probe step's time: the variant's true step, times the probe's level, a resampled
        step residual and the load's slowdown now."""
        z = self.noise.get("step_residuals")
        sd = self.noise.get("step_sd", STEP_SD)
        e = sd * self.rng.choice(z) if z is not None else self.rng.normal(0, STEP_SD)
        return self.model.step_s / self.model.speeds[name] * math.exp(e + level) \
            * self.slowdown()

    def probe(self, mc, name: str, dataset, ref, steps: int, left_s: float) -> dict:
        """quality._first_seed's loop with simulated steps: the same stopping rules."""
        b = mc.plan.variants[name].bench
        total = max(steps, 1 + stopping.probe_floor(ref is None) if b.too_slow_factor else 1)
        times, level = [], self.rng.normal(0, self.noise.get("level_sd", 0.0))
        while len(times) < total:
            t = self._step(name, level) * (self.model.one_time if not times else 1.0)
            times.append(t)
            self.clock.now += t
            stop = quality._stopped(times, 1, self.model.per_step, b, ref,
                                    last=len(times) >= total)
            if stop:
                return {**quality._timings(times, 1, self.model.per_step), **stop}
            if stopping.flagged(times[1:], self.model.per_step, ref):  # as _first_seed
                total = max(total, 1 + stopping.STOP_LOOKS[-1])
            if sum(times) > left_s and len(times) >= min(total, 4):
                break
        return {**quality._timings(times, 1, self.model.per_step), "final_loss": 1.0,
                "quality_steps": min(steps, len(times)), "quality_samples": steps,
                "seed_losses": [1.0]}

    def more_seeds(self, mc, name: str, dataset, steps: int, left_s: float) -> list:
        """The other seeds' untimed steps: their time, within the share they are given."""
        want = (mc.settings.quality_seeds - 1) * steps * self.model.step_s \
            / self.model.speeds[name]
        self.clock.now += min(want, left_s)
        return []

    def trial(self, mc, name: str, round_: int, position: int, dataset, probe, budget) -> dict:
        noise = self.noise
        if round_ not in self.round_effect:
            self.round_effect[round_] = self.rng.normal(0, noise["round_sd"])
        log_step = (math.log(self.model.step_s / self.model.speeds[name])
                    - self.round_effect[round_]
                    - noise["trial_sd"] * self.rng.choice(noise["residuals"])
                    - (math.log1p(-self.position_effect) if position == 0 else 0.0))
        slowdown = self.slowdown()
        step = math.exp(log_step) * slowdown
        # what env.CpuWindow reads: others held (f - 1) / f of the CPU meanwhile
        others = (1 - 1 / slowdown) if slowdown > 1 else self.rng.uniform(0, QUIET_OTHERS)
        # the trial's window stops at the run's deadline (between steps)
        self.clock.now += min(trial_seconds(step, mc.plan.variants[name].bench),
                              budget.left() + step)
        rate = self.model.per_step / step
        return {**self.header(mc, name, round_, position), "status": "ok",
                "samples_per_s": rate, "step_ms": 1000 * step, "data_wait_frac": 0.0,
                "peak_mem_mb": 1.0, "host_rss_mb": 1.0, "final_loss": 1.0,
                "noise_threshold": 0.05, "others_cpu_share": others}


def model_context(model: SimModel, bench, training: SimTraining, comparisons: int,
                  order_seed: int) -> study.ModelContext:
    """A simulated model's context: its plan (variants that all share `bench`), the study's
    settings from `bench` (no explanation, no largest-batch search), the sim's instruments."""
    names = list(model.speeds)
    # single-process recipes (parallel none) on the CPU, as the probes and rounds ask
    plan = SimpleNamespace(variants={n: SimpleNamespace(bench=bench, parallel="none")
                                     for n in names},
                           baseline=names[0], models=[SimpleNamespace(name=model.name)],
                           device="cpu",
                           experiment="sim")
    settings = study.Settings(
        repeats=bench.repeats, target_ci=bench.target_ci, quality_steps=bench.quality_steps,
        quality_seeds=bench.quality_seeds, explain=False, skip_by_forecast=False,
        find_largest_batch=False, too_slow_factor=bench.too_slow_factor,
        time_budget_s=bench.time_budget_s, noise_threshold=bench.noise_threshold, seed=0)
    return study.ModelContext(plan, plan.models[0], settings, training.instruments(),
                              bar=_Bar(), order_seed=order_seed, comparisons=comparisons)


@dataclass
class Settings:
    """bench.* of a simulated run (the amp experiment's by default)."""

    time_budget_s: float = 140.0
    repeats: int = 5
    target_ci: float | None = 0.03
    quality_steps: int = 12
    quality_seeds: int = 3
    too_slow_factor: float | None = 4.0
    warmup: int = 3
    steps: int = 5  # amp's windows (configs/experiment/amp.yaml)
    max_trial_s: float | None = 6.0
    noise_threshold: float = 0.05
    steady_tol: float | None = None
    extra: dict = field(default_factory=dict)


def simulate_run(models: list[SimModel], noise: dict, rng, settings: Settings = Settings(),
                 position_effect: float = 0.0, load: Load | None = None,
                 training: type = None) -> tuple[pd.DataFrame, float]:
    """One run of every model, as the CLI runs it; (summary.csv's rows, the run's seconds).
    `training`: the instruments' class (SimTraining; ab_sim.py's arms add a worker's start)."""
    training = training or SimTraining
    bench = SimpleNamespace(**{k: v for k, v in vars(settings).items() if k != "extra"})
    clock = Clock()
    run = Budget.of_run(settings.time_budget_s, clock=clock)
    comparisons = sum(len(m.speeds) - 1 for m in models)
    load = Load(load.per_minute, load.seconds, load.factor) if load else None  # fresh episodes
    contexts = [model_context(m, bench, training(m, noise, rng, clock, position_effect, load),
                              comparisons, int(rng.integers(2 ** 62))) for m in models]
    states = study.study_models(contexts, run)  # the CLI's: probes, then rounds cheapest first
    rows = []
    for mc, state in zip(contexts, states):
        rows += state.rounds.rows
        records = state.probes.records if state.probes else {}
        for name, status in state.status.items():  # the stopped variants' rows, as round 0
            if not any(r["variant"] == name for r in state.rounds.rows):  # has them
                rows.append({**mc.header(name, 0, 0), **records.get(name, {}),
                             "status": status, "noise_threshold": 0.05})
    return summarise(pd.DataFrame(rows)), clock.now


# ---- the measures ----

def scenario(models: list[SimModel], runs: int, noise: dict, seed: int,
             settings: Settings = Settings(), position_effect: float = 0.0,
             load: Load | None = None) -> dict:
    """`runs` simulated runs: the family-wise false calls (any call on an identical variant),
    the CI coverage of the truth, each variant's verdicts, the run's mean seconds."""
    rng = np.random.default_rng(seed)
    truth = {(m.name, v): s for m in models for v, s in m.speeds.items()}
    false_runs = covered = cis = 0
    verdicts: dict = {k: [] for k in truth}
    seconds = []
    for _ in range(runs):
        s, took = simulate_run(models, noise, rng, settings, position_effect, load)
        seconds.append(took)
        s = s[~s["is_baseline"].astype(bool)]
        false = False
        for r in s.itertuples():
            t = truth[(r.model, r.variant)]
            verdicts[(r.model, r.variant)].append(r.verdict)
            false |= t == 1.0 and r.verdict in CALLS
            if r.speedup_lo == r.speedup_lo:
                cis += 1
                covered += r.speedup_lo <= t <= r.speedup_hi
        false_runs += false
    return {"family_false": false_runs / runs, "coverage": covered / max(cis, 1),
            "verdicts": verdicts, "seconds": float(np.mean(seconds)),
            "seconds_max": float(np.max(seconds))}


def share(verdicts: list[str], *words: str) -> float:
    return sum(v in words for v in verdicts) / max(len(verdicts), 1)


# The reference models on a 2-core AVX-512-bf16 CPU: the fp32 baseline's step and bf16's speed
# against it from speedbench's trials in step_times.csv (medians), where it exists; fp16's
# speeds as the default amp run measured them there (its probes stop it, 20-27x slower).
def amp_models(bf16=None, fp16=(0.04, 0.04, 0.05)) -> list[SimModel]:
    steps = {"resnet": 0.32, "vae": 0.25, "transformer": 0.08}
    speeds = dict(zip(steps, bf16 or (1.45, 1.26, 1.0)))
    if bf16 is None and STEPS.is_file():
        ours = pd.read_csv(STEPS).query("harness == 'speedbench' and step >= 2")
        med = ours.groupby(["model", "precision"])["step_ms"].median() / 1000
        steps = {m: float(med[(m, "fp32")]) for m in steps}
        speeds = {m: float(med[(m, "fp32")] / med[(m, "bf16")]) for m in steps}
    return [SimModel(name, steps[name], {"fp32": 1.0, "fp16": f16, "bf16": speeds[name]})
            for name, f16 in zip(steps, fp16)]


def identical(variants: int, models: int = 3) -> list[SimModel]:
    base = amp_models()
    return [SimModel(m.name, m.step_s, {f"v{i}": 1.0 for i in range(variants)})
            for m in base[:models]]


def table(runs: int, noise: dict, seed: int = 0) -> list[str]:
    """The Markdown tables of benchmarks/README.md."""
    lines = [f"Noise: per-trial sd {noise['trial_sd']:.3f} ({noise['source']}), round-effect sd "
             f"{noise['round_sd']:.3f} (log scale), probe steps "
             f"{'resampled from step_times.csv' if noise['step_residuals'] is not None else 'lognormal'}"
             f"; {runs} runs per row.", ""]
    lines += ["| scenario | budget | A/A family-wise false calls | CI coverage | mean run s (max) |",
              "|---|---|---|---|---|"]
    for name, models, budget in (("amp, 3 models x 3 identical variants", identical(3), 140),
                                 ("7 identical variants, transformer", [identical(7)[2]], 140),
                                 ("7 identical variants, transformer", [identical(7)[2]], 600)):
        r = scenario(models, runs, noise, seed, Settings(time_budget_s=budget))
        lines.append(f"| {name} | {budget} s | {r['family_false']:.2%} | {r['coverage']:.2%} | "
                     f"{r['seconds']:.0f} ({r['seconds_max']:.0f}) |")
    lines += ["", "| amp on the reference CPU | budget | bf16 decided | bf16 verdicts | "
                  "fp16 | mean run s |", "|---|---|---|---|---|---|"]
    for budget in (140, 600):
        r = scenario(amp_models(), runs, noise, seed, Settings(time_budget_s=budget))
        for m in amp_models():
            v16, v32 = r["verdicts"][(m.name, "bf16")], r["verdicts"][(m.name, "fp16")]
            decided = share(v16, intervals.FASTER, intervals.SLOWER, intervals.EQUIVALENT)
            lines.append(f"| {m.name} (bf16 {m.speeds['bf16']:.2f}x) | {budget} s | "
                         f"{decided:.1%} | {_mix(v16)} | {_mix(v32)} | {r['seconds']:.0f} |")
    lines += ["", "| true speed-up (one variant per model of 3, 3 variants each) | budget | "
                  "called faster | CI coverage |", "|---|---|---|---|"]
    for effect in (1.1, 1.2):
        for budget in (140, 600):
            models = [SimModel(m.name, m.step_s, {"a": 1.0, "b": 1.0, "c": effect})
                      for m in amp_models()]
            r = scenario(models, runs, noise, seed, Settings(time_budget_s=budget))
            called = np.mean([share(r["verdicts"][(m.name, "c")], intervals.FASTER)
                              for m in models])
            lines.append(f"| {effect:.1f}x | {budget} s | {called:.1%} | {r['coverage']:.2%} |")
    return lines


def load_table(runs: int, noise: dict, seed: int = 0, load: Load = Load()) -> list[str]:
    """A/A rows quiet and with load episodes (`load`), with each row's verdict mix: the
    rounds, the stops and the budget check all see the same episodes."""
    lines = [f"Load episodes: {load.per_minute:g} a minute, {load.seconds[0]:g}-"
             f"{load.seconds[1]:g} s each, steps {load.factor[0]:g}-{load.factor[1]:g}x slower; "
             f"probe level sd {noise.get('level_sd', 0):.3f}; {runs} runs per row.", "",
             "| scenario | budget | load | A/A family-wise false calls (stops included) | CI "
             "coverage | identical variants' verdicts | mean run s (max) |",
             "|---|---|---|---|---|---|---|"]
    for name, models, budget in (("amp, 3 models x 3 identical", identical(3), 140),
                                 ("7 identical, transformer", [identical(7)[2]], 140),
                                 ("7 identical, transformer", [identical(7)[2]], 600)):
        for episodes in (None, load):
            r = scenario(models, runs, noise, seed, Settings(time_budget_s=budget),
                         load=episodes)
            mix = _mix([v for vs in r["verdicts"].values() for v in vs])
            lines.append(f"| {name} | {budget} s | {'episodes' if episodes else 'quiet'} | "
                         f"{r['family_false']:.2%} | {r['coverage']:.2%} | {mix} | "
                         f"{r['seconds']:.0f} ({r['seconds_max']:.0f}) |")
    return lines


# Short bursts as a quiet machine sees them (another job's start, an import): 1-4 s, a step
# 5-20x slower, about 2 a minute. A 2026-12-05 quiet A/B had 4 such rounds in 21.
BURSTS = Load(per_minute=2.0, seconds=(1.0, 4.0), factor=(5.0, 20.0))


def burst_table(runs: int, noise: dict, seed: int = 0) -> list[str]:
    """A/A and a true 1.1x on the transformer (3 variants), quiet, with short bursts and with
    the long load episodes, each with the burst rounds kept (the rule before) and left out
    (intervals.burst_rounds): false calls, coverage and power through the CLI's code."""
    lines = ["| scenario | budget | load | burst rounds | family-wise false calls | "
             "CI coverage | 1.1x called faster |", "|---|---|---|---|---|---|---|"]
    kept_over = intervals.BURST_OVER
    for name, speeds in (("A/A, 3 identical", {"a": 1.0, "b": 1.0, "c": 1.0}),
                         ("1.1x, 3 variants", {"a": 1.0, "b": 1.0, "c": 1.1})):
        model = [SimModel("transformer", 0.08, speeds)]
        for load_name, load in (("quiet", None), ("short bursts", BURSTS), ("episodes", Load())):
            for rule, over in (("kept", math.inf), ("left out", kept_over)):
                intervals.BURST_OVER = over  # paired() reads it at each call
                try:
                    r = scenario(model, runs, noise, seed, Settings(time_budget_s=140),
                                 load=load)
                finally:
                    intervals.BURST_OVER = kept_over
                found = share(r["verdicts"][("transformer", "c")], intervals.FASTER) \
                    if speeds["c"] > 1 else math.nan
                lines.append(f"| {name} | 140 s | {load_name} | {rule} | "
                             f"{r['family_false']:.2%} | {r['coverage']:.2%} | "
                             f"{'-' if math.isnan(found) else f'{found:.1%}'} |")
    return lines


# ---- the recipe search's forecast screen, quiet and with load episodes ----

# The current recipe's profile (a transformer step, step_times.csv's fp32 median), by category:
# an assumption, the order of the shares a default profile of the reference transformer shows
# (no explain.csv is committed to fit them to); the data wait is the scenario's.
OTHER_SHARES = {"matmul": 0.45, "elementwise": 0.25, "python": 0.09, "other": 0.08,
                "optimizer": 0.12, "host_sync": 0.01}
# The profiler's cost, a category's profiled time over its own: most on the many small ops
# (an assumption: it makes a profiled step ~1.5x an unprofiled one, PROFILER_FACTOR is 2)
PROFILER_COST = {"matmul": 1.05, "elementwise": 1.8, "python": 2.0, "other": 1.8,
                 "optimizer": 1.6, "host_sync": 1.2, "data": 1.1, "compiled": 1.0}
PART_SD = 0.15  # a category's own step-to-step log sd beyond the step's (an assumption)
LUMPS = 4.0  # a load's extra time lands in a few lumps: Dirichlet(LUMPS x the shares)
QUIET_OTHERS = 0.05  # others' share of the CPU on a quiet machine, at most (uniform)


class SimProfile:
    """explain.profile_recipe on a simulated clock: a fresh model (its level), the warm-up,
    PLAIN_STEPS unprofiled steps, then up to FORECAST_STEPS profiled ones until `limit_s` has
    passed (one at least), as forecasts.Forecaster asks for them; every step's time split by
    category, the profiler's cost added, a load's slowdown spread in lumps; the Breakdown the
    CLI's split makes of them (explain.without_overhead)."""

    def __init__(self, noise: dict, rng, load: Load | None, step_s: float, data: float,
                 cpu_window: bool = True):
        self.noise, self.rng, self.load, self.step_s = noise, rng, load, step_s
        self.cpu_window = cpu_window  # False: the profile as before others' share was read
        self.others = self.watched = 0.0
        rest = sum(OTHER_SHARES.values())
        self.shares = {**{c: v * (1 - data) / rest for c, v in OTHER_SHARES.items()},
                       "data": data}
        self.now = float(rng.uniform(0, 600))  # a moment of the load's timeline
        self.level = rng.normal(0, noise.get("level_sd", 0.0))

    def _step(self, profiled: bool) -> dict:
        z = self.noise.get("step_residuals")
        e = self.noise.get("step_sd", STEP_SD) * self.rng.choice(z)
        quiet = self.step_s * math.exp(self.level + e)
        parts = {c: quiet * v * math.exp(self.rng.normal(0, PART_SD))
                 * (PROFILER_COST[c] if profiled else 1.0) for c, v in self.shares.items()}
        f = self.load.at(self.now, self.rng) if self.load else 1.0
        if f > 1:  # the load's extra time, in lumps over the categories
            w = self.rng.dirichlet([LUMPS * v for v in self.shares.values()])
            extra = (f - 1) * sum(parts.values())
            parts = {c: p + extra * wc for (c, p), wc in zip(parts.items(), w)}
        took = sum(parts.values())
        self.now += took
        # what env.CpuWindow reads: others held (f - 1) / f of the CPU meanwhile
        self.others += took * ((1 - 1 / f) if f > 1 else self.rng.uniform(0, QUIET_OTHERS))
        self.watched += took
        return parts

    def profile(self, limit_s: float):
        from speedbench.measure import explain

        started = self.now
        for i in range(max(explain.WARMUP, Settings.warmup)):  # the warm-up
            self._step(False)
        self.others = self.watched = 0.0  # env.CpuWindow, from the unprofiled steps on
        plain = [sum(self._step(False).values()) for _ in range(explain.PLAIN_STEPS)]
        if self.now - started >= limit_s:
            return None  # explain.OutOfTime: this step screens every option
        steps = []
        for i in range(explain.FORECAST_STEPS):
            if i and self.now - started >= limit_s:
                break
            steps.append({**dict.fromkeys(explain.CATEGORIES, 0.0),
                          **{c: 1000 * v for c, v in self._step(True).items()}})
        got = explain.cpu_breakdown(steps, 1000 * float(np.mean(plain)))  # as split does
        got.others_cpu = self.others / self.watched if self.cpu_window else math.nan
        return got


def _workers_recipes():
    """The CLI's recipes: the naive transformer and the same with data workers."""
    from hydra import compose, initialize_config_dir

    from speedbench.config import build_plan, config_dir, register_schema

    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=transformer", "device=cpu", "+experiment=workers"])
    plan = build_plan(cfg, None)
    base = plan.variants[plan.baseline]
    return base, next(r for r in plan.variants.values() if r.data.num_workers > 0)


def forecast_screen(runs: int, noise: dict, truth: float, budget_s: float, load: Load | None,
                    seed: int = 0, min_gain: float = 0.05) -> dict:
    """`runs` forecast screens of the workers option whose true gain is `truth` (it hides the
    whole data wait: amdahl(d) = truth, the case where a bound is tightest), on the current
    recipe's profile with `budget_s` of the search left: how often each rule sets it aside,
    how often its forecast covers the truth (now: of those that are bounds); before (the
    plug-in's bound on the point shares, whatever the steps: main until issue 44), with the
    upper limits alone (others' CPU share not read) and now (search.forecasts.set_aside)."""
    from speedbench import techniques
    from speedbench.search import forecasts

    base, more = _workers_recipes()
    step_s = amp_models()[2].step_s
    limit = min(10 * Settings.max_trial_s, forecasts.PROFILE_SHARE * budget_s)
    rng = np.random.default_rng(seed)
    got = {"before": 0, "upper": 0, "now": 0, "covered_before": 0, "covered_now": 0,
           "bounds": 0, "profiles": 0, "steps": []}
    for _ in range(runs):
        sim = SimProfile(noise, rng, Load(load.per_minute, load.seconds, load.factor)
                         if load else None, step_s, 1 - 1 / truth)
        prof = sim.profile(limit)
        if prof is None:
            continue
        got["profiles"] += 1
        got["steps"].append(len(prof.steps))
        old = techniques.bound(more, base, prof, {})[1]
        now = techniques.forecast(more, base, prof, {})[1]
        got["before"] += bool(old.under(min_gain))
        unread = dataclasses.replace(prof, others_cpu=math.nan)  # others' share not read
        got["upper"] += bool(forecasts.set_aside({"w": more}, base, unread, {}, min_gain))
        got["now"] += bool(forecasts.set_aside({"w": more}, base, prof, {}, min_gain))
        got["covered_before"] += old.speedup >= truth
        got["bounds"] += now.sound  # what the screen may act on now: its coverage
        got["covered_now"] += now.sound and now.speedup >= truth
    n = max(got["profiles"], 1)
    return {**{k: v / n for k, v in got.items()
               if k in ("before", "upper", "now", "covered_before")},
            "covered_now": got["covered_now"] / max(got["bounds"], 1), "bounds": got["bounds"],
            "profiles": got["profiles"], "steps": got["steps"]}


def forecast_table(runs: int, noise: dict, seed: int = 0, load: Load = Load()) -> list[str]:
    lines = [f"The workers option's forecast on the transformer's current recipe "
             f"({1000 * amp_models()[2].step_s:.0f} ms step; fresh-model level sd "
             f"{noise.get('level_sd', 0):.3f}, steps resampled from step_times.csv); load "
             f"episodes {load.per_minute:g} a minute, {load.seconds[0]:g}-{load.seconds[1]:g}"
             f" s, {load.factor[0]:g}-{load.factor[1]:g}x; {runs} screens a row.", "",
             "| true gain | search time left | load | profiles (median steps) | set aside: "
             "before / upper limits / now | forecast >= truth: before (all) / now (bounds) | "
             "bounds now |",
             "|---|---|---|---|---|---|---|"]
    for truth in (1.004, 1.06, 1.3):
        for budget in (140, 600):
            for episodes in (None, load):
                r = forecast_screen(runs, noise, truth, budget, episodes, seed)
                steps = f"{np.median(r['steps']):.0f}" if r["steps"] else "-"
                lines.append(f"| {truth:g}x | {budget} s | "
                             f"{'episodes' if episodes else 'quiet'} | {r['profiles']} "
                             f"({steps}) | {r['before']:.1%} / {r['upper']:.1%} / "
                             f"{r['now']:.1%} | "
                             f"{r['covered_before']:.1%} / {r['covered_now']:.1%} | "
                             f"{r['bounds'] / max(r['profiles'], 1):.0%} |")
    return lines


def _mix(verdicts: list[str]) -> str:
    counts = pd.Series(verdicts).value_counts(normalize=True)
    return ", ".join(f"{w} {p:.0%}" for w, p in counts.items())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", action="store_true", help="the A/A rows quiet and with load "
                   "episodes (Load) instead of the usual tables")
    p.add_argument("--forecasts", action="store_true", help="the recipe search's forecast "
                   "screen, quiet and with load episodes, before and after its rule changed")
    p.add_argument("--bursts", action="store_true", help="A/A and a true 1.1x with short "
                   "bursts and load episodes, burst rounds kept and left out")
    a = p.parse_args(argv)
    rows = forecast_table if a.forecasts else load_table if a.load else \
        burst_table if a.bursts else table
    print("\n".join(rows(a.runs, fit(), a.seed)))


if __name__ == "__main__":
    main()
