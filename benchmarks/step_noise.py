"""Where a trial's noise comes from, and which per-trial estimate of the step time is sharpest.

    python benchmarks/step_noise.py collect [--rounds 12] [--steps 30]   # ~15 min, 2 CPU cores
    python benchmarks/step_noise.py analyse                              # the tables, seconds

`collect` times every step of side-by-side trials, in this one process, of the three reference
models at fp32 and bf16: speedbench's trial (trial.measure_trial, its warm-up included) and a
bare, hand-written loop of the same model, data, batch and precision (run.bare_trial's loop),
the four arms of a model in a rotated order per round. Each step's time goes to
benchmarks/data/step_times.csv (tidy: model, precision, harness, round, step, step_ms).

`analyse` reads that file and compares per-trial estimators of the step time (the window's
mean, which is what a window timed between two synchronisations gives; the median; trimmed
means; the mean without stalls) by
- the per-trial CV of each arm (speedbench against the bare loop: the harness's own noise);
- the sd of the paired log ratio bf16/fp32 per round (what the speed-up's CI is made of), for
  windows of the first 5, 10, 20 or all steps, and the half-width that buys per second of
  budget (a trial costs its set-up, its warm-up and its window).
A lower sd for the same data and the same seconds is a sharper verdict in the same budget.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "step_times.csv"
MODELS = ("resnet", "vae", "transformer")
PRECISIONS = ("fp32", "bf16")
HARNESSES = ("speedbench", "bare")


# --- collect ----------------------------------------------------------------------------------
def bare_steps(spec, recipe, device, dataset, warmup: int, steps: int) -> list[float]:
    """Each timed step's seconds of a plain PyTorch loop (benchmarks/run.py's bare loop), on
    the host clock: on a CPU it is the device's."""
    from run import bare_step  # noqa: E402
    if device.type != "cpu":
        raise SystemExit("step_noise.py times the bare loop's steps on the host: CPU only")
    step = bare_step(spec, recipe, device, dataset)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def collect(rounds: int, steps: int, models: tuple[str, ...], out: Path) -> pd.DataFrame:
    import torch

    from run import plan_for  # noqa: E402
    from speedbench.measure.trial import measure_trial
    rows = []
    for model in models:
        arms = {}
        for precision in PRECISIONS:
            # one warm-up step: the steps after it, warm-up transients included, are all
            # timed, so that the analysis can choose how many to leave out
            plan, spec, recipe, dataset = plan_for(model, [f"precision={precision}",
                                                           f"bench.steps={steps}",
                                                           "bench.warmup=1",
                                                           "bench.steady_tol=null",
                                                           "bench.max_trial_s=null"])
            arms[precision] = (plan, spec, recipe, dataset)
        order = [(p, h) for p in PRECISIONS for h in HARNESSES]
        for r in range(rounds):
            for precision, harness in order[r % 4:] + order[:r % 4]:
                plan, spec, recipe, dataset = arms[precision]
                if harness == "speedbench":
                    record = measure_trial(plan, spec, plan.baseline, recipe, r, dataset)
                    if record["status"] != "ok":
                        raise RuntimeError(f"{model} {precision}: {record['status']}")
                    times = record["step_s"]
                else:
                    times = bare_steps(spec, recipe, torch.device(plan.device), dataset,
                                       recipe.bench.warmup, steps)
                batch = recipe.batch_size or spec.batch_size
                rows += [{"model": model, "precision": precision, "harness": harness,
                          "round": r, "step": i, "step_ms": 1000 * t, "batch": batch}
                         for i, t in enumerate(times)]
            print(f"{model}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            pd.DataFrame(rows).to_csv(out, index=False)  # what is done so far, kept
    return pd.DataFrame(rows)


# --- analyse ------------------------------------------------------------------------------------
def trimmed(x: np.ndarray, cut: float) -> float:
    x = np.sort(x)
    k = int(len(x) * cut)
    return float(x[k:len(x) - k].mean())


def no_stalls(x: np.ndarray, factor: float = 3.0) -> float:
    return float(x[x <= factor * np.median(x)].mean())


ESTIMATORS = {
    "window mean": lambda x: float(x.mean()),
    "median": lambda x: float(np.median(x)),
    "trimmed 10 %": lambda x: trimmed(x, 0.1),
    "trimmed 25 %": lambda x: trimmed(x, 0.25),
    "mean, stalls out": no_stalls,
}




# A trial's set-up in the half-width-per-second table, as benchmarks/README.md gives it (0.5 s;
# measured since at 0.09-0.17 s, stopping.TRIAL_SETUP_S: shorter windows lose a little less)
SETUP_S = 0.5


def per_trial(steps: pd.DataFrame, skip: int, window: int, estimator) -> pd.DataFrame:
    """One estimate of the step time per (model, precision, harness, round), from the steps
    skip .. skip + window - 1 (the trial's own warm-up step came before step 0)."""
    steps = steps[(steps["step"] >= skip) & (steps["step"] < skip + window)]
    return (steps.groupby(["model", "precision", "harness", "round"])["step_ms"]
            .apply(lambda s: estimator(s.to_numpy())).rename("est").reset_index())


def arm_cv(trials: pd.DataFrame) -> pd.DataFrame:
    return (trials.groupby(["model", "precision", "harness"])["est"]
            .agg(lambda s: s.std(ddof=1) / s.mean()).rename("cv").reset_index())


def ratio_sd(trials: pd.DataFrame) -> pd.DataFrame:
    """sd over rounds of log(step fp32 / step bf16): the speed-up's per-round noise."""
    wide = trials.pivot_table(index=["model", "harness", "round"], columns="precision",
                              values="est").dropna()
    log_ratio = np.log(wide["fp32"] / wide["bf16"]).rename("lr").reset_index()
    return (log_ratio.groupby(["model", "harness"])["lr"]
            .agg(sd="std", mean="mean").reset_index())


def components(steps: pd.DataFrame, skip: int) -> pd.DataFrame:
    """Per arm, on the log scale: the within-trial sd of a step, and the between-trial sd of a
    trial's mean log step beyond what the steps' own noise explains."""
    s = steps[steps["step"] >= skip].assign(log=np.log(steps["step_ms"]))
    rows = []
    for key, g in s.groupby(["model", "precision", "harness"]):
        by = g.groupby("round")["log"]
        within = float(by.var(ddof=1).mean())
        n = float(by.size().mean())
        between = max(0.0, float(by.mean().var(ddof=1)) - within / n)
        rows.append({"model": key[0], "precision": key[1], "harness": key[2],
                     "step_sd": within ** 0.5, "trial_sd": between ** 0.5,
                     "step_ms": float(g["step_ms"].median())})
    return pd.DataFrame(rows)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(r) + " |" for r in rows]]


