"""The local disk cache: fetched objects and byte ranges kept on disk as they stream.

With ``cache_dir=`` (``FetchConfig``), the parts the prefetcher fetches for an item (a whole
shard, or a Parquet/Arrow unit's byte ranges) are also written to a file in the directory as
they arrive, no second download and no wait added; the next epoch reads the item from disk
with no request. One file per entry, ``<key>.sdc``, the key a hash of the URL, the ranges,
the object's size and its ETag when known. An entry is its data, then a segment table (one
``u32`` length and ``u32`` CRC-32 per piece of at most ``SEGMENT`` bytes), then a 32-byte
footer: ``b"SDCACHE1"``, ``u64`` data bytes, ``u64`` segments, ``u32`` CRC-32 of the table,
``u32`` zero.

Invariant (CACHE-PUBLISH): readers open only published names (``<key>.sdc``). A writer fills
``<key>.tmp`` while it holds an exclusive ``flock`` on it, and renames it into place once every
byte and the table are written (``rename`` replaces atomically). A second process fetching
the same item at once finds the file locked and only streams; no lock is ever waited for,
except the directory's eviction lock, polled for at most ``LOCK_WAIT_S``. Within one process,
a second pass over an item this process is writing (the next pass, started before the current
one ends: NEXT-EPOCH-EARLY) waits for that writer instead (``being_written``; the prefetcher
bounds the wait), then reads the entry: one download, one miss. A reader keeps the
entry it opened: an entry evicted or replaced meanwhile stays readable through its descriptor.

Invariant (CACHE-VERIFY): an entry whose footer, table or size does not match is deleted and
fetched again; a segment whose CRC does not match is never handed on: the reader deletes the
entry and fetches the rest of the item from the store. Each is counted (``cache.corrupt``).

Eviction (LRU): a hit touches the entry's mtime; after each publish, while the directory holds
more than ``cache_limit`` bytes, the least recently used entries are deleted. An item larger
than the limit is not cached. Any ``OSError`` while writing (a full disk, a read-only
directory) warns once per process, counts ``cache.errors`` (once per reader pass) and stops
this process's writing to that directory: it streams as without a cache, and still serves
entries already there. A read error (not a missing entry) is counted too, and the item fetched.

Threads: lookups run on the reader's I/O loop, writes (publish, eviction) on the prefetcher's
disk thread; ``Cache.count`` takes a lock: one writer at a time (ONE-WRITER-PER-ROW).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
import warnings
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence

from streamdata.fetch.cachefiles import SUFFIX, TMP, flock_within, same_file, scan, unlink_if_same
from streamdata.metrics import CACHE_EVENTS, Counters
from streamdata.redact import redact

try:  # the same CRC-32 as zlib's, 4x faster (isal is a dependency for gzip shards)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal missing: zlib's
    _crc32 = zlib.crc32

__all__ = ["SEGMENT", "Cache", "CorruptEntry", "Entry", "Writer", "cache_key", "cached_object"]

SEGMENT = 1 << 20  # bytes per checksummed segment: what a reader verifies before handing on
LOCK_WAIT_S = 2.0  # the longest wait for the directory's eviction lock; then eviction waits a turn
_MAGIC = b"SDCACHE1"
_FOOTER = struct.Struct("<8sQQII")
_SEG = struct.Struct("<II")
_LOCK_NAME = ".streamdata-cache.lock"

_stopped: dict[str, int] = {}  # directory: pid that stopped writing there (a fork decides anew)
# entry path: (pid, set once its writer published or dropped it); a fork's copies are not its own
_writing: dict[str, tuple[int, threading.Event]] = {}
_writing_lock = threading.Lock()

Range = tuple[int, int]


class CorruptEntry(Exception):
    """A cache entry that does not match its footer, table or checksums (at byte ``offset``)."""

    def __init__(self, message: str, offset: int = 0) -> None:
        super().__init__(message)
        self.offset = offset


def cache_key(url: str, ranges: Sequence[Range], size: int | None, etag: str | None) -> str:
    """The entry name for ``ranges`` of ``url`` (object ``size`` and ``etag``, when known)."""
    material = json.dumps([url, [list(r) for r in ranges], size, etag], separators=(",", ":"))
    return hashlib.sha256(material.encode("utf-8", "surrogateescape")).hexdigest()[:40]


def _segments(data: Sequence[bytes | memoryview]) -> list[tuple[int, int]]:
    """``(length, crc)`` of consecutive pieces of at most ``SEGMENT`` bytes of ``data``'s chunks."""
    out: list[tuple[int, int]] = []
    n = crc = 0
    for chunk in data:
        view = memoryview(chunk)
        while view:
            take = view[:SEGMENT - n]
            crc, n, view = _crc32(take, crc), n + len(take), view[len(take):]
            if n == SEGMENT:
                out.append((n, crc))
                n = crc = 0
    if n:
        out.append((n, crc))
    return out


