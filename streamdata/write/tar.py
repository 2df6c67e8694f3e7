"""``ShardWriter``: WebDataset-style tar shards written to any fsspec URL, uploaded in the background.

Semantics follow ``webdataset.ShardWriter``: ``write(sample)`` takes a dict with ``__key__`` and
one entry per extension, encoded the way webdataset's ``TarWriter`` encodes them (its own
encoder: ``bytes`` as is, ``str`` as UTF-8, ``int``/``float`` as text for ``cls``, ``dict`` as
JSON, numpy arrays as ``.npy``, torch tensors as ``.pth``, images by extension...), members in
sorted order, ``__``-keys left out unless ``keep_meta``; the URL pattern takes the shard number
(``"s3://bkt/train-%06d.tar"`` or ``"...-{shard:06d}.tar"``). A new shard starts when the
current one holds ``maxcount`` samples, or when the next sample would take it past ``maxsize``
bytes of tar (uncompressed; a single larger sample gets a shard of its own). Unlike webdataset,
no empty shard is written for a writer that gets no sample.

Each finished shard is closed in a local spool file and handed to :class:`~streamdata.write.upload.Uploader`
(PUBLISH-WHOLE: a temporary key, then moved into place); ``write`` goes on with the next shard
while up to ``concurrency`` uploads run, and blocks while ``max_pending`` are unfinished, so
memory and spool space stay bounded. ``close()`` (or leaving the ``with`` block) finishes the
last shard, waits for every upload, raises the first failure as our error naming the shard URL,
and writes the sample index (``index.write_index``): the byte offset of every sample, recorded
as it is written (:attr:`ShardWriter.entries`, for a caller that writes one index for several writers:
``integrations.ray``). Compressed shards (``compress="gz"`` / ``"zst"``, or a ``.tar.gz``/``.tgz``/
``.tar.zst`` pattern) are not in the index: offsets into them cannot be read by range, so they
are split by shard and read whole.
"""

from __future__ import annotations

import io
import logging
import tarfile
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from streamdata.config import FetchConfig
from streamdata.errors import SpecError, StreamDataError
from streamdata.formats.compress import codec_from_suffix
from streamdata.store.urls import split_url
from streamdata.write.upload import DEFAULT_PART_SIZE, Uploaded, Uploader

if TYPE_CHECKING:
    from streamdata.catalog.index import ShardEntry

__all__ = ["ShardWriter"]

log = logging.getLogger("streamdata")
_BLOCK = 512
_CODECS = {"gz": "gz", "gzip": "gz", "zst": "zst", "zstd": "zst"}


def _padded(n: int) -> int:
    return (n + _BLOCK - 1) // _BLOCK * _BLOCK


def _member_bytes(name: str, size: int) -> int:
    """Bytes a regular member takes: its header, its padded data, and a pax header before it
    when the name is not short ASCII (a generous estimate of the pax record's length)."""
    raw = name.encode("utf-8", "surrogateescape")
    pax = 0 if len(raw) <= 100 and name.isascii() else _BLOCK + _padded(len(raw) + 32)
    return pax + _BLOCK + _padded(size)


def _shard_url(pattern: str, shard: int) -> str:
    if "{shard" in pattern:
        return pattern.format(shard=shard)
    return pattern % shard


def _codec(pattern: str, compress: str | bool | None) -> str | None:
    if compress is None:  # by the pattern's suffix, as the reader guesses it
        return _CODECS.get(codec_from_suffix(pattern) or "")
    if compress is False:
        return None
    if compress is True:
        return "gz"
    if compress not in _CODECS:
        raise SpecError(f"ShardWriter: compress must be None, 'gz' or 'zst', got {compress!r}")
    return _CODECS[compress]


