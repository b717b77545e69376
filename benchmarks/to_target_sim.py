"""Error rates and power of the time-to-target verdicts, simulated through
analysis.to_target.summarise, the function the command line runs on to_target.csv.

Each simulated run is a to_target.csv of the time_to_target experiment's shape: S paired seeds,
a baseline and 4 variants (a family of 4 comparisons). A seed's time to target is its steps to
target times its time per step. Two noises, fitted (--fit) to real to_target.csv files:

- pace: the sd of the log of a run's time per step, within a variant over its seeds (a run's
  own noise on a loaded or quiet machine, and the seeds' small differences in pace);
- steps: the sd over seeds of the log of a variant's steps to target over the baseline's, for
  variants whose numerics differ (bf16, a larger batch): they reach the target at other
  evaluations. Identical numerics take the same steps from the same seed (0).

A true effect multiplies a variant's time per step. Seeds differ in steps (sd of log steps
0.15) and pace, which pairing removes.

    python benchmarks/to_target_sim.py --fit RUN_DIR/to_target.csv [...]
    python benchmarks/to_target_sim.py --pace-sd 0.05 --steps-sd 0.1 --runs 2000

Prints a markdown table: per scenario and number of seeds, how often a run calls any variant
faster or slower (A/A: a false call at the family's level) and how often a true 1.3x is found.

With `--load`, whole time-to-target stages at a given bench.time_budget_s (`--budgets`),
quiet and with load episodes (verdict_sim.Load: 1 a minute, 5-30 s, steps 5-50x slower),
run through the CLI's own stage (studies.to_target.ToTarget: its order of runs, its caps and
each run's share of the budget as a wall-clock deadline, the statuses of _cap_status and the
figures of _record, to_target.csv as written) and its verdicts (analysis.to_target.summarise),
on a simulated clock: only a run's training is simulated (`SimTraining`). A run is set-up,
steps and evaluations; a step is the variant's true step times the run's level (sd --pace-sd,
fitted on the real A/A run's to_target.csv: a run is a fresh model), a resampled step residual
of benchmarks/data/step_times.csv (verdict_sim.fit) and the load's slowdown at that moment; identical numerics reach the target after the seed's own
steps. The stage starts with the speed rounds' share of the budget spent (run.TARGET_SHARE).

    python benchmarks/to_target_sim.py --load --runs 200 --budgets 140 600
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # verdict_sim: the noise fit and the load
from speedbench.analysis import intervals  # noqa: E402
from speedbench.analysis import to_target  # noqa: E402

STEPS_SD = 0.15  # between seeds: removed by pairing, kept for realism
VARIANTS = 4  # the time_to_target experiment: bf16, batch_x2, batch_x4, accumulate_x4


def _pooled(groups) -> float:
    """The pooled sd of the groups' values about their own means (NaN without two in any)."""
    resid, dof = 0.0, 0
    for values in groups:
        v = np.asarray(values, float)
        v = v[np.isfinite(v)]
        if len(v) > 1:
            resid += float(((v - v.mean()) ** 2).sum())
            dof += len(v) - 1
    return math.sqrt(resid / dof) if dof else math.nan


def fitted(paths: list[str]) -> tuple[float, float]:
    """(pace sd, steps sd) of the given to_target.csv files (the module's docstring)."""
    pace, steps = [], []
    for path in paths:
        runs = pd.read_csv(path)
        ok = runs[runs["status"] == "ok"].copy()
        ok["log_pace"] = np.log(ok["time_s"] / ok["steps"])
        for (_, _, _), g in ok.groupby(["experiment", "model", "variant"]):
            pace.append(g["log_pace"])
        for (_, _), g in ok.groupby(["experiment", "model"]):
            base = g[g["is_baseline"].astype(bool)].set_index("seed")["steps"]
            for _, v in g[~g["is_baseline"].astype(bool)].groupby("variant"):
                ratio = np.log(v.set_index("seed")["steps"] / base).dropna()
                if (ratio != 0).any():  # identical numerics: no steps noise to fit
                    steps.append(ratio)
    if not pace:
        raise SystemExit("--fit: no run that reached the target")
    steps_sd = _pooled(steps)
    return _pooled(pace), 0.0 if math.isnan(steps_sd) else steps_sd


