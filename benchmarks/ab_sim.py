"""The paired A/B of environments (`+arms=`, config/arms.py): its error rates at the default
budget, simulated through the command line's own code, and against the run-to-run comparison
of two separate runs (`python -m speedbench.report RUN_A RUN_B`).

Three parts, each a subcommand:

- `cli`: whole A/B runs of two arms on the three reference models, through the CLI's study
  (verdict_sim.simulate_run: study.study_models' probes, plan, balanced orders, rounds loop and
  its group-sequential looks on one simulated clock and budget; then summary.summarise, the
  family the run's three comparisons), with bench.* at the CLI's defaults (config/schema.py:
  bench.time_budget_s 600 s, 10-step windows, repeats 5, target_ci 0.03 ...). Only the steps
  and the clock are simulated; each arm's trial, probe and probe seeds also pay a worker's
  start (`--start-s`: a process, torch's and speedbench's import, the data), as an arm's do.
  The rounds this gives are the study's own: it runs rounds while they fit the budget. Noise:
  verdict_sim.fit, of the committed reference trials (quiet), or of A/B runs' trials.csv
  (`--noise-from RUN_DIR ...`, each run's arms paired by round). A/A (b = a on every model):
  the run's family-wise false calls and each comparison's; coverage of the true ratio; power
  for a true `--effect` (1.1x) on every model.
- `split`: real paired rounds of A/B runs (`split RUN_DIR ...`), resampled: every window of
  2k consecutive rounds is judged twice, by the paired verdict on all 2k rounds
  (summary.summarise, the CLI's, one look, one comparison) and as two separate runs, arm a's
  trials of the first k rounds against arm b's of the last k, by report/compare.py's own
  comparison_rows (Welch's t on log throughput): how often each calls a difference the other
  does not.
- `days`: the model of two separate days (the earlier version of this script): `rounds` paired
  rounds against `rounds` trials a side on two days, each day with its own level (the round
  effect's sd times `--day-factor`).

    python benchmarks/ab_sim.py cli [--runs 200] [--start-s 4] [--noise-from RUN_DIR ...]
    python benchmarks/ab_sim.py split RUN_DIR [RUN_DIR ...] [--half 3 5]
    python benchmarks/ab_sim.py days RUN_DIR [--runs 1000] [--rounds 5] [--day-factor 1]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from speedbench.analysis import intervals  # noqa: E402
from speedbench.analysis.summary import summarise  # noqa: E402
from speedbench.config.schema import BenchConfig  # noqa: E402
from speedbench.report import compare  # noqa: E402
from speedbench.results.runs import Run  # noqa: E402
from speedbench.results.schema import TRIAL_COLUMNS  # noqa: E402

vsim = sys.modules.get("verdict_sim")  # loaded once (tests load it too)
if vsim is None:
    _spec = importlib.util.spec_from_file_location("verdict_sim", ROOT / "benchmarks" /
                                                   "verdict_sim.py")
    vsim = importlib.util.module_from_spec(_spec)
    sys.modules["verdict_sim"] = vsim  # its dataclasses look their module up
    _spec.loader.exec_module(vsim)

CALLS = (intervals.FASTER, intervals.SLOWER)
# summarise on a frame of trials.csv's many columns: pandas' fragmentation notice, once a call
warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
# a worker's start, torch's and speedbench's import, the model's data: the median gap between
# two trials of a quiet A/B run of the reference models less what costs.trial_seconds charges
# for the trial itself (transformer 4.0 s, VAE 4.9 s, ResNet 5.1 s; benchmarks/README.md)
START_S = 4.5


def trials_of(run_dir: str) -> pd.DataFrame:
    """An A/B run's trials.csv (RUN_DIR or the file itself)."""
    path = Path(run_dir)
    return pd.read_csv(path if path.suffix == ".csv" else path / "trials.csv",
                       dtype={"reference": str, "arm": str}, low_memory=False)


def arm_rows(trials: pd.DataFrame) -> pd.DataFrame:
    """The arms' own rows (their baselines, no technique under them), ok."""
    t = trials[(trials["status"] == "ok") & trials["arm"].notna()]
    return t[t["reference"].fillna("") == ""]


# ---- cli: whole A/B runs through the CLI's study -------------------------------------------