class _OpenShard:
    """One shard being written: a spool file, maybe a compressor, a streaming tar writer."""

    def __init__(self, url: str, spool: str, codec: str | None, level: int | None) -> None:
        self.url, self.spool, self.codec = url, spool, codec
        self.file = open(spool, "wb")  # noqa: SIM115 - closed in close()
        if codec == "gz":
            from isal import igzip

            options = {} if level is None else {"compresslevel": level}
            self.sink: Any = igzip.IGzipFile(fileobj=self.file, mode="wb", mtime=0, **options)
        elif codec == "zst":
            import zstandard

            self.sink = zstandard.ZstdCompressor(level=3 if level is None else level,
                                                 write_checksum=True).stream_writer(self.file, closefd=False)
        else:
            self.sink = self.file
        # pax: plain ustar headers (as webdataset writes) for short ASCII names, a pax header
        # before a longer or non-ASCII one (ustar alone refuses names past 256 bytes)
        self.tar = tarfile.open(fileobj=self.sink, mode="w|", format=tarfile.PAX_FORMAT)
        self.offsets: list[int] = []  # where each sample's first header starts (uncompressed)

    @property
    def size(self) -> int:
        return self.tar.offset

    def close(self) -> None:
        self.offsets.append(self.tar.offset)  # the end-of-archive marker starts here
        self.tar.close()
        if self.sink is not self.file:
            self.sink.close()
        self.file.close()

    def discard(self) -> None:
        import contextlib
        import os

        with contextlib.suppress(Exception):
            self.tar.close()
        with contextlib.suppress(Exception):
            self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.spool)


