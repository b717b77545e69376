"""The step hook's overhead against the built-in step, paired, in one process.

The reference transformer (scale small, or full on CUDA with --full) trained two ways from the
same weights on the same batches: the built-in Trainer.step, and a HookTrainer whose model's
`speedbench_step` does what the built-in step does (forward under sb.autocast(), sb.backward,
sb.step). Blocks of --steps steps alternate A B B A ... (--blocks pairs), each block's mean
step time kept; the overhead is the median over pairs of hook/built-in, with the pairs' 10th
and 90th percentiles. Untimed warm-up first. Prints one line per precision.

    PYTHONPATH=src python benchmarks/hook_overhead.py [--precision fp32 bf16] [--blocks 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from speedbench.config import build_plan
from speedbench.config.schema import register_schema
from speedbench.measure.data import build_dataset, build_loader
from speedbench.measure.step_hook import HookTrainer
from speedbench.measure.timing import synchronize
from speedbench.measure.train import Trainer, build_model
from speedbench.techniques import Context


def hooked(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with a speedbench_step that does what the built-in step does."""
    def speedbench_step(batch, sb):
        x, y = batch
        with sb.autocast():
            loss = sb.model(x, y)
        sb.backward(loss)
        sb.step()
        return loss
    model.speedbench_step = speedbench_step
    return model


def plan(precision: str, full: bool):
    from hydra import compose, initialize_config_dir
    from speedbench.config.schema import config_dir
    register_schema()
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = compose("config", [f"device={'cuda' if full else 'cpu'}",
                                 f"scale={'full' if full else 'small'}", "model=transformer",
                                 f"precision={precision}"])
    return build_plan(cfg, None)


def block_ms(trainer, steps: int, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / steps


def measure(precision: str, blocks: int, steps: int, full: bool) -> str:
    p = plan(precision, full)
    spec, recipe = p.models[0], p.variants["default"]
    device = torch.device(p.device)
    data = build_dataset(spec.dataset, 4096, None, seed=0)
    trainers = []
    for make in (lambda m: m, hooked):
        model = make(build_model(spec, 0).to(device))
        loader = build_loader(data, spec.batch_size, {"num_workers": 0}, seed=0)
        cls = HookTrainer if hasattr(model, "speedbench_step") else Trainer
        trainers.append(cls(spec, recipe, device, loader, model=model,
                            ctx=Context(device=device, model=model)))
    for t in trainers:
        block_ms(t, steps, device)  # warm-up
    ratios, base, hook = [], [], []
    for i in range(blocks):
        order = trainers if i % 2 == 0 else trainers[::-1]
        got = {id(t): block_ms(t, steps, device) for t in order}
        base.append(got[id(trainers[0])])
        hook.append(got[id(trainers[1])])
        ratios.append(hook[-1] / base[-1])
    q = statistics.quantiles(ratios, n=10)
    return (f"{precision}: built-in {statistics.median(base):.2f} ms/step, hook "
            f"{statistics.median(hook):.2f} ms/step; hook/built-in median {statistics.median(ratios):.4f} "
            f"(pairs' 10-90 %: {q[0]:.4f}-{q[-1]:.4f}), {blocks} pairs of {steps} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--full", action="store_true", help="scale=full on CUDA")
    args = ap.parse_args()
    for precision in args.precision:
        print(measure(precision, args.blocks, args.steps, args.full), flush=True)


if __name__ == "__main__":
    main()
