"""The one error policy: what a reader does with a bad shard, unit or sample.

Every stage that can meet bad input runs through :class:`ErrorPolicy`'s two guards:
:meth:`ErrorPolicy.units` (an error ends the rest of that unit) and :meth:`ErrorPolicy.each`
(an error drops that one record). With ``on_error="raise"`` (the default) the error goes on
with the reader's rank and worker in ``where``; with ``"skip"`` or a callable that returns
True it is skipped, counted per reason in the dataset's shared counters (``dataset.skipped``,
summed over every worker), and logged once per shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from streamdata.errors import (
    DecodeError,
    FetchTimeoutError,
    FormatError,
    ShardFetchError,
    SpecError,
    StreamDataError,
)
from streamdata.metrics import Counters, StageClock, decode_timing
from streamdata.redact import RedactFilter, redact

__all__ = ["ErrorPolicy", "skip_reason"]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("streamdata")
if not any(isinstance(f, RedactFilter) for f in log.filters):
    log.addFilter(RedactFilter())  # every line on the streamdata logger, write.py's too

OnError = str | Callable[[BaseException], bool]


def skip_reason(exc: BaseException) -> str:
    """The reason a skipped error is counted under (one of :data:`SKIP_REASONS`)."""
    if isinstance(exc, FetchTimeoutError):
        return "timeout"
    if isinstance(exc, (ShardFetchError, OSError)):
        return "fetch"
    if isinstance(exc, FormatError):
        return "format"
    if isinstance(exc, DecodeError):
        return "decode"
    return "other"


class ErrorPolicy:
    """What to do with a bad shard or sample, for one reader's pass.

    ``"raise"`` (default): raise it. ``"skip"`` (alias ``"warn"``): skip it, count it and log
    a warning for the first skip in each shard (later ones in the same shard at debug level).
    A callable ``f(exc) -> bool``: skip (counted and logged the same way) when it returns True.
    Only our errors and ``OSError``/``ValueError`` can be skipped; anything else is a bug and
    always raises.
    """

    def __init__(self, policy: OnError = "raise", counters: Counters | None = None, *,
                 where: str = "", clock: StageClock | None = None) -> None:
        self.policy = self.validate(policy)
        self.counters = counters
        self.clock = clock  # the pass's stage timings (``each``'s ``pull`` and ``run``), if kept
        self.where = where
        self.skipped = 0  # this pass, this reader
        self._warned: set[str | None] = set()

    @staticmethod
    def validate(policy: OnError) -> OnError:
        """``policy`` if usable, else :class:`SpecError` (called in the constructing process)."""
        if not (callable(policy) or policy in ("raise", "skip", "warn")):
            raise SpecError(f"on_error must be 'raise', 'skip' or a callable, got {policy!r}")
        return policy

    def skip(self, exc: BaseException) -> bool:
        """True when ``exc`` is to be skipped (and is counted and logged); False to raise it."""
        if self.policy == "raise" or not isinstance(exc, (StreamDataError, OSError, ValueError)):
            return False
        if callable(self.policy) and not self.policy(exc):
            return False
        reason = skip_reason(exc)
        self.skipped += 1
        if self.counters is not None:
            self.counters.add(f"skipped.{reason}")
        url = getattr(exc, "url", None)
        if url in self._warned:
            log.debug("streamdata: skipped (%s): %s", reason, redact(str(exc)))
        else:
            self._warned.add(url)
            log.warning("streamdata: skipped (%s): %s; further skips in this shard are counted "
                        "(dataset.skipped), not logged", reason, redact(str(exc)))
        return True

    def check(self, exc: StreamDataError) -> None:
        """Skip ``exc`` per the policy, or raise it with this reader's ``where``."""
        if not self.skip(exc):
            if not exc.where:
                exc.where = self.where or None
            raise exc

    def units(self, units: Iterable[Iterable[T]]) -> Iterator[T]:
        """The records of each unit in turn; an error ends that unit's records (the ones
        delivered before it stay delivered) and is skipped or raised."""
        for unit in units:
            try:
                yield from unit
            except StreamDataError as exc:
                self.check(exc)

    def each(self, items: Iterable[T], fn: Callable[[T], R], *, pull: int | None = None,
             run: int | None = None) -> Iterator[R]:
        """``fn(item)`` for each item; an item whose ``fn`` fails is skipped or raised. With the
        pass's ``clock``, the time taken pulling items (less the waits for bytes) adds to the
        stage ``pull`` and the time in ``fn`` to the stage ``run`` (``StageClock``'s slots; None:
        not timed)."""
        if self.clock is not None and run is not None:
            return self._timed(items, fn, self.clock.acc, pull, run)
        return self._each(items, fn)

    def pooled(self, items: Iterable[T], fn: Callable[[T], R], threads: int, *,
               timeout: float) -> Iterator[R]:
        """:meth:`each` with ``fn`` run on a pool of ``threads`` threads (decoders that release
        the GIL: Pillow, libjpeg-turbo, torch), results in the items' order, at most two per
        thread ahead of the consumer. The pool lives as long as this generator; a result not
        ready within ``timeout`` seconds is a DecodeError."""
        from collections import deque
        from concurrent.futures import Future, ThreadPoolExecutor
        from concurrent.futures import TimeoutError as FutureTimeout

        pool = ThreadPoolExecutor(threads, thread_name_prefix="streamdata-decode")
        pending: deque[Future] = deque()

        def settle(future: Future) -> Iterator[R]:
            try:
                result = future.result(timeout=timeout)
            except FutureTimeout:
                raise DecodeError(f"a sample took longer than {timeout:g} s to decode "
                                  f"on the decode threads ({self.where})") from None
            except StreamDataError as exc:
                self.check(exc)
                return
            yield result

        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                del item
                if len(pending) >= 2 * threads:
                    yield from settle(pending.popleft())
            while pending:
                yield from settle(pending.popleft())
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _each(self, items: Iterable[T], fn: Callable[[T], R]) -> Iterator[R]:
        for item in items:
            try:
                result = fn(item)
            except StreamDataError as exc:
                self.check(exc)
                continue
            yield result

    def _timed(self, items: Iterable[T], fn: Callable[[T], R], acc: list[int], pull: int | None,
               run: int) -> Iterator[R]:
        """:meth:`_each`, each record timed: its pull less the waits for bytes within it adds to
        ``pull`` (None: not timed), its ``fn`` to ``run``; a decoder's fields (``run`` is
        ``DECODE``) to their modalities' slots (``metrics.decode_timing``)."""
        clock, it, waits = time.perf_counter_ns, iter(items), StageClock.WAIT
        decoding = run == StageClock.DECODE
        while True:
            start, waited = clock(), acc[waits]
            try:
                item = next(it)
            except StopIteration:
                if pull is not None:
                    acc[pull] += clock() - start - (acc[waits] - waited)
                return
            pulled = clock()
            if pull is not None:
                acc[pull] += pulled - start - (acc[waits] - waited)
            before = decode_timing(acc) if decoding else None  # the fields' times per modality
            try:
                result = fn(item)
            except StreamDataError as exc:
                self.check(exc)
                continue
            finally:
                acc[run] += clock() - pulled
                if decoding:
                    decode_timing(before)
            del item
            yield result
