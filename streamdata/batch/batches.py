"""Collation as samples arrive: each array goes into the batch tensor when it is produced.

:func:`streamdata.batch.collate.collate` needs the whole list of samples, so a worker holds a batch
twice at its peak (the samples, then the stacked copy), and the memory of large per-sample
arrays goes back to the OS between batches, to be page-faulted in again for the next one.
:class:`BatchBuilder` copies each numeric array (or CPU tensor) into its row of the batch
as soon as the sample arrives, so the sample can be freed at once and the allocator hands
the same warm memory to the next one (benchmarks/README.md, "Large arrays through the worker
pipe").

The result is the same as ``collate(samples)``: fields whose shape or dtype change from one
sample to the next, and every non-array field, are collected as lists and collated at the
end by the same code (dtype promotion, errors naming the field).

:func:`batches` is the one place streamdata groups samples into batches (the datasets' own
``batch_size`` and ``sd.loader``'s batching in the workers), with this collation or the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from streamdata.batch.collate import (
    NUMERIC_KINDS,
    collate,
    collate_column,
    empty_tensor,
    empty_tensors,
    prepare_shared,
)
from streamdata.errors import DecodeError

__all__ = ["BatchBuilder", "batches"]


class _Rows:
    """One array field: rows written into a preallocated (shared-memory) tensor, ``out``: the
    batch's array fields share one storage (:func:`streamdata.batch.collate.empty_tensors`)."""

    def __init__(self, first: Any) -> None:
        self.shape = tuple(first.shape)
        self.np_dtype = first.dtype if isinstance(first, np.ndarray) else None  # None: tensors
        self.dtype = (first.dtype if self.np_dtype is None else
                      torch.from_numpy(np.empty(0, dtype=first.dtype.newbyteorder("="))).dtype)
        self.out = torch.empty(0)
        self.view: np.ndarray | None = None
        self.n = 0

    def into(self, out: torch.Tensor) -> None:
        self.out = out
        self.view = out.numpy() if self.np_dtype is not None else None

    def fits(self, leaf: Any) -> bool:
        if self.np_dtype is not None:
            return isinstance(leaf, np.ndarray) and leaf.dtype == self.np_dtype and leaf.shape == self.shape
        return (isinstance(leaf, torch.Tensor) and leaf.dtype == self.dtype
                and tuple(leaf.shape) == self.shape and leaf.device.type == "cpu")

    def add(self, leaf: Any) -> None:
        if self.view is not None:
            self.view[self.n] = leaf
        else:
            self.out[self.n].copy_(leaf)
        self.n += 1

    def rows_tensor(self) -> torch.Tensor:
        """The filled rows; a short batch gets storage of its own size (the full-size one
        goes back to the pool, or is freed)."""
        if self.n == len(self.out):
            return self.out
        short = empty_tensor((self.n, *self.shape), self.dtype, self.out.is_shared())
        return short.copy_(self.out[: self.n])

    def rows(self) -> list[Any]:
        """The rows so far, as separate values (when the field falls back to a list)."""
        rows = self.out[: self.n]
        return [row.numpy().copy() for row in rows] if self.view is not None else list(rows.clone())


class BatchBuilder:
    """Collate up to ``capacity`` samples one at a time; :meth:`finish` returns the batch."""

    def __init__(self, capacity: int, *, in_flight: int | None = None) -> None:
        self.capacity, self.in_flight = capacity, in_flight
        self._reset()

    def _reset(self) -> None:
        self._template: Any = None  # sample 0's containers, its leaves replaced by their paths
        self._fields: list[Any] = []  # per leaf: a _Rows, or a list of raw values
        self._samples: list[Any] | None = None  # structures the builder does not walk: collate()
        self._shared = False  # the batch goes to shared memory (in a DataLoader worker)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, sample: Any) -> None:
        if self.count >= self.capacity:
            raise ValueError(f"the batch is full ({self.capacity} samples)")
        if self.count == 0:
            self._start(sample)
        elif self._samples is not None:
            self._samples.append(sample)
        else:
            leaves = list(_leaves(self._template, sample, "batch"))  # checked whole, then written
            for index, leaf in enumerate(leaves):
                self._add_leaf(index, leaf)
        self.count += 1

    def _start(self, sample: Any) -> None:
        if not _walkable(sample):
            self._samples = [sample]
            return
        self._template = _skeleton(sample, "batch")
        leaves = list(_leaves(self._template, sample, "batch"))
        self._shared = prepare_shared(sample, self.in_flight, copies_all=True,
                                         times=self.capacity)
        for leaf in leaves:
            self._fields.append(_Rows(leaf) if _is_array(leaf) else [leaf])
        arrays = [(index, field) for index, field in enumerate(self._fields) if isinstance(field, _Rows)]
        outs = empty_tensors([((self.capacity, *rows.shape), rows.dtype) for _, rows in arrays], self._shared)
        for (index, rows), out in zip(arrays, outs, strict=True):
            rows.into(out)
            rows.add(leaves[index])

    def _add_leaf(self, index: int, leaf: Any) -> None:
        field = self._fields[index]
        if isinstance(field, _Rows):
            if field.fits(leaf):
                field.add(leaf)
                return
            field = self._fields[index] = field.rows()  # shape or dtype changed: collate() decides
        field.append(leaf)

    def finish(self) -> Any:
        """The collated batch (``collate`` of the samples added); the builder is then empty."""
        if self.count == 0:
            raise ValueError("finish() needs at least one sample")
        if self._samples is not None:
            batch = collate(self._samples, in_flight=self.in_flight)
        else:
            paths = _leaves(self._template, self._template, "batch")
            columns = iter([field.rows_tensor() if isinstance(field, _Rows)
                            else collate_column(field, path, self._shared)
                            for field, path in zip(self._fields, paths, strict=False)])
            batch = _rebuild(self._template, columns)
        self._reset()
        return batch


