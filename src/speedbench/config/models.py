"""A model to train, resolved: a model name from `models` or an inline model config (`_target_`,
or a model by name: timm, torchvision, hf) turned into a `ModelSpec` for one scale, its
`dataset` checked and its `_target_` imported; the run's own data (`data._target_`), and the
checks of a model's data against the run's (`data.path`, the synthetic sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from speedbench.config.schema import REFERENCE_MODELS
from speedbench.errors import ConfigError

DATASET_KINDS = ("images", "tokens", "tabular")
# dataset.task per kind; the first is the default (tokens with num_classes:
# sequence_classification; images and tabular with targets: regression)
TASKS = {"images": ("classification", "regression"),
         "tabular": ("classification", "regression"),
         "tokens": ("next_token", "sequence_classification", "token_classification",
                    "masked_lm")}
LOSSES = ("cross_entropy", "mse", "module")
# A model config's keys that are speedbench's, not the constructor's (`kwargs` holds the
# constructor's own, where one of them shares a name with these)
MODEL_KEYS = ("dataset", "loss", "inputs", "model_name", "batch_size")
# One-line models by name: the key -> its builder (models/by_name.py)
BY_NAME = {"timm": "speedbench.models.by_name.timm_model",
           "torchvision": "speedbench.models.by_name.torchvision_model",
           "hf": "speedbench.models.by_name.hf_model"}


@dataclass
class ModelSpec:
    """One model to train: how to build it and the data it eats, resolved for one scale."""

    name: str
    target: dict  # `_target_` plus constructor kwargs, for hydra.utils.instantiate
    dataset: dict  # kind, image_size/num_classes or seq_len/vocab_size
    loss: str
    batch_size: int
    inputs: Optional[list] = None  # forward's keyword names for x (and y): model(**batch)


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    """Refuse a value that is not one of `allowed`, naming the key and the choices."""
    if value not in allowed:
        raise ConfigError(f"{key}: '{value}' is not allowed; choose one of "
                          f"{', '.join(map(str, allowed))}")


def first_line(exc: Exception) -> str:
    """An error's first line (OmegaConf's messages go on with the full key and types)."""
    return str(exc).strip().splitlines()[0]


def resolve_model(name: str, raw: Any, registry: DictConfig, scale: str,
                  batch_size: Optional[int], data: Optional[dict] = None,
                  dirs: tuple[Path, ...] = ()) -> ModelSpec:
    """Turn a model name (in `registry`, or a models/NAME.yaml in one of the config folders
    `dirs`) or a model config into a ModelSpec for one scale.

    A model config holds `_target_` (or a model by name: `timm`, `torchvision`, `hf`) and the
    constructor's kwargs, plus speedbench's keys (MODEL_KEYS): `dataset` (what data it eats;
    `data`, the run's data._target_, replaces it), `loss` (`cross_entropy` on logits, `mse`,
    or `module` when forward(x, y) returns the loss), `inputs` (forward's keyword names for x
    and y), `model_name`, `batch_size`; `kwargs` (the constructor's own, where a name is also
    one of speedbench's keys), and `small:`/`full:` blocks merged on top per scale.
    """
    name, node = model_node(name, raw, registry, dirs)
    node = OmegaConf.create(OmegaConf.to_container(node, resolve=False))
    per_scale = {s: node.pop(s, None) for s in ("small", "full")}
    if per_scale[scale] is not None:
        node = OmegaConf.merge(node, per_scale[scale])
    try:
        spec = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"model {name}: {first_line(exc)}") from None
    own = spec.pop("dataset", None)
    dataset = check_dataset(str(spec.get("model_name") or name), data or own or {})
    spec = by_name(name, spec, dataset)
    given = [k for k in MODEL_KEYS if k in spec]
    loss = spec.pop("loss", "mse" if dataset.get("task") == "regression" else "cross_entropy")
    default_batch = spec.pop("batch_size", 32)
    name = str(spec.pop("model_name", None) or name)
    inputs = _inputs(name, spec.pop("inputs", None), loss)
    check_choice(f"model {name}: loss", loss, LOSSES)
    target = check_importable(name, spec["_target_"])
    spec = constructor_args(name, spec, target, given)
    return ModelSpec(name=name, target=spec, dataset=dataset, loss=loss,
                     batch_size=batch_size or default_batch, inputs=inputs)


def model_node(name: str, raw: Any, registry: DictConfig, dirs: tuple[Path, ...] = ()
               ) -> tuple[str, Any]:
    """(name, config node) of a model given by its name in `models`, by its file
    `models/NAME.yaml` in a config folder (`dirs`: Hydra's, --config-dir's among them), or
    inline."""
    if isinstance(raw, str):
        if raw in registry:
            return raw, registry[raw]
        found = next((d / "models" / f"{raw}.yaml" for d in dirs
                      if (d / "models" / f"{raw}.yaml").is_file()), None)
        if found is None:
            raise ConfigError(f"model: '{raw}' is not a known model; choose from "
                              f"{', '.join(registry.keys())}, a list of them, or a config with "
                              "_target_ (or timm, torchvision, hf)" + _nearby_hint(raw))
        try:
            return raw, OmegaConf.load(found)
        except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"model {raw}: {found}: {first_line(exc)}") from None
    if is_inline(raw):
        return name, OmegaConf.create(raw) if isinstance(raw, dict) else raw
    raise ConfigError(f"model: {raw!r} is neither a model name ({', '.join(registry.keys())}) "
                      "nor a config with _target_ (or timm, torchvision, hf)")


def _nearby_hint(name: str) -> str:
    """Where a models/NAME.yaml sits in the current folder or a usual config folder of it, the
    flag that makes it known."""
    for folder in (".", "conf", "configs", "config"):
        if (Path(folder) / "models" / f"{name}.yaml").is_file():
            return (f"; {Path(folder) / 'models' / (name + '.yaml')} is here: give "
                    f"--config-dir {folder} (before the overrides) to use it")
    return ""


def config_dirs() -> tuple[Path, ...]:
    """The folders of Hydra's config search path (--config-dir, hydra.searchpath, the
    package's), where a run is under Hydra; none otherwise."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ()
    return tuple(Path(source.path) for source in HydraConfig.get().runtime.config_sources
                 if source.schema == "file")


def is_inline(raw: Any) -> bool:
    """Whether a `model` entry is a model config (a mapping with _target_ or a model by name)."""
    return isinstance(raw, (dict, DictConfig)) and any(k in raw for k in ("_target_", *BY_NAME))


NEEDS = {"images": ("image_size",), "tokens": ("seq_len", "vocab_size"),
         "tabular": ("features",)}
TASK_NEEDS = {"regression": ("targets",), "next_token": (), "masked_lm": ()}


def check_dataset(name: str, dataset: Any) -> dict:
    """A model's `dataset`, checked, with its `task` filled in: a kind (DATASET_KINDS), a task
    of that kind (TASKS) and the sizes both need; or a user's own (`_target_`), as it is."""
    if not isinstance(dataset, dict):
        raise ConfigError(f"model {name}: dataset: {dataset!r}; give a mapping: {{kind: "
                          f"images|tokens|tabular, ...}} or {{_target_: module.Dataset, ...}}")
    if "_target_" in dataset:
        return dataset
    kind = dataset.get("kind")
    check_choice(f"model {name}: dataset.kind", kind, DATASET_KINDS)
    default = "regression" if "targets" in dataset and kind != "tokens" else TASKS[kind][0]
    if kind == "tokens" and "num_classes" in dataset:
        default = "sequence_classification"
    task = dataset.get("task") or default
    check_choice(f"model {name}: dataset.task", task, TASKS[kind])
    for key in NEEDS[kind] + TASK_NEEDS.get(task, ("num_classes",)):
        value = dataset.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"model {name}: dataset.{key}: {value!r}; {kind} for task {task} "
                              f"needs {key}, a positive integer (it needs "
                              f"{', '.join(NEEDS[kind] + TASK_NEEDS.get(task, ('num_classes',)))})")
    if kind == "images":
        check_choice(f"model {name}: dataset.channels", dataset.get("channels", 3), (1, 3))
    return {**dataset, "task": task}


