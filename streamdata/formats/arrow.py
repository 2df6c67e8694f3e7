"""Arrow IPC and Parquet bytes -> Arrow tables.

Reading works on *fetched byte ranges*, never on a whole object: a ``SparseFile`` presents
the ranges the fetcher delivered as a random-access file of the object's full size, and
pyarrow decodes from it.  A read outside those ranges is a bug or a corrupt footer and
raises ``FormatError`` instead of reaching for the network.

- Parquet: the footer (``<metadata><len:4>PAR1``) is parsed alone; a row group is decoded from
  the byte ranges of the column chunks asked for (``column_chunk_ranges``).
- Arrow IPC file (``ARROW1 ... <footer><len:4>ARROW1``): the footer's flatbuffer lists each
  record batch's block, so a batch is decoded from its block plus the dictionary blocks.
  Each batch's row count is in its message header, read alone (``ipc_batch_rows``).
- Arrow IPC stream: read sequentially from the fetcher's parts, one message at a time.

Tables become tensors in :mod:`streamdata.batch.tables`.
"""

from __future__ import annotations

import bisect
import io
import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from streamdata.errors import FormatError, SpecError

__all__ = [
    "ChunkFile",
    "SparseFile",
    "coalesce",
    "column_chunk_ranges",
    "ipc_batch_meta_ranges",
    "ipc_batch_rows",
    "ipc_blocks",
    "ipc_footer_length",
    "ipc_stream_batches",
    "parquet_footer_length",
    "parquet_leaves",
    "parse_parquet_footer",
    "read_ipc_batch",
    "read_row_group",
    "table_url",
    "tag_url",
]

Range = tuple[int, int]  # [start, end) in bytes
PARQUET_MAGIC = b"PAR1"
IPC_MAGIC = b"ARROW1"
_PARQUET_MR_PAD = 100  # old parquet-mr under-reports a chunk's dictionary page header (PARQUET-816)


URL_KEY = b"streamdata.url"  # schema metadata: the object(s) a table's rows came from


def tag_url(table: pa.Table | pa.RecordBatch, url: str) -> pa.Table | pa.RecordBatch:
    """``table`` marked with the object it was read from (kept through slices, takes, filters
    and concatenation), so that a conversion error can name it."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), URL_KEY: url.encode()})


def table_url(table: pa.Table | pa.RecordBatch) -> str | None:
    """The object(s) ``table``'s rows came from (``tag_url``), or None."""
    raw = (table.schema.metadata or {}).get(URL_KEY)
    return raw.decode("utf-8", "replace") if raw else None


# ---- byte ranges as a file -----------------------------------------------------------------


class SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only the given ``(start, bytes)`` parts exist."""

    def __init__(self, parts: Iterable[tuple[int, bytes]], size: int, url: str = "") -> None:
        super().__init__()
        self._parts = sorted(((s, memoryview(b)) for s, b in parts), key=lambda p: p[0])
        self._starts = [s for s, _ in self._parts]
        self._size = size
        self._pos = 0
        self.url = url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes | memoryview:
        start = self._pos
        n = self._size - start if n is None or n < 0 else min(n, self._size - start)
        i = bisect.bisect_right(self._starts, start) - 1
        if n > 0 and (i < 0 or start + n > self._starts[i] + len(self._parts[i][1])):
            raise OSError(f"bytes {start}..{start + n} of {self.url} were not fetched "
                          "(the footer's offsets do not match the object)")
        self._pos += n
        if n <= 0:
            return b""
        part_start, data = self._parts[i]
        return data[start - part_start:start - part_start + n]

    def pyarrow(self) -> pa.NativeFile:
        return pa.PythonFile(self, mode="r")


class ChunkFile(io.RawIOBase):
    """A sequential, read-only file over an iterator of byte chunks (for IPC streams)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        super().__init__()
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        pieces: list[memoryview] = []
        want = n if n is not None and n >= 0 else None
        got = 0
        while want is None or got < want:
            if not len(self._buf):
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._buf = memoryview(chunk)
            take = len(self._buf) if want is None else min(len(self._buf), want - got)
            pieces.append(self._buf[:take])
            self._buf = self._buf[take:]
            got += take
        self._pos += got
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)


