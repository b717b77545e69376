"""speedbench's own benchmarks: is the instrument light, accurate and repeatable?

    python benchmarks/run.py            # benchmarks/README.md's figures (~15 min, 2 CPU cores)
    python benchmarks/run.py --quick    # a smoke run of every figure (under a minute)

Prints one markdown table of figures (not pass/fail):
- harness overhead: a speedbench trial (trial.measure_trial, train.Trainer) against a bare,
  hand-written loop of the same model, batch, data and precision, in pairs interleaved in this
  one process (order alternated, ABBA); the ratio of median throughputs with a bootstrap CI;
- agreement: speedbench's window clock (timing.timed_steps) against torch.utils.benchmark.Timer
  on the same Trainer.step, alternated on one warmed-up trainer;
- repeatability: CV of trial throughput and half-width of the speed-up CI, from a run of
  `+experiment=amp` at default settings, and the fraction of the measured matmul peak;
- wall time of `+experiment=amp` and of `+experiment=tips` through the CLI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's speedbench, whatever is installed

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from torch.utils.benchmark import Timer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from speedbench import techniques  # noqa: E402
from speedbench.analysis import intervals  # noqa: E402
from speedbench.config import build_plan, config_dir, register_schema  # noqa: E402
from speedbench.measure import env  # noqa: E402
from speedbench.measure.data import build_dataset, build_loader  # noqa: E402
from speedbench.measure.trial import context, dataset_length, measure_trial  # noqa: E402
from speedbench.measure.timing import PhaseClock, synchronize, timed_steps, warm_up  # noqa: E402
from speedbench.measure.train import Trainer, build_model  # noqa: E402

# --quick: tiny shapes (as tests/conftest.py's TINY), so every figure is produced in seconds.
TINY = ["batch_size=4", "models.resnet.small.dataset.image_size=32",
        "models.vae.small.image_size=32", "models.vae.small.dataset.image_size=32",
        "models.transformer.small.seq_len=16", "models.transformer.small.dataset.seq_len=16"]
QUICK_SUITE = TINY + ["bench.warmup=1", "bench.steps=2", "bench.repeats=2",
                      "bench.steady_tol=null", "bench.target_ci=null", "model=transformer"]


def plan_for(model: str, overrides: list[str]):
    """The Plan `python -m speedbench model=MODEL overrides` would run (one default variant)."""
    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", *overrides])
    plan = build_plan(cfg, "benchmark")
    spec = plan.models[0]
    recipe = plan.variants[plan.baseline]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=recipe.bench.seed)
    return plan, spec, recipe, dataset


# --- the bare loop: what a user would write by hand, nothing of speedbench in it -----------------
def bare_step(spec, recipe, device: torch.device, dataset):
    """One optimizer step of a plain PyTorch loop over the same model, data, batch and
    precision, as a function (each call a step)."""
    batch, seed = recipe.batch_size or spec.batch_size, recipe.bench.seed
    torch.manual_seed(seed)
    model = instantiate(spec.target).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(recipe.precision)
    scaler = torch.amp.GradScaler(device.type) if recipe.precision == "fp16" else None
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    batches = iter(loader)

    def step():
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            if spec.loss == "module":
                loss = model(x, y)
            else:
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def bare_trial(spec, recipe, device: torch.device, dataset, warmup: int, steps: int) -> float:
    """Samples/s of a plain PyTorch loop over the same model, data, batch and precision."""
    step = bare_step(spec, recipe, device, dataset)
    for _ in range(warmup):
        step()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return steps * (recipe.batch_size or spec.batch_size) / (time.perf_counter() - t0)


def overhead(model: str, overrides: list[str], rounds: int) -> dict:
    """Pairs (speedbench trial, bare loop), order alternated; fixed warm-up and window for both."""
    fixed = overrides + ["bench.steady_tol=null", "bench.max_trial_s=null"]
    plan, spec, recipe, dataset = plan_for(model, fixed)
    device = torch.device(plan.device)
    harness, bare = [], []
    for r in range(rounds):
        for which in (("harness", "bare") if r % 2 == 0 else ("bare", "harness")):
            if which == "harness":
                record = measure_trial(plan, spec, plan.baseline, recipe, r, dataset)
                if record["status"] != "ok":
                    raise RuntimeError(f"speedbench trial failed: {record['status']}")
                harness.append(record["samples_per_s"])
            else:
                bare.append(bare_trial(spec, recipe, device, dataset, recipe.bench.warmup,
                                       recipe.bench.steps))
    ratio, lo, hi = intervals.unpaired_ratio_ci(np.array(harness), np.array(bare))
    paired = statistics.median(h / b for h, b in zip(harness, bare))
    return {"model": model, "harness": statistics.median(harness), "bare": statistics.median(bare),
            "ratio": ratio, "lo": lo, "hi": hi, "paired": paired, "rounds": rounds,
            "steps": recipe.bench.steps, "batch": recipe.batch_size or spec.batch_size,
            "harness_cv": _cv(harness), "bare_cv": _cv(bare)}


def agreement(model: str, overrides: list[str], rounds: int, min_run_time: float) -> dict:
    """speedbench's window clock vs torch.utils.benchmark.Timer, alternated on one trainer."""
    plan, spec, recipe, dataset = plan_for(model, overrides)
    device = torch.device(plan.device)
    batch = recipe.batch_size or spec.batch_size
    model_ = build_model(spec, recipe.bench.seed).to(device)
    loader = build_loader(dataset, batch, techniques.loader_options(recipe, context(plan)),
                          seed=recipe.bench.seed)
    trainer = Trainer(spec, recipe, device, loader, clock=PhaseClock(device), model=model_)
    warm_up(trainer.step, device, recipe.bench.warmup, recipe.bench.warmup_max,
            recipe.bench.steady_tol)
    # Timer defaults to one thread: give it the threads speedbench runs with.
    timer = Timer(stmt="step()", globals={"step": trainer.step},
                  num_threads=torch.get_num_threads())
    ours, theirs = [], []
    try:
        for r in range(rounds):
            for which in (("ours", "timer") if r % 2 == 0 else ("timer", "ours")):
                if which == "ours":
                    elapsed, steps = timed_steps(trainer.step, recipe.bench.steps, device)
                    ours.append(1000 * elapsed / steps)
                else:  # the same window length: one block of `steps` calls
                    theirs.append(1000 * timer.timeit(number=recipe.bench.steps).median)
        # Timer's own way, for reference: the median of many short blocks.
        auto = 1000 * timer.blocked_autorange(min_run_time=min_run_time).median
    finally:
        trainer.close()
    a, b = statistics.median(ours), statistics.median(theirs)
    return {"model": model, "speedbench_ms": a, "timer_ms": b, "diff": a / b - 1, "rounds": rounds,
            "autorange_ms": auto, "steps": recipe.bench.steps}