def by_name(name: str, spec: dict, dataset: dict) -> dict:
    """A model by name (`timm: resnet18`, `torchvision: mobilenet_v3_small`, `hf:
    BertForSequenceClassification`) as the `_target_` of its builder (models/by_name.py), the
    name given positionally; what its dataset says filled in where not given: num_classes
    (and timm's in_chans) for pictures, the Hugging Face config's vocab_size and num_labels
    and forward's `inputs`."""
    keys = [k for k in BY_NAME if k in spec]
    if not keys:
        return spec
    if len(keys) > 1 or "_target_" in spec:
        raise ConfigError(f"model {name}: give one of _target_, {', '.join(BY_NAME)}; it has "
                          f"{', '.join(k for k in ('_target_', *BY_NAME) if k in spec)}")
    key = keys[0]
    model = spec.pop(key)
    if not isinstance(model, str):
        raise ConfigError(f"model {name}: {key}: {model!r}; give the model's name, e.g. "
                          f"{key}: {BY_NAME_EXAMPLE[key]}")
    out = {"_target_": BY_NAME[key], "_args_": [model], **spec}
    task, kind = dataset.get("task"), dataset.get("kind")
    classes = dataset.get("targets") if task == "regression" else dataset.get("num_classes")
    if key == "hf":
        config = dict(out.get("config") or {})
        if kind == "tokens":
            config.setdefault("vocab_size", dataset["vocab_size"])
        if classes and task not in ("next_token", "masked_lm"):
            config.setdefault("num_labels", classes)
        out["config"] = config
        out.setdefault("inputs", ["pixel_values"] if kind == "images" else ["input_ids"])
    elif kind in ("images", "tabular") and classes:
        out.setdefault("num_classes", classes)
        if key == "timm" and kind == "images":
            out.setdefault("in_chans", dataset.get("channels", 3))
    return out