def coalesce(ranges: Iterable[Range], gap: int = 0) -> list[Range]:
    """Sort and merge ranges that overlap, touch, or lie at most ``gap`` bytes apart."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


# ---- Parquet ------------------------------------------------------------------------------


def parquet_footer_length(tail: bytes, size: int, url: str) -> int:
    """Bytes at the end of the object holding the footer (metadata + 8), from any tail >= 8 bytes."""
    if len(tail) < 8 or tail[-4:] != PARQUET_MAGIC:
        raise FormatError(f"{url} is not a Parquet file or is truncated: it does not end in "
                          f"'PAR1' (size {size} bytes)", url=url, key="footer")
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length > size - 4:
        raise FormatError(f"corrupt Parquet footer in {url}: metadata of {length - 8} bytes "
                          f"does not fit in {size} bytes", url=url, key="footer")
    return length


def parse_parquet_footer(footer: bytes, url: str) -> pq.FileMetaData:
    """The file metadata from the footer bytes alone (``<metadata><len:4>PAR1``)."""
    try:
        meta = pq.read_metadata(pa.BufferReader(footer))
        # what the readers use later, decoded now: a corrupt footer fails here, in the constructor
        _ = meta.created_by, [meta.schema.column(i).path for i in range(meta.num_columns)]
        _ = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        return meta
    except (OSError, pa.ArrowException, ValueError, IndexError) as exc:  # UnicodeDecodeError too
        raise FormatError(f"corrupt Parquet footer in {url}: {type(exc).__name__}: {exc}", url=url,
                          key="footer") from exc


def parquet_leaves(meta: pq.FileMetaData, columns: Sequence[str] | None, url: str = "") -> list[int]:
    """Leaf column indices for ``columns`` (top-level names, or dotted paths into structs)."""
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if columns is None:
        return list(range(len(paths)))
    by_prefix: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            by_prefix.setdefault(".".join(parts[:k]), []).append(i)
    leaves: list[int] = []
    for name in columns:
        if name not in by_prefix:
            top = sorted({p.split(".")[0] for p in paths})
            raise SpecError(f"column {name!r} is not in {url or 'the Parquet schema'}; "
                            f"columns: {', '.join(top)}")
        leaves.extend(by_prefix[name])
    return sorted(set(leaves))


def column_chunk_ranges(meta: pq.FileMetaData, row_group: int, leaves: Sequence[int],
                        size: int, url: str | None = None) -> list[Range]:
    """Byte ranges of the given leaf column chunks of a row group (as pyarrow will read them)."""
    rg = meta.row_group(row_group)
    pad = _PARQUET_MR_PAD if (meta.created_by or "").startswith("parquet-mr") else 0
    out = []
    for leaf in leaves:
        cc = rg.column(leaf)
        start = cc.data_page_offset
        dict_at = cc.dictionary_page_offset
        if cc.has_dictionary_page and dict_at and 0 < dict_at < start:
            start = dict_at
        end = min(size, start + cc.total_compressed_size + pad)
        if not 0 <= start < end:
            raise FormatError(f"corrupt Parquet footer in {url or 'an object'}: column chunk {leaf} "
                              f"of row group {row_group} at bytes {start}..{end} of {size}", url=url,
                              key=f"row group {row_group}")
        out.append((start, end))
    return out


def read_row_group(meta: pq.FileMetaData, parts: Iterable[tuple[int, bytes]], size: int,
                   row_group: int, columns: Sequence[str] | None, url: str,
                   use_threads: bool = False) -> pa.Table:
    """Decode one row group from its fetched column-chunk bytes; FormatError names URL and group."""
    try:
        source = SparseFile(parts, size, url).pyarrow()
        reader = pq.ParquetFile(source, metadata=meta, pre_buffer=False,
                                page_checksum_verification=True)
        table = reader.read_row_group(row_group, columns=None if columns is None else list(columns),
                                      use_threads=use_threads)
        return tag_url(table, url)
    except (OSError, pa.ArrowException, ValueError, IndexError) as exc:
        raise FormatError(f"cannot read row group {row_group} of {url} (corrupt or truncated "
                          f"object?): {type(exc).__name__}: {exc}", url=url,
                          key=f"row group {row_group}") from exc


# ---- Arrow IPC ----------------------------------------------------------------------------


def ipc_footer_length(tail: bytes, size: int, url: str) -> int | None:
    """Bytes at the end of an IPC *file* holding its footer (+10), or None: not the file format."""
    if len(tail) < 10 or tail[-6:] != IPC_MAGIC:
        return None
    length = struct.unpack("<i", tail[-10:-6])[0] + 10
    if length < 10 or length > size - 8:
        raise FormatError(f"corrupt Arrow IPC footer in {url}: length {length - 10} does not fit "
                          f"in {size} bytes", url=url, key="footer")
    return length


def _fb_field(buf: bytes, table: int, index: int) -> int | None:
    """Position of field ``index`` of the flatbuffer table at ``table`` (None when absent);
    every position read is checked against ``buf`` (``struct.error`` when outside it)."""
    vtable = table - _fb_read(buf, "<i", table)
    vsize = _fb_read(buf, "<H", vtable)
    if 4 + 2 * index >= vsize:
        return None
    offset = _fb_read(buf, "<H", vtable + 4 + 2 * index)
    return table + offset if offset else None


def _fb_read(buf: bytes, form: str, at: int) -> int:
    """One value at ``at`` of ``buf``; a position outside ``buf`` (negative ones too, which
    ``struct`` would count from the end) is a ``struct.error``."""
    if at < 0 or at + struct.calcsize(form) > len(buf):
        raise struct.error(f"flatbuffer offset {at} is outside its {len(buf)} bytes")
    return struct.unpack_from(form, buf, at)[0]


def _ipc_footer_blocks(footer: bytes, url: str, size: int | None,
                      ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """``(dictionary blocks, record batch blocks)`` as ``(offset, metaDataLength, bodyLength)``."""
    buf = footer[:-10]
    try:
        root = _fb_read(buf, "<I", 0)

        def blocks(index: int) -> list[tuple[int, int, int]]:
            at = _fb_field(buf, root, index)
            if at is None:
                return []
            vec = at + _fb_read(buf, "<I", at)
            count = _fb_read(buf, "<I", vec)
            if vec + 4 + 24 * count > len(buf):
                raise struct.error(f"{count} blocks do not fit in the footer")
            out = []
            for k in range(count):
                offset, meta_len, body_len = struct.unpack_from("<qi4xq", buf, vec + 4 + 24 * k)
                end = offset + meta_len + body_len
                if size is not None and not (8 <= offset and meta_len > 0 and body_len >= 0
                                             and end <= size - len(footer)):
                    raise FormatError(f"corrupt Arrow IPC footer in {url}: block {k} at bytes "
                                      f"{offset}..{end} is outside the object's data (size {size})",
                                      url=url, key="footer")
                out.append((offset, meta_len, body_len))
            return out

        return blocks(2), blocks(3)
    except struct.error as exc:
        raise FormatError(f"corrupt Arrow IPC footer in {url}: {exc}", url=url, key="footer") from exc


def ipc_blocks(footer: bytes, url: str, size: int | None = None) -> tuple[list[Range], list[Range]]:
    """``(dictionary blocks, record batch blocks)`` as byte ranges, from the footer flatbuffer;
    with the object's ``size``, a block outside the object's data is a ``FormatError`` (a corrupt
    footer must not send the fetcher after bytes that do not exist).

    ``footer`` is the object's tail (``<flatbuffer><len:4>ARROW1``).  Footer fields: 0 version,
    1 schema, 2 dictionaries, 3 recordBatches; a Block is ``{offset: i64, metaDataLength: i32,
    bodyLength: i64}`` (24 bytes with padding).
    """
    dicts, batches = _ipc_footer_blocks(footer, url, size)
    return ([(o, o + m + b) for o, m, b in dicts], [(o, o + m + b) for o, m, b in batches])


def ipc_batch_meta_ranges(footer: bytes, url: str, size: int) -> list[tuple[Range, int]]:
    """Each record batch's message header ``[offset, offset + metaDataLength)``, with its
    ``bodyLength``: what ``ipc_batch_rows`` reads the batch's row count from."""
    return [((o, o + m), b) for o, m, b in _ipc_footer_blocks(footer, url, size)[1]]


