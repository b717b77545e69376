"""Which keys the schema knows, walked in one place: `check_known_keys` refuses a composed
config's unknown keys (build_plan), and the command line's overrides are checked against the
registered schema before Hydra sees them (`is_known`, `deletes_schema`, `schema_keys` and
`did_you_mean`, used by speedbench.__main__). Free-form nodes (FREE_FORM) take any key.
"""
from __future__ import annotations

import difflib
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from speedbench.config.schema import Schema
from speedbench.errors import ConfigError

# Free-form nodes: their keys are names (models, variants) or claim fields, not schema keys.
FREE_FORM = ("model", "models", "variants", "arms", "claims", "recipe.candidates", "data.kwargs")


def check_known_keys(cfg: DictConfig, schema: Optional[DictConfig] = None, prefix: str = "") -> None:
    """Reject keys the schema does not know, including ones added with `+key=value`."""
    schema = schema if schema is not None else OmegaConf.structured(Schema)
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema:
            allowed = ", ".join(str(k) for k in schema.keys())
            raise ConfigError(f"{full}: unknown key; known keys{' under ' + prefix[:-1] if prefix else ''}: "
                              f"{allowed}")
        if full in FREE_FORM:
            continue
        node, spec = cfg._get_node(key), schema._get_node(key)
        if isinstance(node, DictConfig) and isinstance(spec, DictConfig):
            check_known_keys(node, spec, prefix=f"{full}.")


def schema_node() -> DictConfig:
    """The schema as registered in Hydra's ConfigStore (register_schema); a deep copy."""
    return ConfigStore.instance().load("speedbench_schema.yaml").node


def schema_keys(node=None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (nodes and leaves); free-form nodes are not entered."""
    node = schema_node() if node is None else node
    keys = []
    for key in node.keys():
        full = f"{prefix}{key}"
        keys.append(full)
        child = node._get_node(key)
        if full not in FREE_FORM and isinstance(child, DictConfig) and not child._is_none():
            keys += schema_keys(child, f"{full}.")
    return keys


def is_known(key: str, node: DictConfig) -> bool:
    """Whether `key` names a key of the schema `node` (or lies under a free-form node)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or ".".join(parts[:i]) in FREE_FORM:
            return True  # a free-form or untyped node takes any key
        if part not in node:
            return False
        node = node._get_node(part)
    return True


def deletes_schema(key: str, schema: DictConfig) -> bool:
    """Whether `~key` would delete a node or key of the schema (not one under a free-form
    node, such as a variant or a model's own keys)."""
    parts = key.split(".")
    return all(".".join(parts[:i]) not in FREE_FORM for i in range(1, len(parts))) \
        and is_known(key, schema)


def did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
