"""Parquet and Arrow IPC datasets: row groups and record batches as the units split across readers.

Footers are read once, in ``__init__``, through a ``Prefetcher`` over the tails of the objects
(sizes from the listing), and kept as bytes.  The units are a Parquet row group, an Arrow IPC
file's record batch, or a whole IPC stream object.  Parquet footers give every row group's
row count, and an IPC file's batch headers (read right after its footer, one coalesced request
per file) every batch's, so their epochs are exact (EQUAL-STEPS, ``plan``): each reader gets an
equal span of rows, cut inside units where needed, and every rank the same number of batches.
A dataset with any IPC *stream* object (no footer: its rows are unknown until read), and a
pass with a ``filter``, assign units whole, like tar shards without an index (EXACTLY-ONCE,
``sharding``).  Each reader fetches only the byte
ranges of its units (for Parquet: only the column chunks asked for, adjacent ranges merged),
decodes them with pyarrow, and turns rows into batches with Arrow slicing, never per row.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch.utils.data import get_worker_info

from streamdata.batch.tables import DROPPED, TensorOptions, rebatch, shuffle_rows, to_rows, to_tensors
from streamdata.catalog.footers import read_batch_rows, read_footers, with_sizes
from streamdata.catalog.specs import Spec
from streamdata.config import UNIT_WINDOW
from streamdata.datasets.passes import Batching, ReaderPass, stale_count
from streamdata.datasets.sharded import ShardedDataset
from streamdata.epoch.blocks import block_shuffled
from streamdata.epoch.rewind import dropped, placeholder_tables, record_size
from streamdata.errors import DecodeError, FormatError, SpecError
from streamdata.fetch.prefetcher import FetchItem, ItemReader
from streamdata.formats import arrow as fmt
from streamdata.formats.image_columns import ROW_COLUMNS, image_columns, with_row_keys
from streamdata.formats.images import ImageTransform
from streamdata.formats.seeding import for_pass
from streamdata.metrics import StageClock
from streamdata.policy import ErrorPolicy
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard, known_size

__all__ = ["ArrowDataset", "ParquetDataset", "RecordBatchUnit", "RowGroup"]

KiB = 1024
DEFAULT_SHUFFLE_ROWS = 16384
log = logging.getLogger("streamdata")


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: the unit split across ranks and workers."""

    url: str
    size: int
    index: int
    rows: int


@dataclass(frozen=True)
class RecordBatchUnit:
    """One record batch of an Arrow IPC file, or a whole IPC stream object (``index == -1``)."""

    url: str
    size: int
    index: int


# ---- the datasets -------------------------------------------------------------------------


