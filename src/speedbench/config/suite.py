"""Suites: several experiments measured into one run directory and one report (`tips`).

A suite is an experiment file that sets `suite.experiments`. Each member is composed exactly as
`python -m speedbench +experiment=NAME [the same overrides]` would compose it, so the user's
command-line overrides reach every member and win over the member's own defaults. Every
member's plan is built (and so validated) before anything is measured.
"""
from __future__ import annotations

from pathlib import Path

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from speedbench.config.plan import Plan, build_plan
from speedbench.config.schema import config_dir
from speedbench.errors import ConfigError

ALL = "*"


def is_suite(cfg: DictConfig) -> bool:
    return bool(cfg.suite.experiments)


def experiment_files() -> dict[str, Path]:
    """Every experiment speedbench knows: name -> file in configs/experiment/."""
    folder = Path(config_dir()) / "experiment"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def _defines_suite(path: Path) -> bool:
    return bool(OmegaConf.select(OmegaConf.load(path), "suite.experiments"))


def runs_alone(path: Path) -> bool:
    """A suite, the recipe search (it measures plans of its own) or an experiment that trains
    to a target (minutes per variant): never a member of `*`."""
    cfg = OmegaConf.load(path)
    return _defines_suite(path) or bool(OmegaConf.select(cfg, "recipe.candidates")) or \
        bool(OmegaConf.select(cfg, "target.enabled"))


def members(cfg: DictConfig, suite_name: str) -> list[str]:
    """The experiments a suite runs, in order: `*` expands to every non-suite experiment."""
    files = experiment_files()
    for name in cfg.suite.exclude:
        if name not in files:
            raise ConfigError(f"suite.exclude: '{name}' is not an experiment; known: "
                              f"{', '.join(files)}")
    names: list[str] = []
    for entry in cfg.suite.experiments:
        if entry == ALL:
            names += [n for n, p in files.items() if n != suite_name and not runs_alone(p)]
        elif entry not in files:
            raise ConfigError(f"suite.experiments: '{entry}' is not an experiment; choose from "
                              f"{ALL}, {', '.join(files)}")
        elif entry == suite_name or _defines_suite(files[entry]):
            raise ConfigError(f"suite.experiments: '{entry}' is itself a suite; suites do not nest")
        elif runs_alone(files[entry]):
            raise ConfigError(f"suite.experiments: '{entry}' is the recipe search, which runs "
                              f"alone: use +experiment={entry}")
        else:
            names.append(entry)
    chosen = [n for n in dict.fromkeys(names) if n not in set(cfg.suite.exclude)]
    if not chosen:
        raise ConfigError(f"suite.experiments: suite '{suite_name}' has no experiment left to run")
    return chosen


def member_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides minus those that choose the experiment or define the suite, and
    the config flags (already in force)."""
    def key(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0].split(".", 1)[0]
    return [o for o in overrides
            if key(o) not in ("experiment", "suite", "hydra") and not o.startswith("-")]


def compose_member(name: str, overrides: list[str]) -> DictConfig:
    """The config of `python -m speedbench +experiment=NAME overrides...`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    args = member_overrides(overrides) + [f"+experiment={name}"]
    try:
        if GlobalHydra.instance().is_initialized():  # inside @hydra.main
            return compose(config_name="config", overrides=args)
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose(config_name="config", overrides=args)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


def member_plans(cfg: DictConfig, suite_name: str, overrides: list[str]) -> list[Plan]:
    """One validated plan per member experiment; a member's mistake names the member."""
    plans = []
    # the suite's own bench.skip_by_forecast (tips sets it) reaches every member, unless the
    # command line set it: a member is composed from the command line alone
    if not any(o.lstrip("+").startswith("bench.skip_by_forecast=") for o in overrides):
        overrides = [*overrides, f"bench.skip_by_forecast={cfg.bench.skip_by_forecast}"]
    for name in members(cfg, suite_name):
        try:
            plans.append(build_plan(compose_member(name, overrides), name))
        except ConfigError as exc:
            raise ConfigError(f"suite {suite_name}, experiment {name}: {exc} (leave it out with "
                              f"suite.exclude=[{name}])") from None
    return plans


def combined_claims(plans: list[Plan]) -> list[dict]:
    """Every member's claims, each tagged with its experiment so it reads only its own rows."""
    return [{**claim, "experiment": plan.experiment}
            for plan in plans
            for claim in OmegaConf.to_container(plan.config.claims, resolve=True)]