class Cache:
    """One process's handle on a cache directory (shared with every other process of the node)."""

    def __init__(self, directory: str, limit: int | None = None, counters: Counters | None = None) -> None:
        self.directory = directory
        self.limit = limit
        self.counters = counters  # the dataset's shared counters (cache.*), if any
        self.stats = dict.fromkeys(CACHE_EVENTS, 0)  # this handle's own counts
        self._lock = threading.Lock()  # lookups count on the loop, writes on the disk thread
        self._failed = False
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            self.fail(exc, "create the cache directory")

    def count(self, event: str, n: int = 1) -> None:
        """Add to ``cache.<event>``; one thread at a time (ONE-WRITER-PER-ROW in ``metrics``)."""
        with self._lock:
            self.stats[event] += n
            if self.counters is not None:
                self.counters.add(f"cache.{event}", n)

    @property
    def writing(self) -> bool:
        """False once this process met an ``OSError`` writing here (it streams from then on)."""
        return _stopped.get(self.directory) != os.getpid()

    def fail(self, exc: OSError, doing: str) -> None:
        """An ``OSError`` while writing: counted once per handle (a reader's pass); the first in
        this process warns and stops its writing here."""
        if not self._failed:
            self._failed = True
            self.count("errors")
        if self.writing:
            _stopped[self.directory] = os.getpid()
            warnings.warn(f"streamdata cache: could not {doing} in {self.directory} ({redact(str(exc))}); "
                          "this process reads without caching from now on (free space, or fix the "
                          "directory's permissions, or pass another cache_dir)", RuntimeWarning, stacklevel=2)

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    # ---- reading ----------------------------------------------------------------------------

    def lookup(self, key: str, length: int) -> Entry | None:
        """The published entry ``key`` of ``length`` data bytes, opened and its table checked
        (a hit, its mtime touched for LRU); ``None`` if absent or corrupt (deleted) (a miss)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                self.count("errors")  # a read error (EACCES, EIO): fetched instead
            self.count("misses")
            return None
        try:
            entry = Entry(path, fd, length)
        except (CorruptEntry, OSError) as exc:
            unlink_if_same(path, fd)
            os.close(fd)
            self.count("corrupt" if isinstance(exc, CorruptEntry) else "errors")
            self.count("misses")
            return None
        try:
            os.utime(path)  # LRU: least recently used = oldest mtime
        except OSError:
            pass  # evicted meanwhile: the open descriptor still reads it
        self.count("hits")
        return entry

    # ---- writing ----------------------------------------------------------------------------

    def writer(self, key: str, length: int) -> Writer | None:
        """A writer for entry ``key`` (CACHE-PUBLISH), or ``None``: not writing, too large for
        the limit, already published, or another process is writing it (then just stream)."""
        table = -(-length // SEGMENT) * _SEG.size + _FOOTER.size if length else _FOOTER.size
        if not self.writing or (self.limit is not None and length + table > self.limit):
            return None
        final = self.path(key)
        tmp = final[: -len(SUFFIX)] + TMP
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self.fail(exc, "create a cache file")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process writes this entry: stream only
            os.close(fd)
            return None
        # the name may have moved on between open and lock: published (renamed), or deleted
        # as abandoned and made again by another writer; then this file is not ours to fill
        if not same_file(tmp, fd) or os.path.exists(final):
            os.close(fd)
            return None
        try:
            os.ftruncate(fd, 0)  # what a writer that died left here
        except OSError as exc:
            os.close(fd)
            self.fail(exc, "write a cache file")
            return None
        return Writer(self, final, tmp, fd, length)

    def being_written(self, key: str) -> threading.Event | None:
        """If this process is writing entry ``key`` now: an event set once it is published or dropped."""
        with _writing_lock:
            pid, done = _writing.get(self.path(key), (None, None))
        return done if pid == os.getpid() else None

    def evict(self, keep: str | None = None) -> None:
        """Delete least recently used entries while the directory holds more than the limit
        (files being written count; abandoned ones are deleted). Skipped, not waited for,
        when another process holds the eviction lock longer than ``LOCK_WAIT_S``."""
        if self.limit is None:
            return
        try:
            lock = os.open(os.path.join(self.directory, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                           0o644)
        except OSError as exc:
            self.fail(exc, "open the cache's lock file")
            return
        try:
            if not flock_within(lock, LOCK_WAIT_S):
                return  # the next publish evicts
            try:
                entries, total = scan(self.directory)
            except OSError as exc:
                self.fail(exc, "list the cache directory")
                return
            for _, path, size in entries:
                if total <= self.limit:
                    break
                if path == keep:
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self.fail(exc, "evict a cache entry")
                    return
                total -= size
                self.count("evictions")
        finally:
            os.close(lock)  # releases the flock


class Entry:
    """A published entry, open for reading: its data, verified segment by segment."""

    def __init__(self, path: str, fd: int, length: int) -> None:
        self.path = path
        self.length = length
        self.ranges: Sequence[Range] = ((0, length),)  # where its bytes are in the object
        self._fd: int | None = fd
        size = os.fstat(fd).st_size
        if size < _FOOTER.size:
            raise CorruptEntry(f"cache entry {path} is {size} bytes: shorter than its footer")
        magic, data, n, table_crc, _ = _FOOTER.unpack(os.pread(fd, _FOOTER.size, size - _FOOTER.size))
        if magic != _MAGIC or data != length or size != data + n * _SEG.size + _FOOTER.size:
            raise CorruptEntry(f"cache entry {path}: footer does not match ({size} bytes, "
                               f"{data} of {length} data bytes)")
        table = os.pread(fd, n * _SEG.size, data)
        if len(table) != n * _SEG.size or _crc32(table) != table_crc:
            raise CorruptEntry(f"cache entry {path}: segment table damaged", data)
        self.segments = [_SEG.unpack_from(table, i * _SEG.size) for i in range(n)]
        if sum(length for length, _ in self.segments) != data:
            raise CorruptEntry(f"cache entry {path}: segments do not add up to {data} bytes")

    def blocks(self) -> Iterator[bytes]:
        """The data in order, each piece checked against its CRC before it is yielded
        (CACHE-VERIFY); ``CorruptEntry`` at the first that does not match."""
        offset = 0
        for length, crc in self.segments:
            if self._fd is None:
                raise CorruptEntry(f"cache entry {self.path} was closed while read", offset)
            block = os.pread(self._fd, length, offset)
            if len(block) != length or _crc32(block) != crc:
                raise CorruptEntry(f"cache entry {self.path}: checksum mismatch at byte {offset}", offset)
            yield block
            offset += length

    def read(self) -> bytes:
        return b"".join(self.blocks())

    def discard(self) -> None:
        """Delete the entry (if its name still holds this file): it is corrupt."""
        if self._fd is not None:
            unlink_if_same(self.path, self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class Writer:
    """One entry being filled as its parts arrive, in any order (CACHE-PUBLISH)."""

    def __init__(self, cache: Cache, final: str, tmp: str, fd: int, length: int) -> None:
        self.cache = cache
        self.final, self.tmp = final, tmp
        self.length = length
        self.written = 0
        self._fd: int | None = fd
        self._segments: dict[int, list[tuple[int, int]]] = {}  # part offset: its segments
        self._done = threading.Event()  # set once published or dropped (``Cache.being_written``)
        with _writing_lock:
            _writing[final] = (os.getpid(), self._done)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def write(self, offset: int, data: bytes | Sequence[bytes]) -> None:
        """Write one part (``bytes``, or the chunks it arrived in) at ``offset`` of the data;
        publish once every byte is written. An ``OSError`` aborts the entry (``Cache.fail``)."""
        if self._fd is None:
            return
        chunks: Sequence[bytes | memoryview]
        chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
        try:
            pos = offset
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(self._fd, view, pos)
                    view, pos = view[n:], pos + n
            if pos > self.length or offset in self._segments:
                raise CorruptEntry(f"part at {offset} does not fit the entry")
            self._segments[offset] = _segments(chunks)
            self.written += pos - offset
            if self.written == self.length:
                self.publish()
        except CorruptEntry:
            self.abort()  # a fetcher's bug, not the disk's: no entry, no warning
        except OSError as exc:
            self.abort()
            self.cache.fail(exc, "write a cache file")

    def publish(self) -> None:
        """Write the table and footer, check the size, rename into place, then evict."""
        fd = self._fd
        assert fd is not None
        table = b"".join(_SEG.pack(*s) for off in sorted(self._segments) for s in self._segments[off])
        footer = _FOOTER.pack(_MAGIC, self.length, len(table) // _SEG.size, _crc32(table), 0)
        limit = self.cache.limit
        if limit is not None and self.length + len(table) + len(footer) > limit:
            raise CorruptEntry("larger than the whole cache_limit")  # not cached (writer() estimated)
        os.pwrite(fd, table + footer, self.length)
        if os.fstat(fd).st_size != self.length + len(table) + len(footer):
            raise CorruptEntry(f"{self.tmp} is not the size written")
        os.rename(self.tmp, self.final)
        self._fd = None
        os.close(fd)  # releases the flock
        self._finish()
        self.cache.evict(keep=self.final)

    def abort(self) -> None:
        """Delete the unfinished file (if the name is still ours) and release it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            unlink_if_same(self.tmp, fd)
            os.close(fd)
        self._finish()

    def _finish(self) -> None:
        """Published or dropped: a pass waiting for this entry (``being_written``) goes on."""
        with _writing_lock:
            if _writing.get(self.final, (None, None))[1] is self._done:
                del _writing[self.final]
        self._done.set()


async def cached_object(cache: Cache | None, url: str, size: int | None, etag: str | None,
                        fetch: Callable[[], Awaitable[bytes]]) -> bytes:
    """A whole object from the cache, else ``await fetch()`` and keep it (``ObjectDataset``)."""
    if cache is None or size is None:
        return await fetch()
    key = cache_key(url, ((0, size),), size, etag)
    entry = cache.lookup(key, size)
    if entry is not None:
        try:
            return entry.read()
        except (CorruptEntry, OSError) as exc:
            entry.discard()
            cache.count("corrupt" if isinstance(exc, CorruptEntry) else "errors")
        finally:
            entry.close()
    data = await fetch()
    writer = cache.writer(key, size) if len(data) == size else None
    if writer is not None:
        writer.write(0, data)
        writer.abort()  # published by now, unless it failed
    return data
