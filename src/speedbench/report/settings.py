"""Which trials.csv columns are the techniques' settings, read from the run's own files.

The report names no technique. A run's techniques.json lists each technique's fields, with
their trials.csv column and a one-line doc, and the view a technique asks the report for
(`host_sweep`: a setting whose cost shows on the host, such as a worker count). A run written
before techniques.json existed falls back on its config.yaml: a column outside the generic
ones (results.schema.TRIAL_COLUMNS) named after a recipe key is a setting (`num_workers` for
`data.num_workers`, `optimizer_impl` for `optimizer.impl`), and no view is asked for.
"""
from __future__ import annotations

from speedbench.results.schema import TRIAL_COLUMNS


def columns(run) -> dict[str, str]:
    """The run's settings columns, in trials.csv order: column -> label for an axis."""
    if run.techniques:
        labels = _declared(run.techniques)
    else:
        labels = {name: name for name in _recipe_keys(run.cfg)}
    generic = set(TRIAL_COLUMNS)
    return {c: labels[c] for c in run.trials.columns if c in labels and c not in generic}


def host_sweeps(run) -> list[dict]:
    """The host-sweep views the run's techniques ask for, as {"column", "title"}, for the
    columns trials.csv holds."""
    views = [t.get("host_sweep") for t in run.techniques]
    return [v for v in views if isinstance(v, dict) and v.get("column") in run.trials]


def _declared(techniques: list[dict]) -> dict[str, str]:
    out = {}
    for t in techniques:
        for f in t.get("fields", []):
            column = f.get("column") if isinstance(f, dict) else None
            if column:
                out[column] = f"{f['doc']} ({column})" if f.get("doc") else column
    return out


def _recipe_keys(cfg: dict, prefix: str = "") -> set[str]:
    """Every key of a config, by its last part and by its path with `.` -> `_`."""
    out = set()
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _recipe_keys(value, path + ".")
        else:
            out |= {str(key), path.replace(".", "_")}
    return out
