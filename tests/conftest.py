"""Shared test helpers: compose configs on the CPU, run the CLI, tiny settings that keep CI fast."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from speedbench.config import config_dir, register_schema

# Tiny models and windows: every test trains for seconds, not minutes.
TINY = [
    "scale=small", "device=cpu", "batch_size=4",
    "bench.warmup=1", "bench.steps=2", "bench.repeats=2", "bench.max_trial_s=20",
    "bench.steady_tol=null",  # a fixed warm-up: steady-state detection would add steps
    "bench.target_ci=null",  # exactly `repeats` rounds: no adaptive rounds up to the budget
    "bench.quality_steps=2", "bench.quality_seeds=1",  # a short quality probe per variant
    "bench.peak_s=0.05",  # the matmul peak's plumbing, not a settled peak
    "models.resnet.small.dataset.image_size=32",
    "models.vae.small.image_size=32", "models.vae.small.dataset.image_size=32",
    "models.transformer.small.seq_len=16", "models.transformer.small.dataset.seq_len=16",
]


# Narrower still, where a test checks plumbing (files, rows, statuses) rather than a measurement.
# ResNet-18 has no smaller sibling: leave it out there (a bf16 step of it takes seconds on a CPU).
SMALL_MODELS = [
    "models.vae.small.image_size=16", "models.vae.small.dataset.image_size=16",
    "models.vae.small.width=8", "models.vae.small.latent=8",
    "models.transformer.small.dim=32", "models.transformer.small.layers=1",
]


def compose_cfg(*overrides: str, experiment: str | None = None):
    """The config Hydra would compose for `python -m speedbench [+experiment=E] overrides`."""
    register_schema()
    args = list(overrides) + ([f"+experiment={experiment}"] if experiment else [])
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=args)


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600,
            module: str = "speedbench") -> subprocess.CompletedProcess:
    """`python -m speedbench args...` in a subprocess, like a user at a shell."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # the checkout's src/ first, absolute: a relative PYTHONPATH=src does not reach a child
    # started in another folder, which would then import an installed speedbench instead
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m speedbench args...` in this process: what run_cli returns, without a torch
    import per call. For tables of cases; keep one run_cli per path through the program."""
    import contextlib
    import io
    import logging
    import signal

    from hydra.core.global_hydra import GlobalHydra

    from speedbench.__main__ import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    root = logging.getLogger()
    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {sig: signal.getsignal(sig) for sig in stopping}  # main() installs its own
    saved = (sys.argv, os.getcwd(), root.handlers[:], root.level)
    GlobalHydra.instance().clear()
    try:
        sys.argv = ["speedbench", *args]
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
    finally:
        sys.argv, cwd_before, root.handlers[:], level = saved
        os.chdir(cwd_before)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.setLevel(level)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


def only_run_dir(root: Path) -> Path:
    """The single run directory a CLI call made under `root` (fails if not exactly one)."""
    dirs = [p.parent for p in root.rglob("trials.csv")]
    assert len(dirs) == 1, f"expected one run directory under {root}, found {dirs}"
    return dirs[0]


@pytest.fixture(autouse=True)
def _few_threads():
    """Keep each test to the two cores CI has, and restore torch's thread count afterwards."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: whole CLI runs, torchrun jobs, signals "
                          "and races (about half an hour on 2 cores; CI runs them)")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity), as speedbench counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if usable_cores() < 2:  # speedbench refuses more CPU ranks than cores (config.check_plan)
        skip = pytest.mark.skip(reason="starts two CPU ranks; this process may use 1 core")
        for item in items:
            if "distributed" in item.keywords and "gpu" not in item.keywords:
                item.add_marker(skip)
    # The developer's loop leaves the slow tier out (`--slow` puts it back); a test named on the
    # command line, or chosen with -m or -k, always runs.
    if config.getoption("--slow") or config.getoption("-m") or config.getoption("-k") \
            or _named(config):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


def _named(config) -> bool:
    """Whether the command line names tests (file::test) rather than folders or files."""
    return any("::" in str(arg) for arg in config.args)


def default_sigint() -> None:
    """preexec_fn for a child the test will Ctrl-C: a shell starts background jobs with SIGINT
    ignored, the child would inherit that, and Python then installs no KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def without_busy_note(text: str) -> str:
    """A console text without the line of threads a busy machine's run sets (env.threads_plan),
    which a loaded test machine adds before what a test checks."""
    return "\n".join(line for line in text.splitlines() if not THREADS_LINE.match(line))


THREADS_LINE = re.compile(r"speedbench: \d+ threads?, not torch's \d+")


def said_lines(text: str) -> list[str]:
    """speedbench's own lines of a console text, without the busy machine's note (a loaded test
    machine adds it first: not what a test of another message counts)."""
    return [ln for ln in without_busy_note(text).splitlines() if ln.startswith("speedbench:")]


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node SLURM cluster (tests/slurm_cluster.py) for the session; skipped with
    the reason where SLURM cannot start here; its daemons ended by PID afterwards."""
    import slurm_cluster

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="needs hydra-submitit-launcher (pip install -e '.[test]')")
    cluster = slurm_cluster.start()
    if isinstance(cluster, str):
        pytest.skip(cluster)
    yield cluster
    slurm_cluster.stop(cluster)