def batches(samples: Iterable[Any], batch_size: int, *, collate_fn: Callable[[list], Any] | None = None,
            drop_last: bool = False, in_flight: int | None = None,
            sizes: Iterable[int] | None = None,
            left_out: Callable[[int], None] | None = None) -> Iterator[Any]:
    """Group ``samples`` into batches of ``batch_size``; the short tail too unless ``drop_last``
    (then ``left_out(n)`` is told the ``n`` samples of the tail it left out, if any).

    ``sizes``, when given, are the planned sizes of the first batches, in order (an exact
    epoch's plan, EQUAL-STEPS in :mod:`streamdata.epoch.plan`); batches after them are ``batch_size``.

    The one place streamdata batches: ``collate_fn=None`` is the default collation, each
    sample copied into its (shared-memory) batch as it arrives (:class:`BatchBuilder`;
    ``in_flight`` as in :func:`~streamdata.batch.collate.collate`); a callable gets each list of
    ``batch_size`` samples instead (``in_flight`` is then unused).
    """
    targets = iter(sizes) if sizes is not None else None
    if collate_fn is None:
        return _built(samples, batch_size, drop_last, in_flight, targets, left_out)
    return _gathered(samples, batch_size, collate_fn, drop_last, targets, left_out)


def _built(items: Iterable[Any], batch_size: int, drop_last: bool, in_flight: int | None,
           targets: Iterator[int] | None, left_out: Callable[[int], None] | None = None) -> Iterator[Any]:
    """:func:`batches` with the default collation: each sample into the batch as it comes."""
    builder = BatchBuilder(batch_size, in_flight=in_flight)
    want = batch_size if targets is None else next(targets, batch_size)
    for item in items:
        builder.add(item)
        del item  # the sample's arrays are in the batch now: let them go
        if len(builder) == want:
            yield builder.finish()
            want = batch_size if targets is None else next(targets, batch_size)
    if len(builder) and not drop_last:
        yield builder.finish()
    elif len(builder) and left_out is not None:
        left_out(len(builder))


def _gathered(items: Iterable[Any], batch_size: int, collate_fn: Callable[[list], Any],
              drop_last: bool, targets: Iterator[int] | None,
              left_out: Callable[[int], None] | None = None) -> Iterator[Any]:
    """:func:`batches` with the caller's ``collate_fn``: lists of ``batch_size`` items, collated."""
    batch: list[Any] = []
    want = batch_size if targets is None else next(targets, batch_size)
    for item in items:
        batch.append(item)
        if len(batch) == want:
            yield collate_fn(batch)
            batch = []
            want = batch_size if targets is None else next(targets, batch_size)
    if batch and not drop_last:
        yield collate_fn(batch)
    elif batch and left_out is not None:
        left_out(len(batch))


# --- walking samples: plain dicts, lists and tuples; anything else goes to collate() ----------

def _is_array(leaf: Any) -> bool:
    """A field copied row by row: numeric arrays and plain dense CPU tensors. Tensors that
    require grad, sparse tensors and tensor subclasses go to collate() at the end."""
    if isinstance(leaf, np.ndarray):
        return leaf.dtype.kind in NUMERIC_KINDS
    return (type(leaf) is torch.Tensor and leaf.device.type == "cpu"
            and leaf.layout == torch.strided and not leaf.requires_grad)


def _walkable(sample: Any) -> bool:
    if type(sample) is dict:
        return all(_walkable(v) for v in sample.values())
    if type(sample) in (list, tuple):
        return all(_walkable(v) for v in sample)
    if isinstance(sample, (Mapping, list, tuple)) or dataclasses.is_dataclass(sample):
        return False  # subclasses, namedtuples, dataclasses: collate() rebuilds those
    return True


def _skeleton(sample: Any, path: str) -> Any:
    """``sample``'s plain containers with each leaf replaced by its path (``batch['x'][0]``)."""
    if type(sample) is dict:
        return {key: _skeleton(value, f"{path}[{key!r}]") for key, value in sample.items()}
    if type(sample) in (list, tuple):
        items = [_skeleton(value, f"{path}[{i}]") for i, value in enumerate(sample)]
        return items if type(sample) is list else tuple(items)
    return path


def _leaves(template: Any, sample: Any, path: str) -> Iterator[Any]:
    """``sample``'s leaves in ``template``'s order, checked as ``collate`` checks them."""
    if type(template) is dict:
        if not isinstance(sample, Mapping):
            raise DecodeError(f"cannot collate {path}: a dict, then {type(sample).__name__}")
        for key, value in template.items():
            if key not in sample:
                raise DecodeError(f"cannot collate {path}: a sample has no key {key!r}")
            yield from _leaves(value, sample[key], f"{path}[{key!r}]")
    elif type(template) in (list, tuple):
        try:  # any sized sequence lines up, as in collate() (a later sample may be an array)
            got: Any = len(sample)
        except TypeError:
            got = type(sample).__name__
        if got != len(template) or isinstance(sample, (str, bytes, Mapping)):
            raise DecodeError(f"cannot collate {path}: sample 0 has {len(template)} items, "
                              f"a later one has {got}")
        for i, (t, s) in enumerate(zip(template, sample, strict=False)):  # lengths checked above
            yield from _leaves(t, s, f"{path}[{i}]")
    else:
        yield sample


def _rebuild(template: Any, columns: Iterator[Any]) -> Any:
    if type(template) is dict:
        return {key: _rebuild(value, columns) for key, value in template.items()}
    if type(template) in (list, tuple):
        items = [_rebuild(value, columns) for value in template]
        return items if type(template) is list else tuple(items)
    return next(columns)
