"""Diagnosis of a profiled run: pool each (model, variant)'s trial measurements, write the
phase table (phases.csv) and turn the measurements into findings (findings.csv).

A finding is a symptom with the figure that shows it, the tip that addresses it and the knob
to set. Each rule fires on what profile.py measured (shares of the step, counts of host
reads, host-born tensors, CUDA synchronisations, and each technique's own counters), never
on the recipe alone; a clean recipe yields none.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from speedbench import results, techniques
from speedbench.results.schema import PHASES
from speedbench.techniques.base import Finding

# A tip is said to pay when its symptom costs at least this much (each technique's own
# thresholds are in its module).
PER_STEP = 0.5  # synchronisations: "every step" from here


@dataclass
class TrialProfile:
    """What the profile windows of one trial (or, pooled, of all trials) measured."""

    mode: str
    steps: int = 0  # optimizer steps in the phase window
    window_s: float = 0.0  # its wall time, device synchronised at both ends
    phase_s: dict = field(default_factory=dict)  # phase -> seconds in the window
    host_reads: int = 0  # LossMeter reads of the loss (sync knob)
    host_creations: int = 0  # per-step tensors born on the host, then copied
    cuda_syncs: Optional[int] = None  # all synchronising CUDA calls; None off CUDA
    model_syncs: Optional[int] = None  # of those, inside forward/backward
    batch_pinned: Optional[bool] = None  # the loader's batches are in pinned memory
    batch_mb: float = 0.0  # host-to-device bytes per optimizer step
    # What the run was, the same for every trial of one (model, variant).
    device: str = "cpu"
    device_name: str = ""
    capability: Optional[tuple] = None  # CUDA compute capability
    cpus: int = 1
    settings: dict = field(default_factory=dict)  # the techniques' columns of the trial's row
    # What the techniques counted in the phase window (Technique.profile_counters).
    counters: dict = field(default_factory=dict)

    def share(self, phase: str) -> float:
        return self.phase_s.get(phase, 0.0) / self.window_s if self.window_s else 0.0

    def ms(self, phase: str) -> float:
        """Mean milliseconds per optimizer step in a phase."""
        return 1000 * self.phase_s.get(phase, 0.0) / self.steps if self.steps else 0.0

    @property
    def step_ms(self) -> float:
        return 1000 * self.window_s / self.steps if self.steps else 0.0


def pool(profiles: list[TrialProfile]) -> TrialProfile:
    """All trials of one (model, variant) as one long window: times and counts add up."""
    out = dataclasses.replace(profiles[0], phase_s=dict(profiles[0].phase_s),
                              counters=dict(profiles[0].counters))
    for p in profiles[1:]:
        out.steps += p.steps
        out.window_s += p.window_s
        for phase, s in p.phase_s.items():
            out.phase_s[phase] = out.phase_s.get(phase, 0.0) + s
        for name in ("host_reads", "host_creations", "cuda_syncs", "model_syncs"):
            setattr(out, name, _add(getattr(out, name), getattr(p, name)))
        for name, value in p.counters.items():
            out.counters[name] = _add(out.counters.get(name), value) \
                if _is_count(value) else out.counters.get(name, value)
    return out


def _is_count(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _add(a, b):
    """Counts add up; None (not measured) only where neither trial measured it."""
    return None if a is None and b is None else (a or 0) + (b or 0)


# Tips for symptoms no technique owns: the fix is in the user's code.
TIPS = {
    "model_syncs": "find the .item(), .cpu(), .tolist(), print(tensor), nonzero or boolean-mask "
                   "indexing in the model: run it under torch.cuda.set_sync_debug_mode('warn') "
                   "to see where",
}


def diagnose(tp: TrialProfile) -> list[Finding]:
    """Findings from what the profile windows measured; a clean recipe yields none. Each
    technique's rule first (registry order), then the symptoms no technique owns."""
    if not tp.steps:
        return []
    found = techniques.diagnose(tp)
    if tp.model_syncs is not None:
        # Host-born tensors' blocking copies are syncs too; they have their own finding.
        extra = (tp.model_syncs - tp.host_creations) / tp.steps
        if extra >= PER_STEP:
            found.append(Finding("the model makes the host wait for the GPU",
                                 f"{extra:.1f} synchronising CUDA calls per step inside forward "
                                 "and backward (torch.cuda.set_sync_debug_mode)",
                                 TIPS["model_syncs"], "-"))
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
    results.write_diagnosis(run_dir, phases, findings)
    return True
