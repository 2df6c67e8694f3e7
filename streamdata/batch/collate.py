"""Worker-side collation: a batch of tensors that leaves the worker through shared memory.

A DataLoader worker hands its batch to the main process through a pipe.  NumPy arrays are
pickled byte by byte through that pipe; tensors are not: their storage is placed in shared
memory (``/dev/shm``) and only a handle crosses.  So the batch is assembled here, in the
worker, directly into a shared-memory tensor: one copy per sample, nothing pickled.

``/dev/shm`` is a small tmpfs in containers.  When it is full, older torch dies of SIGBUS
("bus error in worker") and newer torch raises "No space left on device"; neither says what
to change.  :func:`check_shared_memory` looks first and raises
:class:`~streamdata.errors.SharedMemoryError` naming the size needed and the fixes.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamdata._compat import new_shared_storage
from streamdata.batch import recycle
from streamdata.batch.encoded import gather
from streamdata.batch.tree import map_leaves
from streamdata.errors import DecodeError, SharedMemoryError
from streamdata.formats.images import EncodedImage

__all__ = [
    "DEFAULT_PREFETCH_FACTOR",
    "NUMERIC_KINDS",
    "SHM_PATH",
    "check_shared_memory",
    "collate",
    "collate_column",
    "empty_tensor",
    "empty_tensors",
    "prepare_shared",
    "shared_memory_space",
    "to_tensors",
]

SHM_PATH = "/dev/shm"
NUMERIC_KINDS = frozenset("biufc")  # numpy dtype kinds torch can hold (and batches as tensors)
# Batches each DataLoader worker keeps in flight (DataLoader's own default): sd.loader's
# default, and what the /dev/shm check assumes when the caller does not say.
DEFAULT_PREFETCH_FACTOR = 2


# --- shared memory -----------------------------------------------------------------------------

def shared_memory_space(path: str = SHM_PATH) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the shared-memory filesystem, or ``None`` where there is none."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # no /dev/shm (macOS, Windows): nothing to check
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    raise AssertionError("unreachable")


def check_shared_memory(nbytes: int, *, in_flight: int = 1, new_bytes: int | None = None,
                        where: str | None = None) -> None:
    """Raise :class:`SharedMemoryError` if a batch of ``nbytes`` cannot be placed in ``/dev/shm``.

    ``new_bytes`` (default: all of ``nbytes``) is what is about to be allocated and must be
    free now.  ``in_flight`` is how many such batches the loader keeps there at once
    (``num_workers * prefetch_factor``); more than the filesystem holds fails part-way
    through an epoch (a bus error on older torch), so it is refused now, with the fixes.
    """
    space = shared_memory_space()
    if space is None or nbytes <= 0:
        return
    free, total = space
    if (nbytes if new_bytes is None else new_bytes) <= free and nbytes * max(1, in_flight) <= total:
        return
    raise SharedMemoryError(_advice(nbytes, in_flight, space), where=where)


def _advice(nbytes: int, in_flight: int, space: tuple[int, int] | None) -> str:
    """The SharedMemoryError message: what was needed, what there is, and the fixes."""
    needed = nbytes * max(1, in_flight)
    have = f"{SHM_PATH} has {_size(space[0])} free of {_size(space[1])}" if space else "it is full"
    suggested_gb = max(1, math.ceil(needed * 1.5 / 1e9))
    flight = (f"; {in_flight} batches in flight (num_workers x prefetch_factor) need about "
              f"{_size(needed)}" if in_flight > 1 else "")
    return (
        f"a batch of {_size(nbytes)} does not fit in shared memory: {have}{flight}. "
        "Fixes: a smaller prefetch_factor (or batch_size, or num_workers); a bigger /dev/shm "
        f"(docker run --shm-size={suggested_gb}g ..., or a memory-backed emptyDir mounted at "
        "/dev/shm in Kubernetes); and, when the failure is 'too many open files' rather than "
        "space, torch.multiprocessing.set_sharing_strategy(\"file_system\") "
        "(sd.loader(..., sharing_strategy=\"file_system\") sets it in every worker)."
    )


def _worker() -> tuple[str, int] | None:
    """``(description, num_workers)`` inside a DataLoader worker, else ``None``."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return None
    return f"DataLoader worker {info.id}/{info.num_workers}", info.num_workers


