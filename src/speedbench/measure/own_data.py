"""A user's own data: a `_target_` (`data._target_`, or a model's `dataset: {_target_: ...}`)
naming a callable in the user's folder that returns a torch `Dataset` or a `DataLoader`.

speedbench owns the loader either way, so that its data knobs (data.num_workers,
data.pin_memory, data.persistent_workers, data.prefetch_factor) and the batch size act on it
and can be measured: a Dataset is loaded by speedbench's DataLoader (data.build_loader); a
DataLoader is taken apart, its dataset, collate_fn and worker_init_fn kept and its own worker,
pinning, batch and order settings replaced by speedbench's, said once in one line. What cannot
be taken over (a batch_sampler of its own, an IterableDataset, anything that is neither a
Dataset nor a DataLoader) stops the run before anything is written, in one line saying why.
Items are (x, y) pairs, as the synthetic data's; the pictures' channels and transforms are the
data set's own.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, \
    RandomSampler, SequentialSampler, default_collate

from speedbench import techniques
from speedbench.measure import batches
from speedbench.errors import ConfigError

_SAID: set[str] = set()  # the targets whose replaced settings were said (once per process)


def own_dataset(spec: dict) -> Dataset:
    """The user's data set from `spec` (`_target_` and its keyword arguments), checked."""
    from hydra.utils import instantiate

    name = str(spec["_target_"])
    try:
        made = instantiate(dict(spec), _convert_="all")
    except (Exception, SystemExit) as exc:  # its sys.exit() too: one line, not a silent end
        cause = exc.__cause__ or exc
        raise ConfigError(f"data: _target_ {name} failed: {type(cause).__name__}: "
                          f"{_first_line(cause)}") from None
    if _is_datamodule(made):  # a LightningDataModule: its training DataLoader
        made = datamodule_loader(name, made)
    if isinstance(made, DataLoader):
        made = LoaderData(name, made)
    elif isinstance(made, IterableDataset) or not _map_style(made):
        raise ConfigError(f"data: _target_ {name} returned {_what(made)}; give a map-style "
                          "torch Dataset (items (x, y), a length) or a DataLoader of one: "
                          "speedbench shuffles it alike for every variant and sets a held-out "
                          "share aside")
    _check_items(name, made)
    return made


def _is_datamodule(made: Any) -> bool:
    """A Lightning DataModule, known by its methods (lightning is not imported here)."""
    return not isinstance(made, (Dataset, DataLoader)) and all(
        callable(getattr(made, m, None)) for m in ("prepare_data", "setup", "train_dataloader"))


def datamodule_loader(name: str, module: Any) -> DataLoader:
    """A DataModule's training DataLoader, as a Trainer's fit gets it: prepare_data(),
    setup("fit"), train_dataloader(). One line (ConfigError) where one of them fails."""
    try:
        module.prepare_data()
        module.setup(stage="fit")
        loader = module.train_dataloader()
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"data: _target_ {name}, a DataModule, failed in prepare_data, setup "
                          f"or train_dataloader: {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"data: _target_ {name}, a DataModule: its train_dataloader() "
                          f"returned {_what(loader)}; speedbench takes one DataLoader")
    return loader


class LoaderData(Dataset):
    """A user's DataLoader as a data set: its dataset's items, and the functions speedbench's
    DataLoader keeps (`loader_functions`: collate_fn, worker_init_fn)."""

    def __init__(self, name: str, loader: DataLoader):
        if isinstance(loader.dataset, IterableDataset):
            raise ConfigError(f"data: _target_ {name} returned a DataLoader of an "
                              "IterableDataset; give a map-style Dataset (items (x, y), a "
                              "length), which speedbench shuffles alike for every variant")
        if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
            raise ConfigError(
                f"data: _target_ {name} returned a DataLoader whose batches come from a "
                f"batch_sampler of its own ({type(loader.batch_sampler).__name__}); speedbench "
                "sets the batch size and the order (batch_size, the batch techniques): give "
                "a DataLoader with batch_size, or its Dataset")
        self.dataset = loader.dataset
        self.loader_functions = {"collate_fn": loader.collate_fn}
        if loader.worker_init_fn is not None:
            self.loader_functions["worker_init_fn"] = loader.worker_init_fn
        _say_replaced(name, loader)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]


