"""Walking nested batches: dicts, lists, tuples, namedtuples and dataclasses, to any depth.

It imports nothing of streamdata's, so collation (:mod:`streamdata.batch.collate`), buffer
recycling and the GPU feed can all walk batches with it; :func:`pin_batch` page-locks one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["iter_tensors", "map_leaves", "map_tensors", "pin_batch"]

T = TypeVar("T")


def map_leaves(fn: Callable[[Any], Any], obj: Any, *, whole: tuple[type, ...] = ()) -> Any:
    """Rebuild ``obj`` (dict, list, tuple, namedtuple, dataclass, nested) with ``fn`` on each leaf.

    Strings, bytes, tensors and arrays are leaves; containers keep their own type. Instances of
    ``whole`` are leaves too (``fn`` gets them whole, even a dataclass).
    """
    if isinstance(obj, (str, bytes, bytearray, torch.Tensor, np.ndarray)) or isinstance(obj, whole):
        return fn(obj)
    if isinstance(obj, dict):
        out: Any = copy.copy(obj)  # keeps the dict subclass and its attributes (defaultdict factory...)
        for key, value in obj.items():
            out[key] = map_leaves(fn, value, whole=whole)
        return out
    if isinstance(obj, Mapping):
        return {key: map_leaves(fn, value, whole=whole) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_leaves(fn, value, whole=whole) for value in obj))
    if isinstance(obj, tuple):
        items = [map_leaves(fn, value, whole=whole) for value in obj]
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        out = copy.copy(obj)
        out[:] = [map_leaves(fn, value, whole=whole) for value in obj]
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(out, field.name, map_leaves(fn, getattr(obj, field.name), whole=whole))
        return out
    return fn(obj)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested batch; other leaves pass through unchanged.

    Containers are rebuilt with their own type: dict (and subclasses), list, tuple,
    namedtuple, dataclass.  The input is not modified.
    """
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, batch)


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested batch, depth first."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return iter(found)


def _pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def pin_batch(batch: T) -> T:
    """Page-lock every CPU tensor of a nested batch (already pinned ones are kept as they are)."""
    return map_tensors(_pin_tensor, batch)