_RECORD_BATCH = 3  # MessageHeader union: 1 Schema, 2 DictionaryBatch, 3 RecordBatch, 4 Tensor


def ipc_batch_rows(meta: bytes, url: str, index: int) -> int:
    """Rows of record batch ``index`` from its encapsulated message header alone: ``0xFFFFFFFF``,
    an int32 size, then the Message flatbuffer (fields: 0 version, 1 header_type, 2 header,
    3 bodyLength), whose header is a RecordBatch table (field 0 ``length``: int64, 0 when absent).
    Pre-1.0 files lack the ``0xFFFFFFFF``.  Anything that does not read so is a FormatError."""
    key = f"record batch {index}"
    try:
        skip = 4 if _fb_read(meta, "<I", 0) == 0xFFFFFFFF else 0
        length = _fb_read(meta, "<i", skip)
        if length <= 0 or skip + 4 + length > len(meta):
            raise struct.error(f"a message of {length} bytes in a block of {len(meta)}")
        buf = bytes(meta[skip + 4:skip + 4 + length])
        message = _fb_read(buf, "<I", 0)
        kind = _fb_field(buf, message, 1)
        if kind is None or _fb_read(buf, "<B", kind) != _RECORD_BATCH:
            raise struct.error("its message is not a record batch")
        at = _fb_field(buf, message, 2)
        if at is None:
            raise struct.error("its message has no header")
        batch = at + _fb_read(buf, "<I", at)
        field = _fb_field(buf, batch, 0)
        rows = 0 if field is None else _fb_read(buf, "<q", field)
        if rows < 0:
            raise struct.error(f"a length of {rows} rows")
        return rows
    except struct.error as exc:
        raise FormatError(f"corrupt Arrow IPC record batch {index} header in {url}: {exc}", url=url,
                          key=key) from exc