def empty_tensor(shape: Sequence[int], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised CPU tensor, its storage in shared memory when ``shared`` (from the
    worker's recycled-buffer pool where there is one)."""
    if not shared:
        return torch.empty(tuple(shape), dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pool = recycle.active_pool()  # sd.loader's workers reuse storages the main process freed
    storage = pool.storage(nbytes, _new_shared) if pool is not None else _new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # type: ignore[call-overload]  # stride optional at run time


_ALIGN = 64  # bytes: where each tensor of a shared block starts


def empty_tensors(specs: Sequence[tuple[Sequence[int], torch.dtype]], shared: bool) -> list[torch.Tensor]:
    """Uninitialised CPU tensors of the ``(shape, dtype)`` given; when ``shared``, all views of one
    shared-memory storage (from the worker's pool where there is one), each at a 64-byte boundary:
    a batch's array fields cross to the main process as one storage (one pool slot, one
    descriptor, one release), whatever their number."""
    if not shared or len(specs) < 2:
        return [empty_tensor(shape, dtype, shared) for shape, dtype in specs]
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        end += -(-nbytes // _ALIGN) * _ALIGN
    pool = recycle.active_pool()
    storage = pool.storage(end, _new_shared) if pool is not None else _new_shared(end)
    return [torch.empty(0, dtype=dtype).set_(  # type: ignore[call-overload]  # stride optional at run time
                storage, offset // torch.empty((), dtype=dtype).element_size(), tuple(shape))
            for (shape, dtype), offset in zip(specs, offsets, strict=True)]


def _new_shared(nbytes: int) -> torch.UntypedStorage:
    """A new storage in ``/dev/shm``; a full filesystem raises :class:`SharedMemoryError`."""
    try:
        return new_shared_storage(nbytes)  # allocated in /dev/shm, no copy
    except RuntimeError as exc:  # torch >= 2.1 fallocates and reports ENOSPC here
        if "shared memory" not in str(exc) and "No space" not in str(exc):
            raise
        worker = _worker()
        raise SharedMemoryError(_advice(nbytes, 1, shared_memory_space()),
                                where=worker[0] if worker else None) from exc


def _nbytes(obj: Any) -> tuple[int, int]:
    """Bytes of array and tensor data in a (nested) sample or batch: all, and not yet shared."""
    total = unshared = 0

    def add(leaf: Any) -> Any:
        nonlocal total, unshared
        size = 0
        if isinstance(leaf, torch.Tensor):
            size = leaf.numel() * leaf.element_size()
            unshared += 0 if leaf.is_shared() else size
        elif isinstance(leaf, np.ndarray) and leaf.dtype.kind in NUMERIC_KINDS:
            size = leaf.nbytes
            unshared += size
        total += size
        return leaf

    map_leaves(add, obj)
    return total, unshared


def prepare_shared(obj: Any, in_flight: int | None, *, copies_all: bool, times: int = 1) -> bool:
    """In a worker: check ``/dev/shm`` has room for ``obj`` and return ``True`` (build the
    batch in shared memory); outside a worker ``False``.

    ``copies_all``: every byte is copied into new shared memory (collation), not only the
    arrays and the tensors that are not shared yet (conversion of a finished batch).
    ``times``: the batch holds that many objects the size of ``obj`` (one sample's worth).
    """
    worker = _worker()
    if worker is None:
        return False
    where, num_workers = worker
    if in_flight is None:
        in_flight = num_workers * DEFAULT_PREFETCH_FACTOR
    total, unshared = (n * times for n in _nbytes(obj))
    new_bytes = total if copies_all else unshared
    if recycle.active_pool() is not None:
        new_bytes = 0  # storages may come from the pool; a new one that does not fit still raises
    check_shared_memory(total, in_flight=in_flight, new_bytes=new_bytes, where=where)
    return True


# --- collation ---------------------------------------------------------------------------------

def collate(samples: Sequence[Any], *, in_flight: int | None = None) -> Any:
    """Stack a list of samples into one batch; a DataLoader ``collate_fn``.

    Tensors and numeric NumPy arrays are stacked into one tensor per field (in a worker, in
    shared memory, after :func:`check_shared_memory`); Python and NumPy scalars become
    tensors; strings, bytes and other objects become lists.  Dicts, lists, tuples,
    namedtuples and dataclasses are collated field by field.  ``in_flight`` is the number
    of batches the loader keeps in shared memory at once (default ``num_workers * 2``).
    """
    if len(samples) == 0:
        raise ValueError("collate() needs at least one sample")
    samples = list(samples)
    shared = prepare_shared(samples, in_flight, copies_all=True)
    return collate_column(samples, "batch", shared)


def collate_column(samples: list[Any], path: str, shared: bool) -> Any:
    """Collate one field's values across samples (``path`` names it in errors), as ``collate``."""
    elem = samples[0]
    if isinstance(elem, torch.Tensor):
        return _stack_tensors(samples, path, shared)
    if isinstance(elem, np.ndarray):
        return _stack_arrays(samples, path, shared) if elem.dtype.kind in NUMERIC_KINDS else samples
    if isinstance(elem, (bool, np.bool_)):
        return _scalars(torch.tensor(samples, dtype=torch.bool), shared)
    if isinstance(elem, np.generic) and elem.dtype.kind in NUMERIC_KINDS:
        return _scalars(torch.from_numpy(np.asarray(samples)), shared)
    if isinstance(elem, int):
        return _scalars(torch.tensor(samples, dtype=torch.int64), shared)
    if isinstance(elem, float):
        return _scalars(torch.tensor(samples, dtype=torch.float64), shared)
    if isinstance(elem, (str, bytes, bytearray)) or elem is None:
        return samples
    if isinstance(elem, EncodedImage):  # decode_on="device": one EncodedBatch (batch/encoded.py)
        return gather(samples, path, lambda shape, dtype: empty_tensor(shape, dtype, shared))
    if isinstance(elem, Mapping):
        return _collate_mapping(samples, path, shared)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(elem)(*(collate_column(list(col), f"{path}.{name}", shared)
                            for name, col in zip(elem._fields, _transpose(samples, path), strict=False)))
    if isinstance(elem, (list, tuple)):
        columns = [collate_column(list(col), f"{path}[{i}]", shared)
                   for i, col in enumerate(_transpose(samples, path))]
        return columns if isinstance(elem, list) else tuple(columns)
    if dataclasses.is_dataclass(elem) and not isinstance(elem, type):
        out = copy.copy(elem)
        for field in dataclasses.fields(elem):
            column = [getattr(sample, field.name) for sample in samples]
            object.__setattr__(out, field.name, collate_column(column, f"{path}.{field.name}", shared))
        return out
    return samples


def _scalars(column: torch.Tensor, shared: bool) -> torch.Tensor:
    """A column of scalars (labels, ids), in a worker copied into shared memory from the pool:
    a tensor left private would be moved to a new shared storage as it is sent, and cross to
    the main process by descriptor with every batch (MAPPED-ONCE in ``recycle``)."""
    if not shared:
        return column
    return empty_tensor(tuple(column.shape), column.dtype, True).copy_(column)


def _collate_mapping(samples: list[Any], path: str, shared: bool) -> Any:
    keys = list(samples[0].keys())
    out: dict[Any, Any] = {}
    for key in keys:
        try:
            column = [sample[key] for sample in samples]
        except KeyError:
            missing = next(i for i, s in enumerate(samples) if key not in s)
            raise DecodeError(f"cannot collate {path}: sample {missing} has no key {key!r}") from None
        out[key] = collate_column(column, f"{path}[{key!r}]", shared)
    if type(samples[0]) is dict:
        return out
    try:
        return type(samples[0])(out)
    except TypeError:  # a Mapping whose constructor takes something else
        return out


def _transpose(samples: list[Any], path: str) -> Iterator[tuple[Any, ...]]:
    length = len(samples[0])
    for i, sample in enumerate(samples):
        if len(sample) != length:
            raise DecodeError(f"cannot collate {path}: sample 0 has {length} items, "
                              f"sample {i} has {len(sample)} items")
    return zip(*samples, strict=False)  # lengths checked above


def _check_shapes(shapes: list[tuple[int, ...]], path: str) -> None:
    for i, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise DecodeError(f"cannot collate {path}: sample 0 has shape {shapes[0]}, "
                              f"sample {i} has shape {shape} (pad, crop or batch them yourself)")


def _stack_tensors(samples: list[Any], path: str, shared: bool) -> torch.Tensor:
    if not all(isinstance(s, torch.Tensor) for s in samples):
        raise DecodeError(f"cannot collate {path}: a mix of tensors and {type(samples[-1]).__name__}")
    _check_shapes([tuple(s.shape) for s in samples], path)
    dtype = samples[0].dtype
    for s in samples[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    if not shared or samples[0].device.type != "cpu":
        return torch.stack([s.to(dtype) for s in samples])
    out = empty_tensor((len(samples), *samples[0].shape), dtype, shared)
    return torch.stack(samples, out=out)


def _stack_arrays(samples: list[Any], path: str, shared: bool) -> torch.Tensor:
    if not all(isinstance(s, np.ndarray) for s in samples):
        raise DecodeError(f"cannot collate {path}: a mix of arrays and {type(samples[-1]).__name__}")
    _check_shapes([s.shape for s in samples], path)
    np_dtype = np.result_type(*samples).newbyteorder("=")
    dtype = torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
    out = empty_tensor((len(samples), *samples[0].shape), dtype, shared)
    np.stack(samples, out=out.numpy())  # the one copy: straight into the (shared) batch
    return out


# --- already-batched structures ----------------------------------------------------------------

def to_tensors(batch: Any, *, in_flight: int | None = None) -> Any:
    """Turn the NumPy arrays in a batch the dataset assembled itself into tensors.

    The ``collate_fn`` for datasets that batch themselves (``DataLoader(batch_size=None)``).
    In a worker, arrays and tensors are copied once into shared memory (after
    :func:`check_shared_memory`); in the main process arrays are wrapped without a copy.
    """
    in_worker = _worker() is not None
    if not _needs_conversion(batch, in_worker):
        return batch  # streamdata's own batches: tensors already in shared memory, and lists
    shared = prepare_shared(batch, in_flight, copies_all=False)
    return map_leaves(lambda leaf: _leaf_to_tensor(leaf, shared), batch)


def _needs_conversion(obj: Any, in_worker: bool) -> bool:
    """Whether ``to_tensors`` would change anything: a NumPy array or scalar, or (in a
    worker) a CPU tensor not yet in shared memory, anywhere in ``obj``."""
    if isinstance(obj, torch.Tensor):
        return in_worker and obj.device.type == "cpu" and not obj.is_shared()
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.dtype.kind in NUMERIC_KINDS
    if isinstance(obj, (str, bytes, bytearray)) or obj is None:
        return False
    if isinstance(obj, Mapping):
        return any(_needs_conversion(v, in_worker) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if obj and all(type(v) is str for v in obj):  # keys and URLs: the common case, fast
            return False
        return any(_needs_conversion(v, in_worker) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_needs_conversion(getattr(obj, f.name), in_worker) for f in dataclasses.fields(obj))
    return False


def _leaf_to_tensor(leaf: Any, shared: bool) -> Any:
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in NUMERIC_KINDS:
        if not shared:
            return torch.from_numpy(leaf) if leaf.flags.writeable else torch.from_numpy(leaf.copy())
        dtype = torch.from_numpy(np.empty(0, dtype=leaf.dtype.newbyteorder("="))).dtype
        out = empty_tensor(leaf.shape, dtype, True)
        np.copyto(out.numpy(), leaf)
        return out
    if isinstance(leaf, np.generic) and leaf.dtype.kind in NUMERIC_KINDS:
        return torch.from_numpy(np.asarray(leaf))
    if shared and isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_shared():
        out = empty_tensor(leaf.shape, leaf.dtype, True)
        return out.copy_(leaf)
    return leaf
