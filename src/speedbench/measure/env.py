"""What the machine and software were: enough to explain why two runs differ."""
from __future__ import annotations

import math
import multiprocessing
import os
import platform
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import torch

from speedbench import results

# Environment variables that change performance: these names, and any name with these prefixes.
PERF_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
             "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA", "LD_PRELOAD", "NVIDIA_TF32_OVERRIDE",
             "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "RANK",
             "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MALLOC_ARENA_MAX")
PERF_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "NCCL_",
                 "CUDA_", "CUBLAS", "CUDNN_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "SLURM_CPUS",
                 "SLURM_GPUS", "SLURM_NTASKS")
# Never record a value whose name suggests a secret.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def perf_env() -> dict[str, str]:
    """The performance-relevant environment variables that are set, sorted by name."""
    return {k: v for k, v in sorted(os.environ.items())
            if (k in PERF_VARS or k.startswith(PERF_PREFIXES))
            and not any(w in k.upper() for w in SECRET_WORDS)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# CPU features that decide which kernels oneDNN and MKL pick, so why a precision pays off on one
# CPU and not another: vector width, 16-bit arithmetic, matrix units (x86 `flags`; Arm `Features`).
SPEED_FLAGS = ("sse4_2", "fma", "f16c", "avx", "avx2", "avx_vnni", "avx512f", "avx512bw",
               "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
               "amx_int8", "amx_fp16", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


def cpu_flags(cpuinfo: str | None = None) -> list[str] | None:
    """The SPEED_FLAGS this CPU has, in SPEED_FLAGS's order (None where /proc/cpuinfo is absent)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            have = set(value.split())
            return [f for f in SPEED_FLAGS if f in have]
    return None


def record_end(env_path: Path) -> dict:
    """Add the machine's load over the run to env.json (`load_average_end`, and `machine_load`:
    the load average at the start, its highest 1-minute value while the run went, at the end,
    CPU steal and this process's own CPU share, and whether that makes the machine busy).
    Returns machine_load."""
    load = _WATCH.summary()
    results.update_json(env_path, load_average_end=load_average(), machine_load=load)
    return load


# A busy machine: other work took the cores (over a quarter of the machine's CPU time while the
# run went, from /proc/stat less the run's own; where that is not known, a load above 1.5 x the
# usable cores, the run itself counting for about one per core) or the hypervisor took them
# (steal above 10 %). The load average alone lags by a minute: a job that ended just before the
# run would make a quiet run look busy.
BUSY_LOAD_PER_CORE, BUSY_STEAL, BUSY_OTHERS = 1.5, 0.10, 0.25


def is_busy(highest: float | None, cores: int, steal: float | None,
            others: float | None) -> bool:
    if steal is not None and steal > BUSY_STEAL:
        return True
    if others is not None:
        return others > BUSY_OTHERS
    return highest is not None and highest > BUSY_LOAD_PER_CORE * cores


class _LoadWatch:
    """The load average sampled every few seconds by a daemon thread (it sleeps in between),
    from the run's start (collect) to its end (record_end), with /proc/stat's steal and this
    process's CPU time over the same span."""

    def __init__(self):
        self.started, self.thread = None, None

    def start(self) -> None:
        self.started = (time.monotonic(), _own_cpu_s(), _cpu_jiffies())
        self.first, self.highest = load_average(), None
        if self.thread is None:  # one sampler for the process, however many runs it makes
            self.thread = threading.Thread(target=self._sample, daemon=True,
                                           name="speedbench-load")
            self.thread.start()

    def _sample(self) -> None:
        while True:
            now = load_average()
            if now and (self.highest is None or now[0] > self.highest):
                self.highest = now[0]
            time.sleep(5)

    def summary(self) -> dict:
        if self.started is None:
            return {}
        wall0, cpu0, jiffies0 = self.started
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
        end = load_average()
        wall = max(time.monotonic() - wall0, 1e-9)
        jiffies, own_s = _cpu_jiffies(), _own_cpu_s() - cpu0
        steal = _steal_fraction(jiffies0, jiffies)
        others = _others_fraction(jiffies0, jiffies, own_s)
        seen = [x for x in (self.highest, end and end[0], self.first and self.first[0])
                if x is not None]
        highest = max(seen, default=None)
        return {"cores": cores, "machine_cores": os.cpu_count() or cores,
                "load_start": self.first and self.first[0],
                "load_highest": highest, "load_end": end and end[0], "cpu_steal": steal,
                "own_cpu_share": round(own_s / wall / cores, 3), "others_cpu_share": others,
                "busy": is_busy(highest, cores, steal, others)}


def _own_cpu_s() -> float:
    """CPU seconds of this process and its children, finished (os.times) and still running
    (DataLoader workers, launched trials, compile workers: psutil), so that none of the run's
    own work counts as another process's."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                c = child.cpu_times()
                own += c.user + c.system
            except psutil.Error:  # it ended meanwhile: os.times has it once it is reaped
                continue
    except Exception:  # no psutil here: the finished children only
        pass
    return own


class CpuWindow:
    """The share of the machine's CPU time other processes used from its creation to
    `others()` (/proc/stat less this run's own, children included): a trial's `others_cpu_share`
    in trials.csv, so that a burst that slowed some trials is seen in those trials, not
    diluted over the run."""

    def __init__(self):
        self.jiffies, self.own = _cpu_jiffies(), _own_cpu_s()

    def others(self) -> float:
        share = _others_fraction(self.jiffies, _cpu_jiffies(), _own_cpu_s() - self.own)
        return math.nan if share is None else share


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """(steal, total, idle incl. I/O wait) CPU time of the cores this process may use (its
    affinity: a SLURM job's, taskset's) from /proc/stat, in clock ticks; the whole machine's
    where it may use them all; None elsewhere. Other processes' share is then of the same
    cores as the run's own, so that the two add up to at most the whole."""
    try:
        lines = Path("/proc/stat").read_text().split("\n")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        per_cpu = {line.split()[0][3:]: line for line in lines
                   if line.startswith("cpu") and line[3:4].isdigit()}
        if usable and len(usable) < len(per_cpu) and all(str(c) in per_cpu for c in usable):
            rows = [[int(x) for x in per_cpu[str(c)].split()[1:]] for c in usable]
        else:
            rows = [[int(x) for x in lines[0].split()[1:]]]
    except (OSError, ValueError):
        return None
    fields = [sum(col) for col in zip(*rows)]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8]), sum(fields[3:5])


def _others_fraction(before, after, own_s: float) -> float | None:
    """The share of the machine's CPU time that other processes used between two /proc/stat
    readings: busy time (neither idle nor stolen) less this process's and its children's."""
    if not before or not after or after[1] <= before[1]:
        return None
    total = after[1] - before[1]
    busy = total - (after[2] - before[2]) - (after[0] - before[0])
    own = own_s * os.sysconf("SC_CLK_TCK")
    return round(max(0.0, busy - own) / total, 3)


def _steal_fraction(before, after) -> float | None:
    if not before or not after or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


_WATCH = _LoadWatch()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_revision() -> str | None:
    return _git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (None outside git)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_devices() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return out


def nvidia_smi() -> list[dict]:
    """Per-GPU driver, clocks, power limit and modes from nvidia-smi; [] when it is absent."""
    fields = ("index", "name", "driver_version", "pstate", "clocks.sm", "clocks.max.sm",
              "clocks.mem", "power.limit", "temperature.gpu", "utilization.gpu", "memory.used",
              "memory.total", "persistence_mode", "compute_mode", "mig.mode.current")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [dict(zip(fields, (v.strip() for v in line.split(","))))
            for line in out.stdout.strip().splitlines()]


def cuda_driver_version() -> str | None:
    """The CUDA version the driver supports (nvidia-smi's header), as opposed to torch's build."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    for token in out.stdout.split("CUDA Version:")[1:2]:
        return token.split()[0].strip("|")
    return None


def start_method() -> str:
    """The multiprocessing start method DataLoader workers use (without fixing it, which would
    make a later set_start_method fail): the one set, else the platform's default."""
    return multiprocessing.get_start_method(allow_none=True) or \
        f"{multiprocessing.get_all_start_methods()[0]} (default)"


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load: a busy machine explains a slow or noisy run."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def memory_gb() -> float | None:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        return None


def numerics() -> dict:
    """Global switches that change kernels and speed: TF32, cuDNN autotune, determinism."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "openmp_available": torch.backends.openmp.is_available(),
    }


def collect(device: str) -> dict:
    """env.json's facts at the run's start; the machine's load is watched from now on, for
    record_end."""
    _WATCH.start()
    gpus = cuda_devices()
    smi = nvidia_smi() if gpus else []
    return {
        "device": device,
        "device_name": gpus[0]["name"] if device.startswith("cuda") and gpus else cpu_model(),
        "cuda_devices": gpus,
        "cuda_device_count": len(gpus),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "nvidia_driver": smi[0]["driver_version"] if smi else None,
        "cuda_driver_version": cuda_driver_version() if smi else None,
        "nvidia_smi": smi,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": memory_gb(),
        "cpu_flags": cpu_flags(),
        "load_average": load_average(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mp_start_method": start_method(),
        "numerics": numerics(),
        "env": perf_env(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "versions": {d: _version(d) for d in ("torch", "torchvision", "hydra-core", "omegaconf",
                                                  "pandas", "numpy", "matplotlib", "psutil",
                                                  "triton", "speedbench")},
        "torch_git_version": torch.version.git_version,
        "torch_config_cpu": torch.backends.cpu.get_cpu_capability(),
        "git_revision": git_revision(),
        "git_dirty": git_dirty(),
    }


# --- the machine against the plan: threads that fit the free cores ------------------------------
LOOK_S = 0.3  # how long the start-up look at the other processes' CPU use lasts


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def others_busy_cores(seconds: float = LOOK_S) -> float | None:
    """How many of the cores this process may use (cores()) other processes keep busy, over a
    short look (None where /proc/stat cannot be read). CpuWindow's share is of those cores."""
    window = CpuWindow()
    time.sleep(seconds)
    share = window.others()
    return None if math.isnan(share) else share * cores()


def fitting_threads(cores_: int, busy: float) -> int:
    """The threads that fit the cores other processes leave free (one at least)."""
    return max(1, min(cores_, math.floor(cores_ - busy + 0.5)))


def threads_plan(setting: str | None, busy: float | None, current: int, cores_: int
                 ) -> tuple[int | None, str]:
    """(threads to set, None: leave torch's; the line to say, '' for none) for bench.threads
    (null, auto or a number) on a machine whose other processes keep `busy` cores busy. The
    default (null) keeps torch's `current` threads where they fit the free cores, and else sets
    the count that fits: on 2 cores at load 10, torch's 2 threads measured nothing where 1
    thread ran about 6x faster. One decision, at the start, for the whole run."""
    if setting not in (None, "auto"):
        return int(setting), ""
    fit = current if busy is None else fitting_threads(cores_, busy)
    if setting == "auto":
        said = f"bench.threads=auto: {fit} thread(s)" + (
            f" (other processes keep {busy:.1f} of {cores_} cores busy)" if busy else "")
        return fit, said
    if busy is None or current <= fit:
        return None, ""
    return fit, _using(fit, current, f": others keep {busy:.1f} of {cores_} cores busy")


THREADS_PIN = "(pin: bench.threads=N)"  # the end of the one line that says the run's threads


def _using(fit: int, current: int, why: str) -> str:
    return f"speedbench: {fit} thread{'s' * (fit > 1)}, not torch's {current}{why} {THREADS_PIN}"


# --- ... or a matrix product that more threads make slower --------------------------------------
RATE_N = 256  # a matrix product small enough to time in milliseconds on one core
RATES_S = 0.6  # how long the threads' matrix products may take in all, at most
RATE_MARGIN = 1.25  # fewer threads are taken where they multiply this much faster at least


def thread_counts(current: int) -> list[int]:
    """The thread counts the start-up check compares: torch's, then halvings down to one."""
    counts = [current]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


def matmul_rates(counts: list[int], seconds: float = RATES_S, rounds: int = 5
                 ) -> dict[int, float]:
    """Matrix products per second at each thread count (fp32, RATE_N square, on the CPU): the
    median of `rounds` windows, the counts interleaved so that a burst of other work slows
    them alike; fewer rounds where `seconds` run out. torch's threads are put back."""
    before = torch.get_num_threads()
    a = torch.randn(RATE_N, RATE_N)
    rates: dict[int, list[float]] = {n: [] for n in counts}
    started = time.perf_counter()
    try:
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                for _ in range(8):
                    torch.mm(a, a)
                rates[n].append(8 / (time.perf_counter() - t0))
            if time.perf_counter() - started > seconds:
                break
    finally:
        torch.set_num_threads(before)
    return {n: sorted(r)[(len(r) - 1) // 2] for n, r in rates.items()}


def threads_by_rates(rates: dict[int, float], current: int, margin: float = RATE_MARGIN
                     ) -> tuple[int | None, str]:
    """(the thread count to set, None: keep torch's; the line to say) from matmul_rates: a
    count that multiplies `margin` times faster than torch's `current` threads means these
    share their cores with other work (a CPU quota, a busy host, stolen time) that the
    /proc/stat look did not show."""
    best = max(rates, key=lambda n: rates[n])
    if best == current or not rates.get(current, 0) > 0 or \
            rates[best] < margin * rates[current]:
        return None, ""
    return best, _using(best, current, f", {rates[best] / rates[current]:.1f}x slower at a "
                        "matrix product here")
