"""Running a variant's trials and probes in its arm's interpreter (config/arms.py): a worker
process (studies/arm_worker.py) per call, fed the call as plain JSON and read back as JSON;
and the up-front check that every arm's interpreter can run one.

Each call is a fresh process of the arm's python, started with the arm's environment
variables on top of ours and speedbench's source on PYTHONPATH (the same speedbench in every
arm). Its start, torch's import and the data's building are outside the timed window. A
compiler cache of its own per arm (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), unless the arm
sets one: two torch versions must not share compiled kernels.

The variants whose techniques must set variables at a process's start (LD_PRELOAD for another
malloc or OpenMP, OMP_*/KMP_*, PYTORCH_CUDA_ALLOC_CONF) are arms of the same kind
(variant_arm): this interpreter with those variables, each trial and probe a fresh worker.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from speedbench import techniques
from speedbench.config.arms import Arm
from speedbench.errors import ConfigError
from speedbench.measure import launch
from speedbench.measure.trial import header
from speedbench.results import schema

WORKER = "speedbench.studies.arm_worker"
FACTS_TIMEOUT_S = 300.0  # torch's import on a cold disk, twice over
START_S = 120.0  # a worker's start, torch's import and the data, beside the call's own limit
# the pip package of a module an arm's interpreter may lack
PACKAGES = {"hydra": "hydra-core", "omegaconf": "hydra-core", "yaml": "pyyaml", "PIL": "pillow"}
# what the synthetic image data imports (measure/data.py: JPEG pool, augmentation)
IMAGE_MODULES = ("PIL.Image", "torchvision.transforms.v2.functional")
# variables that set torch's intra-op threads at start-up: an arm that sets one keeps it
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_JOBS: dict[int, dict] = {}  # id(plan) -> its plain data (built once per plan)


def variant_arm(plan, name: str, ctx) -> Arm | None:
    """Where variant `name`'s trials and probes run: its A/B arm, with its techniques'
    start-up variables over the arm's; without an A/B, an arm of this interpreter with those
    variables (a fresh process per trial, as LD_PRELOAD needs); None: in this process. A
    technique's LD_PRELOAD joins the arm's (the arm's libraries kept, less those it replaces)."""
    arm = plan.arms.get(name)
    start = techniques.environment(plan.variants[name], ctx, arm.env if arm else None)
    if arm is None:
        return Arm(name, sys.executable, start, implied=True) if start else None
    return replace(arm, env={**arm.env, **start}) if start else arm


def environment(arm: Arm) -> dict[str, str]:
    """The worker's environment: ours, the arm's variables, speedbench's source first on
    PYTHONPATH, and a compiler cache per A/B arm (an implied arm's torch is ours)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **arm.env, launch.PARENT_PID: str(os.getpid())}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, arm.env.get(
        "PYTHONPATH", os.environ.get("PYTHONPATH"))) if p)
    cache = Path(tempfile.gettempdir()) / f"speedbench-arm-{os.getuid()}-{arm.name}"
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if var not in arm.env and not arm.implied:
            env[var] = str(cache / sub)
    return env


def missing_line(arm: Arm, output: str) -> str:
    """One line for an arm whose worker cannot start: what to install there."""
    missing = re.findall(r"No module named '([^']+)'", output)
    if missing:
        module = missing[-1].split(".")[0]
        package = PACKAGES.get(module, module)
        return (f"arms.{arm.name}: {arm.python} cannot import {module}: install it there "
                f"({arm.python} -m pip install {package}), or make the arm with "
                "scripts/make-arm.sh")
    lines = [ln.strip() for ln in output.splitlines() if re.match(r"^\w+(Error|Exception)", ln)]
    lines = lines or [ln.strip() for ln in output.splitlines() if ln.strip()]
    detail = lines[-1][:120] if lines else "no output"
    hint = "; install a torchvision built for the arm's torch there" \
        if "torchvision" in output else ""
    return f"arms.{arm.name}: {arm.python} cannot run speedbench's worker: {detail}{hint}"


def check(plan) -> dict[str, dict]:
    """arm name -> its facts (arm_worker.facts), each arm's interpreter asked once, before any
    trial, to import what a trial and the plan's models import. ConfigError, one line saying
    what to install, for an arm that cannot."""
    modules = sorted({s.target["_target_"].rsplit(".", 1)[0] for s in plan.models
                      if isinstance(s.target, dict) and "." in str(s.target.get("_target_", ""))})
    if any(s.dataset.get("kind") == "images" for s in plan.models):
        modules += IMAGE_MODULES
    found = {}
    for arm in {a.name: a for a in plan.arms.values()}.values():
        try:
            done = subprocess.run([arm.python, "-m", WORKER, "--facts", *modules],
                                  env=environment(arm), capture_output=True, text=True,
                                  timeout=FACTS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"arms.{arm.name}: {arm.python} did not start: {exc}") from None
        if done.returncode != 0:
            raise ConfigError(missing_line(arm, done.stdout + done.stderr))
        found[arm.name] = {**json.loads(done.stdout.strip().splitlines()[-1]),
                           "env": dict(arm.env)}
    return found


def job_data(plan, spec) -> dict:
    """The plan and one model as plain data (arm_worker.plan_of rebuilds them)."""
    key = id(plan)
    if key not in _JOBS:
        _JOBS.clear()  # one plan at a time
        _JOBS[key] = {
            "experiment": plan.experiment, "device": plan.device, "scale": plan.scale,
            "baseline": plan.baseline, "config": _plain(plan.config),
            "variants": {n: _plain(r) for n, r in plan.variants.items()}}
    return {**_JOBS[key], "spec": asdict(spec)}


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True)


def trial(plan, spec, arm: Arm, name: str, round_: int, position: int = 0,
          probe: dict | None = None, left_s: float | None = None) -> dict:
    """One trial of variant `name` in a worker of `arm`: its record, or its header and why the
    worker failed (`left_s`: the budget's seconds left; None: no limit)."""
    recipe = plan.variants[name]
    got = call(plan, spec, arm, name, "trial", {"round": round_, "position": position,
                                                 "probe": probe, "left_s": left_s},
               launch.launch_timeout_s(recipe))
    return got if "experiment" in got else {**header(plan, spec, name, recipe, round_,
                                                     position=position), **got}


def to_target(plan, spec, arm: Arm, name: str, args: dict,
              left_s: float | None) -> tuple[dict, list[dict]]:
    """One time-to-target run of variant `name` in a worker of `arm` (args: the seed's index,
    the target, to_target.caps_data's caps; `left_s`: its share of the budget, None: no
    limit): (its record, its curve), or ({"status": why the worker failed}, [])."""
    got = call(plan, spec, arm, name, "to_target", args, left_s)
    return (got["record"], got["curve"]) if "record" in got else (got, [])


def job(plan, spec, arm: Arm, name: str, what: str, args: dict) -> dict:
    """A call as the worker reads it: torch's intra-op threads the parent's (as bench.threads
    set them), unless the arm sets them at its start (OMP_NUM_THREADS)."""
    threads = None if set(THREAD_VARIABLES) & set(arm.env) else torch.get_num_threads()
    return {"call": what, "plan": job_data(plan, spec), "variant": name, "args": args,
            "intra_op": threads}


def call(plan, spec, arm: Arm, name: str, what: str, args: dict,
         limit_s: float | None) -> dict:
    """One call (arm_worker.CALLS) of variant `name` in a worker of `arm`: its result, or
    {"status": why it failed} (`limit_s`: the call's own limit, START_S added)."""
    with tempfile.TemporaryDirectory(prefix="speedbench-arm-") as tmp:
        job_file, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job(plan, spec, arm, name, what, args), default=str))
        proc = subprocess.Popen([arm.python, "-m", WORKER, str(job_file), str(out)],
                                env=environment(arm), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        launch.LIVE[proc.pid] = Path(tmp)  # a second Ctrl-C kills it (launch.abandon)
        try:
            output, _ = proc.communicate(timeout=None if limit_s is None else limit_s + START_S)
        except subprocess.TimeoutExpired:
            return {"status": schema.format_status(
                schema.ERROR, f"{arm.worker()} did not end within {limit_s + START_S:.0f} s")}
        finally:
            launch.LIVE.pop(proc.pid, None)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if os.environ.get("SPEEDBENCH_DEBUG"):
            print(output, file=sys.stderr)
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        return {"status": _failure(arm, proc.returncode, output)}


def _failure(arm: Arm, returncode: int, output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines()
             if re.match(r"^\s*\w+(Error|Exception)\b.*:", ln)]
    detail = lines[-1][:160] if lines else "no message (SPEEDBENCH_DEBUG=1 shows its output)"
    return schema.format_status(schema.ERROR, f"{arm.worker()} exited with status "
                                              f"{returncode}: {detail}")