class _ArrowTables(ShardedDataset):
    """Arrow formats: a unit's records are Arrow tables, shuffled by row and batched by slicing.
    Units are row groups or record batches: ``config.UNIT_WINDOW`` of them in flight by default."""

    fetch_defaults = {"window": UNIT_WINDOW}
    default_shuffle_buffer = DEFAULT_SHUFFLE_ROWS  # rows

    def __init__(self, urls: Spec, columns: Sequence[str] | None = None, *,
                 lists: str = "padded", pad_value: float = 0, fill_null: Any = None,
                 decoders: Mapping[str, Callable[[Any], Any]] | None = None, decode: Any = None,
                 filter: Any = None, footer_bytes: int = 64 * KiB, **options: Any) -> None:
        if options.get("collate_fn") is not None:
            raise SpecError(f"{type(self).__name__} builds batches from Arrow tables; "
                            "use map= to transform each batch instead of collate_fn")
        if isinstance(columns, str):
            raise SpecError(f"columns must be a list of names, got the string {columns!r}")
        if options.get("decode_threads", 1) != 1:
            raise SpecError(f"{type(self).__name__} decodes whole batches of rows: decode_threads is for "
                            "tar and object samples (use more workers)")
        if filter is not None and not isinstance(filter, pc.Expression):
            raise SpecError(f"filter must be a pyarrow.compute.Expression (e.g. pc.field('x') > 0), "
                            f"got {type(filter).__name__}")
        _check_decode(decode)
        if footer_bytes < 16:
            raise SpecError(f"footer_bytes must be >= 16, got {footer_bytes}")
        super().__init__(urls, **options)
        self.columns = None if columns is None else list(columns)
        self.filter = filter
        self.decode = decode or None
        self.tensor_options = TensorOptions(lists, pad_value, fill_null, dict(decoders or {}), self.decode)
        self._pass_options = self.tensor_options  # its decoders bound to the current pass (``start_pass``)
        # IMAGE-SEED: an image transform seeds each row's crop by the row's key, which the units'
        # tables carry in hidden columns (``formats.image_columns``) when one is in use
        self._keyed = isinstance(self.decode, ImageTransform) or any(
            isinstance(fn, ImageTransform) for fn in self.tensor_options.decoders.values())
        self.footer_bytes = footer_bytes
        self.shards = from_rank0(lambda: with_sizes(self.shards, self.storage_options, self.fetch_config))
        self._footers: dict[str, bytes] = {}
        self._units: list[Any] = []
        # the Hugging Face image columns of the first schema read (None: not known before reading)
        self.image_columns: list[str] | None = None

    def units(self) -> Sequence[Any]:
        return self._units

    def _found_schema(self, schema: Callable[[], pa.Schema], url: str) -> None:
        """Note the image columns of the first schema read; say how to decode them (once, at
        info level) where neither ``decode=`` nor ``decoders=`` does: by default they stay bytes."""
        if self.image_columns is not None:
            return
        wanted = None if self.columns is None else {c.split(".")[0] for c in self.columns}
        try:
            found = image_columns(schema())
        except (ValueError, pa.ArrowException):  # e.g. names that are not UTF-8: the read says so
            return
        self.image_columns = [c for c in found if wanted is None or c in wanted]
        raw = [c for c in self.image_columns if c not in self.tensor_options.decoders]
        if raw and self.decode is None:
            log.info("streamdata: %s of %s hold%s Hugging Face images, read as bytes (%s.bytes); "
                     "decode=sd.images.RandomResizedCrop(224) (or another sd.images transform) decodes "
                     "them into uint8 tensors (docs/images.md)", ", ".join(map(repr, raw)), redact_url(url),
                     "s" if len(raw) == 1 else "", raw[0])

    def start_pass(self, epoch: int) -> None:
        """``map``, the column decoders and ``decode`` bound to the pass (IMAGE-SEED: an image
        transform for the Hugging Face image columns, or as a column's decoder)."""
        super().start_pass(epoch)
        opts = self.tensor_options
        self._pass_options = dataclasses.replace(opts, decoders={
            name: for_pass(fn, self.seed, epoch) for name, fn in opts.decoders.items()},
            images=for_pass(opts.images, self.seed, epoch))

    def keyed(self, table: pa.Table, url: str, unit: str, first: int = 0) -> pa.Table:
        """``table`` (rows ``first``... of ``unit``) with its rows' keys, when a crop needs them."""
        return with_row_keys(table, url, unit, first) if self._keyed else table

    def _policy(self) -> ErrorPolicy:
        """The error policy of the constructor's footer reads."""
        return ErrorPolicy(self.on_error, self._counters, where="footers")

    def prepare(self, table: pa.Table) -> pa.Table:
        """Apply the filter (subclasses then keep the requested columns)."""
        if self.filter is None:
            return table
        try:
            return table.filter(self.filter)
        except (pa.ArrowException, ValueError, TypeError) as exc:  # e.g. a value the filter cannot take
            url = fmt.table_url(table)
            raise DecodeError(f"the filter {self.filter} failed on rows of {url}: "
                              f"{type(exc).__name__}: {exc}", url=url, key="filter") from exc

    def read_segment(self, unit: Any, start: int, stop: int, count: int,
                     reader: ItemReader) -> Iterator[pa.Table]:
        """Rows ``[start, stop)`` of ``unit`` (an exact epoch's span may cut a row group); a
        unit that does not hold the ``count`` rows its footer says is a FormatError."""
        seen = 0
        for table in self.read_unit(unit, reader):
            lo, hi = max(start - seen, 0), min(stop - seen, table.num_rows)
            if hi > lo:
                yield table.slice(lo, hi - lo)
            seen += table.num_rows
        if seen != count:
            raise stale_count(reader.url, seen, count)

    records_are_tables = True

    def shuffled(self, tables: Iterable[pa.Table], seed: list[int]) -> Iterator[pa.Table]:
        return shuffle_rows(tables, self.shuffle_buffer, np.random.default_rng(seed))

    def stages(self, records: Iterator[pa.Table], policy: ErrorPolicy, p: ReaderPass,
               batching: Batching) -> Iterator[Any]:
        """Tables -> row shuffle -> batches of exactly ``batch_size`` rows -> dicts of tensors
        (one per batch, or one per row without ``batch_size``) -> ``map``. A batch that cannot be
        converted (nulls without ``fill_null``) is skipped or raised per ``on_error``; so is one
        that ``map`` fails on. A value a decoder or ``decode`` fails on costs only its row: the
        batch comes that much shorter (the number of batches, EQUAL-STEPS, is kept) and the
        row counts as delivered for ``state_dict``."""
        tables = policy.each(records, self.prepare, pull=StageClock.PARSE, run=StageClock.DECODE)
        rewind = None if self._live is None else self._live.rewind
        if rewind is not None:  # RESUME-BUFFER: stand-ins for what was delivered before the position
            tables = placeholder_tables(tables, rewind.sizes, rewind.first)
        tables = self.shuffled(tables, p.seed(self.seed)) if batching.windows is None else block_shuffled(
            tables, batching.windows)
        if rewind is not None:
            tables = dropped(tables, rewind.delivered)
        opts = self._pass_options
        if batching.batch_size is not None:
            tables = rebatch(tables, batching.batch_size, batching.drop_last, batching.sizes, self._left_out)
            if self._live is not None:  # counted as delivered (state_dict)
                tables = self._live.count(tables, record_size)
            items = policy.each(tables, lambda t: to_tensors(t, opts, policy.skip), run=StageClock.DECODE)
        else:
            rows = policy.each(tables, lambda t: list(to_rows(t, opts, policy.skip, dropped=True)),
                               run=StageClock.DECODE)
            items = (row for batch in rows for row in batch)
            items = items if self._live is None else self._live.count(items)  # a dropped row too
            items = (row for row in items if row is not DROPPED)
        return items if self._map is None else policy.each(items, self._map, run=StageClock.MAP)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.shards)} objects, {len(self._units)} units, "
                f"columns={self.columns}, batch_size={self.batch_size}, shuffle={self.shuffle})")


