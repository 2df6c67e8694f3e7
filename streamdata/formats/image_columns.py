"""Hugging Face image columns in Arrow tables, and the row keys their crops are seeded by.

Hugging Face ``datasets`` store an ``Image`` feature as a ``struct<bytes: binary, path: string>``
column (``large_binary`` / ``large_string`` too, fields in either order) and mark it in the
schema's ``huggingface`` metadata (``{"info": {"features": {col: {"_type": "Image"}}}}``).
:func:`image_columns` finds such columns by either sign: the struct type alone, or the
metadata, which also marks columns stored another way (plain ``binary``; a ``string`` holds
only a path, which cannot be decoded from the row).

A row's key (IMAGE-SEED): where its rows came from travels with a table through shuffles,
slices and concatenation as three hidden columns (:data:`ROW_COLUMNS`: the object's URL, the
unit — ``row group N``, ``record batch N`` or ``stream`` — and the row's index in that unit),
added by the dataset that read the unit (:func:`with_row_keys`) and taken off again before
the batch is made (:func:`take_row_keys`). The key of a row is the object's *name* (not its
whole URL: another endpoint, the same crops), its unit and its row: two rows holding the same
image get different crops, and the crop depends on neither the world size nor a resume.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["ROW_COLUMNS", "RowKeys", "cell_values", "image_columns", "is_image_cell", "take_row_keys",
           "with_row_keys"]

ROW_URL, ROW_UNIT, ROW_INDEX = "__streamdata_url__", "__streamdata_unit__", "__streamdata_row__"
ROW_COLUMNS = (ROW_URL, ROW_UNIT, ROW_INDEX)
HF_METADATA = b"huggingface"


def _binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def is_image_cell(t: pa.DataType) -> bool:
    """Whether ``t`` is a Hugging Face image cell: ``struct<bytes: binary, path: string>`` (large
    types too, either field order)."""
    if not pa.types.is_struct(t) or t.num_fields != 2:
        return False
    fields = {t.field(i).name: t.field(i).type for i in range(2)}
    return set(fields) == {"bytes", "path"} and _binary(fields["bytes"]) and _string(fields["path"])


@functools.lru_cache(maxsize=64)
def _marked(raw: bytes) -> frozenset[str]:
    """The top-level features ``huggingface`` metadata marks as ``Image`` (none if unreadable)."""
    try:
        features = json.loads(raw)["info"]["features"]
        return frozenset(name for name, f in features.items()
                         if isinstance(f, dict) and f.get("_type") == "Image")
    except (ValueError, KeyError, TypeError, AttributeError):
        return frozenset()


def _storable(t: pa.DataType) -> bool:
    """A type an ``Image`` feature can be stored as: a struct with a binary ``bytes`` field,
    bytes alone, or a path alone."""
    if pa.types.is_struct(t):
        index = t.get_field_index("bytes")
        return index >= 0 and _binary(t.field(index).type)
    return _binary(t) or _string(t)


def image_columns(schema: pa.Schema) -> list[str]:
    """The top-level columns of ``schema`` that hold Hugging Face images, in schema order."""
    marked = _marked((schema.metadata or {}).get(HF_METADATA, b"{}"))
    return [f.name for f in schema if is_image_cell(f.type) or (f.name in marked and _storable(f.type))]


def cell_values(arr: pa.Array) -> tuple[list[bytes | None], list[str | None]]:
    """The encoded bytes (None where absent) and the path (None where absent) of each cell of an
    image column found by :func:`image_columns`."""
    t = arr.type
    if pa.types.is_struct(t):
        blobs = pc.struct_field(arr, [t.get_field_index("bytes")])  # a null cell: None (its validity kept)
        index = t.get_field_index("path")
        paths = pc.struct_field(arr, [index]).to_pylist() if index >= 0 else [None] * len(arr)
        return blobs.to_pylist(), paths
    if _string(t):
        return [None] * len(arr), arr.to_pylist()
    return arr.to_pylist(), [None] * len(arr)


# ---- row keys (IMAGE-SEED) -------------------------------------------------------------------


def with_row_keys(table: pa.Table, url: str, unit: str, first: int = 0) -> pa.Table:
    """``table`` (rows ``first``, ``first + 1``, ... of ``unit`` of the object ``url``) with the
    hidden columns that say so."""
    n = table.num_rows
    zeros = pa.array(np.zeros(n, dtype=np.int32))
    return (table.append_column(ROW_URL, pa.DictionaryArray.from_arrays(zeros, pa.array([url])))
            .append_column(ROW_UNIT, pa.DictionaryArray.from_arrays(zeros, pa.array([unit])))
            .append_column(ROW_INDEX, pa.array(np.arange(first, first + n, dtype=np.int64))))


class RowKeys(NamedTuple):
    """Where each row of a batch came from: its object's URL, its unit and its row in that unit."""

    urls: list[str]
    units: list[str]
    rows: list[int]

    def key(self, i: int) -> str:
        """Row ``i``'s key: the object's name, its unit and row (IMAGE-SEED)."""
        name = self.urls[i].rstrip("/").rsplit("/", 1)[-1]
        return f"{name}\x00{self.units[i]}\x00{self.rows[i]}"

    def place(self, i: int) -> str:
        """Row ``i``'s place in its object, in words: ``row 3 of row group 1``."""
        unit = "" if self.units[i] == "stream" else f" of {self.units[i]}"
        return f"row {self.rows[i]}{unit}"


def take_row_keys(table: pa.Table | pa.RecordBatch) -> tuple[Any, RowKeys | None]:
    """``table`` without the hidden row-key columns, and the keys they held (None: none there)."""
    if ROW_INDEX not in table.column_names:
        return table, None
    cols = [table.column(name).to_pylist() for name in ROW_COLUMNS]
    return table.drop_columns(list(ROW_COLUMNS)), RowKeys(*cols)
