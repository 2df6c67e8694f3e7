"""How ``sd.TokenDataset`` finds, fetches and reads its tokens, one strategy per source layout.

A layout says three things about a corpus, and nothing else: its units and their documents
(``scan``: from metadata only), what to fetch for stream positions ``[start, stop)`` of a unit
(``fetch``: byte ranges), and the tokens those bytes hold (``read``). With loss masks, the
``.bin`` layouts fetch a range's mask as an item of its own (``fetch_mask``, ``read_mask``: the
same span of ``NAME.mask.bin``), a Parquet column's with the tokens, in the same item
(``read_masked``). The pass, the plan, packing
and the state are the dataset's (:mod:`streamdata.datasets.tokens`), the same for every layout.

- :class:`FlatBin`: flat ``.bin`` token arrays of one dtype, one document per file (nanoGPT).
- :class:`MegatronIdx`: ``.bin`` + ``.idx`` pairs, the ``.idx`` giving the dtype and documents.
- :class:`TarNpy`: tar shards whose samples each hold a 1-D integer ``.npy`` (one document each),
  counted by a pass over the shards (COUNT-SHARED in ``catalog.tokens``).
- :class:`ParquetColumn`: a Parquet list column of token ids, one row one document, a unit per
  row group (its token column chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from streamdata.catalog.footers import read_footers
from streamdata.catalog.tokens import (
    SIDECAR,
    count_tar_tokens,
    default_counts_url,
    read_indexes,
    save_tar_counts,
)
from streamdata.epoch.tokens import augmented, augmented_mask, raw_range
from streamdata.errors import FormatError, ShardNotFoundError, SpecError
from streamdata.fetch.prefetcher import FetchItem, ItemReader
from streamdata.formats import arrow as fmt
from streamdata.formats.tokens import mask_of, tar_tokens, tokens_of
from streamdata.policy import ErrorPolicy
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import known_size

if TYPE_CHECKING:
    from streamdata.datasets.tokens import TokenDataset, TokenUnit

__all__ = ["FlatBin", "MegatronIdx", "ParquetColumn", "Scanned", "TarNpy", "TokenLayout"]


class Scanned(NamedTuple):
    """One unit as a layout's metadata gives it: the object, the row group (-1: the whole
    object), its raw tokens, its documents' raw lengths (None: known only once read) and count."""

    url: str
    size: int
    row_group: int
    tokens: int
    lengths: np.ndarray | None
    docs: int