def _check_decode(decode: Any) -> None:
    """``decode=``: None/False, an ``sd.images`` transform, or a function of an image's bytes."""
    if decode is None or decode is False or (callable(decode) and decode is not True):
        return
    raise SpecError(f"decode= takes an image transform for the Hugging Face image columns "
                    f"(e.g. sd.images.RandomResizedCrop(224)) or a function of an image's encoded "
                    f"bytes, or None to keep them as bytes; got {decode!r} (for other columns use "
                    f"decoders={{column: f}})")



def _use_threads() -> bool:
    """pyarrow's own threads only in the main process; DataLoader workers are the parallelism."""
    return get_worker_info() is None


class ParquetDataset(_ArrowTables):
    """Parquet objects at any fsspec URL, split by row group across ranks and workers.

    ``columns`` (top-level names, or dotted paths into structs) limits both what is decoded and
    what is fetched: only those column chunks' byte ranges are requested.  ``filter`` is a
    ``pyarrow.compute`` expression applied to each row group (its columns are fetched too, and
    dropped after filtering).  ``batch_size=N`` yields dicts of tensors of N rows (across row
    group boundaries); ``None`` yields one dict per row.  See docs/arrow.md.
    """

    suffixes = (".parquet", ".pq", ".parq")

    def __init__(self, urls: Spec, columns: Sequence[str] | None = None, *,
                 coalesce_gap: int = 0, **options: Any) -> None:
        super().__init__(urls, columns, **options)
        self.coalesce_gap = coalesce_gap
        policy = self._policy()
        self._footers = from_rank0(lambda: read_footers(  # LIST-ONCE: footers read once per job
            self.shards, self.storage_options, self.fetch_config, tail_bytes=self.footer_bytes,
            footer_length=lambda tail, s: fmt.parquet_footer_length(tail, known_size(s), s.url),
            policy=policy))
        self._meta_cache: dict[str, Any] = {}
        self._leaf_cache: dict[str, list[int]] = {}
        self._extra: list[str] = []
        for shard in self.shards:
            if shard.url not in self._footers:
                continue  # skipped under on_error
            try:
                meta = self._meta(shard.url)
            except FormatError as exc:
                policy.check(exc)
                continue
            fmt.parquet_leaves(meta, self.columns, shard.url)  # SpecError for a missing column
            for index in range(meta.num_row_groups):
                rows = meta.row_group(index).num_rows
                if rows:
                    self._units.append(RowGroup(shard.url, known_size(shard), index, rows))
        self.num_rows = sum(u.rows for u in self._units)
        if self._units:
            first = self._units[0].url
            self._found_schema(lambda: self._meta(first).schema.to_arrow_schema(), first)
        if self.filter is not None and self._units:
            self._extra = _filter_columns(self._meta(self._units[0].url).schema.to_arrow_schema(),
                                          self.filter, self.columns)
        self._read_columns = None if self.columns is None else self.columns + self._extra
        self.block_window()  # shuffle="block" with a filter: SpecError here, not in a worker

    def sample_counts(self) -> np.ndarray | None:
        """Rows per row group, from the footers: an exact epoch (``plan``), unless a ``filter``
        makes the rows a reader keeps unknowable before reading."""
        if self.filter is not None:
            return None
        return np.array([u.rows for u in self._units], dtype=np.int64)

    def _meta(self, url: str) -> Any:
        meta = self._meta_cache.get(url)
        if meta is None:
            meta = self._meta_cache[url] = fmt.parse_parquet_footer(self._footers[url], url)
        return meta

    def prepare(self, table: pa.Table) -> pa.Table:
        table = super().prepare(table)
        return table.drop_columns(self._extra) if self._extra else table

    def fetch_item(self, unit: RowGroup) -> FetchItem:
        """The coalesced byte ranges of ``unit``'s requested column chunks."""
        meta = self._meta(unit.url)
        leaves = self._leaf_cache.get(unit.url)
        if leaves is None:
            leaves = self._leaf_cache[unit.url] = fmt.parquet_leaves(meta, self._read_columns, unit.url)
        ranges = fmt.column_chunk_ranges(meta, unit.index, leaves, unit.size, unit.url)
        return FetchItem(unit.url, unit.size, tuple(fmt.coalesce(ranges, self.coalesce_gap)),
                         self.etag(unit.url))

    def read_unit(self, unit: RowGroup, reader: ItemReader) -> Iterator[pa.Table]:
        parts = zip([start for start, _ in reader.item.ranges or ()], reader.read_ranges(), strict=True)
        yield self.keyed(fmt.read_row_group(self._meta(unit.url), parts, unit.size, unit.index,
                                            self._read_columns, unit.url, _use_threads()),
                         unit.url, f"row group {unit.index}")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_meta_cache"] = {}  # parsed again, lazily, in the process that reads
        state["_leaf_cache"] = {}
        return state


