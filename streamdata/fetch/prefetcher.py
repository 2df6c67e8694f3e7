"""The per-worker prefetcher: keeps upcoming shards and byte ranges in flight.

One ``Prefetcher`` serves one reader (a DataLoader worker, or the main process with
``num_workers=0``).  It owns a ``LoopThread`` and a fresh async filesystem bound to it
(LOOP-AFTER-FORK, see ``store.loop``), and fetches the items it is given *in the order they will
be consumed*, as parts of at most ``part_size`` bytes, so that remote first-byte latency
overlaps parsing, decoding and training.

Invariant (BYTE-BUDGET): ``reserved`` counts bytes requested or fetched but not yet
released by the consumer.  A part is requested only while ``reserved + part <= budget``
or when nothing at all is reserved, so the fetcher never holds more than
``max(budget, one part)`` bytes. The budget starts at ``byte_budget`` and grows, up to
``byte_budget_max``, only where it held back a part the reader then waited for
(BUDGET-GROWTH, ``budget``); the window, the request limit and the part size are the
``Tuner``'s too (AUTOTUNE, ``tune``), which the scheduler reads as it goes and tells which
knob held a part back.  Parts are requested in consumption order, so the
part the consumer waits for is never queued behind later ones (no deadlock).

With ``cache_dir`` (``streamdata.fetch.cache``), an item found in the cache is served from disk
through the same ``ItemReader`` (no request, no budget); any other item's parts are also
written to the cache as they arrive (``tee``: CACHE-PUBLISH, CACHE-VERIFY).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import itertools
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple

from streamdata.config import FetchConfig
from streamdata.errors import StreamDataError
from streamdata.fetch.cache import Cache, CorruptEntry, Entry
from streamdata.fetch.parts import (
    FIRST_HOLD_MAX_S,
    Arrivals,
    Part,
    Range,
    first_parts,
    split_parts,
)
from streamdata.fetch.tail import Tail
from streamdata.fetch.tee import CacheTee
from streamdata.fetch.tune import Held, Tuner
from streamdata.metrics import KNOBS, Counters, StageClock
from streamdata.store.backends import translate_error
from streamdata.store.client import AsyncClient, Chunks, body_size
from streamdata.store.loop import wait_future
from streamdata.store.urls import Shard, split_url

__all__ = ["FetchItem", "ItemReader", "Prefetcher"]


class FetchItem(NamedTuple):
    """An object to fetch: whole (``ranges=None``) or only the given byte ranges, in order.
    ``etag`` (when the listing or index gave one) is part of the item's cache key."""

    url: str
    size: int | None = None
    ranges: tuple[Range, ...] | None = None
    etag: str | None = None


# an item's plan: its parts in order, each with the future that will hold its bytes
_Plan = collections.deque[Part]


_DONE: concurrent.futures.Future = concurrent.futures.Future()  # stands in for a consumed plan

_RELEASE_STEP = 1 << 20  # a reader gives budget back in steps this big (one wake-up each)


def _readers(protocol: str | None, config: FetchConfig) -> int:
    """The job's reading processes (RATE-SHARE, ``store.rate``: each paces its requests at its
    share of the job's rate): ranks times DataLoader workers, as this reader's world says; 1
    where no rate applies."""
    if protocol != "hf" and config.max_requests_per_s is None:
        return 1
    from streamdata.epoch.world import World
    from streamdata.errors import SpecError

    try:
        return World.current().slots
    except SpecError:
        return 1


def _arrived(first: Arrivals) -> bool:
    return first.done

