"""Token shards to any URL: Megatron ``.bin`` + ``.idx`` pairs (with an optional ``.mask.bin``
loss mask beside each) or Parquet files with a ``tokens`` list column, cut by a token target,
published whole, with a receipt per shard that makes a rerun resume.

Layout under a destination directory ``DEST`` (``shard`` is the writer's ``name``):

    DEST/shard-000000.bin        the documents' tokens back to back (uint16 or uint32)
    DEST/shard-000000.idx        its Megatron index (``formats.tokens.idx_bytes``: one document
                                per sequence)
    DEST/shard-000000.mask.bin   with a loss mask: one uint8 per token of the .bin, 1 = train on it
    DEST/shard-000000.parquet    Parquet instead: ``tokens`` list<int32> (and ``loss_mask``
                                list<uint8>), one row per document
    DEST/_streamdata.tokenize/job.json            the settings the shards were written with
    DEST/_streamdata.tokenize/shard-000000.json    a shard's receipt

A shard closes after the document that brings it to ``shard_tokens`` tokens (a document is
never split), so the cuts are a function of the documents alone. Each file goes through the
background :class:`~streamdata.write.upload.Uploader` (PUBLISH-WHOLE: under its final name only
whole).

Invariant (RECEIPT-LAST): a shard's receipt (its files' sizes, documents, tokens and the input
position after its last document) is submitted only once every file of the shard is published,
and a shard counts as complete only when its receipt is there and every file it names is there
at the size it records. :func:`completed` gives the longest run of complete shards from shard 0;
a writer started at the next shard and the input position the last receipt records writes the
rest: with the same settings (``job.json``) the same bytes an uninterrupted run would have
written, no document twice, none left out.
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamdata.config import FetchConfig
from streamdata.errors import SpecError
from streamdata.formats.tokens import idx_bytes
from streamdata.store.backends import close_filesystem, filesystem
from streamdata.store.urls import split_url
from streamdata.write.upload import Uploaded, Uploader

__all__ = ["FORMATS", "JOB_DIR", "Completed", "TokenShardWriter", "completed", "shard_files",
           "token_dtype_for"]

FORMATS = ("megatron", "parquet")
JOB_DIR = "_streamdata.tokenize"
ROW_GROUP_TOKENS = 1 << 20  # Parquet: a row group closes after the document reaching this many tokens


def token_dtype_for(largest_id: int) -> np.dtype:
    """uint16 when every id fits (``largest_id < 65536``), else uint32."""
    if largest_id < 0 or largest_id >= 1 << 32:
        raise SpecError(f"token id {largest_id} does not fit uint32")
    return np.dtype("<u2") if largest_id < 1 << 16 else np.dtype("<u4")


def shard_files(fmt: str, name: str, index: int, mask: bool) -> list[str]:
    """The file names of shard ``index`` (relative to the destination), the receipt's order."""
    stem = f"{name}-{index:06d}"
    if fmt == "parquet":
        return [f"{stem}.parquet"]
    return [f"{stem}.bin", *([f"{stem}.mask.bin"] if mask else []), f"{stem}.idx"]


@dataclass(frozen=True)
class Completed:
    """What the receipts say is done: ``shards`` complete from shard 0, their documents and
    tokens, and the input position after the last one (``unit``, ``doc`` in that unit)."""

    shards: int = 0
    documents: int = 0
    tokens: int = 0
    unit: int = 0
    doc: int = 0


def _join(dest: str, name: str) -> str:
    return dest.rstrip("/") + "/" + name


def completed(dest: str, fmt: str, name: str, storage_options: Mapping[str, Any] | None,
              config: FetchConfig | None = None) -> Completed:
    """The longest run of complete shards from shard 0 under ``dest``: each with its receipt
    and every file the receipt names at the size it records (one listing of each folder)."""
    protocol, path = split_url(dest)
    config = config or FetchConfig()
    fs = filesystem(protocol, storage_options if protocol != "file" else None, timeout=config.timeout)
    try:
        path = fs._strip_protocol(path).rstrip("/")
        receipts = _sizes(fs, f"{path}/{JOB_DIR}")
        if not receipts:
            return Completed()
        files = _sizes(fs, path)
        names = (f"{name}-{i:06d}.json" for i in itertools.count())
        run = list(itertools.takewhile(lambda n: n in receipts, names))
        paths = [f"{path}/{JOB_DIR}/{n}" for n in run]
        found = fs.cat(paths, on_error="return") if paths else {}  # (at once, where the store allows)
        done = Completed()
        for receipt_path in paths:
            data = found.get(receipt_path, found.get(fs._strip_protocol(receipt_path)))
            if not isinstance(data, bytes):
                return done
            receipt = json.loads(data)
            if receipt.get("format") != fmt or any(files.get(f) != n for f, n in receipt["files"].items()):
                return done
            unit, doc = (int(v) for v in receipt["end"])
            done = Completed(done.shards + 1, done.documents + int(receipt["documents"]),
                             done.tokens + int(receipt["tokens"]), unit, doc)
        return done
    finally:
        close_filesystem(fs)


