"""Diagnosis of a profiled run: pool each (model, variant)'s trial measurements, write the
phase table (phases.csv) and turn the measurements into findings (findings.csv).

A finding is a symptom with the figure that shows it, the tip that addresses it and the knob
to set. Each rule fires on what profile.py measured (shares of the step, counts of host
reads, host-born tensors, empty_cache calls, CUDA synchronisations, synced DDP forwards),
never on the recipe alone; a clean recipe yields none.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

PHASES = ("data", "h2d", "forward", "backward", "optimizer", "other")
PHASE_COLUMNS = ["experiment", "model", "variant", "phase", "mean_ms", "total_ms", "share"]
FINDING_COLUMNS = ["experiment", "model", "variant", "symptom", "figure", "tip", "knob"]
# A tip is said to pay when its symptom costs at least this much.
DATA_WAIT_SHARE = 0.10  # of the step spent waiting for the next batch
H2D_SHARE = 0.02  # of the step spent copying the batch from pageable memory
FP32_COMPUTE_SHARE = 0.30  # of the step in fp32 forward+backward on a GPU with tensor cores
PER_STEP = 0.5  # host reads, host-born tensors, synchronisations: "every step" from here


@dataclass
class TrialProfile:
    """What the profile windows of one trial (or, pooled, of all trials) measured."""

    mode: str
    steps: int = 0  # optimizer steps in the phase window
    window_s: float = 0.0  # its wall time, device synchronised at both ends
    phase_s: dict = field(default_factory=dict)  # phase -> seconds in the window
    host_reads: int = 0  # LossMeter reads of the loss (sync knob)
    host_creations: int = 0  # per-step tensors born on the host, then copied
    empty_cache_calls: int = 0
    cuda_syncs: Optional[int] = None  # all synchronising CUDA calls; None off CUDA
    model_syncs: Optional[int] = None  # of those, inside forward/backward
    synced_forwards: Optional[int] = None  # DDP forwards that all-reduce; None without DDP
    batch_pinned: Optional[bool] = None  # the loader's batches are in pinned memory
    batch_mb: float = 0.0  # host-to-device bytes per optimizer step
    # What the run was, the same for every trial of one (model, variant).
    device: str = "cpu"
    device_name: str = ""
    capability: Optional[tuple] = None  # CUDA compute capability
    precision: str = "fp32"
    matmul_precision: str = "highest"
    sync: str = "deferred"
    accumulate: int = 1
    num_workers: int = 0
    cpus: int = 1
    data_parallel: Optional[str] = None  # how DataParallel was seen, None when not in use

    def share(self, phase: str) -> float:
        return self.phase_s.get(phase, 0.0) / self.window_s if self.window_s else 0.0

    def ms(self, phase: str) -> float:
        """Mean milliseconds per optimizer step in a phase."""
        return 1000 * self.phase_s.get(phase, 0.0) / self.steps if self.steps else 0.0

    @property
    def step_ms(self) -> float:
        return 1000 * self.window_s / self.steps if self.steps else 0.0


@dataclass
class Finding:
    symptom: str
    figure: str  # the measured figure that shows it
    tip: str
    knob: str  # what to set, `-` when the fix is in the user's own code



def pool(profiles: list[TrialProfile]) -> TrialProfile:
    """All trials of one (model, variant) as one long window: times and counts add up."""
    out = dataclasses.replace(profiles[0], phase_s=dict(profiles[0].phase_s))
    for p in profiles[1:]:
        out.steps += p.steps
        out.window_s += p.window_s
        for phase, s in p.phase_s.items():
            out.phase_s[phase] = out.phase_s.get(phase, 0.0) + s
        for name in ("host_reads", "host_creations", "empty_cache_calls", "cuda_syncs",
                     "model_syncs", "synced_forwards"):
            a, b = getattr(out, name), getattr(p, name)
            setattr(out, name, None if a is None and b is None else (a or 0) + (b or 0))
    return out


# The tips, one per symptom (the articles' wording where they have one).
TIPS = {
    "workers": "load batches in DataLoader worker processes, so the next batch is decoded while "
               "the model trains",
    "cpu_bound": "the workers already use every CPU: make decoding and augmentation cheaper, "
                 "pre-decode the data, or decode on the GPU",
    "reads": "keep the running loss on the device (loss.detach()) and read it every K steps: "
             "each .item() or .cpu() makes the host wait for the device",
    "model_syncs": "find the .item(), .cpu(), .tolist(), print(tensor), nonzero or boolean-mask "
                   "indexing in the model: run it under torch.cuda.set_sync_debug_mode('warn') "
                   "to see where",
    "pinning": "pin the DataLoader's memory and copy with non_blocking=True: pinned copies are "
               "faster and overlap with compute",
    "creation": "create per-step tensors where they are used: torch.randn(..., device=x.device)",
    "empty_cache": "do not empty the caching allocator during training: the next step has to "
                   "cudaMalloc its memory again, and that synchronises",
    "ddp": "use DistributedDataParallel, one process per GPU (torchrun): DataParallel scatters, "
           "replicates and gathers from one Python process every step",
    "amp": "train in mixed precision, so matrix work runs on the tensor cores",
    "no_sync": "run forward and backward of the first k-1 micro-batches inside model.no_sync(), "
               "so gradients are all-reduced once per optimizer step",
}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(tp: TrialProfile) -> list[Finding]:
    """Findings from what the profile windows measured; a clean recipe yields none."""
    if not tp.steps:
        return []
    found: list[Finding] = []

    def per_step(count: float) -> float:
        return count / tp.steps

    if tp.share("data") >= DATA_WAIT_SHARE:
        figure = (f"the loop waits for data {_pct(tp.share('data'))} of the step "
                  f"({tp.ms('data'):.1f} of {tp.step_ms:.1f} ms), "
                  f"data.num_workers={tp.num_workers}")
        if tp.num_workers < tp.cpus:
            more = min(tp.cpus, 4) if tp.num_workers == 0 else min(tp.cpus, 2 * tp.num_workers)
            found.append(Finding("data wait share high", figure, TIPS["workers"],
                                 f"data.num_workers={more} data.persistent_workers=true"))
        else:
            found.append(Finding("data wait share high", f"{figure} on {tp.cpus} CPUs",
                                 TIPS["cpu_bound"], "-"))

    reads = per_step(tp.host_reads)
    if reads >= PER_STEP:
        figure = (f"{reads:.1f} host reads of the loss per step (sync={tp.sync}), "
                  f"{tp.ms('other'):.2f} ms per step in them")
        if tp.cuda_syncs is not None:
            figure += f"; {per_step(tp.cuda_syncs):.1f} synchronising CUDA calls per step in all"
        elif tp.device == "cpu":
            figure += " (cheap on a CPU, where nothing runs ahead of the host; a stall on a GPU)"
        found.append(Finding("host reads of device values every step", figure, TIPS["reads"],
                             "sync=deferred"))

    if tp.model_syncs is not None:
        # Host-born tensors' blocking copies are syncs too; they have their own finding.
        extra = per_step(tp.model_syncs - tp.host_creations)
        if extra >= PER_STEP:
            found.append(Finding("the model makes the host wait for the GPU",
                                 f"{extra:.1f} synchronising CUDA calls per step inside forward "
                                 "and backward (torch.cuda.set_sync_debug_mode)",
                                 TIPS["model_syncs"], "-"))

    if tp.device == "cuda" and tp.batch_pinned is False and tp.share("h2d") >= H2D_SHARE:
        found.append(Finding("pageable host-to-device copies",
                             f"copying {tp.batch_mb:.1f} MB per step from pageable memory takes "
                             f"{_pct(tp.share('h2d'))} of the step ({tp.ms('h2d'):.2f} ms)",
                             TIPS["pinning"], "data.pin_memory=true data.non_blocking=true"))

    born = per_step(tp.host_creations)
    if born >= PER_STEP:
        found.append(Finding("per-step tensors created on the host",
                             f"{born:.1f} tensors per step created on the CPU and copied to the "
                             f"{tp.device} (forward: {tp.ms('forward'):.1f} ms per step)",
                             TIPS["creation"], "tensor_creation=device"))

    if tp.empty_cache_calls:
        found.append(Finding("empty_cache called in the loop",
                             f"torch.cuda.empty_cache() called {tp.empty_cache_calls} times in "
                             f"{tp.steps} steps", TIPS["empty_cache"], "empty_cache=false"))

    if tp.data_parallel:
        found.append(Finding("DataParallel in use", tp.data_parallel, TIPS["ddp"], "parallel=ddp"))

    cores = tp.device == "cuda" and tp.capability is not None and tp.capability >= (7, 0)
    compute = tp.share("forward") + tp.share("backward")
    if cores and tp.precision == "fp32" and compute >= FP32_COMPUTE_SHARE:
        tf32 = "off" if tp.matmul_precision == "highest" else "on"
        major, minor = tp.capability
        found.append(Finding("fp32 matrix work on a GPU with tensor cores",
                             f"forward+backward take {_pct(compute)} of the step in fp32 on "
                             f"{tp.device_name} (compute capability {major}.{minor}, TF32 "
                             f"matmuls {tf32})", TIPS["amp"],
                             "precision=bf16" if major >= 8 else "precision=fp16"))

    if tp.synced_forwards is not None and tp.accumulate > 1:
        synced = per_step(tp.synced_forwards)
        if synced > 1 + 1e-9:
            found.append(Finding("gradient accumulation without no_sync under DDP",
                                 f"{synced:.1f} of {tp.accumulate} micro-batches per optimizer "
                                 "step all-reduce their gradients", TIPS["no_sync"], "-"))
    return found


def write_tables(run_dir: Path, records: list[dict]) -> bool:
    """phases.csv and findings.csv from the profiled trials of a run; False when none was."""
    groups: dict[tuple, list[TrialProfile]] = {}
    for r in records:
        if r.get("profile_data") is not None:
            key = (r["experiment"], r["model"], r["variant"])
            groups.setdefault(key, []).append(r["profile_data"])
    if not groups:
        return False
    phases, findings = [], []
    for key, profiles in groups.items():
        tp = pool(profiles)
        names = dict(zip(("experiment", "model", "variant"), key))
        phases += [{**names, "phase": p, "mean_ms": tp.ms(p),
                    "total_ms": 1000 * tp.phase_s.get(p, 0.0), "share": tp.share(p)}
                   for p in PHASES]
        findings += [{**names, **dataclasses.asdict(f)} for f in diagnose(tp)]
    run_dir = Path(run_dir)
    pd.DataFrame(phases, columns=PHASE_COLUMNS).to_csv(run_dir / "phases.csv", index=False)
    pd.DataFrame(findings, columns=FINDING_COLUMNS).to_csv(run_dir / "findings.csv", index=False)
    return True
