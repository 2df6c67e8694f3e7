"""Writers: a table, or an iterator of record batches, to sharded Parquet / Arrow IPC objects.

The shard URL is a pattern with a ``{shard}`` field (``"s3://bkt/train-{shard:05d}.parquet"``),
formatted with 0, 1, 2...; rows fill each shard up to ``rows_per_shard``.  Within a shard, rows
are regrouped into row groups (Parquet) or record batches (IPC) of exactly ``row_group_size`` /
``batch_size`` rows (the last of a shard may be shorter), so readers that split by row group
get even units whatever the input's chunking.  Memory: about one row group.  Each shard is
written to a local spool file and uploaded in the background (``upload.Uploader``: a temporary
key moved into place, retries by deadline, multipart for big objects) while the next is written;
the call returns once every shard is in place.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import pyarrow as pa

from streamdata.datasets.parquet import rebatch
from streamdata.errors import SpecError, StreamDataError
from streamdata.store.backends import translate_error
from streamdata.store.urls import split_url
from streamdata.write.upload import Uploader

__all__ = ["write_arrow", "write_parquet"]

log = logging.getLogger("streamdata")

TableLike: TypeAlias = pa.Table | pa.RecordBatch | Mapping[str, Any] | Iterable[pa.Table | pa.RecordBatch]


def _tables(data: TableLike) -> Iterator[pa.Table]:
    if isinstance(data, pa.Table):
        yield data
    elif isinstance(data, pa.RecordBatch):
        yield pa.Table.from_batches([data])
    elif isinstance(data, Mapping):
        yield pa.table(dict(data))
    else:
        for item in data:
            if isinstance(item, pa.RecordBatch):
                item = pa.Table.from_batches([item])
            if not isinstance(item, pa.Table):
                raise SpecError(f"write: expected pyarrow Tables or RecordBatches, got {type(item).__name__}")
            yield item


def _pieces(tables: Iterable[pa.Table], rows_per_shard: int | None) -> Iterator[tuple[int, pa.Table]]:
    """``(shard index, slice)``: the input cut so that no slice crosses a shard boundary."""
    shard, used = 0, 0
    for table in tables:
        start = 0
        while start < table.num_rows:
            if rows_per_shard and used == rows_per_shard:
                shard, used = shard + 1, 0
            room = rows_per_shard - used if rows_per_shard else table.num_rows
            take = min(room, table.num_rows - start)
            yield shard, table.slice(start, take)
            used += take
            start += take


def _has_shard_field(pattern: str) -> bool:
    try:
        return any(name == "shard" for _, name, _, _ in string.Formatter().parse(pattern))
    except ValueError as exc:
        raise SpecError(f"bad URL pattern {pattern!r}: {exc}") from exc


class _Progress:
    """Logs a line every ``every_s`` seconds while writing, and a summary at the end."""

    def __init__(self, what: str, every_s: float) -> None:
        self.what, self.every_s = what, every_s
        self.start = self.last = time.monotonic()
        self.shards = self.rows = self.bytes = 0

    def add(self, rows: int) -> None:
        self.rows += rows
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("%s: %d shards done, %d rows written (%.1f s)", self.what, self.shards,
                     self.rows, now - self.start)

    def done(self, urls: list[str]) -> None:
        log.info("%s: wrote %d rows to %d shards, %.1f MB, in %.1f s (first: %s)", self.what,
                 self.rows, len(urls), self.bytes / 1e6, time.monotonic() - self.start,
                 urls[0] if urls else "-")


def _write_sharded(data: TableLike, url_pattern: str, *, rows_per_shard: int | None, chunk_rows: int,
                   storage_options: Mapping[str, Any] | None, what: str, log_every_s: float,
                   open_writer: Callable[[Any, pa.Schema], Any],
                   write_chunk: Callable[[Any, pa.Table], None]) -> list[str]:
    if chunk_rows < 1 or (rows_per_shard is not None and rows_per_shard < 1):
        raise SpecError(f"{what}: row counts must be >= 1 (chunk {chunk_rows}, shard {rows_per_shard})")
    sharded = _has_shard_field(url_pattern)
    if rows_per_shard is not None and not sharded:
        raise SpecError(f"{what}: rows_per_shard needs a {{shard}} field in the URL pattern, e.g. "
                        f"'s3://bkt/train-{{shard:05d}}.parquet'; got {url_pattern!r}")
    protocol, _ = split_url(url_pattern)
    uploader = Uploader(protocol, storage_options, desc=f"{what}: shards uploaded")
    try:
        urls = _write_all(uploader, data, url_pattern, sharded, rows_per_shard, chunk_rows,
                          _Progress(what, log_every_s), open_writer, write_chunk)
        uploader.wait()
    except BaseException:
        uploader.close(cancel=True)
        raise
    uploader.close()
    return urls


def _write_all(uploader: Uploader, data: TableLike, url_pattern: str, sharded: bool,
               rows_per_shard: int | None, chunk_rows: int, progress: _Progress,
               open_writer: Callable[[Any, pa.Schema], Any],
               write_chunk: Callable[[Any, pa.Table], None]) -> list[str]:
    """Each shard into a local spool file, then handed to the background uploader (PUBLISH-WHOLE,
    ``upload``): the next shard is written while the last ones go up."""
    what = progress.what
    urls: list[str] = []
    for index, pieces in itertools.groupby(_pieces(_tables(data), rows_per_shard), key=lambda p: p[0]):
        url = url_pattern.format(shard=index) if sharded else url_pattern
        spool = uploader.spool_path(url)
        try:
            with open(spool, "wb") as sink:
                writer = None
                try:
                    for chunk in rebatch((p for _, p in pieces), chunk_rows):
                        writer = writer or open_writer(sink, chunk.schema)
                        write_chunk(writer, chunk)
                        progress.add(chunk.num_rows)
                finally:
                    if writer is not None:
                        writer.close()
                progress.bytes += sink.tell()
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.remove(spool)
            if isinstance(exc, (pa.ArrowInvalid, pa.ArrowTypeError)):
                raise SpecError(f"{what}: cannot write {url}: {exc}") from exc
            if isinstance(exc, OSError) and not isinstance(exc, StreamDataError):
                raise translate_error(exc, url, "write") from None
            raise
        uploader.submit(spool, url)
        urls.append(url)
        progress.shards += 1
    progress.done(urls)
    return urls


def write_parquet(data: TableLike, url_pattern: str, *, rows_per_shard: int | None = None,
                  row_group_size: int = 65536, storage_options: Mapping[str, Any] | None = None,
                  compression: str | None = "zstd", page_checksum: bool = True,
                  log_every_s: float = 10.0, **writer_options: Any) -> list[str]:
    """Write ``data`` (a Table, a RecordBatch, a dict of columns, or an iterable of Tables /
    RecordBatches) to Parquet objects at ``url_pattern``; returns the URLs written, in order.

    Every row group has exactly ``row_group_size`` rows except the last of each shard.
    Pages carry CRC checksums (``page_checksum``), which ``ParquetDataset`` verifies.
    ``writer_options`` go to ``pyarrow.parquet.ParquetWriter`` (e.g. ``use_dictionary``).
    """
    import pyarrow.parquet as pq

    def open_writer(sink: Any, schema: pa.Schema) -> Any:
        return pq.ParquetWriter(sink, schema, compression=compression,
                                write_page_checksum=page_checksum, **writer_options)

    return _write_sharded(data, url_pattern, rows_per_shard=rows_per_shard, chunk_rows=row_group_size,
                          storage_options=storage_options, what="write_parquet", log_every_s=log_every_s,
                          open_writer=open_writer,
                          write_chunk=lambda w, t: w.write_table(t, row_group_size=row_group_size))


def write_arrow(data: TableLike, url_pattern: str, *, rows_per_shard: int | None = None,
                batch_size: int = 65536, stream: bool = False, compression: str | None = None,
                storage_options: Mapping[str, Any] | None = None,
                log_every_s: float = 10.0) -> list[str]:
    """Write ``data`` to Arrow IPC objects (the file format; ``stream=True``: the stream format)
    at ``url_pattern``, in record batches of ``batch_size`` rows; returns the URLs written.

    ``compression`` is ``None``, ``"lz4"`` or ``"zstd"`` (buffer compression inside the IPC data).
    """
    options = pa.ipc.IpcWriteOptions(compression=compression)

    def open_writer(sink: Any, schema: pa.Schema) -> Any:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        return new(sink, schema, options=options)

    def write_chunk(writer: Any, table: pa.Table) -> None:
        for batch in table.combine_chunks().to_batches(max_chunksize=batch_size):
            writer.write_batch(batch)

    return _write_sharded(data, url_pattern, rows_per_shard=rows_per_shard, chunk_rows=batch_size,
                          storage_options=storage_options, what="write_arrow", log_every_s=log_every_s,
                          open_writer=open_writer, write_chunk=write_chunk)