def _sizes(fs: Any, folder: str) -> dict[str, int]:
    """``{basename: size}`` of the files directly in ``folder`` (empty when there is none)."""
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return {}
    return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries
            if e.get("type") != "directory"}


def remove_temporaries(dest: str, name: str, storage_options: Mapping[str, Any] | None,
                       config: FetchConfig | None = None) -> int:
    """Remove what a killed writer of shards ``name`` left under temporary names
    (``.shard-*.tmp`` for ``shard``, which no listing of shard suffixes picks up); the number
    removed."""
    protocol, path = split_url(dest)
    config = config or FetchConfig()
    fs = filesystem(protocol, storage_options if protocol != "file" else None, timeout=config.timeout)
    try:
        path = fs._strip_protocol(path).rstrip("/")
        removed = 0
        for folder in (path, f"{path}/{JOB_DIR}"):
            for base in _sizes(fs, folder):
                if base.startswith(f".{name}-") and base.endswith(".tmp"):
                    fs.rm_file(f"{folder}/{base}")
                    removed += 1
        return removed
    finally:
        close_filesystem(fs)


@dataclass
class _Shard:
    index: int
    lengths: list[int] = field(default_factory=list)
    tokens: int = 0
    parts: list[np.ndarray] = field(default_factory=list)  # Parquet: the documents, held
    masks: list[np.ndarray] = field(default_factory=list)
    sinks: dict[str, Any] = field(default_factory=dict)  # Megatron: file name -> open spool file
    spools: dict[str, str] = field(default_factory=dict)  # file name -> spool path