def one_run(rng, seeds: int, effects: list[float], pace_sd: float,
            steps_sd: list[float]) -> pd.DataFrame:
    rows = []
    steps = 200 * rng.lognormal(0, STEPS_SD, seeds)
    pace = rng.lognormal(np.log(0.05), 0.05, seeds)
    for v, (effect, ssd) in enumerate(zip([1.0] + effects, [0.0] + steps_sd)):
        name = "base" if v == 0 else f"v{v}"
        own = np.round(steps * rng.lognormal(0, ssd, seeds)) if ssd else np.round(steps)
        for s in range(seeds):
            per_step = pace[s] / effect * rng.lognormal(0, pace_sd)
            t = own[s] * per_step
            rows.append({"experiment": "sim", "model": "m", "variant": name,
                         "is_baseline": v == 0, "seed": s, "status": "ok", "time_s": t,
                         "cold_s": t, "one_time_s": 0.0, "steps": own[s],
                         "step_ms": 1000 * per_step, "final_loss": 1.0, "target_loss": 1.0,
                         "entropy_floor": math.nan, "target_source": "sim"})
    return pd.DataFrame(rows)


def rates(seeds: int, effects: list[float], pace_sd: float, steps_sd: list[float], runs: int,
          seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    any_call = found = 0
    for _ in range(runs):
        verdicts = to_target.summarise(one_run(rng, seeds, effects, pace_sd, steps_sd))
        verdicts = verdicts.set_index("variant")
        calls = verdicts["verdict"].isin([intervals.FASTER, intervals.SLOWER])
        any_call += bool(calls.any())
        found += verdicts.loc["v1", "verdict"] == intervals.FASTER
    return {"any call": any_call / runs, "v1 found faster": found / runs}


SCENARIOS = (  # name, effects, whether the variants' numerics differ (steps noise)
    ("A/A", [1.0] * VARIANTS, False),
    ("one 1.3x, same numerics", [1.3] + [1.0] * (VARIANTS - 1), False),
    ("one 1.3x, other numerics", [1.3] + [1.0] * (VARIANTS - 1), True),
)


# ---- whole stages through studies.to_target.ToTarget, quiet and with load episodes ----

QUIET_STEP_S = 0.061  # the transformer's fp32 step, speedbench's trials in step_times.csv
STEPS_TO_TARGET = 165  # steps the A/A run's seeds took to the target (160, 170, 160)
SETUP_S, EVAL_S = 0.5, 0.15  # a run's model built; one held-out evaluation (untimed, wall)
SEED_STRIDE = 1000  # the sim's variants differ in bench.seed by this: variant = seed // it


@functools.lru_cache(maxsize=None)
def sim_plan(variants: int, budget_s: float, seeds: int):
    """The CLI's plan of an A/A time-to-target run of the transformer (`variants` recipes),
    each variant's bench.seed SEED_STRIDE apart so that the simulated training can tell them
    apart (ToTarget pairs the rows by the baseline's seed: to_target.csv is as the CLI's)."""
    from hydra import compose, initialize_config_dir

    from speedbench.config import build_plan, config_dir, register_schema

    names = [chr(ord("a") + i) for i in range(variants)]
    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=transformer", "device=cpu", "target.enabled=true", "baseline=a",
            f"target.seeds={seeds}", f"bench.time_budget_s={budget_s}",
            "+variants={" + ", ".join(f"{n}: {{bench: {{seed: {i * SEED_STRIDE}}}}}"
                                      for i, n in enumerate(names)) + "}"])
    return build_plan(cfg, None), names