def _filter_columns(schema: pa.Schema, expr: Any, columns: list[str] | None) -> list[str]:
    """Columns ``expr`` needs beyond ``columns`` (found by binding it to schemas without each)."""
    empty = schema.empty_table()
    try:
        empty.filter(expr)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError) as exc:
        raise SpecError(f"the filter {expr} does not apply to the schema: {exc}") from exc
    if columns is None:
        return []
    covered = {c.split(".")[0] for c in columns}
    extra = []
    for name in schema.names:
        if name in covered:
            continue
        try:
            empty.drop_columns([name]).filter(expr)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError):
            extra.append(name)
    return extra


class ArrowDataset(_ArrowTables):
    """Arrow IPC objects (the file format, ``.arrow``/``.feather`` v2, and the stream format).

    A file's record batches are the units (addressed through its footer; their row counts,
    from their headers, make epochs exact); a stream object is one unit, parsed as its bytes
    arrive (a dataset with one is split by unit).  Whole record batches are fetched (the IPC layout
    has no per-column chunks to skip); ``columns`` and ``filter`` apply after decoding.
    """

    suffixes = (".arrow", ".arrows", ".feather", ".ipc")

    def __init__(self, urls: Spec, columns: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__(urls, columns, **options)
        policy = self._policy()
        self._footers = from_rank0(lambda: read_footers(  # LIST-ONCE: footers read once per job
            self.shards, self.storage_options, self.fetch_config, tail_bytes=self.footer_bytes,
            footer_length=lambda tail, s: fmt.ipc_footer_length(tail, known_size(s), s.url) or 0,
            policy=policy))
        self._blocks: dict[str, tuple[list[fmt.Range], list[fmt.Range]]] = {}
        files: list[Shard] = []
        for shard in self.shards:
            footer = self._footers.get(shard.url)
            if footer is None:
                continue  # skipped under on_error
            if not footer:  # no IPC file magic at the end: a stream, read whole
                self._units.append(RecordBatchUnit(shard.url, known_size(shard), -1))
                continue
            try:
                blocks = fmt.ipc_blocks(footer, shard.url, known_size(shard))
                dicts, batches = self._blocks[shard.url] = blocks
                self._check_columns(footer, shard)
            except FormatError as exc:
                policy.check(exc)
                continue
            files.append(shard)
            self._units.extend(RecordBatchUnit(shard.url, known_size(shard), i) for i in range(len(batches)))
        self._rows: dict[str, list[int] | None] = {}
        if self.filter is None and all(u.index >= 0 for u in self._units):  # else: no exact epoch
            self._rows = from_rank0(lambda: read_batch_rows(  # LIST-ONCE: rank 0 reads them
                files, self._footers, self.storage_options, self.fetch_config, policy))
            self._units = [u for u in self._units if u.url in self._rows]  # unreadable: skipped
        self.block_window()  # shuffle="block" without row counts: SpecError here, not in a worker

    def sample_counts(self) -> np.ndarray | None:
        """Rows per record batch, from the batches' headers: an exact epoch (``plan``); None
        (units split whole) with a ``filter``, any stream object, or a count not trusted."""
        if self.filter is not None:
            return None
        counts = []
        for u in self._units:
            rows = self._rows.get(u.url)
            if rows is None:
                return None
            counts.append(rows[u.index])
        return np.array(counts, dtype=np.int64)

    def _check_columns(self, footer: bytes, shard: Shard) -> None:
        parts = [(known_size(shard) - len(footer), footer)]
        try:
            schema = pa.ipc.open_file(fmt.SparseFile(parts, known_size(shard), shard.url).pyarrow()).schema
        except (OSError, pa.ArrowException) as exc:
            raise FormatError(f"corrupt Arrow IPC footer in {shard.url}: {exc}", url=shard.url,
                              key="footer") from exc
        missing = [c for c in self.columns or () if c not in schema.names]
        if missing:
            raise SpecError(f"column {missing[0]!r} is not in {shard.url}; columns: "
                            f"{', '.join(schema.names)}")
        self._found_schema(lambda: schema, shard.url)
        if self.filter is not None:
            _filter_columns(schema, self.filter, None)

    def fetch_item(self, unit: RecordBatchUnit) -> FetchItem:
        """A stream object whole; a file's record batch block plus its dictionary blocks."""
        if unit.index < 0:
            return FetchItem(unit.url, unit.size, None, self.etag(unit.url))
        dicts, batches = self._blocks[unit.url]
        return FetchItem(unit.url, unit.size, tuple(fmt.coalesce([*dicts, batches[unit.index]])),
                         self.etag(unit.url))

    def read_unit(self, unit: RecordBatchUnit, reader: ItemReader) -> Iterator[pa.Table]:
        if unit.index < 0:
            batches: Iterable[pa.RecordBatch] = fmt.ipc_stream_batches(reader.chunks(), unit.url)
        else:
            footer = self._footers[unit.url]
            starts = [start for start, _ in reader.item.ranges or ()]
            parts = [*zip(starts, reader.read_ranges(), strict=True), (unit.size - len(footer), footer)]
            batches = [fmt.read_ipc_batch(parts, unit.size, unit.index, unit.url)]
        first = 0  # a stream's rows are counted from its start
        for batch in batches:
            table = pa.Table.from_batches([batch])
            missing = [c for c in self.columns or () if c not in table.column_names]
            if missing:
                raise FormatError(f"column {missing[0]!r} is not in {unit.url}; columns: "
                                  f"{', '.join(table.column_names)}", url=unit.url,
                                  key=f"record batch {max(unit.index, 0)}")
            yield self.keyed(table, unit.url, "stream" if unit.index < 0 else f"record batch {unit.index}",
                             first)
            first += table.num_rows

    def prepare(self, table: pa.Table) -> pa.Table:
        table = super().prepare(table)
        if self.columns is None:
            return table
        return table.select(self.columns + [c for c in ROW_COLUMNS if c in table.column_names])
