"""Arrow tables -> what a reader yields: a row-level shuffle, batches of exactly N rows by
slicing, and dicts of tensors (numeric columns zero-copy; the mapping is in docs/arrow.md).
No per-row Python anywhere but ``to_rows`` (``batch_size=None``), user ``decoders`` and image
columns (``images``: Hugging Face image cells through an ``sd.images`` transform, seeded by
their rows' keys, IMAGE-SEED in ``formats.images``). A value that cannot be decoded costs
its row, where the caller's ``skip`` says so (counted there), not its batch.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from streamdata.batch.encoded import gather
from streamdata.errors import DecodeError, SpecError
from streamdata.formats.arrow import table_url, tag_url
from streamdata.formats.image_columns import RowKeys, cell_values, image_columns, take_row_keys
from streamdata.formats.images import EncodedImage, ImageTransform

__all__ = ["DROPPED", "TensorOptions", "rebatch", "shuffle_rows", "to_rows", "to_tensors"]

DROPPED: Any = object()  # ``to_rows``' stand-in for a row dropped under the caller's ``skip``
Skip = Callable[[BaseException], bool]


# ---- table stages (Arrow slicing) ---------------------------------------------------------


def _concat(tables: list[pa.Table]) -> pa.Table:
    if len(tables) == 1:
        return tables[0]
    try:
        whole = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SpecError(f"objects with incompatible schemas cannot share a batch: {exc}") from exc
    urls = list(dict.fromkeys(u for u in map(table_url, tables) if u))
    return tag_url(whole, ", ".join(urls)) if len(urls) > 1 else whole


def rebatch(tables: Iterable[pa.Table], batch_size: int, drop_last: bool = False,
            sizes: Iterable[int] | None = None,
            left_out: Callable[[int], None] | None = None) -> Iterator[pa.Table]:
    """Tables of exactly ``batch_size`` rows (the last may be short unless ``drop_last``: then
    ``left_out(n)`` is told its ``n`` rows, if any); the first ones of the planned ``sizes``
    instead, when given (EQUAL-STEPS, ``plan``)."""
    targets = iter(sizes if sizes is not None else ())
    pending: list[pa.Table] = []
    have, want = 0, next(targets, batch_size)
    for table in tables:
        start = 0
        while start < table.num_rows:
            take = min(want - have, table.num_rows - start)
            pending.append(table.slice(start, take))
            have += take
            start += take
            if have == want:
                yield _concat(pending)
                pending, have, want = [], 0, next(targets, batch_size)
    if have and not drop_last:
        yield _concat(pending)
    elif have and left_out is not None:
        left_out(have)


def shuffle_rows(tables: Iterable[pa.Table], buffer_rows: int,
                 rng: np.random.Generator) -> Iterator[pa.Table]:
    """A row-level shuffle buffer: gather at least ``buffer_rows`` rows, permute them, emit all but
    half a buffer, keep the rest to mix with what comes next.  A buffer of 0 or 1 passes through."""
    if buffer_rows <= 1:
        yield from tables
        return
    buf: list[pa.Table] = []
    have = 0
    for table in tables:
        if not table.num_rows:
            continue
        buf.append(table)
        have += table.num_rows
        if have >= buffer_rows:
            whole, perm, keep = _concat(buf), rng.permutation(have), buffer_rows // 2
            yield whole.take(perm[keep:])
            buf, have = [whole.take(perm[:keep])], keep
    if have:
        yield _concat(buf).take(rng.permutation(have))


# ---- tables -> tensors --------------------------------------------------------------------


@dataclass(frozen=True)
class TensorOptions:
    """How columns become tensors.

    lists:     ``"padded"``: a variable-length list column ``x`` becomes ``x`` [rows, longest, ...]
               padded with ``pad_value``, plus ``x_lengths`` (int64 [rows]); ``"offsets"``: ``x``
               holds the values of all rows [total, ...] and ``x_offsets`` (int64 [rows + 1]) where
               each row starts.
    fill_null: a value (or ``{column: value}``) for nulls in integer/bool columns, which have no
               NaN; without one such nulls raise ``DecodeError``.  Float nulls become NaN.
    decoders:  ``{column: f}``; ``f(value)`` is applied to each value of the column (e.g. image
               bytes -> tensor); equal-shaped tensor results are stacked. An ``sd.images``
               transform is given the row's key too (IMAGE-SEED).
    images:    a transform (``sd.images``, or ``f(encoded bytes)``) for every column holding
               Hugging Face images (``formats.image_columns``) that ``decoders`` does not name.
    """

    lists: str = "padded"
    pad_value: float = 0
    fill_null: Any = None
    decoders: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    images: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.lists not in ("padded", "offsets"):
            raise SpecError(f"lists must be 'padded' or 'offsets', got {self.lists!r}")

    def null_fill(self, name: str) -> Any:
        if isinstance(self.fill_null, Mapping):
            return self.fill_null.get(name)
        return self.fill_null


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) \
        or pa.types.is_temporal(t)


def _numeric(arr: pa.Array, name: str, opts: TensorOptions) -> torch.Tensor:
    """A flat numeric (or temporal, as its integer) array -> 1-D tensor; zero-copy when no nulls."""
    t = arr.type
    if pa.types.is_temporal(t):
        arr = arr.view(pa.int64() if t.bit_width == 64 else pa.int32())
    if arr.null_count and not pa.types.is_floating(arr.type):
        fill = opts.null_fill(name)
        if fill is None:
            raise DecodeError(f"column {name!r} has {arr.null_count} nulls and {arr.type} has no "
                              f"NaN: pass fill_null={{{name!r}: value}}", key=name)
        arr = pc.fill_null(arr, pa.scalar(fill, arr.type))
    values = arr.to_numpy(zero_copy_only=False)
    with warnings.catch_warnings():  # Arrow memory is read-only to numpy; the tensor aliases it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


def _dense(arr: pa.Array, name: str, opts: TensorOptions) -> torch.Tensor | None:
    """Numeric, or (nested) fixed-size lists of numeric -> tensor [n, k, ...]; None otherwise."""
    t = arr.type
    if pa.types.is_dictionary(t):
        return _dense(arr.dictionary_decode(), name, opts)
    if _is_numeric(t):
        return _numeric(arr, name, opts)
    if pa.types.is_fixed_size_list(t):
        if arr.null_count:
            raise DecodeError(f"column {name!r} has {arr.null_count} null fixed-size lists; "
                              "fill them before writing, or read it with a decoder", key=name)
        k = t.list_size
        inner = _dense(arr.values.slice(arr.offset * k, len(arr) * k), name, opts)
        return None if inner is None else inner.reshape(len(arr), k, *inner.shape[1:])
    return None


def _ragged(arr: pa.Array, name: str, opts: TensorOptions) -> dict[str, torch.Tensor] | None:
    """A variable-length list column -> padded + lengths, or values + offsets; None if not numeric."""
    lengths_arr = pc.fill_null(pc.list_value_length(arr), 0)
    values = _dense(arr.flatten(), name, opts)
    if values is None:
        return None
    lengths = torch.from_numpy(lengths_arr.to_numpy(zero_copy_only=False).astype(np.int64))
    if opts.lists == "offsets":
        offsets = torch.zeros(len(arr) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return {name: values, f"{name}_offsets": offsets}
    n, longest = len(arr), int(lengths.max()) if len(arr) else 0
    padded = torch.full((n, longest, *values.shape[1:]), opts.pad_value, dtype=values.dtype)
    rows = torch.repeat_interleave(torch.arange(n), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(len(values)) - torch.repeat_interleave(starts, lengths)
    padded[rows, cols] = values
    return {name: padded, f"{name}_lengths": lengths}


def _decoded(values: list, name: str) -> Any:
    if values and isinstance(values[0], EncodedImage):  # decode_on="device": one EncodedBatch
        for row, value in enumerate(values):
            if isinstance(value, EncodedImage) and value.key is None:
                value.key = f"{name}[{row}]"  # a cell has no sample key: its column and row name it
        return gather(values, name, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    if values and all(isinstance(v, torch.Tensor) for v in values) \
            and len({tuple(v.shape) for v in values}) == 1:
        return torch.stack(values)
    return values


def _column(arr: pa.Array, name: str, opts: TensorOptions, out: dict[str, Any]) -> None:
    """Convert one column into ``out`` (one key, two for list columns, one per struct field)."""
    t = arr.type
    if name in opts.decoders:
        decode = opts.decoders[name]
        try:
            out[name] = _decoded([decode(v) for v in arr.to_pylist()], name)
        except Exception as exc:
            raise DecodeError(f"decoder for column {name!r} failed: {type(exc).__name__}: {exc}",
                              key=name) from exc
        return
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            _column(pc.struct_field(arr, [i]), f"{name}.{t.field(i).name}", opts, out)
        return
    dense = _dense(arr, name, opts)
    if dense is not None:
        out[name] = dense
        return
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        ragged = _ragged(arr, name, opts)
        if ragged is not None:
            for key in ragged:
                if key in out:
                    raise DecodeError(f"column {name!r} would write {key!r}, which already exists; "
                                      "rename the column or use a decoder", key=name)
            out.update(ragged)
            return
    out[name] = arr.to_pylist()  # strings, binary, decimals, nested ragged lists: Python values


def _per_row(table: pa.Table | pa.RecordBatch, opts: TensorOptions) -> dict[str, tuple[Callable, bool]]:
    """The top-level columns decoded value by value: ``{name: (f, by_type)}``; a ``decoders``
    entry wins over ``images`` for an image column."""
    fns: dict[str, tuple[Callable, bool]] = {}
    if opts.images is not None:
        fns.update((name, (opts.images, True)) for name in image_columns(table.schema))
    fns.update((name, (opts.decoders[name], False)) for name in table.column_names if name in opts.decoders)
    return fns


def _row_error(exc: Exception, name: str, i: int, keys: RowKeys | None, url: str | None) -> DecodeError:
    """A value of column ``name`` that failed, naming its column, row, unit and object."""
    if keys is not None:
        key, url = keys.place(i), keys.urls[i]
        where = f"{key} of {url}"
    else:
        key = f"row {i} of the batch"
        where = key + (f" from {url}" if url else "")
    cause = exc.message if isinstance(exc, DecodeError) else f"{type(exc).__name__}: {exc}"
    return DecodeError(f"cannot decode column {name!r} at {where}: {cause}", url=url, key=key)


def _decode_values(arr: pa.Array, name: str, fn: Callable, by_type: bool, keys: RowKeys | None,
                   url: str | None, raise_first: bool) -> tuple[list, list[tuple[int, DecodeError]]]:
    """``fn`` on each value of ``arr`` (an image column's encoded bytes, ``by_type``; else the
    Python values); the rows that failed, with their errors (the first raised at once, with
    ``raise_first``)."""
    if by_type:
        values, paths = cell_values(arr)
    else:
        values, paths = arr.to_pylist(), []
    transform = fn if isinstance(fn, ImageTransform) else None
    out: list = []
    bad: list[tuple[int, DecodeError]] = []
    for i, value in enumerate(values):
        try:
            if by_type and value is None:
                raise DecodeError(f"the image cell has no bytes (path {paths[i]!r}): only images "
                                  "embedded in the table can be decoded (Hugging Face datasets embed "
                                  "them in Parquet exports, e.g. push_to_hub; decode=None reads the paths)")
            if transform is not None:
                out.append(transform.image(value, key=None if keys is None else keys.key(i)))
            else:
                out.append(fn(value))
        except Exception as exc:  # a user decoder's error too: named, then skipped or raised
            err = _row_error(exc, name, i, keys, url)
            if raise_first:
                raise err from exc
            err.__cause__ = exc  # raised later (``skip`` declined it), with its cause
            bad.append((i, err))
            out.append(None)
    return out, bad


def _convert(table: pa.Table | pa.RecordBatch, opts: TensorOptions,
             skip: Skip | None) -> tuple[dict[str, Any], list[int]]:
    """``to_tensors``' work: the dict, and the rows ``skip`` dropped from it (ascending)."""
    url = table_url(table)
    table, keys = take_row_keys(table)
    per_row = _per_row(table, opts)
    decoded: dict[str, list] = {}
    dropped: set[int] = set()
    for name, (fn, by_type) in per_row.items():
        values, bad = _decode_values(_whole(table.column(name)), name, fn, by_type, keys, url, skip is None)
        for i, err in bad:
            if i in dropped:
                continue
            if skip is None or not skip(err):
                raise err
            dropped.add(i)
        decoded[name] = values
    if dropped:  # the rows whose values failed, gone from every column
        keep = np.ones(table.num_rows, dtype=bool)
        keep[list(dropped)] = False
        table = table.filter(pa.array(keep))
        decoded = {name: [v for v, k in zip(values, keep, strict=True) if k]
                   for name, values in decoded.items()}
    out: dict[str, Any] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name in decoded:
            out[name] = _decoded(decoded[name], name)
            continue
        try:
            _column(_whole(col), name, opts, out)
        except DecodeError as exc:
            exc.url = exc.url or url
            raise
        except (ValueError, OverflowError, pa.ArrowException) as exc:  # UnicodeDecodeError too
            raise DecodeError(f"column {name!r} ({col.type}) of {url or 'a table'} cannot be "
                              f"converted: {type(exc).__name__}: {exc}", url=url, key=name) from exc
    return out, sorted(dropped)


