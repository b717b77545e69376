"""Loading a run directory back for a report: tolerant of interrupted runs and other versions.

A run is usable when its trials.csv holds the columns a report cannot do without (MINIMUM).
Other contract columns may be missing (an older speedbench): they are filled with NaN and
listed in `Run.notes`, so the report says what it left out instead of failing. The run's
format (env.json's `format_version`, schema.FORMAT_VERSION) says what else to expect.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import yaml

from speedbench.results.schema import (CURVE_COLUMNS, EXPLAIN_CATEGORIES, EXPLAIN_COLUMNS,
                                       FINDING_COLUMNS,
                                       FORECAST_COLUMNS, OK, PHASE_COLUMNS,
                                       RECIPE_COLUMNS, REQUIRED_CAPACITY_COLUMNS,
                                       REQUIRED_TRIAL_COLUMNS, REQUIRED_QUALITY_COLUMNS,
                                       REQUIRED_TO_TARGET_COLUMNS, SUMMARY_COLUMNS,
                                       TRIAL_COLUMNS)

# The contract columns without which a run cannot be summarised, plotted or compared at all.
MINIMUM = ("experiment", "model", "variant", "is_baseline", "status", "samples_per_s")
# The rest of the trials.csv contract (docs/outputs.md) plus what summary.summarise reads.
OPTIONAL_NUMERIC = ("trial", "world_size", "step_ms", "data_wait_frac", "peak_mem_mb",
                    "final_loss", "host_rss_mb")
SUMMARY_CONTRACT = ("experiment", "model", "variant", "is_baseline", "status", "samples_per_s",
                    "speedup", "speedup_lo", "speedup_hi", "verdict")
KEYS = ["experiment", "model", "variant"]
# Columns read as numbers (every trials.csv column but its text ones): a cell that is not a
# finite number is read as missing (and noted). A run writes `nan` for a figure it did not
# measure, which keep_default_na=False would otherwise keep as text.
TRIAL_TEXT = ("experiment", "model", "variant", "is_baseline", "status", "device", "profile",
              "rank_step_ms", "peak_kind", "peak_phase", "arm", "reference", "energy_status")
TRIAL_NUMERIC = tuple(c for c in TRIAL_COLUMNS if c not in TRIAL_TEXT)
SUMMARY_TEXT = ("experiment", "model", "variant", "is_baseline", "status", "verdict",
                "family_scope", "peak_phase", "quality_verdict", "arm", "reference",
                "energy_verdict")
SUMMARY_NUMERIC = tuple(c for c in SUMMARY_COLUMNS if c not in SUMMARY_TEXT) + (
    "mem_ratio_lo", "mem_ratio_hi", "scaling_efficiency", "scaling_efficiency_lo",
    "scaling_efficiency_hi")
# env.json entries the report reads, with the type each must have to be used.
ENV_TYPES = {"versions": dict, "env": dict, "distributed": dict, "cuda_devices": list,
             "cpu_flags": list, "machine_load": dict, "model_changes": list, "arms": dict}
# config.yaml entries the report reads, with their types (claims: checked one by one).
CONFIG_TYPES = {"bench": dict}
# A run's JSON and YAML files stay far below this; a deeper nesting is not a run's, and
# walking it would overflow Python's stack (RecursionError).
MAX_DEPTH = 64
# A name (experiment, model, variant) longer than this is shortened for the report: a figure's
# tick labels would take minutes to lay out a name of megabytes.
MAX_NAME = 200
# Claim fields and the types they may have (claims.py reads them); other claims are left out.
CLAIM_TYPES = {"tip": str, "source": str, "quote": str, "kind": str, "metric": str,
               "versus": str, "experiment": str, "requires": str, "factor": (int, float),
               "variants": list}


class ReportError(Exception):
    """A run directory the report cannot use; the message says why (printed as one line)."""


@dataclass
class Run:
    path: Path
    trials: pd.DataFrame
    # summary.csv as the run wrote it; None where absent or unusable: the statistics are
    # analysis's (summary.summarised recomputes it from the trials)
    summary: Optional[pd.DataFrame]
    env: dict
    cfg: dict
    phases: Optional[pd.DataFrame] = None
    findings: Optional[pd.DataFrame] = None
    capacity: Optional[pd.DataFrame] = None  # capacity.csv: the largest batch that fits
    to_target: Optional[pd.DataFrame] = None  # to_target.csv: a row per variant and seed
    curves: Optional[pd.DataFrame] = None  # curves.csv: the held-out loss as each run trained
    quality: Optional[pd.DataFrame] = None  # quality.csv: the probe's loss per variant and seed
    explain: Optional[pd.DataFrame] = None  # explain.csv: profiled steps split by category
    forecast: Optional[pd.DataFrame] = None  # forecast.csv: each variant's forecast
    recipe_search: bool = False  # recipe.csv beside: each experiment is its own CI family
    format_version: int = 1
    members: dict = field(default_factory=dict)  # a suite's members/*.yaml: bench per experiment
    techniques: list = field(default_factory=list)  # techniques.json: the run's techniques
    notes: list[str] = field(default_factory=list)  # what is missing, recomputed, left out
    missing: list[str] = field(default_factory=list)  # contract columns absent from trials.csv
    label: str = ""

    @property
    def experiments(self) -> list[str]:
        return list(dict.fromkeys(self.trials["experiment"]))


def _bool(col: pd.Series) -> pd.Series:
    return col.astype(str).str.strip().str.lower().isin(["true", "1", "yes"])


def _names(col: pd.Series) -> pd.Series:
    """Names (experiment, model, variant) as non-empty strings: pandas reads an empty cell as
    missing, which would drop the row from every group. A name over MAX_NAME characters is
    shortened, with a hash of the whole that keeps two such names apart."""
    text = col.astype(object).where(col.notna(), "").map(str).str.strip()
    return text.where(text != "", "(empty)").map(_short_name)


def _short_name(name: str) -> str:
    if len(name) <= MAX_NAME:
        return name
    import hashlib

    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{name[:MAX_NAME - 40]}… ({len(name):,} characters, #{digest})"


# Columns that hold sizes, times and counts: a negative value is not one (and a figure of
# one can overflow matplotlib's rasteriser).
NON_NEGATIVE = ("peak_mem_mb", "host_rss_mb", "host_rss_main_mb", "step_ms", "elapsed_s",
                "data_wait_frac", "steps", "warmup_steps", "batch_size", "devices", "samples",
                "world_size", "flops_per_step", "achieved_tflops", "peak_tflops", "trials",
                "mem_ratio", "mem_ratio_lo", "mem_ratio_hi", "params_mem_mb", "grads_mem_mb",
                "opt_state_mem_mb", "activation_mem_mb", "state_mem_mb")


def _numbers(df: pd.DataFrame, columns, what: str, notes: list[str]) -> int:
    """Read `columns` of df as numbers in place; a cell that is not a finite number (or a
    negative one in a NON_NEGATIVE column) becomes NaN. `nan`, as Python writes a figure that
    was not measured (final_loss without a quality probe), is missing, not wrong. Returns how
    many other non-empty cells were not numbers, after noting them."""
    bad = {}
    for c in columns:
        if c not in df.columns:
            continue
        values = _floats(df[c])
        values = values.where(np.isfinite(values))
        if c in NON_NEGATIVE:
            values = values.where(~(values < 0))
        missing = df[c].isna() | df[c].astype(str).str.strip().str.lower().isin(["nan", ""])
        wrong = int((values.isna() & ~missing).sum())
        if wrong:
            bad[c] = wrong
        df[c] = values
    if bad:
        notes.append(f"{what}: " + ", ".join(f"{n} {c} cell(s)" for c, n in bad.items())
                     + " not finite numbers, read as missing")
    return sum(bad.values())


def _env(env, notes: list[str]) -> dict:
    """env.json as a mapping whose entries the report reads have the types it expects."""
    if not isinstance(env, dict):
        notes.append("env.json is not a JSON object: environment unknown")
        return {}
    wrong = [k for k, kind in ENV_TYPES.items() if k in env and not isinstance(env[k], kind)]
    env = {k: v for k, v in env.items() if k not in wrong}
    if isinstance(env.get("cuda_devices"), list):
        env["cuda_devices"] = [g for g in env["cuda_devices"] if isinstance(g, dict)]
    if isinstance(env.get("cpu_flags"), list):
        env["cpu_flags"] = [f for f in env["cpu_flags"] if isinstance(f, str)]
    if wrong:
        notes.append(f"env.json: {', '.join(wrong)} of an unexpected type, left out")
    return env


def _config(cfg: dict, notes: list[str]) -> dict:
    """The config with the entries the report reads of the types it expects."""
    wrong = [k for k, kind in CONFIG_TYPES.items() if k in cfg and not isinstance(cfg[k], kind)]
    if wrong:
        notes.append(f"config.yaml: {', '.join(wrong)} of an unexpected type, left out")
    return _claims({k: v for k, v in cfg.items() if k not in wrong}, notes)


def _claims(cfg: dict, notes: list[str]) -> dict:
    """The config with only the claims whose fields have the expected types."""
    claims = cfg.get("claims")
    if claims is None:
        return cfg
    if not isinstance(claims, list):
        notes.append("the config's claims: is not a list: claims left out")
        return {**cfg, "claims": []}
    kept = []
    for i, claim in enumerate(claims):
        wrong = [k for k, kind in CLAIM_TYPES.items()
                 if isinstance(claim, dict) and claim.get(k) is not None
                 and (not isinstance(claim[k], kind) or isinstance(claim[k], bool))]
        if isinstance(claim, dict) and isinstance(claim.get("variants"), list):
            wrong += ["variants"] * any(not isinstance(v, (str, int)) for v in claim["variants"])
        if not isinstance(claim, dict) or wrong:
            what = "not a mapping" if not isinstance(claim, dict) else \
                "unexpected " + ", ".join(dict.fromkeys(wrong))
            notes.append(f"claim {i + 1} of the config left out ({what})")
        else:
            kept.append(claim)
    return {**cfg, "claims": kept}


def _members(path: Path, notes: list[str]) -> dict:
    """bench settings of each member of a suite run (members/*.yaml), the readable ones."""
    members = {}
    for p in sorted((path / "members").glob("*.yaml")) if (path / "members").is_dir() else []:
        try:
            bench = (_yaml(p) or {}).get("bench", {}) if p.is_file() else None
        except (yaml.YAMLError, UnicodeDecodeError, AttributeError, OSError, ValueError,
                RecursionError):
            bench = None
        if isinstance(bench, dict):
            members[p.stem] = bench
        else:
            notes.append(f"members/{p.name} is not a readable member config: left out")
    return members


def _techniques(run_dir: Path) -> list[dict]:
    """The technique entries of techniques.json (load_techniques); [] without a usable one.
    Their fields and host-sweep views are kept only where their names are strings."""
    data = load_techniques(run_dir)
    entries = data.get("techniques") if isinstance(data, dict) else None
    return [_technique(t) for t in entries if isinstance(t, dict)] \
        if isinstance(entries, list) else []


def _technique(entry: dict) -> dict:
    fields = entry.get("fields") if isinstance(entry.get("fields"), list) else []
    fields = [{**f, "doc": f.get("doc") if isinstance(f.get("doc"), str) else ""}
              for f in fields
              if isinstance(f, dict) and isinstance(f.get("column"), (str, type(None)))]
    view = entry.get("host_sweep")
    view = view if isinstance(view, dict) and isinstance(view.get("column"), str) \
        and isinstance(view.get("title", ""), str) else {}
    return {**entry, "fields": fields, "host_sweep": view}


def _floats(col: pd.Series) -> pd.Series:
    """`col` as floats, a cell that is no number NaN; an integer too large for a float (a
    400-digit seed, which pandas cannot convert) is infinite, so not a finite number."""
    try:
        return pd.to_numeric(col, errors="coerce").astype(float)
    except OverflowError:
        return col.map(_float)


def _float(cell) -> float:
    try:
        return float(str(cell))  # a decimal string past a float's range: inf, no error
    except ValueError:
        return math.nan


# A text cell of a run's table (a status, a reason) stays far below this; a longer one is cut
# where it is read: one 5 MB reason must not make a 10 MB report.
MAX_TEXT = 2000


def _long_texts(df: pd.DataFrame, what: str, notes: list[str]) -> None:
    """Text cells over MAX_TEXT characters cut, in place, saying how long they were (names are
    _names's, which keeps two long ones apart); a note counts them."""
    cut = 0
    for c in df.columns:
        if c in KEYS or pd.api.types.is_numeric_dtype(df[c]):  # (bools too)
            continue
        long = df[c].map(lambda v: isinstance(v, str) and len(v) > MAX_TEXT)
        if long.any():
            cut += int(long.sum())
            df.loc[long, c] = df.loc[long, c].map(
                lambda v: f"{v[:MAX_TEXT - 40]}… ({len(v):,} characters)")
    if cut:
        notes.append(f"{what}: {cut} text cell(s) over {MAX_TEXT:,} characters, more than a run "
                     "writes, shortened")


def _regular(path: Path) -> bool:
    """A regular file (through links): a FIFO or a device would block or never end."""
    return path.is_file()


# A run's CSV files stay far below this (a long suite writes a few MB); a larger one is not a
# run's, and reading it, let alone plotting every trial, would take gigabytes of memory.
MAX_CSV_MB = 20


def _read_csv(path: Path) -> pd.DataFrame:
    if not _regular(path):
        raise ReportError(f"{path} is not a regular file")
    size_mb = path.stat().st_size / 1e6
    if size_mb > MAX_CSV_MB:
        raise ReportError(f"{path} is {size_mb:,.0f} MB, more than a run writes (at most "
                          f"{MAX_CSV_MB} MB are read)")
    try:  # only empty cells are missing: pandas would read a verdict "n/a" as NaN
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        raise ReportError(f"{path} is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise ReportError(f"{path} is not a readable CSV file ({reason})") from None
    except OSError as exc:
        raise ReportError(f"{path} cannot be read ({exc.strerror or exc})") from None


def _optional_table(path: Path, columns: tuple[str, ...],
                    notes: list[str]) -> Optional[pd.DataFrame]:
    """phases.csv / findings.csv when present and well formed; a note otherwise."""
    if not path.exists():
        return None
    try:
        df = _read_csv(path)
    except ReportError as exc:
        notes.append(f"{path.name} left out: {exc}")
        return None
    lacking = [c for c in columns if c not in df.columns]
    if lacking:
        notes.append(f"{path.name} left out: it lacks the columns {', '.join(lacking)}")
        return None
    for c in KEYS:
        df[c] = _names(df[c])
    _long_texts(df, path.name, notes)
    return df


MAX_MS = 1e9  # a profiled category's ms past this (11 days a step) is no measurement


def _explain_table(path: Path, notes: list[str]) -> Optional[pd.DataFrame]:
    """explain.csv when present, well formed and its measured rows usable (a hand-edited one
    with NaN, inf or huge times, text for numbers, per_step 0, an unknown category or a profile
    lacking one is left out, with a note, rather than break the report)."""
    df = _optional_table(path, tuple(EXPLAIN_COLUMNS), notes)
    why = None if df is None else _explain_unusable(df)
    if why:
        notes.append(f"{path.name} left out: {why}")
        return None
    return df


def _explain_unusable(df: pd.DataFrame) -> Optional[str]:
    ok = df[df["status"].astype(str) == OK]
    measured = ok[ok["category"].astype(str) != "profiler"]  # (the profiler's cost may be empty)
    nums = measured[["steps", "mean_ms", "sd_ms", "per_step"]].apply(pd.to_numeric,
                                                                     errors="coerce")
    sd_ok = nums["sd_ms"].isna() | (nums["sd_ms"].abs() <= MAX_MS)
    good = (np.isfinite(nums[["steps", "mean_ms", "per_step"]]).all(axis=1) & sd_ok
            & (nums["mean_ms"].abs() <= MAX_MS) & (nums["per_step"] > 0) & (nums["steps"] >= 0))
    if not good.all():
        return ("a measured row holds a time that is not a finite number of ms, or a per_step "
                "that is not positive")
    known = {*EXPLAIN_CATEGORIES, "step"}
    unknown = set(measured["category"].astype(str)) - known
    if unknown:
        return f"unknown categories {', '.join(sorted(unknown))}"[:160]
    groups = measured.groupby(["experiment", "model", "variant", "stage"])["category"]
    if any(set(g.astype(str)) != known for _, g in groups):
        return "a profile lacks some of its categories"
    return None


def _forecast_table(path: Path, notes: list[str]) -> Optional[pd.DataFrame]:
    """forecast.csv when present and well formed; an `ok` row whose forecast is not a positive
    number (an Amdahl speed-up; inf, "any factor", is one) or whose share of the step lies
    outside [0, 1] cannot come from a run: its status says so, and a note counts them, rather
    than a forecast of -1x or 0x shown as measured."""
    df = _optional_table(path, tuple(FORECAST_COLUMNS), notes)
    if df is None:
        return None
    ok = df["status"].astype(str) == OK
    forecast, share = _floats(df["forecast"]), _floats(df["share"])
    usable = (forecast > 0) & (share.isna() | share.between(0, 1))
    bad = ok & ~usable
    df["forecast"] = forecast.where(usable)  # numbers only: a sentence reads every row's
    if bad.any():
        df.loc[bad, "status"] = "n/a: forecast.csv's forecast or share is not a usable number"
        notes.append(f"{path.name}: {int(bad.sum())} forecast(s) not a positive number, or with "
                     "a share of the step outside [0, 1], shown as n/a")
    return df


def _unusable_summary(summary: pd.DataFrame, trials: pd.DataFrame,
                      notes: list[str]) -> Optional[str]:
    """Why summary.csv cannot be used as written (None: it can; its names are then cleaned)."""
    lacking = [c for c in SUMMARY_CONTRACT if c not in summary.columns]
    if lacking:
        return f"summary.csv lacks {', '.join(lacking)}: summary recomputed from trials.csv"
    if _numbers(summary, SUMMARY_NUMERIC, "summary.csv", notes):
        return "summary.csv holds cells that are not numbers: summary recomputed from trials.csv"
    for c in KEYS:
        summary[c] = _names(summary[c])
    summary["is_baseline"] = _bool(summary["is_baseline"])
    if summary[summary["is_baseline"]].duplicated(["experiment", "model"]).any():
        return "summary.csv flags more than one baseline of a model: summary recomputed"
    have = set(map(tuple, summary[KEYS].to_numpy()))
    if have != set(map(tuple, trials[KEYS].drop_duplicates().to_numpy())):
        return "summary.csv does not match trials.csv: summary recomputed from trials.csv"
    return None


def _summary(path: Path, trials: pd.DataFrame, notes: list[str]) -> Optional[pd.DataFrame]:
    """summary.csv as the run wrote it; None, with a note, when absent or unusable."""
    file = path / "summary.csv"
    reason = None
    if file.exists() and not _regular(file):
        reason = "summary.csv is not a regular file: summary recomputed from trials.csv"
    elif not file.exists():
        reason = ("no summary.csv (the run was interrupted or is still going): "
                  f"summary recomputed from the {len(trials)} trials written")
    else:
        try:
            summary = _read_csv(file)
            reason = _unusable_summary(summary, trials, notes)
        except ReportError as exc:  # unreadable or too large: trials.csv still tells
            reason = f"{exc}: summary recomputed from trials.csv"
    if reason:
        notes.append(reason)
        return None
    if "scaling_efficiency" in summary.columns and "devices" not in summary.columns:
        summary = summary.drop(columns=[c for c in summary.columns
                                        if c.startswith("scaling_efficiency")])
    scaling = ("scaling_efficiency_lo", "scaling_efficiency_hi") \
        if "scaling_efficiency" in summary.columns else ()
    for c in ("peak_mem_mb", "final_loss", "mem_ratio", "mem_ratio_lo", "mem_ratio_hi", "cv",
              *scaling):
        if c not in summary.columns:
            summary[c] = math.nan
    return summary


def load_run(path, cfg: Optional[dict] = None) -> Run:
    """Everything a report needs from one run directory, its summary None where summary.csv
    is absent or unusable (summary.summarised recomputes it); ReportError when it is unusable."""
    path = Path(path)
    named = str(path) if len(str(path)) <= 200 else \
        f"{str(path)[:160]}… ({len(str(path)):,} characters)"
    try:
        if not path.exists():
            raise ReportError(f"{named} does not exist")
        if not path.is_dir():
            raise ReportError(f"{named} is not a directory")
        if not (path / "trials.csv").exists():
            raise ReportError(f"{named} has no trials.csv; is it a speedbench run directory?")
    except OSError as exc:  # a name too long, a folder that cannot be searched
        raise ReportError(f"{named} cannot be read ({exc.strerror or exc})") from None
    notes: list[str] = []
    env_notes: list[str] = []  # noted after the trials' own, as a report lists them
    env = _env_file(path / "env.json", env_notes)
    version = format_version(env)
    trials, missing = _trials(path / "trials.csv", version, notes)
    trials.attrs["format_version"] = version  # what its summary.csv was computed with
    notes += env_notes
    _planned_file(path / "planned.json", notes)
    if cfg is None:
        cfg = _config_file(path / "config.yaml", notes)
    cfg = _config(cfg, notes) if isinstance(cfg, dict) else {}
    return Run(path=path, trials=trials, summary=_summary(path, trials, notes), env=env,
               cfg=cfg, members=_members(path, notes),
               techniques=_techniques(path),
               phases=_optional_table(path / "phases.csv", PHASE_COLUMNS, notes),
               findings=_optional_table(path / "findings.csv", FINDING_COLUMNS, notes),
               capacity=_optional_table(path / "capacity.csv", REQUIRED_CAPACITY_COLUMNS, notes),
               to_target=_to_target_table(path, notes), curves=_curves_table(path, notes),
               quality=_optional_table(path / "quality.csv", REQUIRED_QUALITY_COLUMNS, notes),
               explain=_explain_table(path / "explain.csv", notes),
               forecast=_forecast_table(path / "forecast.csv", notes),
               recipe_search=_recipe_search(path, notes), format_version=version,
               notes=notes, missing=missing, label=path.name)


def _recipe_search(path: Path, notes: list[str]) -> bool:
    """Whether the run is a recipe search (recipe.csv beside trials.csv: each experiment its own
    CI family); an unusable recipe.csv is noted (and left out of the report)."""
    load_recipe(path, notes)
    return (path / "recipe.csv").is_file()


def load_quality(run_dir) -> Optional[pd.DataFrame]:
    """quality.csv of a run (None without one, or unreadable)."""
    return _optional_table(Path(run_dir) / "quality.csv", REQUIRED_QUALITY_COLUMNS, [])


def load_to_target(run_dir) -> Optional[pd.DataFrame]:
    """to_target.csv of a run (None without one, or unreadable)."""
    return _to_target_table(Path(run_dir), [])


TO_TARGET_TEXT = ("experiment", "model", "variant", "is_baseline", "status", "target_source")


def _to_target_table(run_dir: Path, notes: list[str]) -> Optional[pd.DataFrame]:
    """to_target.csv with its figures read as numbers (a `nan` target loss is missing, text
    where a number belongs is noted), None without one or unreadable."""
    df = _optional_table(run_dir / "to_target.csv", REQUIRED_TO_TARGET_COLUMNS, notes)
    if df is not None:
        _numbers(df, [c for c in df.columns if c not in TO_TARGET_TEXT], "to_target.csv", notes)
    return df


# A held-out loss curve a run writes has target.max_steps / target.eval_every points, far
# below this; a figure of millions takes minutes and gigabytes to draw.
MAX_CURVE_POINTS = 2000


def _curves_table(run_dir: Path, notes: list[str]) -> Optional[pd.DataFrame]:
    """curves.csv with its figures read as numbers, each curve (a variant's seed) thinned to
    at most MAX_CURVE_POINTS evenly spread points, its last kept (noted)."""
    df = _optional_table(run_dir / "curves.csv", CURVE_COLUMNS, notes)
    if df is None:
        return None
    _numbers(df, ("steps", "samples", "train_s", "loss"), "curves.csv", notes)
    curve = ["experiment", "model", "variant", "seed"]
    groups = df.groupby(curve, sort=False, dropna=False)
    size, place = groups["loss"].transform("size"), groups.cumcount()
    keep = (place % np.ceil(size / MAX_CURVE_POINTS) == 0) | (place == size - 1)
    if not keep.all():
        long = len(df.loc[size > MAX_CURVE_POINTS, curve].drop_duplicates())
        notes.append(f"curves.csv: {long} curve(s) of more than {MAX_CURVE_POINTS:,} points, "
                     f"more than a run writes, thinned to about {MAX_CURVE_POINTS:,} each")
        df = df[keep].reset_index(drop=True)
    return df


def load_trials(run_dir, notes: Optional[list[str]] = None) -> pd.DataFrame:
    """A run's trials.csv as a report reads it (load_run's trials): the one trials.csv loader.
    What it had to mend is added to `notes`."""
    run_dir = Path(run_dir)
    version = format_version(_env_file(run_dir / "env.json", []))
    trials = _trials(run_dir / "trials.csv", version, [] if notes is None else notes)[0]
    trials.attrs["format_version"] = version  # what its summary.csv was computed with
    return trials


def format_version(env: dict) -> int:
    """The run directory's format (schema.FORMAT_VERSION); 1 for a run that does not say."""
    version = env.get("format_version", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) else 1


def _trials(file: Path, version: int,
            notes: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """trials.csv with its names, flags and numbers cleaned, and the contract columns it lacks."""
    trials = _read_csv(file)
    lacking = [c for c in MINIMUM if c not in trials.columns]
    if lacking:
        raise ReportError(f"{file} lacks the contract columns {', '.join(lacking)}; "
                          "cannot report on it")
    if trials.empty:
        raise ReportError(f"{file} holds no trials yet")
    missing = [c for c in REQUIRED_TRIAL_COLUMNS if c not in trials.columns]
    if missing:
        notes.append(f"trials.csv lacks {', '.join(missing)} (format {version}, another "
                     "speedbench version?): what needs them is left out")
    for c in OPTIONAL_NUMERIC:
        if c not in trials.columns:
            trials[c] = math.nan
    if "device" not in trials.columns:
        trials["device"] = "unknown"
    if version < 3:  # before rounds, trials were paired by `trial`, which `round` is since
        trials["round"] = trials["trial"]
    if version < 4 and "state_mem_mb" in trials.columns:
        notes.append(f"memory split of format {version}: state_mem_mb leaves out the gradients, "
                     "and activation_mem_mb holds them")
    for c in KEYS:
        trials[c] = _names(trials[c])
    trials["is_baseline"] = _bool(trials["is_baseline"])
    _one_baseline(trials, notes)
    trials["status"] = trials["status"].astype(object).where(
        trials["status"].notna(), "error: no status").map(str)
    _numbers(trials, TRIAL_NUMERIC, "trials.csv", notes)
    _long_texts(trials, "trials.csv", notes)
    # a measurement is a positive, finite throughput: any other ok row is not one
    unusable = (trials["status"] == OK) & ~(trials["samples_per_s"] > 0)
    if unusable.any():
        trials.loc[unusable, "status"] = "error: no positive samples_per_s in trials.csv"
        notes.append(f"{int(unusable.sum())} ok trial(s) without a positive, finite "
                     "samples_per_s: counted as errors")
    # its columns were replaced one by one (a block each): a copy joins them, or the report's
    # next assign prints pandas' "highly fragmented" PerformanceWarning on the run's console
    return trials.copy(), missing


def _one_baseline(trials: pd.DataFrame, notes: list[str]) -> None:
    """One baseline variant per (experiment, model), as a run writes: where several variants
    are flagged, the first one flagged stays the baseline (noted)."""
    flagged = trials[trials["is_baseline"]]
    first = flagged.groupby(["experiment", "model"], sort=False)["variant"].first()
    keep = [first.get((e, m)) == v for e, m, v in
            zip(trials["experiment"], trials["model"], trials["variant"])]
    extra = trials["is_baseline"] & ~pd.Series(keep, index=trials.index, dtype=bool)
    if extra.any():
        names = ", ".join(dict.fromkeys(trials.loc[extra, "variant"]))
        notes.append(f"trials.csv flags more than one baseline variant of a model: "
                     f"{_short_name(names)} read as not the baseline")
        trials.loc[extra, "is_baseline"] = False


def _env_file(file: Path, notes: list[str]) -> dict:
    if not _regular(file):
        notes.append("no env.json: environment unknown")
        return {}
    data = _json_or_note(file, "environment unknown", notes)
    return {} if data is None else _env(data, notes)


def _planned_file(file: Path, notes: list[str]) -> None:
    """planned.json only checked here (report/unfinished.py reads it): one that cannot be read
    is noted, since whether the run got to its end is then unknown."""
    if file.exists() or file.is_symlink():
        if not _regular(file):
            notes.append(f"{file.name} is not a regular file: whether the run got to its end "
                         "is unknown")
            return
        _json_or_note(file, "whether the run got to its end is unknown", notes)


def _json_or_note(file: Path, unknown: str, notes: list[str]):
    """A JSON file of the run, parsed (_json); None after a note saying why it is unusable and
    what is therefore `unknown`."""
    try:
        return _json(file)
    except TooLarge as exc:
        notes.append(f"{file.name} {exc}: {unknown}")
    except RecursionError:  # the parser's own stack: deeper than MAX_DEPTH by far
        notes.append(f"{file.name} nests deeper than {MAX_DEPTH} levels, deeper than a run "
                     f"writes: {unknown}")
    except (ValueError, UnicodeDecodeError, OSError):
        notes.append(f"{file.name} is not valid JSON: {unknown}")
    return None


def _config_file(file: Path, notes: list[str]) -> dict:
    if not _regular(file):
        return {}
    try:
        return _yaml(file) or {}
    except AliasError:
        notes.append("config.yaml uses YAML aliases, which speedbench never writes (they can "
                     "expand without bound): claims and settings unknown")
    except TooLarge as exc:
        notes.append(f"config.yaml {exc}: claims and settings unknown")
    except RecursionError:
        notes.append(f"config.yaml nests deeper than {MAX_DEPTH} levels, deeper than a run "
                     "writes: claims and settings unknown")
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        notes.append("config.yaml is not valid YAML: claims and settings unknown")
    return {}


class TooLarge(ValueError):
    """A run's JSON or YAML file larger or deeper than a run writes; the message says which."""


def _text(path: Path) -> str:
    size_mb = path.stat().st_size / 1e6
    if size_mb > MAX_CSV_MB:
        raise TooLarge(f"is {size_mb:,.0f} MB, more than a run writes (at most {MAX_CSV_MB} MB "
                       "are read)")
    return path.read_text(encoding="utf-8")


def _bounded(data):
    """`data` (loaded JSON or YAML) when it nests at most MAX_DEPTH deep; TooLarge otherwise,
    before anything walks it recursively."""
    level, depth = [data], 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise TooLarge(f"nests deeper than {MAX_DEPTH} levels, deeper than a run writes")
        level = [v for x in level
                 for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list)
                           else ()) if isinstance(v, (dict, list))]
    return data


def _json(path: Path):
    """A JSON file of the run: at most MAX_CSV_MB and MAX_DEPTH (TooLarge), else parsed."""
    return _bounded(json.loads(_text(path)))


def _yaml(path: Path):
    """A YAML file speedbench wrote, read back as UTF-8 whatever the locale, without aliases,
    at most MAX_CSV_MB and MAX_DEPTH."""
    return _bounded(yaml.load(_text(path), Loader=NoAliasLoader))


class AliasError(yaml.YAMLError):
    """A YAML alias, in a file speedbench writes without any."""


class NoAliasLoader(yaml.SafeLoader):
    """safe_load without aliases: `*a` repeats a whole subtree, so a few hundred bytes of nested
    aliases expand to gigabytes once the values are copied (a "billion laughs" file)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise AliasError("a YAML alias")
        return super().compose_node(parent, index)


def load_profile_tables(run_dir) -> Optional[tuple[pd.DataFrame, pd.DataFrame]]:
    """(phases.csv, findings.csv as text) of a profiled run; None when no variant was profiled
    or phases.csv is unusable (load_run notes why)."""
    run_dir = Path(run_dir)
    phases = _optional_table(run_dir / "phases.csv", tuple(PHASE_COLUMNS), [])
    if phases is None:
        return None
    findings = _optional_table(run_dir / "findings.csv", tuple(FINDING_COLUMNS), [])
    return phases, (pd.DataFrame() if findings is None else findings.fillna("").astype(str))


def load_explain(run_dir) -> tuple[Optional[pd.DataFrame], Optional[pd.DataFrame]]:
    """(explain.csv, forecast.csv) of a run directory, each None where absent or unusable."""
    run_dir = Path(run_dir)
    return (_explain_table(run_dir / "explain.csv", []),
            _forecast_table(run_dir / "forecast.csv", []))


def load_recipe(run_dir, notes: Optional[list[str]] = None) -> Optional[pd.DataFrame]:
    """recipe.csv of a run directory (a recipe search), or None: also where it is unreadable
    or lacks the columns a search writes (said in `notes`)."""
    path = Path(run_dir) / "recipe.csv" if run_dir is not None else None
    if path is None or not path.exists():
        return None
    try:
        table = _read_csv(path)
    except ReportError as exc:
        (notes if notes is not None else []).append(f"recipe.csv left out: {exc}")
        return None
    lacking = [c for c in RECIPE_COLUMNS if c not in table.columns]
    if lacking:
        (notes if notes is not None else []).append(
            f"recipe.csv left out: it lacks the columns {', '.join(lacking)}")
        return None
    table["model"] = _names(table["model"])
    return table


def load_recipe_yaml(run_dir) -> dict:
    """recipe.yaml (the recipe found per model); empty when absent or unreadable."""
    path = Path(run_dir) / "recipe.yaml"
    try:
        data = _yaml(path) if _regular(path) else {}
    except (yaml.YAMLError, UnicodeDecodeError, OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def load_techniques(run_dir) -> Optional[dict]:
    """techniques.json (the registry's metadata as the run had it); None when the run has none
    (it predates the file) or it is unreadable, too large or too deep."""
    path = Path(run_dir) / "techniques.json"
    try:
        return _json(path) if _regular(path) else None
    except (OSError, ValueError, RecursionError):
        return None


def label_runs(runs: list[Run]) -> None:
    """Short, distinct labels: the run's own label (label=..., `speedbench runs label`), else
    the directory name with parents added until they differ; "#n" where two still match."""
    from speedbench.results.index import user_label

    depth, own = 1, [user_label(r.path) for r in runs]
    while depth < 6:
        labels = [mine or "/".join(r.path.resolve().parts[-depth:]) for r, mine in zip(runs, own)]
        if len(set(labels)) == len(labels):
            break
        depth += 1
    for i, (run, label) in enumerate(zip(runs, labels)):
        run.label = label if labels.count(label) == 1 else f"{label} #{i + 1}"


def measured_something(run_dir) -> bool:
    """Whether the run has a trial that measured a throughput (status ok, a finite
    samples_per_s): a run that has none cannot be a comparison's reference."""
    try:
        trials = load_run(run_dir).trials
    except (ReportError, OSError):
        return False
    ok = trials[trials["status"] == "ok"]["samples_per_s"]
    return bool(np.isfinite(pd.to_numeric(ok, errors="coerce").to_numpy(float)).any())