class TokenLayout:
    """A source layout of token corpora (see the module docstring)."""

    name = ""
    suffixes: tuple[str, ...] = (".bin",)
    mask_apart = False  # loss masks: fetched as items of their own (else with the tokens: read_masked)

    def scan(self, ds: TokenDataset) -> Iterator[Scanned]:
        """Every unit of ``ds.shards``, from metadata (one read per job, on rank 0, LIST-ONCE)."""
        raise NotImplementedError

    def fetch(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        """What to fetch for stream positions ``[start, stop)`` of ``unit``."""
        raise NotImplementedError

    def read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
             reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions ``[start, stop)`` of ``unit``: tokens (int64) and each one's document,
        numbered across the corpus (``unit.first_doc`` on)."""
        raise NotImplementedError

    def fetch_mask(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        """What to fetch for the loss mask of stream positions ``[start, stop)`` (``mask_apart``)."""
        raise SpecError(f"{type(self).__name__} reads no loss mask apart")

    def read_mask(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
                  reader: ItemReader) -> np.ndarray:
        """The loss mask (uint8) of stream positions ``[start, stop)`` (``epoch.tokens.augmented_mask``)."""
        raise SpecError(f"{type(self).__name__} reads no loss mask apart")

    def read_masked(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
                    reader: ItemReader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``read``'s tokens and documents, and their loss mask, from the same item."""
        raise SpecError(f"{type(self).__name__} reads no loss mask")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Flat(TokenLayout):
    """A ``.bin`` of one dtype: the raw tokens of ``[start, stop)`` in one byte range."""

    mask_apart = True

    def __init__(self, dtype: np.dtype | None) -> None:
        self.dtype = dtype

    def fetch(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        assert self.dtype is not None
        a, b = self._raw(ds, unit, start, stop)
        return FetchItem(unit.url, unit.size, ((a * self.dtype.itemsize, b * self.dtype.itemsize),),
                         ds.etag(unit.url))

    def read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
             reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        assert self.dtype is not None
        lengths = ds.doc_lengths(unit)
        a, b = self._raw(ds, unit, start, stop)
        raw = tokens_of(reader.read_ranges()[0], self.dtype, reader.url, b - a)
        tokens, doc = augmented(lengths, start, stop, raw, a, ds.bos_id, ds.eos_id)
        return tokens, doc + unit.first_doc

    def fetch_mask(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        a, b = self._mask_raw(ds, unit, start, stop)
        mask = ds.mask_shard(unit)
        return FetchItem(mask.url, known_size(mask), ((a, b),), getattr(mask, "etag", None))

    def read_mask(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
                  reader: ItemReader) -> np.ndarray:
        a, b = self._mask_raw(ds, unit, start, stop)
        raw = mask_of(reader.read_ranges()[0], reader.url, b - a)
        return augmented_mask(ds.doc_lengths(unit), start, stop, raw, a, ds.bos_id is not None,
                              ds.eos_id is not None)

    def _mask_raw(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> tuple[int, int]:
        """The mask bytes of ``[start, stop)``: the tokens' (one byte each), and with ``eos_id`` the
        one before them (an eos takes its document's last token's mask)."""
        a, b = self._raw(ds, unit, start, stop)
        return (max(a - 1, 0) if ds.eos_id is not None else a), b

    @staticmethod
    def _raw(ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> tuple[int, int]:
        """The raw tokens fetched for ``[start, stop)``: at least one (a range is never empty)."""
        a, b = raw_range(ds.doc_lengths(unit), start, stop, ds.bos_id is not None, ds.eos_id is not None)
        if b == a:
            a = min(a, unit.tokens - 1)
            b = a + 1
        return a, b


class FlatBin(_Flat):
    """Flat ``.bin`` files of ``dtype`` tokens (``dtype=``, or a ``tokens.json`` beside them): one
    document per file, or, with the dataset's ``sep_id``, documents ending at that token."""

    name = "bin"

    def scan(self, ds: TokenDataset) -> Iterator[Scanned]:
        assert self.dtype is not None
        for shard in ds.shards:
            size = known_size(shard)
            if size % self.dtype.itemsize:
                raise FormatError(f"{redact_url(shard.url)}: {size} bytes is not a whole number of "
                                  f"{self.dtype} tokens (truncated, or another dtype?)", url=shard.url,
                                  key="bin")
            n = size // self.dtype.itemsize
            yield Scanned(shard.url, size, -1, n, np.array([n], np.int64), 1)

    def read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
             reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        tokens, doc = super().read(ds, unit, start, stop, reader)
        if ds.sep_id is not None and (ds.documents or ds.loss_mask):  # a document ends after each separator
            ends = np.concatenate([[0], np.cumsum(tokens[:-1] == ds.sep_id)])
            return tokens, (np.int64(unit.i) << 32) + ends  # distinct from other units' keys
        return tokens, doc


class MegatronIdx(_Flat):
    """Megatron ``.bin`` + ``.idx`` pairs: each ``.idx`` gives its ``.bin``'s dtype and documents."""

    name = "idx"

    def __init__(self, dtype: np.dtype | None, sniffed: bool) -> None:
        super().__init__(dtype)
        self.sniffed = sniffed  # neither dtype= nor idx= given: a missing .idx says how to fix it

    def scan(self, ds: TokenDataset) -> Iterator[Scanned]:
        try:
            indexes = read_indexes(ds.shards, ds.storage_options, ds.fetch_config)
        except ShardNotFoundError as exc:
            if self.sniffed:  # neither dtype= nor a tokens.json nor the .idx files: say how to fix
                exc.message += (f"; a flat .bin needs its token dtype: pass dtype= (e.g. 'uint16') or "
                                f"put a {SIDECAR} beside the files holding {{\"dtype\": \"uint16\"}}")
            raise
        for shard, (dtype, lengths) in zip(ds.shards, indexes, strict=True):
            if self.dtype is not None and dtype != self.dtype:
                raise SpecError(f"{redact_url(shard.url)}: its .idx says {dtype} tokens, dtype= says "
                                f"{self.dtype}")
            self.dtype = dtype
            yield Scanned(shard.url, known_size(shard), -1, int(lengths.sum()), lengths, len(lengths))


class TarNpy(TokenLayout):
    """Tar shards whose samples' ``field`` is a 1-D integer ``.npy`` (one sample, one document):
    counted once per job (``counts``: a file of kept counts, ``"auto"`` beside the shards), then
    read in byte ranges, only the samples a span needs (the counting pass's offsets)."""

    name = "tar"
    suffixes = (".tar",)

    def __init__(self, field: str, counts: str | None, progress: bool | None) -> None:
        self.field, self.counts, self.progress = field, counts, progress
        self.counted: list[tuple[np.ndarray, np.ndarray]] = []  # per shard: tokens per sample, offsets
        self.offsets: dict[str, np.ndarray] = {}
        self.counted_shards = 0  # tar shards the job's counting pass read (every rank's share)
        self.counted_here = 0  # those this rank read (COUNT-SHARED, ``catalog.tokens``)

    def scan(self, ds: TokenDataset) -> Iterator[Scanned]:
        url = default_counts_url(ds.shards) if self.counts == "auto" else self.counts
        self.counted, self.counted_shards, self.counted_here = count_tar_tokens(
            ds.shards, self.field, ds.storage_options, ds.fetch_config, show=self.progress,
            counts_url=url, auto=self.counts == "auto")
        for shard, (counts, offsets) in zip(ds.shards, self.counted, strict=True):
            self.offsets[shard.url] = offsets
            yield Scanned(shard.url, known_size(shard), -1, int(counts.sum()), counts, len(counts))

    def save(self, ds: TokenDataset, url: str | None) -> str:
        """Keep the counts at ``url`` (default: beside the shards); the URL written."""
        url = url or default_counts_url(ds.shards)
        if url is None:
            raise SpecError("the shards share no directory: pass save_counts the counts file's URL")
        save_tar_counts(url, self.field, ds.shards, self.counted, ds.storage_options, ds.fetch_config)
        return url

    def fetch(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        offsets = self.offsets[unit.url]
        d0, d1 = self._samples(ds, unit, start, stop)
        return FetchItem(unit.url, unit.size, ((int(offsets[d0]), int(offsets[d1])),), ds.etag(unit.url))

    def read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
             reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        lengths = ds.doc_lengths(unit)
        d0, d1 = self._samples(ds, unit, start, stop)
        raw = tar_tokens(reader.read_ranges()[0], reader.url, self.field, lengths[d0:d1])
        tokens, doc = augmented(lengths, start, stop, raw, int(lengths[:d0].sum()), ds.bos_id, ds.eos_id)
        return tokens, doc + unit.first_doc

    @staticmethod
    def _samples(ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> tuple[int, int]:
        """The samples (documents) ``[d0, d1)`` that stream positions ``[start, stop)`` need: at
        least one."""
        lengths = ds.doc_lengths(unit)
        starts = np.concatenate([[0], np.cumsum(lengths + ds.specials)])
        d0 = max(int(np.searchsorted(starts, start, side="right")) - 1, 0)
        d1 = min(max(int(np.searchsorted(starts, stop, side="left")), d0 + 1), len(lengths))
        return d0, d1


class ParquetColumn(TokenLayout):
    """A Parquet list column of integer token ids (one row, one document); a unit per row group,
    its tokens counted from the footers (the column's value count less its nulls)."""

    name = "parquet"
    suffixes = (".parquet", ".pq", ".parq")

    def __init__(self, column: str, footer_bytes: int) -> None:
        self.column, self.footer_bytes = column, footer_bytes
        self._footers: dict[str, bytes] = {}
        self._meta_cache: dict[str, Any] = {}

    def scan(self, ds: TokenDataset) -> Iterator[Scanned]:
        for shard in ds.shards:
            meta = self.meta(ds, shard.url)
            leaf = self._leaf(meta, shard.url)
            if ds.mask_column is not None:
                self._leaf(meta, shard.url, ds.mask_column)  # (a list of 0/1 values, or a SpecError now)
            for g in range(meta.num_row_groups):
                cc = meta.row_group(g).column(leaf)
                stats = cc.statistics if cc.is_stats_set else None
                nulls = stats.null_count if stats is not None and stats.has_null_count else 0
                yield Scanned(shard.url, known_size(shard), g, int(cc.num_values - nulls), None,
                              meta.row_group(g).num_rows)

    def meta(self, ds: TokenDataset, url: str) -> Any:
        """The parsed footer of ``url`` (every footer read once, on rank 0, LIST-ONCE)."""
        if not self._footers:
            self._footers = from_rank0(lambda: read_footers(
                ds.shards, ds.storage_options, ds.fetch_config, tail_bytes=self.footer_bytes,
                footer_length=lambda tail, s: fmt.parquet_footer_length(tail, known_size(s), s.url),
                policy=ErrorPolicy("raise")))
        meta = self._meta_cache.get(url)
        if meta is None:
            meta = self._meta_cache[url] = fmt.parse_parquet_footer(self._footers[url], url)
        return meta

    def _leaf(self, meta: Any, url: str, column: str | None = None) -> int:
        """The one leaf of the token column (or of the loss mask's ``column``); SpecError unless
        it is a list of integers (of integers or booleans)."""
        column = column or self.column
        leaves = fmt.parquet_leaves(meta, [column], url)
        kind = meta.schema.to_arrow_schema().field(column).type
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if column != self.column:
            flags = listed and (pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type))
            if not flags:
                raise SpecError(f"loss-mask column {column!r} of {redact_url(url)} is {kind}, not a list of "
                                "0/1 values (list<uint8> or list<bool>, a value per token)")
        elif not listed or not pa.types.is_integer(kind.value_type):
            raise SpecError(f"column {self.column!r} of {redact_url(url)} is {kind}, not a list of integer "
                            "token ids (e.g. list<int32>)")
        return leaves[0]

    def fetch(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int) -> FetchItem:
        meta = self.meta(ds, unit.url)
        leaves = [self._leaf(meta, unit.url)]
        if ds.mask_column is not None:  # the loss mask's chunk: parts of the same item
            leaves = sorted([*leaves, self._leaf(meta, unit.url, ds.mask_column)])
        ranges = fmt.column_chunk_ranges(meta, unit.index, leaves, unit.size, unit.url)
        return FetchItem(unit.url, unit.size, tuple(ranges), ds.etag(unit.url))

    def read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
             reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        tokens, doc, _ = self._read(ds, unit, start, stop, reader, None)
        return tokens, doc

    def read_masked(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int,
                    reader: ItemReader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, doc, mask = self._read(ds, unit, start, stop, reader, ds.mask_column)
        assert mask is not None
        return tokens, doc, mask

    def _read(self, ds: TokenDataset, unit: TokenUnit, start: int, stop: int, reader: ItemReader,
              mask_column: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The row group's token values, checked against its footer's counts (and its loss
        mask's, a value per token)."""
        parts = zip([s for s, _ in reader.item.ranges or ()], reader.read_ranges(), strict=True)
        columns = [self.column] + ([mask_column] if mask_column is not None else [])
        table = fmt.read_row_group(self.meta(ds, unit.url), parts, unit.size, unit.index, columns,
                                   unit.url)
        column = table.column(0).combine_chunks()
        if column.null_count:
            column = column.fill_null([])  # a null row: an empty document
        values = column.flatten()
        if values.null_count:
            raise FormatError(f"{redact_url(unit.url)}: row group {unit.index} of column {self.column!r} "
                              "holds null token ids", url=unit.url, key=f"row group {unit.index}")
        if len(values) != unit.tokens or len(column) != unit.docs:
            raise FormatError(
                f"{redact_url(unit.url)}: row group {unit.index} holds {len(values)} tokens in {len(column)} "
                f"rows where its footer says {unit.tokens} in {unit.docs} (the file changed after it was "
                "listed, or was written without column statistics and holds empty lists: write it with "
                "statistics)", url=unit.url, key=f"row group {unit.index}")
        lengths = np.diff(column.offsets.to_numpy()).astype(np.int64)
        tokens, doc = augmented(lengths, start, stop, values.to_numpy(zero_copy_only=False), 0, ds.bos_id,
                                ds.eos_id)
        mask = None
        if mask_column is not None:
            raw = self._mask(table.column(1).combine_chunks(), lengths, unit, mask_column)
            mask = augmented_mask(lengths, start, stop, raw, 0, ds.bos_id is not None, ds.eos_id is not None)
        return tokens, doc + unit.first_doc, mask

    @staticmethod
    def _mask(column: Any, lengths: np.ndarray, unit: TokenUnit, name: str) -> np.ndarray:
        """A row group's loss mask, a 0/1 value per token: the same lengths as its token rows."""
        where = f"row group {unit.index}"
        if column.null_count:
            column = column.fill_null([])
        values = column.flatten()
        if values.null_count or not np.array_equal(np.diff(column.offsets.to_numpy()), lengths):
            raise FormatError(f"{redact_url(unit.url)}: {where}'s loss mask {name!r} is not a 0/1 value per "
                              "token (its rows' lengths differ from the tokens', or it holds nulls)",
                              url=unit.url, key=where)
        return mask_of(values.to_numpy(zero_copy_only=False), unit.url, int(lengths.sum()))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_meta_cache": {}}  # parsed again, lazily, in the process that reads


