"""Error rates of speedbench's verdicts, simulated through the code the command line runs.

Each simulated run drives measure.rounds.ModelRounds itself (its balanced orders, its rounds
loop and the group-sequential stopping of adaptive.wants_more_rounds), on a simulated clock with
the experiment's time budget, with a simulated measurer in place of training; then
summary.summarise gives the verdicts, as run.py does. Only the measurer and the clock are
simulated.

The noise is fitted to the committed reference trials (results/reference/*/trials.csv, every
measurement with 5+ complete rounds): a two-way fit (round + variant) of log throughput gives
the per-trial sd, the sd of the round effect (what pairing removes) and the standardised
residuals, which the simulation resamples (their light tails included). A position effect (the
first trial of a round slower by 0-5 %) is the stress case the balanced orders must absorb.

    python benchmarks/verdict_sim.py              # the table in benchmarks/README.md
    python benchmarks/verdict_sim.py --runs 200   # quicker, rougher

tests/test_verdicts_sim.py runs a small version.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speedbench.analysis import intervals  # noqa: E402
from speedbench.analysis.summary import summarise  # noqa: E402
from speedbench.measure.budget import Budget  # noqa: E402
from speedbench.measure.rounds import ModelRounds  # noqa: E402

# The default `+experiment=amp` on a 2-core CPU: bench.repeats 5, target_ci 0.03,
# time_budget_s 60 per model (the rounds' share: the probes are not simulated), and about 2 s
# per trial (a round of 3 variants, fp16 stopped, takes ~4-6 s on the reference machine).
AMP = dict(repeats=5, target_ci=0.03, time_budget_s=60.0, trial_s=2.0)


# ---- the noise model, fitted to real trials ----

def fit(paths=None, min_rounds: int = 5) -> dict:
    """Per-trial sd, round-effect sd and pooled standardised residuals (log throughput) of the
    reference measurements with at least `min_rounds` complete rounds."""
    paths = paths or sorted((ROOT / "results" / "reference").glob("*/trials.csv"))
    trial_sd, round_sd, residuals = [], [], []
    for path in paths:
        t = pd.read_csv(path)
        t = t[t["status"] == "ok"]
        key = "round" if "round" in t else "trial"
        for _, g in t.groupby(["experiment", "model"]):
            y = np.log(g.pivot_table(index=key, columns="variant", values="samples_per_s",
                                     aggfunc="median")).dropna()
            r, v = y.shape
            if r < min_rounds or v < 2:
                continue
            e = y.sub(y.mean(axis=1), axis=0).sub(y.mean(axis=0), axis=1) + y.values.mean()
            var_e = float((e.values ** 2).sum()) / ((r - 1) * (v - 1))
            var_round = max(0.0, float(y.mean(axis=1).var(ddof=1)) - var_e / v)
            trial_sd.append(math.sqrt(var_e))
            round_sd.append(math.sqrt(var_round))
            residuals.append(e.values.ravel() / math.sqrt(var_e * (r - 1) * (v - 1) / (r * v)))
    z = np.concatenate(residuals)
    return {"trial_sd": float(np.median(trial_sd)), "round_sd": float(np.median(round_sd)),
            "residuals": (z - z.mean()) / z.std(), "measurements": len(trial_sd)}


# ---- one simulated model: the CLI's rounds loop with a simulated measurer ----

class _Bar:
    total = 0

    def write(self, *_): ...

    def set_postfix_str(self, *_): ...

    def update(self, *_): ...


class SimRounds(ModelRounds):
    """ModelRounds with throughputs drawn from the noise model instead of training, and a
    simulated clock (each trial takes `trial_s` at 100 samples/s, longer when slower)."""

    def __init__(self, effects: dict[str, float], bench, noise: dict, rng, comparisons: int,
                 position_effect: float = 0.0, trial_s: float = 2.0):
        names = list(effects)
        self.plan = SimpleNamespace(variants={n: SimpleNamespace(bench=bench) for n in names},
                                    baseline=names[0], models=[SimpleNamespace(name="m")],
                                    experiment="sim")
        self.spec, self.first, self.repeats = self.plan.models[0], self.plan.variants[names[0]], \
            bench.repeats
        self.dist_env = self.run_dir = self.writer = None
        self.bar, self.skip, self.probes, self.rows = _Bar(), {}, {}, []
        self.order_seed, self.comparisons = int(rng.integers(2 ** 62)), comparisons
        self.looks = None if bench.target_ci is not None else 1
        self.effects, self.noise, self.rng = effects, noise, rng
        self.position_effect, self.trial_s, self.now, self.round_effect = \
            position_effect, trial_s, 0.0, {}
        self.stops, self.probe_steps = {}, {}
        # no data or probes simulated: the budget is the rounds'
        self.budget = Budget(bench.time_budget_s, clock=lambda: self.now)

    def measure(self, name: str, round_: int, position: int) -> dict:
        noise = self.noise
        if round_ not in self.round_effect:
            self.round_effect[round_] = self.rng.normal(0, noise["round_sd"])
        log_tp = (math.log(100 * self.effects[name]) + self.round_effect[round_]
                  + noise["trial_sd"] * self.rng.choice(noise["residuals"])
                  + (math.log1p(-self.position_effect) if position == 0 else 0.0))
        tp = math.exp(log_tp)
        self.now += self.trial_s * 100 / tp
        return {"experiment": "sim", "model": "m", "variant": name,
                "is_baseline": name == self.plan.baseline, "trial": round_, "round": round_,
                "position": position, "status": "ok", "samples_per_s": tp,
                "step_ms": 1000 / tp, "data_wait_frac": 0.0, "peak_mem_mb": 1.0,
                "host_rss_mb": 1.0, "final_loss": 1.0, "noise_threshold": 0.05}


def simulate(effects: dict[str, float], noise: dict, rng, repeats: int = 5,
             target_ci: float | None = 0.03, time_budget_s: float = 30.0, trial_s: float = 2.0,
             position_effect: float = 0.0) -> pd.DataFrame:
    """One run of one model, as the CLI runs it: the rounds, then summary.summarise."""
    bench = SimpleNamespace(repeats=repeats, target_ci=target_ci, time_budget_s=time_budget_s)
    sim = SimRounds(effects, bench, noise, rng, len(effects) - 1, position_effect, trial_s)
    for round_ in sim.rounds():
        sim.run_round(round_)
    return summarise(pd.DataFrame(sim.rows))


# ---- the measures ----

def cell(variants: int, effect: float, runs: int, noise: dict, seed: int,
         position_effect: float = 0.0, **settings) -> dict:
    """`runs` simulated runs of a baseline and `variants - 1` variants; the first non-baseline
    variant is `effect` times faster, the others identical. Family-wise false calls (any
    faster/slower among the identical ones), coverage of every CI, power on the first
    variant, mean rounds."""
    rng = np.random.default_rng(seed)
    effects = {"v0": 1.0, **{f"v{i}": 1.0 for i in range(1, variants)}}
    effects["v1"] = effect
    false_runs = covered = cis = called = rounds = 0
    for _ in range(runs):
        s = simulate(effects, noise, rng, position_effect=position_effect, **settings)
        s = s[~s["is_baseline"]].set_index("variant")
        truth = pd.Series(effects).loc[s.index]
        calls = s["verdict"].isin([intervals.FASTER, intervals.SLOWER])
        nulls = truth == 1.0
        false_runs += bool((calls & nulls).any())
        covered += int(((s["speedup_lo"] <= truth) & (truth <= s["speedup_hi"])).sum())
        cis += len(s)
        want = intervals.FASTER if effect > 1 else intervals.SLOWER
        called += s.loc["v1", "verdict"] == want
        rounds += int(s["rounds"].max())
    return {"family_false": false_runs / runs, "coverage": covered / cis,
            "power": called / runs, "rounds": rounds / runs}


def aa_rows(variants: list[int], runs: int, noise: dict, settings: dict, seed: int = 0
            ) -> list[str]:
    """A/A rows: identical variants, without and with a 5 % first-in-round slowdown."""
    lines = []
    for v in variants:
        for pos in (0.0, 0.05):
            r = cell(v, 1.0, runs, noise, seed + v, pos, **settings)
            lines.append(f"| {v} | {pos:.0%} | {r['family_false']:.2%} | {r['coverage']:.2%} | "
                         f"{r['rounds']:.1f} |")
    return lines


def power_rows(runs: int, noise: dict, settings: dict, seed: int = 0) -> list[str]:
    """Power rows: 3 variants, one truly 1.1x / 1.2x / 1.3x faster."""
    lines = []
    for effect in (1.1, 1.2, 1.3):
        r = cell(3, effect, runs, noise, seed + int(effect * 100), **settings)
        lines.append(f"| {effect:.1f}x | {r['power']:.1%} | {r['coverage']:.2%} | "
                     f"{r['rounds']:.1f} |")
    return lines


AA_HEAD = ["| variants | position effect | A/A family-wise false calls | CI coverage | mean rounds |",
           "|---|---|---|---|---|"]
POWER_HEAD = ["| true speed-up (3 variants) | called faster | CI coverage | mean rounds |",
              "|---|---|---|---|"]


def table(runs: int, noise: dict, seed: int = 0) -> list[str]:
    """The Markdown tables of benchmarks/README.md: the default amp settings (a 60 s budget:
    one look), then the default budget of 600 s (group-sequential looks)."""
    lines = [f"Noise fitted to {noise['measurements']} reference measurements: per-trial sd "
             f"{noise['trial_sd']:.3f}, round-effect sd {noise['round_sd']:.3f} (log scale); "
             f"{runs} runs per row."]
    for name, settings, variants in (("amp defaults", AMP_SETTINGS, range(2, 8)),
                                     ("bench.time_budget_s=600", LONG_SETTINGS, (2, 3, 7))):
        lines += ["", f"{name}: {settings}", "", *AA_HEAD,
                  *aa_rows(list(variants), runs, noise, settings, seed), "", *POWER_HEAD,
                  *power_rows(runs, noise, settings, seed)]
    return lines


AMP_SETTINGS = dict(AMP)
LONG_SETTINGS = dict(AMP, time_budget_s=600.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print("\n".join(table(a.runs, fit(), a.seed)))


if __name__ == "__main__":
    main()
