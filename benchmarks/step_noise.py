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


def per_trial(steps: pd.DataFrame, window: int | None, estimator) -> pd.DataFrame:
    """One estimate of the step time per (model, precision, harness, round)."""
    if window is not None:
        steps = steps[steps["step"] < window]
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


def analyse(steps: pd.DataFrame) -> str:
    out = []
    windows = sorted({5, 10, 20, int(steps["step"].max()) + 1})
    lines = ["| model | harness | estimator | " + " | ".join(f"CV, {w} steps" for w in windows)
             + " |", "|---|---|---|" + "---|" * len(windows)]
    cvs = {}
    for name, est in ESTIMATORS.items():
        for w in windows:
            cvs[(name, w)] = arm_cv(per_trial(steps, w, est))
    for model in MODELS:
        for harness in HARNESSES:
            for name in ESTIMATORS:
                cells = []
                for w in windows:
                    c = cvs[(name, w)]
                    sel = c[(c["model"] == model) & (c["harness"] == harness)]["cv"]
                    cells.append(f"{100 * sel.mean():.1f} %" if len(sel) else "-")
                lines.append(f"| {model} | {harness} | {name} | " + " | ".join(cells) + " |")
    out += ["Per-trial CV of the step time (mean of the fp32 and bf16 arms):", "", *lines, ""]
    lines = ["| model | estimator | " + " | ".join(f"sd, {w} steps" for w in windows) + " |",
             "|---|---|" + "---|" * len(windows)]
    for model in MODELS:
        for name, est in ESTIMATORS.items():
            cells = []
            for w in windows:
                sd = ratio_sd(per_trial(steps, w, est))
                sel = sd[(sd["model"] == model) & (sd["harness"] == "speedbench")]["sd"]
                cells.append(f"{sel.iloc[0]:.3f}" if len(sel) else "-")
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    out += ["sd over rounds of the paired log speed-up bf16/fp32, speedbench's trials:", "",
            *lines, ""]
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