class ArmTraining(vsim.SimTraining):
    """verdict_sim's instruments with an arm's costs: every trial, probe and probe seeds call
    is a worker that first starts (START_S on the clock, outside the timed window), and the
    rows carry their arm, as an A/B run's do."""

    start_s = START_S

    def header(self, mc, name: str, round_: int, position: int) -> dict:
        return {**super().header(mc, name, round_, position), "arm": name, "reference": ""}

    def probe(self, mc, name, dataset, ref, steps, left_s):
        self.clock.now += self.start_s
        return super().probe(mc, name, dataset, ref, steps, max(0.0, left_s - self.start_s))

    def more_seeds(self, mc, name, dataset, steps, left_s):
        self.clock.now += self.start_s
        return super().more_seeds(mc, name, dataset, steps, max(0.0, left_s - self.start_s))

    def trial(self, mc, name, round_, position, dataset, probe, budget):
        self.clock.now += self.start_s
        return super().trial(mc, name, round_, position, dataset, probe, budget)


def default_settings() -> "vsim.Settings":
    """bench.* as the CLI's defaults (config/schema.py's BenchConfig)."""
    b = BenchConfig()
    return vsim.Settings(time_budget_s=b.time_budget_s, repeats=b.repeats,
                         target_ci=b.target_ci, quality_steps=b.quality_steps,
                         quality_seeds=b.quality_seeds, too_slow_factor=b.too_slow_factor,
                         warmup=b.warmup, steps=b.steps, max_trial_s=b.max_trial_s,
                         noise_threshold=b.noise_threshold, steady_tol=b.steady_tol)


def ab_models(ratio: float) -> list:
    """The three reference models (verdict_sim's fp32 steps), arm b `ratio` times arm a."""
    return [vsim.SimModel(m.name, m.step_s, {"a": 1.0, "b": ratio}) for m in vsim.amp_models()]


def cli_runs(ratio: float, runs: int, noise: dict, seed: int, start_s: float) -> dict:
    """`runs` simulated A/B runs with b `ratio` times a on every model: the family-wise calls,
    each comparison's calls and faster calls, the coverage, the rounds, the run's seconds."""
    rng, settings = np.random.default_rng(seed), default_settings()
    training = type("Arms", (ArmTraining,), {"start_s": start_s})
    family, calls, faster, covered, cis, rounds, seconds = 0, [], [], 0, 0, [], []
    for _ in range(runs):
        summary, took = vsim.simulate_run(ab_models(ratio), noise, rng, settings,
                                          training=training)
        rows = summary[~summary["is_baseline"].astype(bool)]
        called = rows["verdict"].isin(CALLS)
        family += bool(called.any())
        calls += list(called)
        faster += list(rows["verdict"] == intervals.FASTER)
        ok = rows["speedup_lo"].notna()
        cis += int(ok.sum())
        covered += int(((rows["speedup_lo"] <= ratio) & (ratio <= rows["speedup_hi"]))[ok].sum())
        rounds += list(pd.to_numeric(rows["rounds"], errors="coerce").fillna(0))
        seconds.append(took)
    return {"family": family / runs, "calls": float(np.mean(calls)),
            "faster": float(np.mean(faster)), "coverage": covered / max(cis, 1),
            "rounds": np.array(rounds), "seconds": float(np.mean(seconds)),
            "seconds_max": float(np.max(seconds))}


def ab_noise(run_dirs: list[str], min_rounds: int) -> dict:
    """verdict_sim.fit of A/B runs' arm rows (each run's arms paired by round)."""
    with tempfile.TemporaryDirectory() as tmp:  # fit reads files: the arm rows, apart
        paths = [Path(tmp) / f"{i}.csv" for i in range(len(run_dirs))]
        for run_dir, path in zip(run_dirs, paths):
            arm_rows(trials_of(run_dir)).to_csv(path, index=False)
        noise = vsim.fit(paths, min_rounds=min_rounds, steps=None)
    return {**noise, "source": f"{len(run_dirs)} A/B runs' trials.csv"}


def cli_table(runs: int, noise: dict, seed: int, start_s: float, effect: float) -> list[str]:
    s = default_settings()
    lines = [f"Noise: per-trial sd {noise['trial_sd']:.3f}, round-effect sd "
             f"{noise['round_sd']:.3f} (log), from {noise['source']} ({noise['measurements']} "
             f"measurements); a worker's start {start_s:g} s; bench.time_budget_s "
             f"{s.time_budget_s:g}, {s.steps}-step windows, repeats {s.repeats}, target_ci "
             f"{s.target_ci}; {runs} runs per row, 3 models (3 comparisons).", "",
             "| true b/a | family-wise calls | calls per comparison | called faster | CI "
             "coverage | rounds per model: mean (5-95 %) | mean run s (max) |",
             "|---|---|---|---|---|---|---|"]
    for ratio in (1.0, effect):
        r = cli_runs(ratio, runs, noise, seed, start_s)
        lo, hi = np.percentile(r["rounds"], [5, 95])
        lines.append(f"| {ratio:g}x | {r['family']:.1%} | {r['calls']:.1%} | {r['faster']:.1%} "
                     f"| {r['coverage']:.1%} | {r['rounds'].mean():.1f} ({lo:.0f}-{hi:.0f}) | "
                     f"{r['seconds']:.0f} ({r['seconds_max']:.0f}) |")
    return lines