class ShardWriter:
    """Write samples to tar shards at ``pattern`` (any fsspec URL); see the module docstring.

    ``storage_options`` go to fsspec; fetch options (``timeout``, ``retry_deadline``,
    ``retries``, ``backoff``, ``backoff_cap``) bound and retry each upload like a read.
    ``concurrency`` uploads run at once, ``max_pending`` finished shards may wait; S3 objects of
    at least ``2 * part_size`` bytes go up as multipart uploads. ``publish``: ``"put"`` (the default
    on S3 and GCS, whose uploads appear whole) or ``"copy"`` (a temporary key copied into place;
    the default elsewhere), see ``upload``. ``index=True`` writes the sample
    index next to the shards at ``close()``. ``progress``: a bar of shards uploaded (``None``:
    when stderr is a terminal). After ``close()``, :attr:`urls` lists the shards written.
    """

    def __init__(self, pattern: str, maxcount: int = 100_000, maxsize: float = 3e9, *,
                 storage_options: Mapping[str, Any] | None = None, compress: str | bool | None = None,
                 compresslevel: int | None = None, index: bool = True, start_shard: int = 0,
                 encoder: bool | Callable[[dict], dict] | dict = True, keep_meta: bool = False,
                 user: str = "bigdata", group: str = "bigdata", mode: int = 0o444,
                 mtime: float | None = None, concurrency: int = 4, max_pending: int = 4,
                 part_size: int = DEFAULT_PART_SIZE, tmpdir: str | None = None,
                 progress: bool | None = None, publish: str | None = None,
                 fetch_config: FetchConfig | None = None,
                 **fetch_options: Any) -> None:
        if maxcount < 1 or maxsize <= 0:
            raise SpecError(f"ShardWriter: maxcount and maxsize must be positive, got {maxcount}, {maxsize}")
        try:
            first = _shard_url(pattern, start_shard)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise SpecError(f"ShardWriter: bad pattern {pattern!r} ({exc}): use '%06d' or '{{shard:06d}}' "
                            "for the shard number, e.g. 's3://bkt/train-%06d.tar'") from None
        if first == _shard_url(pattern, start_shard + 1):
            raise SpecError(f"ShardWriter: pattern {pattern!r} has no shard number: use '%06d' or "
                            "'{shard:06d}', e.g. 's3://bkt/train-%06d.tar'")
        from webdataset.writer import make_encoder

        self.pattern, self.maxcount, self.maxsize = pattern, maxcount, maxsize
        self.codec = _codec(pattern, compress)
        self.compresslevel = compresslevel
        self.index = index
        self.storage_options = dict(storage_options or {})
        self.keep_meta, self.user, self.group, self.mode = keep_meta, user, group, mode
        self.mtime = int(time.time() if mtime is None else mtime)  # an int: no pax mtime record
        self._encode = make_encoder(encoder)
        config = FetchConfig.resolve(fetch_config, self, **fetch_options)
        self._protocol = split_url(first)[0]
        self._uploader = Uploader(self._protocol, self.storage_options, config=config,
                                  concurrency=concurrency, max_pending=max_pending, part_size=part_size,
                                  tmpdir=tmpdir, progress=progress, desc="shards uploaded",
                                  publish=publish)
        self._next = start_shard
        self._shard: _OpenShard | None = None
        self._count = 0
        self._offsets: dict[str, list[int]] = {}  # url -> offsets of its samples and of its end
        self.total = 0  # samples written
        self.urls: list[str] = []  # shards finished, in order
        self.entries: list[ShardEntry] = []  # after close(): the index's entries of the shards (uncompressed)
        self._closed = False

    # ---- writing --------------------------------------------------------------------------

    def write(self, sample: Mapping[str, Any]) -> int:
        """Encode and append one sample; returns its payload bytes (as webdataset's does)."""
        if self._closed:
            raise SpecError("ShardWriter.write after close()")
        members = self._members(sample)
        need = sum(_member_bytes(name, len(data)) for name, data in members)
        shard = self._shard
        if shard is not None and (self._count >= self.maxcount
                                  or shard.size + need + 2 * _BLOCK > self.maxsize):
            self._finish()
            shard = None
        if shard is None:
            shard = self._open()
        shard.offsets.append(shard.size)
        payload = 0
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), self.mtime, self.mode
            info.uname, info.gname = self.user, self.group
            shard.tar.addfile(info, io.BytesIO(data))
            payload += len(data)
        self._count += 1
        self.total += 1
        return payload

    def _members(self, sample: Mapping[str, Any]) -> list[tuple[str, bytes]]:
        if "__key__" not in sample:
            raise SpecError(f"ShardWriter.write: the sample has no '__key__' (fields: {sorted(sample)})")
        encoded = self._encode(dict(sample))
        key = encoded["__key__"]
        out = []
        for field in sorted(encoded):
            if field == "__key__" or (field.startswith("_") and not self.keep_meta):
                continue
            value = encoded[field]
            if isinstance(value, str):
                value = value.encode("utf-8")
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise SpecError(f"ShardWriter.write: field {field!r} of sample {key!r} is "
                                f"{type(value).__name__} after encoding, not bytes: name it by an "
                                "extension the encoder knows (npy, json, pth, cls, txt, png...)")
            out.append((f"{key}.{field}", bytes(value)))
        return out

    def _open(self) -> _OpenShard:
        url = _shard_url(self.pattern, self._next)
        self._next += 1
        self._shard = _OpenShard(url, self._uploader.spool_path(url), self.codec, self.compresslevel)
        self._count = 0
        return self._shard

    def _finish(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        shard.close()
        self._offsets[shard.url] = shard.offsets
        self.urls.append(shard.url)
        self._uploader.submit(shard.spool, shard.url)

    # ---- closing --------------------------------------------------------------------------

    @property
    def retried(self) -> dict[str, int]:
        """Uploads tried again so far, per reason (``metrics.RETRY_REASONS``)."""
        return dict(self._uploader.retried)

    def close(self) -> list[str]:
        """Finish the last shard, wait for every upload, write the index; returns the shard URLs.
        Raises the first failure (our error, naming the shard's URL)."""
        if self._closed:
            return list(self.urls)
        self._closed = True
        try:
            self._finish()
            uploaded = self._uploader.wait()
            if self.codec is None:
                self.entries = self._entries(uploaded)
            if self.index and self.entries:
                from streamdata.catalog.index import default_index_url, write_index

                write_index(default_index_url([e.name for e in self.entries]), self.entries,
                            storage_options=self.storage_options, config=self._uploader.config)
        except BaseException:
            self._abandon()
            raise
        finally:
            self._uploader.close()
        return list(self.urls)

    def _discard_open_shard(self) -> None:
        if self._shard is not None:
            self._shard.discard()
            self._shard = None

    def _abandon(self) -> None:
        self._discard_open_shard()
        self._uploader.close(cancel=True)

    def _entries(self, uploaded: list[Uploaded]) -> list[ShardEntry]:
        """The index entries of the shards now in place: the offsets recorded while writing."""
        import numpy as np

        from streamdata.catalog.index import ShardEntry

        by_url = {u.url: u for u in uploaded}
        return [ShardEntry(url, by_url[url].size, by_url[url].etag, len(self._offsets[url]) - 1,
                           np.asarray(self._offsets[url], dtype=np.uint64))
                for url in self.urls if url in by_url]

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._discard_open_shard()  # the block failed: finished shards still go up
        try:
            self.close()
        except StreamDataError as err:
            log.error("streamdata: ShardWriter closed after an error; an upload failed too: %s", err)

    def __repr__(self) -> str:
        return f"ShardWriter({self.pattern!r}, {len(self.urls)} shards, {self.total} samples)"