def note(message: str) -> None:
    """Progress on stderr; the table alone goes to stdout."""
    print(f"[benchmarks] {message}", file=sys.stderr, flush=True)


def _cv(values) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else math.nan


# --- whole experiments through the CLI ------------------------------------------------------
def cli_run(experiment: str, overrides: list[str], out: Path) -> dict:
    """`python -m speedbench +experiment=E overrides` in a subprocess: wall time and summary."""
    run_dir = out / experiment
    cmd = [sys.executable, "-m", "speedbench", f"+experiment={experiment}", f"run_dir={run_dir}",
           *overrides]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    summaries = list(run_dir.rglob("summary.csv"))
    summary = pd.concat([pd.read_csv(p) for p in summaries]) if summaries else pd.DataFrame()
    return {"wall_s": wall, "summary": summary, "dir": run_dir}


def repeatability(summary: pd.DataFrame) -> dict:
    ok = summary[summary["status"] == "ok"]
    rest = ok[~ok["is_baseline"].astype(bool)]
    half = ((rest["speedup_hi"] - rest["speedup_lo"]) / 2).dropna()
    fp32 = ok[ok["variant"] == "fp32"] if "peak_fraction" in ok else ok.iloc[0:0]
    return {"cv_median": ok["cv"].median(), "cv_max": ok["cv"].max(),
            "half_median": half.median() if len(half) else math.nan,
            "half_max": half.max() if len(half) else math.nan,
            "peak_fraction": fp32["peak_fraction"].median() if len(fp32) else math.nan,
            "rows": len(ok)}


