"""Batches of any structure: x and y each a tensor, or a tuple, list or dict (nested) of them.

`to_device` moves every tensor of a batch, element by element, with the copy options the
techniques give (non_blocking acts on each; the DataLoader's pin_memory already pins each,
nested); `samples_of` counts a batch's samples: the model's own `speedbench_samples(batch)`
where it has one, else the first tensor's leading dimension (depth first, dict values in their
order); `take` slices every tensor of a batch along the samples; `unsupported` names what
cannot be moved (a str, a PIL image, None) in one line naming the supported forms.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

FORMS = ("a tensor, or a tuple, list or dict (nested) of tensors; numbers are collated into "
         "tensors")
COUNT_HOOK = "speedbench_samples"  # a model method (batch) -> int that overrides the count


def map_tensors(fn, obj: Any) -> Any:
    """`obj` with every tensor in it replaced by fn(tensor), its tuples (namedtuples too),
    lists and dicts kept; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple keeps its type
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def to_device(obj: Any, device: torch.device, **options) -> Any:
    """`obj` with every tensor in it moved to `device` (`options`: tensor.to's keywords)."""
    return map_tensors(lambda t: t.to(device, **options), obj)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, depth first (dict values in their order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensors(v)]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors(v)]
    return []


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    found = tensors(obj)
    return found[0] if found else None


def samples_of(batch: Any, model: Any = None) -> int:
    """A batch's samples: `model.speedbench_samples(batch)` where the model has it, else the
    leading dimension of the batch's first tensor (1 for a batch without one with a leading
    dimension)."""
    count = getattr(model, COUNT_HOOK, None)
    if callable(count):
        return int(count(batch))
    t = first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.dim() else 1


def take(obj: Any, start: int, stop: int) -> Any:
    """`obj` with every tensor that has a leading dimension sliced to [start:stop]."""
    return map_tensors(lambda t: t[start:stop] if t.dim() else t, obj)


def unsupported(obj: Any, where: str = "x") -> Optional[str]:
    """Where `obj` (a collated batch part) holds something speedbench cannot move to the
    device, `x[1]` holds a str, ...: the first such place and its type; None when it is all
    tensors (in tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            found = unsupported(v, f"{where}[{i}]")
            if found:
                return found
        return None if obj else f"{where} is an empty {type(obj).__name__}"
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            found = unsupported(v, f"{where}[{k!r}]")
            if found:
                return found
        return None if obj else f"{where} is an empty dict"
    return f"{where} holds a {type(obj).__name__}"