def _whole(col: Any) -> pa.Array:
    """One array from a column (a chunked one combined)."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else (
            col.combine_chunks() if col.num_chunks else pa.array([], col.type))
    return col


def to_tensors(table: pa.Table | pa.RecordBatch, options: TensorOptions | None = None,
               skip: Skip | None = None) -> dict[str, Any]:
    """A table -> ``{column: tensor or list}``; see ``TensorOptions`` and docs/arrow.md. A value
    that a decoder (or the image transform) fails on is a ``DecodeError`` naming its column,
    row and object; where ``skip(error)`` is true (it counts it), its row is dropped instead."""
    return _convert(table, options or TensorOptions(), skip)[0]


def to_rows(table: pa.Table | pa.RecordBatch, options: TensorOptions | None = None,
            skip: Skip | None = None, dropped: bool = False) -> Iterator[dict]:
    """One dict per row (list columns as unpadded 1-D tensors); the slow, per-row path. With
    ``dropped``, a row dropped under ``skip`` is yielded as ``DROPPED`` (a reader counts it)."""
    opts = dataclasses.replace(options or TensorOptions(), lists="offsets")
    cols, gone = _convert(table, opts, skip)
    ragged = {k[:-len("_offsets")]: v.tolist() for k, v in cols.items()
              if k.endswith("_offsets") and k[:-len("_offsets")] in cols}
    plain = [(k, v) for k, v in cols.items() if k not in ragged and not
             (k.endswith("_offsets") and k[:-len("_offsets")] in ragged)]
    gone_at, i = set(gone), 0
    for at in range(table.num_rows):  # DROPPED in a dropped row's place: a reader counts it there
        if at in gone_at:
            if dropped:
                yield DROPPED
            continue
        row = {k: v[i] for k, v in plain}
        for k, offsets in ragged.items():
            row[k] = cols[k][offsets[i]:offsets[i + 1]]
        yield row
        i += 1