class Prefetcher:
    """Fetch ``items`` ahead of the consumer; iterate to get one ``ItemReader`` per item.

    Fetching starts at construction, so the first requests are on the wire before the first
    byte is needed.  Always ``close()`` (or use as a context manager): it cancels requests,
    closes connections and joins the I/O thread.
    """

    def __init__(self, items: Sequence[FetchItem | Shard], storage_options: dict | None = None,
                 config: FetchConfig | None = None, *, where: str = "",
                 counters: Counters | None = None, stats: Counters | None = None) -> None:
        self.items = Tail(_as_item(i) for i in items)
        self.config = config or FetchConfig()
        self.where = where
        protocols = {split_url(i.url)[0] for i in self.items}
        if len(protocols) > 1:
            from streamdata.errors import SpecError

            raise SpecError(f"one dataset reads one protocol; got {sorted(protocols)}")
        self.protocol = protocols.pop() if protocols else None  # None: no item, a client for "file"
        self.client = AsyncClient(self.protocol or "file", storage_options,
                                  self.config, name="fetch",
                                  url=self.items[0].url if self.items else None, counters=counters,
                                  readers=_readers(self.protocol, self.config))
        self.stats = self.client.stats
        self.throttle = self.client.throttle  # READER-THROTTLE: .allowed now, .lowest so far
        cfg = self.config
        self._io = self.client.io
        self.cache = Cache(cfg.cache_dir, cfg.cache_limit, counters) if cfg.cache_dir else None
        self._tee = (CacheTee(self.cache, cfg.byte_budget, self._io.call_soon, self._wait_timeout())
                     if self.cache is not None else None)
        self.peak_reserved = 0
        self.tuner = Tuner(cfg, key=self.client.endpoint or self.client.protocol)  # AUTOTUNE
        self.budget = self.tuner.budget  # BUDGET-GROWTH
        self._counters = counters
        # READER_STATS (``metrics``): the parts fetched, written by the loop's thread; and the
        # pass's stage clock (``StageClock.acc``), where the reader's thread adds its waits
        self._stats = stats
        self.times: list[int] | None = None
        self._knobs = dict.fromkeys(KNOBS, 0)  # what this reader's row of ``knob.*`` holds now
        self._show_knobs()
        self.peak_inflight = 0  # parts in flight at once, at most (READER-THROTTLE bounds it)
        self._plans: Tail = Tail(concurrent.futures.Future() for _ in self.items)
        self._consumer = 0
        self._fence = 0  # the first item ``extend`` queued last: past it, wait for the reader
        self._reserved = 0
        self._inflight = 0
        self._closed = False
        self._wake = asyncio.Event()
        self._io.close_at_exit(self.close)  # CLOSE-AT-EXIT: the cache's entries and files too
        self._scheduler = self._io.submit(self._schedule())

    # ---- consumer side (the reader's thread) -------------------------------------------

    def __iter__(self) -> Iterator[ItemReader]:
        return self.readers(0, len(self.items))

    def readers(self, start: int, stop: int) -> Iterator[ItemReader]:
        """One ``ItemReader`` for each of items ``start`` to ``stop`` (one pass's, ``extend``)."""
        for index in range(start, stop):
            yield ItemReader(self, index)

    def extend(self, items: Sequence[FetchItem | Shard]) -> int:
        """Queue ``items`` after those already given (NEXT-EPOCH-EARLY: the next pass of a
        persistent worker); the index of the first of them. They are fetched in order, on the
        same connections and within the same byte budget: the first of them as soon as every
        part before it is requested, the others once the reader has taken the last item before
        them (a job that ends after this pass fetches one item it does not read, not a budget's
        worth).
        The items before the last ``extend``'s, all taken, are let go (indices stay as they
        were): a prefetcher that serves pass after pass holds two passes' items, not every
        epoch's. Call it from the reader's thread: the only one besides the loop that reads
        the lists, and it waits here while the loop changes them.
        """
        more = [_as_item(i) for i in items]
        if any(split_url(i.url)[0] != (self.protocol or "file") for i in more):
            from streamdata.errors import SpecError

            raise SpecError("extend() takes items of the protocol the prefetcher was made for "
                            f"({self.protocol or 'none: it was made without items'})")

        async def add() -> int:  # on the loop, where the scheduler reads the lists
            if self._consumer >= self._fence and all(
                    self._plans[i] is _DONE for i in range(self._plans.base, self._fence)):
                self.items.drop_before(self._fence)
                self._plans.drop_before(self._fence)
            start = len(self.items)
            self._plans.extend(concurrent.futures.Future() for _ in more)
            self.items.extend(more)
            self._fence = start
            self._wake.set()
            return start

        return wait_future(self._io.submit(add()), self._wait_timeout(), what="queueing the next pass",
                           url=more[0].url if more else "", check=self._check)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel what is in flight, close the filesystem's connections, join the I/O thread."""
        if self._closed:
            return
        self._closed = True
        self.client.close()
        if self._stats is not None and any(self._knobs.values()):  # the loop is gone: its writes too
            self._stats.add_many({f"knob.{name}": -n for name, n in self._knobs.items()})
            self._knobs = dict.fromkeys(KNOBS, 0)
        if self._tee is not None:  # parts queued are written; unfinished entries dropped
            self._tee.close()
        for plan in self._plans:  # cache entries opened ahead that no reader took
            if plan is not _DONE and plan.done() and not plan.cancelled() and plan.exception() is None \
                    and isinstance(plan.result(), Entry):
                plan.result().close()

    def _check(self) -> None:
        """Raise if the fetcher can no longer deliver (closed, or its scheduler failed)."""
        if self._closed:
            raise StreamDataError("the prefetcher was closed while a reader waited for bytes")
        if self._scheduler.done() and not self._scheduler.cancelled() and self._scheduler.exception():
            exc = self._scheduler.exception()
            raise StreamDataError(f"the prefetcher's scheduler failed: {type(exc).__name__}: {exc}") from exc

    def _wait_timeout(self) -> float:
        return self.config.wait_limit()  # past the part's retry_deadline: never before it

    # ---- what an ItemReader asks of its prefetcher (the reader's thread) ---------------

    def take_plan(self, index: int) -> _Plan | Entry:
        """Wait for item ``index``'s plan (its parts, or its cache entry) and drop the
        prefetcher's reference to it, so that consumed parts are freed as soon as the reader
        lets go of them."""
        self._io.call_soon(self._advance, index)
        url = self.items[index].url
        start = time.perf_counter_ns()
        plan = wait_future(self._plans[index], self._wait_timeout(), what="the shard's size",
                           url=url, check=self._check)
        self.waited(start)
        self._plans[index] = _DONE
        return plan

    def waited(self, start: int) -> None:
        """The reader waited for bytes since ``start`` (``perf_counter_ns``): a stage time."""
        if self.times is not None:
            self.times[StageClock.WAIT] += time.perf_counter_ns() - start

    def wait(self, fut: concurrent.futures.Future, what: str, url: str) -> Any:
        """A part's result, waited for within the fetch's time limit; raises if the prefetcher
        can no longer deliver (closed, or its scheduler failed)."""
        return wait_future(fut, self._wait_timeout(), what=what, url=url, check=self._check)

    def stalled(self, held: Held, latency: float | None) -> None:
        """The reader waited for a part that ``held`` had held back, whose first byte took
        ``latency`` seconds (AUTOTUNE, BUDGET-GROWTH)."""
        self._io.call_soon(self._tuned, self.tuner.stalled, held, latency)

    def release_soon(self, nbytes: int) -> None:
        """The reader is done with ``nbytes`` of the budget (BYTE-BUDGET); any thread."""
        self._io.call_soon(self._release, nbytes)

    def get_now(self, url: str, start: int, end: int | None) -> bytes | Chunks:
        """Bytes ``[start, end)`` of ``url`` in one request, outside the window and the budget
        (what a bad cache entry left, CACHE-VERIFY)."""
        return self.wait(self._io.submit(self.client.get(url, start, end, chunks=True)),
                         f"bytes {start}..{end}", url)

    def count_cache(self, reason: str) -> None:
        """Count a cache event (``cache.<reason>``) from the reader's thread."""
        if self.cache is not None:
            self._io.call_soon(self.cache.count, reason)

    # ---- loop side --------------------------------------------------------------------

    def _advance(self, index: int) -> None:
        self._consumer = max(self._consumer, index)
        self._wake.set()

    def _release(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self.budget.released(nbytes)
        self._wake.set()

    def _tuned(self, decide: Callable[..., bool], *args: Any) -> None:
        """AUTOTUNE: a held-back part waited for (``Tuner.stalled``), or the pass's first parts
        in (``Tuner.first_byte``); each decision counted, the reader's knobs shown."""
        before = dict(self.tuner.decisions)
        if decide(*args):
            if self._counters is not None:
                self._counters.add_many({_DECISION[name]: n - before[name]
                                         for name, n in self.tuner.decisions.items() if n != before[name]})
            self._show_knobs()
            self._wake.set()

    def _show_knobs(self) -> None:
        """This reader's knobs into its row of ``knob.*`` (as changes: ONE-WRITER-PER-ROW)."""
        if self._stats is None:
            return
        now = self.tuner.knobs()
        change = {f"knob.{name}": n - self._knobs[name] for name, n in now.items() if n != self._knobs[name]}
        if change:
            self._stats.add_many(change)
            self._knobs = now

    def _window_holds(self, index: int) -> bool:
        """Item ``index`` is queued and waits for the reader's window alone."""
        return (index < len(self.items) and index >= self._consumer + self.tuner.window
                and (index <= self._fence or self._consumer >= self._fence - 1))

    def _due(self, index: int) -> bool:
        """Item ``index`` may be scheduled: queued, in the reader's window, and not past a queued
        pass's first item (``extend``) before the reader takes the last item ahead of it."""
        return (index < min(len(self.items), self._consumer + self.tuner.window)
                and (index <= self._fence or self._consumer >= self._fence - 1))

    def _fits(self, need: int) -> bool:
        """A part of ``need`` bytes fits the budget now (BYTE-BUDGET: or nothing is reserved)."""
        return self._reserved == 0 or self._reserved + need <= self.budget.limit

    def _may_send(self, need: int) -> bool:
        return self._inflight < self.tuner.requests_allowed(self.throttle.allowed) and self._fits(need)

    def _holds(self, need: int, held: Held) -> Held:
        """Note in ``held`` which knobs hold a part of ``need`` bytes back now (AUTOTUNE); one
        held by READER-THROTTLE (the throttle allows fewer than the tuned limit) is not the
        request limit's."""
        if not self._fits(need):
            held.budget = self.budget.limit
        if self._inflight >= self.tuner.max_requests and self.throttle.allowed >= self.tuner.max_requests:
            held.max_requests = self.tuner.max_requests
        return held

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self._wake.clear()
            await self._wake.wait()

    def _size_ahead(self, index: int, sizing: dict[int, asyncio.Future]) -> asyncio.Future:
        """Item ``index``'s size; the window's other unsized items are asked for theirs now too,
        in order (one request each, concurrent: not one round trip after another). The reader's
        first item is probed alone: its probe brings its first bytes (HEAD-START), and the
        window's requests follow its first parts (FIRST-BYTES-FIRST)."""
        end = index + 1 if index == 0 else self._consumer + self.tuner.window
        for i in range(index, min(len(self.items), end)):
            item = self.items[i]
            if i not in sizing and item.ranges is None and item.size is None:
                probe = self._probe(item.url) if index == 0 else self.client.size(item.url)
                sizing[i] = asyncio.ensure_future(probe)
                sizing[i].add_done_callback(lambda f: f.cancelled() or f.exception())  # read later
        return sizing.pop(index)

    async def _probe(self, url: str) -> int | None:
        """The reader's first item's size probe (probed alone), its first byte to the tuner (the
        far step) before the window's requests go out."""
        latency: list[float] = []
        size = await self.client.size(url, first_byte=latency)
        if latency and self.tuner.on:
            self._tuned(self.tuner.first_byte, latency[0])
        return size

    async def _schedule(self) -> None:
        """Each item in turn, in consumption order (``extend``'s too, as they come): when it is
        due, its parts are planned, then sent one by one within the byte budget and the
        request limit; after the reader's first shard, the window waits for its first bytes."""
        sizing: dict[int, asyncio.Future] = {}  # unsized items' size probes, in flight
        for index in itertools.count():  # items may be added (``extend``): wait for them
            by_window = await self._turn(index)
            url = self.items[index].url
            planned = await self._plan(index, sizing)
            if planned is None:  # from the cache, or failed: the reader has its plan already
                continue
            todo, opening = planned
            first = first_parts(todo) if opening else None
            offset = 0  # the part's offset in the item's bytes (the cache entry): parts tile the ranges
            while todo:
                part = todo.popleft()
                await self._send(url, index, part, offset, by_window)
                by_window = None  # the item's first part only
                start, end = part.range
                offset += (end if end is not None else start) - start
                del part
            if first is not None:  # the reader's first shard: FIRST-BYTES-FIRST
                await self._hold_first(first)

    async def _turn(self, index: int) -> int | None:
        """Wait until item ``index`` is due (``_due``); the window then, where the window alone
        held it back (it goes with the item's first part to the tuner, AUTOTUNE), else None."""
        by_window = self.tuner.window if self._window_holds(index) else None
        await self._until(functools.partial(self._due, index))
        return by_window

    async def _plan(self, index: int, sizing: dict[int, asyncio.Future]) -> tuple[_Plan, bool] | None:
        """Item ``index``'s parts, also handed to its reader, and whether they start small (the
        reader's first shard); None where the reader's plan is its cache entry (no request, no
        budget) or its error."""
        item = self.items[index]
        part_size = self.tuner.part_size  # AUTOTUNE: the item's parts are cut as the knob is now
        try:
            ranges = item.ranges
            if ranges is None:
                size = item.size if item.size is not None else await self._size_ahead(index, sizing)
                ranges = ((0, size),)
            # only the reader's first shard starts with a small part: it is what the first
            # batch waits for; later shards are fetched ahead, where fewer, bigger GETs
            # cost the client and the server less CPU per byte
            opening = index == 0 and item.ranges is None
            small = self.config.first_part if opening else None
            parts = split_parts(ranges, part_size, small)
            if self._tee is not None:
                entry = await self._tee.entry(index, item.url, ranges, item.size, item.etag)
                if entry is not None:  # from disk: no request, no budget
                    self._plans[index].set_result(entry)
                    return None
        except Exception as exc:
            self._plans[index].set_exception(translate_error(exc, item.url))
            return None
        todo = collections.deque(Part.cut(part, part_size) for part in parts)
        # the reader gets its own queue of the same parts: each side drops a part as soon as it
        # is done with it, so consumed bytes are freed (BYTE-BUDGET)
        self._plans[index].set_result(collections.deque(todo))
        return todo, small is not None

    async def _send(self, url: str, index: int, part: Part, offset: int, by_window: int | None) -> None:
        """Send ``part`` (at ``offset`` in item ``index``'s bytes) once it fits the byte budget
        (BYTE-BUDGET) and the requests in flight allow it (READER-THROTTLE); what held it back
        goes with it (AUTOTUNE: ``by_window``, the window, for an item's first part)."""
        # No slow start: the window's requests all go out at once, in consumption
        # order (a slow start cost throughput for no better first batch:
        # benchmarks/README.md, "Latency"). READER-THROTTLE (``retry``): at most as many
        # parts in flight as the reader's throttle allows (max_requests, unless throttled).
        held = self._holds(part.need, Held(window=by_window))
        await self._until(functools.partial(self._may_send, part.need))
        self._reserved += part.need
        self._inflight += 1
        self.peak_inflight = max(self.peak_inflight, self._inflight)
        self.peak_reserved = max(self.peak_reserved, self._reserved)
        asyncio.ensure_future(self._fetch(url, part, index, offset, held))

    async def _hold_first(self, first: Arrivals) -> None:
        """FIRST-BYTES-FIRST (``parts``): the rest of the window waits, at most
        FIRST_HOLD_MAX_S, until the reader's first shard's first parts have arrived."""
        try:
            async with asyncio.timeout(FIRST_HOLD_MAX_S):
                await self._until(functools.partial(_arrived, first))
        except TimeoutError:
            pass

    async def _fetch(self, url: str, part: Part, index: int, offset: int,
                     held: Held | None = None) -> None:
        start, end = part.range
        reserved, fut = part.need, part.future
        latency: list[float] = []  # its first byte's, where the backend can tell (BUDGET-GROWTH)
        try:
            data = await self.client.get(url, start, end, chunks=True, first_byte=latency)
            if held is not None and held != _NOT_HELD:  # a knob held it back: a wait for it may grow it
                part.held = held
                part.latency = latency[0] if latency else None
            if latency and self.tuner.wants_first_byte:  # the far step
                self._tuned(self.tuner.first_byte, latency[0])
            size = body_size(data)
            if self._stats is not None:  # the loop's thread: its own columns (ONE-WRITER-PER-ROW)
                self._stats.add_many({"requests": 1, "bytes": size} if not latency else {
                    "requests": 1, "bytes": size, "first_byte_ns": int(latency[0] * 1e9), "first_bytes": 1})
            if size != reserved:  # only for open-ended parts: account for the real size
                self._reserved += size - reserved
                part.reserved_fix = size - reserved
            if fut.set_running_or_notify_cancel():
                fut.set_result(data)  # the reader first: the cache adds no wait
            else:
                self._reserved -= size
            if self._tee is not None:  # also when the reader gave up: the entry can still complete
                self._tee.write(index, offset, data, size)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._tee is not None:
                self._tee.abort(index)
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
        finally:
            self._inflight -= 1
            self._wake.set()


_NOT_HELD = Held()
# the counter each of the tuner's decisions adds to (``metrics.COUNTERS``)
_DECISION = {"window": "tuned.window", "max_requests": "tuned.max_requests", "byte_budget": "budget.grown",
             "part_size": "tuned.part_size"}


def _release_landed(fetcher: Prefetcher, part: weakref.ref[Part], fut: concurrent.futures.Future) -> None:
    """A part its reader gave up on has landed: its budget back (BYTE-BUDGET), what it reserved
    and its real size's fix; none where it was cancelled. ``part`` is a weak reference (alive
    while its future can land: ``_fetch`` holds it), as its future holds this callback and keeps
    its bytes."""
    landed = part()
    if landed is not None and not fut.cancelled():
        fetcher.release_soon(landed.need + landed.reserved_fix)


def _as_item(item: FetchItem | Shard) -> FetchItem:
    if isinstance(item, FetchItem):
        return item
    return FetchItem(item.url, item.size, None, getattr(item, "etag", None))


class ItemReader:
    """The consumer's view of one fetched item: its bytes, part by part, in order."""

    def __init__(self, fetcher: Prefetcher, index: int) -> None:
        self._fetcher = fetcher
        self.index = index
        self.url = fetcher.items[index].url

    @property
    def item(self) -> FetchItem:
        """What this reader reads: the object and its byte ranges."""
        return self._fetcher.items[self.index]

    def chunks(self) -> Generator[bytes, None, None]:
        """Yield the item's bytes in order, in pieces of any size. Budget is released once the
        reader has asked for the next piece (a MiB at a time, and at the end of each part)."""
        f = self._fetcher
        pending: _Plan = collections.deque()
        try:
            plan = f.take_plan(self.index)
            if isinstance(plan, Entry):
                yield from self._from_cache(plan)
                return
            pending = plan
            while pending:
                part = pending[0]
                start, end = part.range
                stalled = not part.future.done()
                waiting = time.perf_counter_ns() if stalled else 0
                data = f.wait(part.future, f"bytes {start}..{end}", self.url)
                if stalled:
                    f.waited(waiting)
                if stalled and part.held is not None:  # AUTOTUNE, BUDGET-GROWTH
                    f.stalled(part.held, part.latency)
                pending.popleft()
                del part
                # a part may come as the chunks it arrived in (``Chunks``): hand them on one
                # by one, and give their budget back a MiB at a time as the reader moves on
                held = body_size(data)
                pieces = list(data) if type(data) is Chunks else [data]
                del data
                freed = 0
                try:
                    for i, piece in enumerate(pieces):
                        pieces[i] = b""
                        yield piece
                        freed += len(piece)
                        del piece
                        if freed >= _RELEASE_STEP:
                            f.release_soon(freed)
                            held, freed = held - freed, 0
                finally:
                    if held:
                        f.release_soon(held)
        except StreamDataError as exc:
            if f.where and not exc.where:
                exc.where = f.where
            raise
        finally:
            for part in pending:  # abandoned mid-item: free the budget as parts land
                part.future.add_done_callback(functools.partial(_release_landed, f, weakref.ref(part)))

    def _from_cache(self, entry: Entry) -> Iterator[bytes]:
        """The item's bytes from its cache entry, each segment verified before it is handed
        on; from the first bad one (CACHE-VERIFY), the entry is deleted and the rest fetched."""
        f, done = self._fetcher, 0
        try:
            try:
                blocks = entry.blocks()
                while True:
                    reading = time.perf_counter_ns()  # from disk: a wait for bytes too
                    block = next(blocks, None)
                    f.waited(reading)
                    if block is None:
                        break
                    yield block
                    done += len(block)
            except (CorruptEntry, OSError) as exc:
                entry.discard()
                f.count_cache("corrupt" if isinstance(exc, CorruptEntry) else "errors")
                yield from self._fetch_rest(entry.ranges, done)
        finally:
            entry.close()

    def _fetch_rest(self, ranges: Sequence[Range], skip: int) -> Iterator[bytes]:
        """The item's bytes after its first ``skip``, fetched part by part, one at a time."""
        f = self._fetcher
        for start, end in ranges:
            if end is not None and skip >= end - start:
                skip -= end - start
                continue
            for s, e in split_parts(((start + skip, end),), f.config.part_size):
                data = f.get_now(self.url, s, e)
                yield from (data if isinstance(data, Chunks) else (data,))
            skip = 0

    def read(self) -> bytes:
        """The whole item as one ``bytes`` (for small objects and footers)."""
        return b"".join(self.chunks())

    def read_ranges(self) -> list[bytes]:
        """One ``bytes`` per requested range (parts joined back), in the item's range order."""
        item = self._fetcher.items[self.index]
        ranges = item.ranges or ((0, item.size),)
        out, buf, chunks = [], bytearray(), self.chunks()
        for start, end in ranges:
            if end is None:
                out.append(b"".join(chunks))
                continue
            while len(buf) < end - start:
                buf += next(chunks)
            out.append(bytes(buf[: end - start]))
            del buf[: end - start]
        return out
