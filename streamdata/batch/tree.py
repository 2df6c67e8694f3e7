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

__all__ = ["iter_tensors", "map_kinds", "map_leaves", "map_tensors", "pin_batch"]

T = TypeVar("T")


def map_leaves(fn: Callable[[Any], Any], obj: Any, *, whole: tuple[type, ...] = ()) -> Any:
    """Rebuild ``obj`` (dict, list, tuple, namedtuple, dataclass, nested) with ``fn`` on each leaf.

    Strings, bytes, tensors and arrays are leaves; containers keep their own type. Instances of
    ``whole`` are leaves too (``fn`` gets them whole, even a dataclass).
    """
    return _mapped(fn, obj, whole, None)


def map_kinds(fn: Callable[[Any], Any], obj: Any, kinds: tuple[type, ...]) -> Any:
    """Rebuild ``obj`` as :func:`map_leaves` does, with ``fn`` on the leaves that are instances
    of ``kinds`` only; other leaves are kept. A list, tuple or dict of plain values (a batch's
    keys and URLs, a reader's counts) is copied whole, without a step per item: the cost of a
    walk follows the number of fields, not of samples."""
    return _mapped(fn, obj, (), kinds)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested batch; other leaves pass through unchanged.

    Containers are rebuilt with their own type: dict (and subclasses), list, tuple,
    namedtuple, dataclass.  The input is not modified.
    """
    return _mapped(fn, batch, (), (torch.Tensor,))


_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})


def _mapped(fn: Callable[[Any], Any], obj: Any, whole: tuple[type, ...],
            only: tuple[type, ...] | None) -> Any:
    """``fn`` on every leaf (``only`` None), or on the leaves of the types ``only``."""
    if isinstance(obj, (str, bytes, bytearray, torch.Tensor, np.ndarray)) or isinstance(obj, whole):
        return fn(obj) if only is None or isinstance(obj, only) else obj
    if only is not None and (isinstance(obj, (list, tuple)) and _PLAIN.issuperset(map(type, obj)) or type(obj)
                             is dict and _PLAIN.issuperset(map(type, obj.values()))):
        return copy.copy(obj)  # nothing of ``only`` inside: plain values (keys, URLs, a state's counts)
    if isinstance(obj, dict):
        out: Any = copy.copy(obj)  # keeps the dict subclass and its attributes (defaultdict factory...)
        for key, value in obj.items():
            out[key] = _mapped(fn, value, whole, only)
        return out
    if isinstance(obj, Mapping):
        return {key: _mapped(fn, value, whole, only) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_mapped(fn, value, whole, only) for value in obj))
    if isinstance(obj, tuple):
        items = [_mapped(fn, value, whole, only) for value in obj]
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        out = copy.copy(obj)
        out[:] = [_mapped(fn, value, whole, only) for value in obj]
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(out, field.name, _mapped(fn, getattr(obj, field.name), whole, only))
        return out
    return fn(obj) if only is None or isinstance(obj, only) else obj


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