def _valid(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` once fully validated: pyarrow's IPC reader checks buffers' sizes but not offsets
    or dictionary indices, and a slice of a batch with corrupt offsets aborts the process in
    Arrow's C++ checks (found by fuzzing), where ``validate`` raises ``ArrowInvalid``."""
    batch.validate(full=True)
    _ = batch.schema.names  # names that are not UTF-8 raise UnicodeDecodeError here, not later
    return batch


def read_ipc_batch(parts: Iterable[tuple[int, bytes]], size: int, index: int, url: str) -> pa.RecordBatch:
    """Decode record batch ``index`` from the footer, dictionary and batch blocks fetched."""
    try:
        reader = pa.ipc.open_file(SparseFile(parts, size, url).pyarrow())
        return tag_url(_valid(reader.get_batch(index)), url)
    except (OSError, pa.ArrowException, ValueError, IndexError) as exc:
        raise FormatError(f"cannot read record batch {index} of {url} (corrupt or truncated "
                          f"object?): {type(exc).__name__}: {exc}", url=url,
                          key=f"record batch {index}") from exc


def ipc_stream_batches(chunks: Iterable[bytes], url: str) -> Iterator[pa.RecordBatch]:
    """Record batches of an IPC stream, parsed as its bytes arrive (memory: about one batch)."""
    index = 0
    chunks = iter(chunks)
    first = b""
    for piece in chunks:  # pieces can be a few bytes (S3 parts come as received): enough to compare
        first += piece
        if len(first) >= len(IPC_MAGIC):
            break
    if first[:len(IPC_MAGIC)] == IPC_MAGIC:
        raise FormatError(f"{url} starts as an Arrow IPC file but does not end with its footer "
                          "(truncated?)", url=url, key="footer")
    try:
        reader = pa.ipc.open_stream(pa.PythonFile(ChunkFile(itertools.chain([first], chunks)), mode="r"))
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            yield tag_url(_valid(batch), url)
            index += 1
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise FormatError(f"cannot read record batch {index} of Arrow IPC stream {url} (corrupt "
                          f"or truncated object?): {type(exc).__name__}: {exc}", url=url,
                          key=f"record batch {index}") from exc
