"""The run's config: its typed schema and the checks types cannot express, one module a job.

Data flow: Hydra composes a `Schema` (schema.py: SpeedbenchConfig plus every technique's keys);
`build_plan` (plan.py) refuses unknown keys (keys.py), resolves the models (models.py) and
expands the config into a `Plan`: the models to train and, per variant, the fully merged recipe.
suite.py builds one plan per experiment of a suite; docs.py generates the key tables.

The names below are the package's public ones, imported as `from speedbench.config import ...`.
"""
from __future__ import annotations

from speedbench.config.keys import FREE_FORM, check_known_keys
from speedbench.config.models import ModelSpec, inline_name, resolve_model
from speedbench.config.plan import (RUN_LEVEL_KEYS, Plan, build_plan, check_declared,
                                    check_plan, merge_variant)
from speedbench.config.schema import (BenchConfig, DataConfig, RecipeConfig, Schema,
                                      SpeedbenchConfig, SuiteConfig, TargetConfig, config_dir,
                                      config_flags, register_schema, setting)
from speedbench.errors import ConfigError

__all__ = [
    "BenchConfig", "ConfigError", "DataConfig", "FREE_FORM", "ModelSpec", "Plan", "RUN_LEVEL_KEYS",
    "RecipeConfig", "Schema", "SpeedbenchConfig", "SuiteConfig", "TargetConfig", "build_plan",
    "check_declared", "check_known_keys", "check_plan", "config_dir", "config_flags",
    "inline_name", "merge_variant", "register_schema", "resolve_model", "setting",
]
