"""The prefetcher's disk side: items looked up in the local cache, and the parts of the others
written to it as they arrive (CACHE-PUBLISH, CACHE-VERIFY in ``streamdata.fetch.cache``).

Parts go to the disk by a thread of their own, after the reader has them, so the prefetcher's
loop never waits for the disk. Parts queued for it hold at most ``queue_limit`` bytes (the
byte budget) more; past that, an item is streamed without being cached.

Every method but ``close`` runs on the prefetcher's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamdata._compat import executor_threads
from streamdata.fetch.cache import Cache, Entry, Writer, cache_key
from streamdata.store.client import Chunks
from streamdata.store.loop import wait_threads_gone

__all__ = ["CacheTee"]

_WRITTEN_POLL_S = 0.01  # how often a pass looks whether the entry it waits for is written


class CacheTee:
    """One prefetcher's cache: lookups, and one entry writer per item being fetched."""

    def __init__(self, cache: Cache, queue_limit: int, call_soon: Callable[..., Any],
                 wait_limit: float) -> None:
        self.cache = cache
        self._queue_limit = queue_limit
        self._call_soon = call_soon  # onto the prefetcher's loop
        self._wait_limit = wait_limit
        self._writers: dict[int, Writer] = {}  # item index: its cache entry being written
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="streamdata-cache")
        self._queued = 0  # bytes of parts handed to the disk thread, not yet written

    async def entry(self, index: int, url: str, ranges: Sequence[tuple[int, int]], size: int | None,
                    etag: str | None) -> Entry | None:
        """Item ``index``'s cache entry, opened, if the cache has it; else ``None``, and its parts
        will be written (``write``) when the cache takes a new entry of that length."""
        if not all(end is not None for _, end in ranges):
            return None
        length = sum(end - start for start, end in ranges)
        key = cache_key(url, ranges, size, etag)
        await self._written(key)
        entry = self.cache.lookup(key, length)
        if entry is not None:  # from disk: no request, no budget
            entry.ranges = ranges
            return entry
        writer = self.cache.writer(key, length)
        if writer is not None:
            self._writers[index] = writer
        return None

    async def _written(self, key: str) -> None:
        """While another pass of this process writes entry ``key`` (the pass this one follows,
        NEXT-EPOCH-EARLY), wait for it, at most half the reader's wait for a plan: then the
        lookup finds the entry (one download), or the item streams as before."""
        done = self.cache.being_written(key)
        if done is None:  # the common case: no pass of this process writes it
            return
        deadline = time.monotonic() + self._wait_limit / 2
        while not done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(_WRITTEN_POLL_S)

    def write(self, index: int, offset: int, data: bytes | Chunks, size: int) -> None:
        """Hand a part of item ``index`` to the disk thread, if its entry is being written; past
        ``queue_limit`` bytes queued, drop the item's entry instead (the disk is slower than
        the network)."""
        writer = self._writers.get(index)
        if writer is None:
            return
        if self._queued + size > self._queue_limit:
            self.abort(index)
            return
        self._queued += size

        def written(_: concurrent.futures.Future) -> None:  # on the loop
            self._queued -= size
            if not writer.active and self._writers.get(index) is writer:  # published, or failed
                del self._writers[index]

        self._disk.submit(writer.write, offset, data).add_done_callback(
            lambda f: self._call_soon(written, f))

    def abort(self, index: int) -> None:
        """Item ``index`` failed (or is not to be cached after all): drop its entry, after the
        parts already queued."""
        writer = self._writers.pop(index, None)
        if writer is not None:
            self._disk.submit(writer.abort)

    def close(self) -> None:
        """After the loop has stopped: write the parts queued (a pass that ends publishes its
        last items), join the disk thread, drop the entries left unfinished."""
        threads = executor_threads(self._disk)
        self._disk.shutdown(wait=True)
        wait_threads_gone(threads)
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()