# --- the table -----------------------------------------------------------------------------------
def fmt(x, spec=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    out = ["| figure | measured | goal | how |", "|---|---|---|---|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few rounds: a smoke run")
    ap.add_argument("--models", default="transformer,resnet",
                    help="models for overhead and agreement (comma-separated)")
    ap.add_argument("--rounds", type=int, default=None, help="pairs per overhead/agreement figure")
    ap.add_argument("--no-suites", action="store_true", help="skip the amp and tips runs")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, help="torch threads here and OMP_NUM_THREADS for the "
                    "CLI runs (default: torch's default, one per core)")
    ap.add_argument("--json", type=Path, help="also write the raw figures to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    rounds = args.rounds or (2 if args.quick else 10)
    base = [f"device={args.device}"] + (TINY + ["bench.warmup=1", "bench.steps=3"] if args.quick
                                        else ["scale=small"])
    models = [m for m in args.models.split(",") if m]
    if args.quick:
        models = models[:1]
    started = time.perf_counter()
    load_before = env.load_average()
    raw = {"quick": args.quick, "env": env.collect(args.device)}
    rows = harness_rows(models, base, rounds, args.quick, raw)
    if args.no_suites:
        rows.append(("repeatability, wall times", "skipped (--no-suites)", "", ""))
    else:
        rows += suite_rows(args.device, args.quick, raw)

    e = raw["env"]
    print(table(rows))
    print(f"\n{e['cpu_model']}, {e['cpu_count']} cores, {e['torch_threads']} torch threads, "
          f"device {args.device}, torch {e['versions']['torch']}; load average "
          f"{load_before} before, {env.load_average()} after; "
          f"{time.perf_counter() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    return 0


def harness_rows(models: list[str], base: list[str], rounds: int, quick: bool,
                 raw: dict) -> list[tuple]:
    """The overhead and agreement figures of each model (their raw values go into `raw`)."""
    rows = []
    for m in models:
        note(f"harness overhead: {m}, {rounds} pairs")
        o = overhead(m, base, rounds)
        raw.setdefault("overhead", []).append(o)
        rows.append((f"harness overhead, {m} (bs {o['batch']}, {o['steps']} steps)",
                     f"{fmt(o['ratio'])} [{fmt(o['lo'])}, {fmt(o['hi'])}]; "
                     f"paired {fmt(o['paired'])}",
                     ">= 0.98",
                     f"speedbench {fmt(o['harness'], '.1f')} vs bare {fmt(o['bare'], '.1f')} "
                     "samples/s, "
                     f"median of {o['rounds']} interleaved pairs"))
    for m in models:
        note(f"agreement with torch.utils.benchmark.Timer: {m}, {rounds} rounds")
        a = agreement(m, base, rounds, min_run_time=0.3 if quick else 2.0)
        raw.setdefault("agreement", []).append(a)
        rows.append((f"agreement with torch Timer, {m}", f"{a['diff']:+.1%}", "within 5 %",
                     f"step {fmt(a['speedbench_ms'], '.2f')} ms (timed_steps) vs "
                     f"{fmt(a['timer_ms'], '.2f')} ms (Timer.timeit, {a['steps']} steps), medians "
                     f"of {a['rounds']} alternated windows; Timer.blocked_autorange median "
                     f"{fmt(a['autorange_ms'], '.2f')} ms"))
    return rows


def suite_rows(device: str, quick: bool, raw: dict) -> list[tuple]:
    """Repeatability and wall time from `+experiment=amp` (and `tips`) through the CLI."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="speedbench-bench-") as tmp:
        suite = [f"device={device}"] + (QUICK_SUITE if quick else [])
        note("python -m speedbench +experiment=amp")
        amp = cli_run("amp", suite, Path(tmp))
        rep = repeatability(amp["summary"])
        raw["amp"] = {"wall_s": amp["wall_s"], **rep}
        settings = "--quick settings" if quick else "default settings"
        rows.append(("repeatability: CV of trial throughput",
                     f"median {fmt(rep['cv_median'])}, max {fmt(rep['cv_max'])}", "",
                     f"+experiment=amp, {settings}, {rep['rows']} (model, variant) rows"))
        rows.append(("repeatability: speed-up CI half-width",
                     f"median {fmt(rep['half_median'])}, max {fmt(rep['half_max'])}", "",
                     "95 % bootstrap CI of the ratio of medians, non-baseline rows of amp"))
        rows.append(("fraction of measured matmul peak, fp32 (amp)",
                     fmt(rep["peak_fraction"]), "", "median over models; FlopCounterMode "
                     "FLOPs / step time / best n x n matmul rate"))
        rows.append(("wall time, +experiment=amp", f"{amp['wall_s']:.0f} s", "",
                     f"CLI in a subprocess, {settings}"))
        if quick:
            rows.append(("wall time, +experiment=tips", "skipped (--quick)", "", ""))
        elif (ROOT / "configs" / "experiment" / "tips.yaml").exists():
            note("python -m speedbench +experiment=tips")
            tips = cli_run("tips", suite, Path(tmp))
            raw["tips"] = {"wall_s": tips["wall_s"]}
            rows.append(("wall time, +experiment=tips", f"{tips['wall_s']:.0f} s", "",
                         "CLI in a subprocess, default settings"))
        else:
            rows.append(("wall time, +experiment=tips",
                         "absent (configs/experiment/tips.yaml not in this checkout)", "", ""))
    return rows


if __name__ == "__main__":
    sys.exit(main())