class SimTraining:
    """train_to_target on a simulated clock (ToTarget's `train` seam): set-up, steps and
    evaluations, stopped by the same caps; the record by to_target._record and the cap's
    status by to_target._cap_status, the CLI's. `effects`: variant index -> true step
    speed-up; `steps_sd`: the log sd of a variant's steps over the baseline's (0: the same
    numerics); `seed_steps`: each seed's steps to the target."""

    def __init__(self, rng, clock, load, noise: dict, pace_sd: float, effects: list[float],
                 seed_steps: np.ndarray, steps_sd: float):
        self.rng, self.clock, self.load, self.noise = rng, clock, load, noise
        self.pace_sd, self.effects, self.seed_steps = pace_sd, effects, seed_steps
        self.own_steps = [np.round(seed_steps * (rng.lognormal(0, steps_sd, len(seed_steps))
                                                 if v and steps_sd else 1.0))
                          for v in range(len(effects))]

    def _wait(self, seconds: float) -> float:
        """`seconds` of quiet work at the current moment's slowdown; the clock moves on."""
        took = seconds * (self.load.at(self.clock.now, self.rng) if self.load else 1.0)
        self.clock.now += took
        return took

    def __call__(self, spec, recipe, ctx, train, xy, target, caps) -> tuple[dict, list]:
        from speedbench.measure.session import batching
        from speedbench.results import schema
        from speedbench.studies import to_target as stage

        variant, seed = divmod(int(recipe.bench.seed), SEED_STRIDE)
        need = self.own_steps[variant][seed]
        level = self.rng.normal(0, self.pace_sd)  # a fresh model's pace, as fitted
        z, sd = self.noise["step_residuals"], self.noise["step_sd"]
        step_s, setup = [], self._wait(SETUP_S)
        per_step = batching(spec, recipe, ctx).per_step
        while True:
            quiet = QUIET_STEP_S / self.effects[variant] * math.exp(level + sd * self.rng.choice(z))
            step_s.append(self._wait(quiet))
            steps = len(step_s)
            by_samples = steps * per_step >= caps.samples
            late = caps.deadline is not None and self.clock.now >= caps.deadline
            by_time = late or (caps.seconds is not None and sum(step_s) >= caps.seconds)
            if steps * per_step % caps.every and not (by_samples or by_time):
                continue
            self._wait(EVAL_S)
            if steps >= need:
                status = schema.OK
                break
            if by_samples or by_time:
                status = stage._cap_status(caps, by_samples, steps * per_step, steps,
                                           sum(step_s), 9.9, 1.0, late)
                break
        return {**stage._record(step_s, per_step, setup, 1.0 if status == schema.OK else 9.9,
                                status), "cap_s": caps.seconds or math.nan}, []


def stage_run(rng, budget_s: float, effects: list[float], steps_sd: float, noise: dict,
              pace_sd: float, load, seeds: int, tmp: Path) -> pd.DataFrame:
    """One time-to-target stage through ToTarget, its to_target.csv summarised as the CLI does."""
    from speedbench.measure.budget import Budget
    from speedbench.run import TARGET_SHARE
    from speedbench.studies.to_target import ToTarget
    import verdict_sim

    plan, _ = sim_plan(len(effects), budget_s, seeds)
    clock = verdict_sim.Clock()
    budget = Budget.of_run(budget_s, clock=clock)
    clock.now = (1 - TARGET_SHARE) * budget.seconds  # the speed rounds took their share
    load = verdict_sim.Load(load.per_minute, load.seconds, load.factor) if load else None
    steps = np.maximum(10, np.round(STEPS_TO_TARGET * rng.lognormal(0, STEPS_SD, seeds)))
    train = SimTraining(rng, clock, load, noise, pace_sd, effects, steps, steps_sd)
    for f in tmp.glob("*.csv"):
        f.unlink()
    ToTarget(plan, tmp, [], progress=False, order_seed=int(rng.integers(2 ** 62)),
             budget=budget, train=train, data=lambda *a: (None, None, 1.0)).run()
    return to_target.summarise(pd.read_csv(tmp / "to_target.csv"))


def load_rates(budget_s: float, effects: list[float], steps_sd: float, noise: dict,
               pace_sd: float, load, runs: int, seeds: int, seed: int = 0) -> dict:
    """Over `runs` stages: runs with any false call (a call on an identical variant, or one
    against the truth), the CI coverage, the first variant called faster, the verdicts."""
    import tempfile

    rng = np.random.default_rng(seed)
    false = covered = cis = found = 0
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            s = stage_run(rng, budget_s, effects, steps_sd, noise, pace_sd, load, seeds,
                          Path(tmp))
            s = s[~s["is_baseline"].astype(bool)].set_index("variant")
            wrong = False
            for name, r in s.iterrows():
                truth = effects[ord(name) - ord("a")]
                verdicts.append(r["verdict"].split(" (")[0].split(":")[0])
                call = r["verdict"] in (intervals.FASTER, intervals.SLOWER)
                wrong |= call and (truth == 1.0 or (r["verdict"] == intervals.SLOWER) !=
                                   (truth < 1.0))
                if math.isfinite(r["speedup_lo"]):
                    cis += 1
                    covered += r["speedup_lo"] <= truth <= r["speedup_hi"]
            found += s.loc["b", "verdict"] == intervals.FASTER
            false += wrong
    return {"false": false / runs, "coverage": covered / cis if cis else math.nan,
            "cis": cis, "found": found / runs, "mix": pd.Series(verdicts).value_counts(
                normalize=True)}