# ---- split: real paired rounds, judged paired and as two separate runs ---------------------

def _as_run(rows: pd.DataFrame, label: str) -> Run:
    """Rows of one arm as a separate run of the default recipe (what RUN_A or RUN_B holds)."""
    trials = rows.assign(variant="default", is_baseline=True, arm=np.nan, reference=np.nan)
    summary = trials[["experiment", "model", "variant"]].drop_duplicates().assign(status="ok")
    return Run(Path(label), trials, summary, {}, {}, label=label)


def paired_verdict(rows: pd.DataFrame, arm: str) -> str:
    """The CLI's paired verdict (summary.summarise) of `arm` over the baseline arm on `rows`,
    at one look (the windows are fixed samples, as the separate runs' are)."""
    fixed = rows.assign(looks=np.nan, min_rounds=np.nan, look_every=np.nan)
    s = summarise(fixed)
    return str(s.loc[s["variant"] == arm, "verdict"].iloc[0])


def separate_verdict(first: pd.DataFrame, second: pd.DataFrame) -> str:
    """report/compare.py's verdict of run B (`second`) against run A (`first`)."""
    runs = [_as_run(first, "A"), _as_run(second, "B")]
    keys, _ = compare.align(runs)
    return str(compare.comparison_rows(runs, keys)["verdict"].iloc[0])


def windows(rows: pd.DataFrame, base: str, arm: str, half: int):
    """Every 2 x `half` consecutive complete rounds of `base` and `arm` in one model: (the
    rows of both arms in them, arm a's rows of the first half, arm b's of the second)."""
    both = rows[rows["arm"].isin([base, arm])]
    complete = both.groupby("round")["arm"].nunique()
    rounds = sorted(complete[complete == 2].index)
    for start in range(len(rounds) - 2 * half + 1):
        first, second = rounds[start:start + half], rounds[start + half:start + 2 * half]
        inside = both[both["round"].isin(first + second)]
        yield (inside, inside[(inside["arm"] == base) & inside["round"].isin(first)],
               inside[(inside["arm"] == arm) & inside["round"].isin(second)])


def split_rows(run_dir: str, half: int) -> list[dict]:
    """Per model and arm against the baseline arm: each window's two verdicts."""
    t = arm_rows(trials_of(run_dir))
    out = []
    for model, rows in t.groupby("model"):
        base = rows.loc[rows["is_baseline"].astype(bool), "arm"]
        if base.empty:
            continue
        for arm in sorted(set(rows["arm"]) - {base.iloc[0]}):
            for inside, first, second in windows(rows, base.iloc[0], arm, half):
                out.append({"run": Path(run_dir).name, "model": model, "arms": f"{arm}/"
                            f"{base.iloc[0]}", "half": half,
                            "paired": paired_verdict(inside, arm),
                            "separate": separate_verdict(first, second)})
    return out


def split_table(run_dirs: list[str], halves: list[int]) -> list[str]:
    rows = pd.DataFrame([r for d in run_dirs for h in halves for r in split_rows(d, h)])
    if rows.empty:
        return ["no window: each run needs 2 x --half complete paired rounds"]
    rows["p"] = rows["paired"].isin(CALLS)
    rows["s"] = rows["separate"].isin(CALLS)
    lines = ["| run | model | arms | rounds (k + k) | windows | paired calls | separate-runs "
             "calls | paired only | separate only |", "|---|---|---|---|---|---|---|---|---|"]
    for (run, model, arms, half), g in rows.groupby(["run", "model", "arms", "half"]):
        lines.append(f"| {run} | {model} | {arms} | {half} + {half} | {len(g)} | "
                     f"{g['p'].mean():.0%} | {g['s'].mean():.0%} | "
                     f"{(g['p'] & ~g['s']).mean():.0%} | {(g['s'] & ~g['p']).mean():.0%} |")
    return lines


# ---- days: the model of two separate days --------------------------------------------------

def fitted_noise(trials: pd.DataFrame) -> tuple[float, float]:
    """(per-trial sd, round-effect sd) of log throughput, from the arms' baseline rows."""
    rows = arm_rows(trials)
    y = np.log(rows.pivot_table(index="round", columns="variant", values="samples_per_s"))
    y = y.dropna()
    trial_sd, round_sd, _ = vsim._two_way(y)
    return trial_sd, round_sd


