"""The worker an arm's interpreter runs (config/arms.py, studies/arms.py): one call of the
study's instruments (a trial, a quality probe, the probe's other seeds, a time-to-target run)
from a job file of plain JSON, its result written back as JSON.

    ARM_PYTHON -m speedbench.studies.arm_worker JOB.json RESULT.json
    ARM_PYTHON -m speedbench.studies.arm_worker --facts [MODULE ...]

The arm's interpreter needs torch and speedbench's light dependencies (hydra-core, omegaconf,
pandas, psutil, tqdm); speedbench itself comes from the running one's source, on PYTHONPATH
(studies/arms.py sets it), so both arms run the same speedbench. torchvision only where a
model needs it (the ResNet, the VAE). `--facts` imports what a trial imports, and MODULEs
(the models' modules), then prints the arm's software facts as JSON: the up-front check.
Process start, the imports and the data's building are outside every timed window, as in
measure/launch.py's torchrun trials. The variants whose techniques set variables at a
process's start (LD_PRELOAD) run here too, in this interpreter (arms.variant_arm).
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import sys
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from speedbench.config.models import ModelSpec
from speedbench.config.plan import Plan
from speedbench.measure import launch
from speedbench.measure.budget import Budget
from speedbench.measure.data import build_dataset
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.studies import probes, stopping, to_target

FACTS = "--facts"


def facts() -> dict:
    """The arm's software, for env.json's `arms` and the report's A/B section: what can differ
    between two environments on one machine (the driver and the kernel cannot)."""
    shown = torch.__config__.show()
    onednn = re.search(r"(?:oneDNN|MKL-DNN)\D*v?(\d+(?:\.\d+)+)", shown)
    return {
        "python": sys.version.split()[0], "python_executable": sys.executable,
        "torch": torch.__version__, "torch_git_version": torch.version.git_version,
        "torch_cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "onednn": onednn.group(1) if onednn else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "build": _build(shown),
        "numpy": _version("numpy"), "torchvision": _version("torchvision"),
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "torch_config": shown,
    }


BUILD_KEYS = ("BLAS_INFO", "USE_CUDA", "CUDA_VERSION", "USE_CUDNN", "CUDNN_VERSION",
              "USE_MKLDNN", "USE_OPENMP")


def _build(shown: str) -> str:
    """The build settings that change kernels, from torch.__config__.show()."""
    settings = dict(re.findall(r"\b([A-Z_]+)=([^,\s]*)", shown))
    return ", ".join(f"{k}={settings[k]}" for k in BUILD_KEYS if k in settings)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def plan_of(data: dict) -> tuple[Plan, ModelSpec]:
    """The plan and model of a job, rebuilt from plain data (studies/arms.job_data)."""
    spec = ModelSpec(**data["spec"])
    variants = {n: OmegaConf.create(c) for n, c in data["variants"].items()}
    plan = Plan(data["experiment"], data["device"], data["scale"], [spec], variants,
                data["baseline"], OmegaConf.create(data["config"]))
    return plan, spec


def _dataset(plan: Plan, spec: ModelSpec):
    """The model's data set, as the study's prepare builds it: the baseline's path and seed,
    so that every arm trains on the same samples."""
    base = plan.variants[plan.baseline]
    return build_dataset(spec.dataset, dataset_length(plan, spec), base.data.path,
                         seed=base.bench.seed)


def _trial(plan, spec, name: str, args: dict, dataset) -> dict:
    budget = Budget(args["left_s"]) if args.get("left_s") is not None else None
    return measure_trial(plan, spec, name, plan.variants[name], args["round"], dataset,
                         position=args["position"], probe=args.get("probe"), budget=budget)


def _context(plan, spec, seeds: int) -> SimpleNamespace:
    """What probes.probe_variant and more_seed_losses read of a model's context."""
    return SimpleNamespace(plan=plan, spec=spec, dist_env=None,
                           settings=SimpleNamespace(quality_seeds=seeds))


def _probe(plan, spec, name: str, args: dict, dataset) -> dict:
    ref = stopping.Reference(**args["ref"]) if args.get("ref") else None
    got = probes.probe_here(_context(plan, spec, 1), name, dataset, ref, args["steps"],
                            args["left_s"])
    if got and "seed_losses" in got:  # each with its step-0 and chance loss
        got["seed_losses"] = [triple(x) for x in got["seed_losses"]]
    return {"probe": got}


def triple(loss) -> list[float]:
    """A seed's loss as plain data: [loss, initial, chance] (quality.SeedLoss)."""
    return [float(loss), getattr(loss, "initial", math.nan), getattr(loss, "chance", math.nan)]


def _more_seeds(plan, spec, name: str, args: dict, dataset) -> dict:
    got = probes.more_seeds_here(_context(plan, spec, args["seeds"]), name, dataset,
                                 args["steps"], args["left_s"])
    return {"losses": [triple(x) for x in got], "fault": getattr(got, "fault", None)}


def _to_target(plan, spec, name: str, args: dict, dataset) -> dict:
    record, curve = to_target.trained_here(plan, spec, name, args["seed"], args["target"],
                                           to_target.caps_of(args["caps"]))
    return {"record": record, "curve": curve}


CALLS = {"trial": _trial, "probe": _probe, "more_seeds": _more_seeds, "to_target": _to_target}
OWN_DATA = ("to_target",)  # calls that build data of their own (held_out's)


def run_job(job: dict) -> dict:
    """One call of a job: the plan rebuilt, torch's intra-op parallelism as the parent's, the
    data built, then the call."""
    plan, spec = plan_of(job["plan"])
    if job.get("intra_op"):  # (none where the arm sets OMP_NUM_THREADS)
        torch.set_num_threads(int(job["intra_op"]))
    dataset = None if job["call"] in OWN_DATA else _dataset(plan, spec)
    return CALLS[job["call"]](plan, spec, job["variant"], job["args"], dataset)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [FACTS]:
        for module in args[1:]:
            import_module(module)
        print(json.dumps(facts()))
        return
    if len(args) != 2:
        raise SystemExit("usage: python -m speedbench.studies.arm_worker JOB.json RESULT.json "
                         "(run by speedbench, for an arm)")
    launch.die_with_parent(signal.SIGKILL, launch.PARENT_PID)
    result = run_job(json.loads(Path(args[0]).read_text()))
    tmp = Path(args[1] + ".tmp")  # renamed whole: the parent never reads half a result
    tmp.write_text(json.dumps(result, default=float))
    os.replace(tmp, args[1])


if __name__ == "__main__":
    main()