def load_table(runs: int, budgets: list[float], pace_sd: float, steps_sd: float,
               seeds: int) -> list[str]:
    import verdict_sim

    noise = verdict_sim.fit()
    load = verdict_sim.Load()
    lines = [f"Noise: a run's level sd {pace_sd:.3f} (its pace), steps resampled from "
             f"step_times.csv (sd {noise['step_sd']:.3f}); "
             f"load episodes {load.per_minute:g} a minute, {load.seconds[0]:g}-"
             f"{load.seconds[1]:g} s, steps {load.factor[0]:g}-{load.factor[1]:g}x slower; "
             f"{VARIANTS} variants + baseline, {seeds} seeds, {runs} runs a row.", "",
             "| scenario | budget | load | runs with a false call | CI coverage (CIs) | "
             "true 1.3x found | verdicts |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, effects, other in SCENARIOS[:2] + (("A/A, other numerics", [1.0] * VARIANTS,
                                                   True),):
        for budget in budgets:
            for episodes in (None, load):
                r = load_rates(budget, [1.0] + effects, steps_sd if other else 0.0, noise,
                               pace_sd, episodes, runs, seeds)
                mix = ", ".join(f"{w} {p:.0%}" for w, p in r["mix"].items())
                found = "-" if name.startswith("A/A") else f"{r['found']:.1%}"
                lines.append(f"| {name} | {budget:g} s | {'episodes' if episodes else 'quiet'}"
                             f" | {r['false']:.1%} | {r['coverage']:.1%} ({r['cis']}) | "
                             f"{found} | {mix} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs="*", default=[], help="to_target.csv files")
    ap.add_argument("--pace-sd", type=float, default=None, help="sd of log time per step")
    ap.add_argument("--steps-sd", type=float, default=None, help="sd of log steps ratio")
    ap.add_argument("--seeds", type=int, nargs="*", default=[3, 5, 8])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--load", action="store_true", help="whole stages through ToTarget, "
                    "quiet and with load episodes, at each of --budgets")
    ap.add_argument("--budgets", type=float, nargs="*", default=[140, 600])
    args = ap.parse_args()
    if args.load:
        seeds = args.seeds[0] if args.seeds != [3, 5, 8] else 5  # target.seeds' default
        load_table(args.runs, args.budgets, args.pace_sd or 0.054, args.steps_sd or 0.028,
                   seeds)  # printed row by row
        return
    pace_sd, steps_sd = fitted(args.fit) if args.fit else (0.03, 0.1)
    pace_sd = args.pace_sd if args.pace_sd is not None else pace_sd
    steps_sd = args.steps_sd if args.steps_sd is not None else steps_sd
    print(f"noise: sd of a run's log time per step {pace_sd:.4f}, of a variant's log steps "
          f"ratio {steps_sd:.4f}" + (f" (fitted to {', '.join(args.fit)})" if args.fit else "")
          + "\n")
    print("| scenario | seeds | variants | runs | any faster/slower call | true 1.3x found |")
    print("|---|---|---|---|---|---|")
    for name, effects, other in SCENARIOS:
        for seeds in args.seeds:
            r = rates(seeds, effects, pace_sd, [steps_sd if other else 0.0] * VARIANTS,
                      args.runs)
            found = "-" if name == "A/A" else f"{r['v1 found faster']:.1%}"
            print(f"| {name} | {seeds} | {VARIANTS} + baseline | {args.runs} | "
                  f"{r['any call']:.1%} | {found} |")


if __name__ == "__main__":
    main()