class TokenShardWriter:
    """Documents (token arrays, with their loss masks when ``mask``) into token shards under
    ``dest``, shard ``start_shard`` on (see the module docstring). Use as a context manager;
    :meth:`add` each input unit's documents; leaving the block without an
    error publishes the last shard and waits for every upload and receipt."""

    def __init__(self, dest: str, *, fmt: str = "megatron", dtype: Any = np.uint16, mask: bool = False,
                 shard_tokens: int = 1 << 28, name: str = "shard", start_shard: int = 0,
                 storage_options: Mapping[str, Any] | None = None, config: FetchConfig | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        if fmt not in FORMATS:
            raise SpecError(f"token shards: format must be one of {FORMATS}, got {fmt!r}")
        if shard_tokens < 1:
            raise SpecError(f"token shards: shard_tokens must be >= 1, got {shard_tokens}")
        self.dest, self.fmt, self.mask, self.name = dest.rstrip("/"), fmt, mask, name
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.meta = dict(meta or {})
        self.config = config or FetchConfig()
        self.uploader = Uploader(split_url(dest)[0], storage_options, config=self.config, progress=False)
        self.next_index = start_shard
        self.written: list[int] = []  # shards written by this writer, in order
        self.documents = self.tokens = 0
        self._shard: _Shard | None = None
        self._lock = threading.Lock()
        self._waiting: dict[int, set[str]] = {}  # shard -> its files not yet published
        self._receipts: dict[int, dict] = {}  # shard -> its receipt, to submit once its files are up

    # ---- the caller's side -------------------------------------------------------------------

    def __enter__(self) -> TokenShardWriter:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            self._abandon()
            self.uploader.close(cancel=True)
            return
        try:
            self.finish()
        finally:
            self.uploader.close()

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None, unit: int,
            first: int = 0) -> None:
        """The documents of input unit ``unit`` from its document ``first`` to its end, laid back
        to back (``lengths`` tokens each; ``mask``: their loss masks, likewise). A shard closes
        after the document that fills it."""
        if self.mask and (mask is None or len(mask) != len(tokens)):
            raise SpecError("token shards: a loss mask of the documents' length is needed for every document")
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        if int(bounds[-1]) != len(tokens):
            raise SpecError(f"token shards: lengths add up to {int(bounds[-1])} tokens, not {len(tokens)}")
        n, i = len(lengths), 0
        while i < n:
            shard = self._shard or self._open()
            need = self.shard_tokens - shard.tokens  # > 0: a full shard is closed at once
            j = min(max(int(np.searchsorted(bounds, bounds[i] + need, "left")), i + 1), n)
            a, b = int(bounds[i]), int(bounds[j])
            if self.fmt == "parquet":
                shard.parts.extend(np.split(tokens[a:b], bounds[i + 1:j] - a))
                if self.mask:
                    assert mask is not None
                    shard.masks.extend(np.split(np.asarray(mask[a:b], np.uint8), bounds[i + 1:j] - a))
            else:
                shard.sinks["bin"].write(tokens[a:b].tobytes())
                if self.mask:
                    assert mask is not None
                    shard.sinks["mask"].write(np.asarray(mask[a:b], np.uint8).tobytes())
            shard.lengths.extend(int(x) for x in lengths[i:j])
            shard.tokens += b - a
            i = j
            if shard.tokens >= self.shard_tokens:
                self._close((unit + 1, 0) if i == n else (unit, first + i))

    def finish(self, end: tuple[int, int] | None = None) -> None:
        """Publish the shard being written (if any) and wait for every file and receipt."""
        if self._shard is not None:
            if end is None:
                raise SpecError("token shards: finish() needs the input position after the last document")
            self._close(end)
        self.uploader.wait()
        self._submit_receipts()
        self.uploader.wait()
        if self._receipts:  # (every file was published: a receipt left is a bug)
            raise SpecError(f"token shards: receipts of shards {sorted(self._receipts)} were not written")

    # ---- shards ------------------------------------------------------------------------------

    def _url(self, base: str) -> str:
        return _join(self.dest, base)

    def _open(self) -> _Shard:
        shard = _Shard(self.next_index)
        self.next_index += 1
        if self.fmt == "megatron":
            names = shard_files(self.fmt, self.name, shard.index, self.mask)
            for key, base in (("bin", names[0]), *((("mask", names[1]),) if self.mask else ())):
                shard.spools[base] = self.uploader.spool_path(self._url(base))
                shard.sinks[key] = open(shard.spools[base], "wb")  # noqa: SIM115 - closed in _close
        self._shard = shard
        return shard

    def _close(self, end: tuple[int, int]) -> None:
        shard, self._shard = self._shard, None
        assert shard is not None
        names = shard_files(self.fmt, self.name, shard.index, self.mask)
        if self.fmt == "parquet":
            spool = self.uploader.spool_path(self._url(names[0]))
            shard.spools[names[0]] = spool
            self._write_parquet(shard, spool)
        else:
            for sink in shard.sinks.values():
                sink.close()
            spool = self.uploader.spool_path(self._url(names[-1]))
            shard.spools[names[-1]] = spool
            with open(spool, "wb") as f:
                f.write(idx_bytes(shard.lengths, self.dtype))
        sizes = {base: os.path.getsize(path) for base, path in shard.spools.items()}
        receipt = {"format": self.fmt, "shard": shard.index, "files": {b: sizes[b] for b in names},
                   "documents": len(shard.lengths), "tokens": shard.tokens, "dtype": str(self.dtype.name),
                   "end": list(end), **self.meta}
        with self._lock:
            self._waiting[shard.index] = set(names)
            self._receipts[shard.index] = receipt
        for base in names:
            self.uploader.submit(shard.spools[base], self._url(base), self._published_by(shard.index, base))
        self.written.append(shard.index)
        self.documents += len(shard.lengths)
        self.tokens += shard.tokens
        self._submit_receipts()

    def _published_by(self, index: int, base: str) -> Any:
        def done(_: Uploaded) -> None:
            with self._lock:
                self._waiting[index].discard(base)
        return done

    def _submit_receipts(self) -> None:
        """Submit the receipt of every shard whose files are all published (RECEIPT-LAST; in the
        writer's thread)."""
        with self._lock:
            ready = [i for i, left in self._waiting.items() if not left]
            for i in ready:
                del self._waiting[i]
        for i in sorted(ready):
            receipt = self._receipts.pop(i)
            url = _join(self.dest, f"{JOB_DIR}/{self.name}-{i:06d}.json")
            spool = self.uploader.spool_path(url)
            with open(spool, "w") as f:
                json.dump(receipt, f, sort_keys=True)
            self.uploader.submit(spool, url)

    def _write_parquet(self, shard: _Shard, spool: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = [("tokens", shard.parts, pa.int32())] + ([("loss_mask", shard.masks, pa.uint8())]
                                                            if self.mask else [])
        schema = pa.schema([(col, pa.list_(kind)) for col, _, kind in columns])
        with pq.ParquetWriter(spool, schema) as writer:
            start = 0
            while start < len(shard.parts):  # row groups of whole documents, cut by tokens
                stop, held = start, 0
                while stop < len(shard.parts) and held < ROW_GROUP_TOKENS:
                    held += len(shard.parts[stop])
                    stop += 1
                arrays = [_lists(docs[start:stop], kind) for _, docs, kind in columns]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=stop - start)
                start = stop

    def _abandon(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        for sink in shard.sinks.values():
            sink.close()
        for path in shard.spools.values():
            try:
                os.remove(path)
            except OSError:
                pass


def _lists(docs: list[np.ndarray], kind: Any) -> Any:
    import pyarrow as pa

    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(docs) if docs else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                    pa.array(values.astype(kind.to_pandas_dtype()), kind))