def _frame(a: np.ndarray, b: np.ndarray) -> pd.DataFrame:
    rows = [{"experiment": "ab", "model": "m", "variant": v, "is_baseline": v == "a",
             "status": "ok", "trial": r, "round": r, "samples_per_s": float(x),
             "step_ms": 1000 / float(x)} for v, xs in (("a", a), ("b", b))
            for r, x in enumerate(xs)]
    frame = pd.DataFrame(rows)
    for column in TRIAL_COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    return frame


def paired_call(rng, ratio: float, rounds: int, trial_sd: float, round_sd: float):
    drift = rng.normal(0, round_sd, rounds)
    a = np.exp(drift + rng.normal(0, trial_sd, rounds))
    b = ratio * np.exp(drift + rng.normal(0, trial_sd, rounds))
    row = summarise(_frame(a, b)).set_index("variant").loc["b"]
    return row["verdict"], row["speedup_lo"] <= ratio <= row["speedup_hi"]


def separate_call(rng, ratio: float, rounds: int, trial_sd: float, round_sd: float,
                  day_sd: float) -> tuple[str, bool, str]:
    def day(level: float) -> np.ndarray:
        return level * np.exp(rng.normal(0, day_sd) + rng.normal(0, round_sd, rounds)
                              + rng.normal(0, trial_sd, rounds))
    a, b = day(1.0), day(ratio)
    point, lo, hi = intervals.welch_ratio_ci(b, a)
    _, blo, bhi = intervals.unpaired_ratio_ci(b, a, resamples=500)
    return intervals.verdict(lo, hi), lo <= ratio <= hi, intervals.verdict(blo, bhi)


def simulate(trial_sd: float, round_sd: float, ratio: float, rounds: int, runs: int,
             day_factor: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    paired = [paired_call(rng, ratio, rounds, trial_sd, round_sd) for _ in range(runs)]
    separate = [separate_call(rng, ratio, rounds, trial_sd, round_sd, day_factor * round_sd)
                for _ in range(runs)]
    return {"ratio": ratio, "rounds": rounds,
            "paired calls": np.mean([v in CALLS for v, _ in paired]),
            "paired coverage": np.mean([c for _, c in paired]),
            "separate Welch calls": np.mean([v in CALLS for v, _, _ in separate]),
            "separate Welch coverage": np.mean([c for _, c, _ in separate]),
            "separate bootstrap calls": np.mean([v in CALLS for _, _, v in separate])}


def days(args) -> None:
    trial_sd, round_sd = fitted_noise(trials_of(args.run_dir))
    trial_sd = args.trial_sd if args.trial_sd is not None else trial_sd
    round_sd = args.round_sd if args.round_sd is not None else round_sd
    print(f"fitted: per-trial sd {trial_sd:.3f}, round-effect sd {round_sd:.3f} (log units); "
          f"day sd = {args.day_factor:g} x the round effect's")
    table = [simulate(trial_sd, round_sd, r, args.rounds, args.runs, args.day_factor,
                      args.seed) for r in (1.0, 1.1)]
    print(pd.DataFrame(table).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cli", help="whole A/B runs through the CLI's study, default budget")
    c.add_argument("--runs", type=int, default=200)
    c.add_argument("--start-s", type=float, default=START_S)
    c.add_argument("--effect", type=float, default=1.1)
    c.add_argument("--noise-from", nargs="*", default=None, metavar="RUN_DIR")
    c.add_argument("--min-rounds", type=int, default=5)
    s = sub.add_parser("split", help="real paired rounds: paired against two separate runs")
    s.add_argument("run_dirs", nargs="+")
    s.add_argument("--half", type=int, nargs="+", default=[3, 5])
    d = sub.add_parser("days", help="the model of two separate days")
    d.add_argument("run_dir")
    d.add_argument("--runs", type=int, default=1000)
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--day-factor", type=float, default=1.0)
    d.add_argument("--trial-sd", type=float, help="instead of RUN_DIR's fit (e.g. 0.083)")
    d.add_argument("--round-sd", type=float, help="likewise (e.g. 0.050)")
    for q in (c, d):
        q.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.what == "cli":
        noise = ab_noise(args.noise_from, args.min_rounds) if args.noise_from else vsim.fit()
        print("\n".join(cli_table(args.runs, noise, args.seed, args.start_s, args.effect)))
    elif args.what == "split":
        print("\n".join(split_table(args.run_dirs, args.half)))
    else:
        days(args)


if __name__ == "__main__":
    main()