BY_NAME_EXAMPLE = {"timm": "resnet18", "torchvision": "mobilenet_v3_small",
                   "hf": "BertForSequenceClassification"}
MODEL_KEY_MEANING = {"dataset": "the data it eats", "loss": "how its loss is taken",
                     "inputs": "forward's keyword names", "model_name": "its name in the tables",
                     "batch_size": "samples per micro-batch"}


def constructor_args(name: str, spec: dict, target: Any, given: list[str]) -> dict:
    """The `_target_`'s arguments: the model config's other keys and `kwargs`. A key of
    speedbench's (MODEL_KEYS) that is also a keyword of the target is refused unless `kwargs`
    is given (the target's then go there): no reserved key swallows a user's argument."""
    kwargs = spec.pop("kwargs", None)
    where = spec["_target_"]
    if kwargs is None:
        clash = [k for k in given if k in keyword_names(target)]
        if clash:
            key = clash[0]
            raise ConfigError(f"model {name}: {key} is speedbench's key ({MODEL_KEY_MEANING[key]}) "
                              f"and also an argument of {where}; give {where}'s under kwargs: "
                              f"{{{key}: ...}}, speedbench's beside it")
        return spec
    if not isinstance(kwargs, dict):
        raise ConfigError(f"model {name}: kwargs: {kwargs!r}; give a mapping of {where}'s "
                          "keyword arguments")
    twice = [k for k in kwargs if k in spec]
    if twice:
        raise ConfigError(f"model {name}: {twice[0]} is given twice, in kwargs and beside it; "
                          "keep one")
    return {**spec, **kwargs}


def keyword_names(target: Any) -> set[str]:
    """The names a callable takes as keywords (none where its signature cannot be read)."""
    import inspect

    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _inputs(name: str, inputs: Any, loss: str) -> Optional[list]:
    """`inputs`: the keyword names forward takes x (and, with loss: module, y) under."""
    if inputs is None:
        return None
    want = 2 if loss == "module" else 1
    if not (isinstance(inputs, list) and len(inputs) == want
            and all(isinstance(n, str) for n in inputs)):
        example = "[input_ids, labels]" if want == 2 else "[pixel_values]"
        raise ConfigError(f"model {name}: inputs: {inputs!r}; with loss: {loss} give {want} "
                          f"keyword name{'s' * (want > 1)} of forward, e.g. inputs: {example}")
    return inputs