def analyse(steps: pd.DataFrame) -> str:
    """The tables of benchmarks/README.md's "Trial noise" section."""
    out = ["Where a trial's noise lies (log scale; steps after the 2nd):", ""]
    comp = components(steps, 2)
    out += _table(["model", "precision", "harness", "median step ms", "sd of a step",
                   "sd of a trial's level"],
                  [[r.model, r.precision, r.harness, f"{r.step_ms:.0f}", f"{r.step_sd:.3f}",
                    f"{r.trial_sd:.3f}"] for r in comp.itertuples()])
    windows = [w for w in (5, 10, 20) if w <= steps["step"].max() + 1]
    models = [m for m in MODELS if m in set(steps["model"])]  # those the file holds
    out += ["", "Per-trial CV of the estimate, speedbench against the bare loop (steps 2 .. "
            "2 + window; mean of the fp32 and bf16 arms):", ""]
    rows = []
    for model in models:
        for name, est in ESTIMATORS.items():
            cells = []
            for w in windows:
                c = arm_cv(per_trial(steps, 2, w, est))
                c = c[c["model"] == model].groupby("harness")["cv"].mean()
                cells.append(f"{100 * c.get('speedbench', np.nan):.1f} / "
                             f"{100 * c.get('bare', np.nan):.1f} %")
            rows.append([model, name, *cells])
    out += _table(["model", "estimator", *[f"{w} steps" for w in windows]], rows)
    out += ["", "The paired speed-up's per-round sd (log bf16/fp32, speedbench's trials) and "
            "the half-width it buys per second of budget (sd x sqrt(seconds of a round of the "
            "two arms: set-up, 1 + skip warm-up steps, the window); lower is better:", ""]
    rows = []
    for model in models:
        step_s = steps[(steps["model"] == model) & (steps["harness"] == "speedbench")] \
            .groupby("precision")["step_ms"].median() / 1000
        for skip in (0, 2, 4):
            for name, est in ESTIMATORS.items():
                cells = []
                for w in windows:
                    sd = ratio_sd(per_trial(steps, skip, w, est))
                    sd = sd[(sd["model"] == model) & (sd["harness"] == "speedbench")]["sd"]
                    round_s = sum(SETUP_S + (1 + skip + w) * t for t in step_s)
                    cells.append(f"{sd.iloc[0]:.3f} ({sd.iloc[0] * round_s ** 0.5:.3f})"
                                 if len(sd) else "-")
                rows.append([model, str(skip), name, *cells])
    out += _table(["model", "skip", "estimator", *[f"{w} steps" for w in windows]], rows)
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("collect", "analyse"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--data", type=Path, default=DATA)
    a = ap.parse_args(argv)
    if a.what == "collect":
        a.data.parent.mkdir(parents=True, exist_ok=True)
        collect(a.rounds, a.steps, tuple(a.models.split(",")), a.data)
        print(f"wrote {a.data}", file=sys.stderr)
    print(analyse(pd.read_csv(a.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