def loader_knobs() -> dict[str, str]:
    """DataLoader's own arguments that a technique's `data.*` key sets -> that key (from the
    registry: the keys whose last part is one of DataLoader's arguments)."""
    params = inspect.signature(DataLoader.__init__).parameters
    return {f.key.split(".")[-1]: f.key for f in techniques.fields()
            if f.key.startswith("data.") and f.key.split(".")[-1] in params}


def replaced_settings(loader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader's settings that speedbench's replaces: {argument: its value},
    those of the data knobs that differ from DataLoader's defaults, and the batch size."""
    params = inspect.signature(DataLoader.__init__).parameters
    got = {"batch_size": loader.batch_size}
    for arg in loader_knobs():
        value = getattr(loader, arg, params[arg].default)
        if value != params[arg].default:
            got[arg] = value
    return got


def _say_replaced(name: str, loader: DataLoader) -> None:
    """One line, once per target: what of the user's DataLoader speedbench's replaces, and the
    keys that train as it does."""
    if name in _SAID:
        return
    _SAID.add(name)
    settings = replaced_settings(loader)
    sampler = type(loader.sampler)
    order = "" if sampler in (RandomSampler, SequentialSampler) else \
        f", its {sampler.__name__} (a seeded shuffle instead)"
    key = {**loader_knobs(), "batch_size": "batch_size"}
    keys = " ".join(f"{key[k]}={_value(v)}" for k, v in settings.items())
    print(f"speedbench: data: {name}'s DataLoader: speedbench loads its dataset with its own "
          f"DataLoader, keeping collate_fn and worker_init_fn and replacing "
          f"{', '.join(settings)}{order}, so that the data knobs can be measured; to train "
          f"as yours does, give {keys}", file=sys.stderr)


def _map_style(obj: Any) -> bool:
    """A Dataset, or anything indexable with a length (a list of pairs)."""
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
                                        and not isinstance(obj, (str, bytes, dict)))


def _check_items(name: str, ds: Dataset) -> None:
    try:
        length = len(ds)  # a __len__ that raises, or returns no count
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"data: _target_ {name}: len() failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from None
    if length == 0:
        raise ConfigError(f"data: _target_ {name} returned an empty data set")
    try:
        item = ds[0]
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"data: _target_ {name}: reading item 0 failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"data: _target_ {name}'s items are {_what(item)}; speedbench trains "
                          f"on (x, y) pairs, x and y each {batches.FORMS}: return (input, "
                          "label) from __getitem__")
    _check_batch(name, ds, item)


def _check_batch(name: str, ds: Dataset, item) -> None:
    """A batch of two items, collated as the loader will, holds only what speedbench can move
    to the device (batches.py); else one line naming the place and the forms."""
    collate = getattr(ds, "loader_functions", {}).get("collate_fn") or default_collate
    index = min(1, len(ds) - 1)
    try:
        second = ds[index]
    except MemoryError:  # the host, not the data's form: the trial records it (oom, reading)
        return
    except (Exception, SystemExit) as exc:  # its sys.exit() too: one line, not a silent end
        raise ConfigError(f"data: _target_ {name}: reading item {index} failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    try:
        got = collate([item, second])
    except MemoryError:
        return
    except Exception as exc:
        raise ConfigError(f"data: _target_ {name}: two items do not make a batch: "
                          f"{type(exc).__name__}: {_first_line(exc)}; x and y are each "
                          f"{batches.FORMS}") from None
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ConfigError(f"data: _target_ {name}: its collate_fn makes {_what(got)}; "
                          f"speedbench trains on (x, y) pairs, x and y each {batches.FORMS}")
    x, y = got
    found = batches.unsupported(x, "x") or batches.unsupported(y, "y")
    if found:
        raise ConfigError(f"data: _target_ {name}: a batch's {found}, which speedbench cannot "
                          f"move to the device; x and y are each {batches.FORMS}")


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _what(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