def check_importable(name: str, target: str) -> Any:
    """Import a `_target_`'s module now, so that a missing one stops the run before any trial;
    returns the callable it names."""
    import importlib

    parts = str(target).split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:
            if exc.name != module or i == 1:
                raise ConfigError(f"model {name}: _target_ {target}: no module named "
                                  f"'{exc.name}'{_import_fix(exc.name)}") from None
        except Exception as exc:
            raise ConfigError(f"model {name}: _target_ {target}: importing {module} failed: "
                              f"{type(exc).__name__}: {first_line(exc)}"
                              f"{torchvision_mismatch(str(exc))}") from None
    else:
        raise ConfigError(f"model {name}: _target_ {target}: give module.callable, "
                          f"e.g. mynet.build")
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            raise ConfigError(f"model {name}: _target_ {target}: {obj.__name__} has no {attr}")
        obj = getattr(obj, attr)
    return obj


def torchvision_mismatch(message: str) -> str:
    """The likely cause of torchvision's failed import, where its message names one of its
    operators: a torchvision built for another torch (torchvision 0.N goes with torch 2.(N-15))."""
    if "torchvision::" not in message:
        return ""
    from importlib import metadata

    import torch

    try:
        vision = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return ""
    release = torch.__version__.split("+")[0]
    minor = int(release.split(".")[1])
    return (f"; torchvision {vision} was likely built for another torch than {torch.__version__}"
            f": install the pair, e.g. pip install torch=={release} torchvision==0.{minor + 15}.*")


def _import_fix(module: str) -> str:
    from pathlib import Path

    top = module.split(".")[0]
    if Path(f"{top}.py").is_file() or Path(top).is_dir():
        return ""
    return (f" (run speedbench from the folder that holds {top}.py, or add that folder to "
            f"PYTHONPATH; an installed package: pip install it)")


def inline_name(raw: Any) -> str:
    """An inline model's name: its `model_name`, else its name (`timm: resnet18`), else the
    last part of its `_target_`."""
    named = [raw[k] for k in BY_NAME if k in raw]
    return str(raw.get("model_name") or (named[0] if named else "")
               or str(raw.get("_target_")).rsplit(".", 1)[-1])


def model_entries(model: Any) -> list:
    if model is None:
        return list(REFERENCE_MODELS)
    if isinstance(model, (list, ListConfig)):
        entries = list(model)
        if not entries:
            raise ConfigError("model: the list is empty; name at least one of "
                              + ", ".join(REFERENCE_MODELS))
        return entries
    return [model]


# A synthetic data set's sizes: each a positive integer where the model's dataset gives it
# (vocab_size=0 would fail while the data is made, after the run directory exists).
DATASET_SIZES = ("image_size", "num_classes", "seq_len", "vocab_size")


def check_dataset_sizes(spec: "ModelSpec") -> None:
    for key in DATASET_SIZES:
        if key in spec.dataset:
            value = spec.dataset[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"model {spec.name}: dataset.{key}: {value!r} is out of "
                                  f"range; it must be an integer >= 1")


def own_data(cfg: DictConfig) -> Optional[dict]:
    """The run's data._target_ and its kwargs, as a model's `dataset`; None without one."""
    if cfg.data._target_ is None:
        if cfg.data.kwargs:
            raise ConfigError("data.kwargs: given without data._target_; name the callable "
                              "they are for (data._target_=module.name)")
        return None
    return {"_target_": cfg.data._target_, **OmegaConf.to_container(cfg.data.kwargs)}


def check_path_fits(spec: ModelSpec, path: str) -> None:
    from pathlib import Path

    p = Path(path).expanduser()
    kind = spec.dataset.get("kind")
    if kind not in ("images", "tokens"):
        what = "its own data set (_target_)" if kind is None else f"{kind} data, made up"
        raise ConfigError(f"data.path: model {spec.name} eats {what}; data.path takes an "
                          "ImageFolder directory (images) or a text file (tokens)")
    want_dir = kind == "images"
    if want_dir != p.is_dir():
        need = "an ImageFolder directory" if want_dir else "a text file"
        raise ConfigError(f"data.path: model {spec.name} eats {spec.dataset['kind']}, so data.path "
                          f"must be {need}; '{path}' is not")
