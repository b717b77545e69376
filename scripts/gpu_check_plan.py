"""Bench settings that fit an experiment (or a suite of them) into a time budget.

    python scripts/gpu_check_plan.py BUDGET_S EXPERIMENT [OVERRIDE ...]

prints one line of overrides, e.g. `bench.repeats=3 bench.max_trial_s=4.5`. Used by
gpu_check.sh. It counts the trials the experiment will run (models x variants x repeats; a suite
file with a `suite:` block, or `suite.experiments=[...]` / `suite.exclude=[...]` overrides,
counts its member experiments) and gives each trial an equal share of the budget after fixed
costs (compiled trials also pay COMPILE_S). Three repeats if a trial then gets at least
MIN_TRIAL_S, else two. If the count fails (a config this script does not understand), it prints
safe settings.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Estimates for a GPU host with a dozen cores (not measured on the H200 yet: adjust after a run).
TRIAL_OVERHEAD_S = 1.5  # per trial: build and move a full-scale model, start the loader
MODEL_OVERHEAD_S = 3.0  # per model and experiment: make the data set (a full-size JPEG pool)
MIN_TRIAL_S, MAX_TRIAL_S = 2.0, 6.0  # three repeats from this share on; 6 s is the default cap
LARGEST_BATCH_S = 10  # per model, where an experiment searches the largest batch that fits
COMPILE_S = 30.0  # per compiled trial: torch.compile of a full-scale model (warm cache later)
SAFE = f"bench.repeats=2 bench.max_trial_s=2 bench.largest_batch_s={LARGEST_BATCH_S}"


def _listed(overrides: list[str], key: str) -> list[str] | None:
    """The names in a `key=[a,b]` override, or None when there is none."""
    for o in overrides:
        if o.startswith(key + "="):
            return [n.strip() for n in o.split("=", 1)[1].strip("[]").split(",") if n.strip()]
    return None


def members(name: str, overrides: list[str] = ()) -> list[str]:
    """The experiments `+experiment=name [overrides]` runs: itself, or a suite's members."""
    exp_dir = ROOT / "configs" / "experiment"
    data = yaml.safe_load((exp_dir / f"{name}.yaml").read_text()) or {}
    suite = data.get("suite") or {}
    wanted = _listed(overrides, "suite.experiments") or suite.get("experiments")
    if not wanted:
        return [name]
    exclude = set(_listed(overrides, "suite.exclude") or suite.get("exclude") or [])
    names = sorted(p.stem for p in exp_dir.glob("*.yaml")) if "*" in wanted else list(wanted)
    return [n for n in names if n not in exclude and n != name
            and not (yaml.safe_load((exp_dir / f"{n}.yaml").read_text()) or {}).get("suite")]


def count(experiment: str, overrides: list[str]) -> tuple[int, int, float, int]:
    """(trials, models, seconds searching the largest batch, compiled trials) of one experiment
    with these overrides, as build_plan expands it."""
    from hydra import compose, initialize_config_dir

    from speedbench.config import build_plan, config_dir, register_schema

    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", *overrides])
    plan = build_plan(cfg, experiment)
    repeats = max(r.bench.repeats for r in plan.variants.values())
    per_model = sum(min(r.bench.repeats, repeats) for r in plan.variants.values())
    compiled = sum(min(r.bench.repeats, repeats) for r in plan.variants.values()
                   if r.get("compile", "off") != "off")
    bench = plan.variants[plan.baseline].bench
    search_s = bench.largest_batch_s * len(plan.models) if bench.find_largest_batch else 0.0
    return per_model * len(plan.models), len(plan.models), search_s, compiled * len(plan.models)


def settings(budget_s: float, experiment: str, overrides: list[str]) -> str:
    own = [o for o in overrides if not o.lstrip("+~").startswith("suite.")]  # a member's
    for repeats in (3, 2):
        trials = models = search_s = compiled = 0
        for name in members(experiment, overrides):
            t, m, s, c = count(name, [*own, f"bench.repeats={repeats}",
                                      f"bench.largest_batch_s={LARGEST_BATCH_S}"])
            trials, models, search_s, compiled = trials + t, models + m, search_s + s, compiled + c
        fixed = models * MODEL_OVERHEAD_S + search_s + compiled * COMPILE_S
        per_trial = (budget_s - fixed) / max(trials, 1) - TRIAL_OVERHEAD_S
        if per_trial >= MIN_TRIAL_S:
            break
    if per_trial < 1:
        print(f"gpu_check_plan: {trials} trials will hardly fit in {budget_s:.0f} s",
              file=sys.stderr)
    max_trial_s = min(MAX_TRIAL_S, max(1.0, per_trial))
    return (f"bench.repeats={repeats} bench.max_trial_s={max_trial_s:.1f} "
            f"bench.largest_batch_s={LARGEST_BATCH_S}")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(settings(float(argv[0]), argv[1], argv[2:]))
    except Exception as exc:  # never block the check: fall back to settings that fit most suites
        print(f"gpu_check_plan: could not count trials ({type(exc).__name__}: {exc}); "
              f"using {SAFE}", file=sys.stderr)
        print(SAFE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
