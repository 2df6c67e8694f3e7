"""The job's request rate to a store that counts requests (the Hugging Face Hub): a governor
that paces every request a process sends there.

Invariant (RATE-SHARE): a job of R reading processes (``world_size`` ranks times each rank's
DataLoader workers, or the rank itself where it reads in its main process) sends at most
``max_requests_per_s`` requests per second to a governed store, plus R at its start: each
process paces its requests at ``max_requests_per_s / R``, one every ``R / max_requests_per_s``
seconds, through one :class:`RateGovernor` per process and rate, which every client and
thread of that process shares (a part's first try and each retry, size probes too). The
budget is split by the world each reader already knows, so no process talks to another to
keep it (no shared memory across nodes, nothing to clean up after a crash); the price is that
a reader that sends nothing does not lend its share to the others.

A throttled answer (429) that asks for a wait (``Retry-After``) holds the process's next
request until then: all of its readers wait, not only the request that was refused
(``AsyncClient._retrying``, which also counts the retry as ``retried.throttled``).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

from streamdata._fork import at_fork_in_child
from streamdata.errors import SpecError

__all__ = ["RateGovernor", "governor_for", "share_of"]


class RateGovernor:
    """Requests at most ``rate`` per second, spaced ``1 / rate`` apart, for every thread and
    loop of a process (RATE-SHARE). A slot is reserved under a lock: callers on several
    loops and threads get distinct slots in the order they asked."""

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise SpecError(f"a request rate must be > 0 requests per second, got {rate!r}")
        self.rate = rate
        self.interval = 1.0 / rate
        self._next = 0.0  # time.monotonic() of the next free slot
        self._lock = threading.Lock()
        self.waited = 0  # requests that waited for their slot (read by tests)
        self.held = 0  # waits asked for by throttled answers (``hold``)

    def reserve(self) -> float:
        """Reserve the next slot; the seconds until it (0: now)."""
        now = time.monotonic()
        with self._lock:
            slot = max(now, self._next)
            self._next = slot + self.interval
            if slot > now:
                self.waited += 1
        return slot - now

    async def wait(self) -> bool:
        """Wait for a slot (on the caller's loop); whether it had to."""
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)
        return delay > 0

    def hold(self, seconds: float) -> None:
        """No slot before ``seconds`` from now (a 429's ``Retry-After``)."""
        until = time.monotonic() + max(0.0, seconds)
        with self._lock:
            if until > self._next:
                self._next = until
                self.held += 1


def share_of(rate: float | None, readers: int) -> float | None:
    """One of ``readers`` processes' share of the job's ``rate`` (``None``: not governed)."""
    if rate is None or math.isinf(rate):
        return None
    return rate / max(1, readers)


_GOVERNORS: dict[tuple[str, float], RateGovernor] = {}
_LOCK = threading.Lock()


def governor_for(key: str, rate: float) -> RateGovernor:
    """The process's governor for requests to ``key`` (an endpoint) at ``rate`` per second."""
    with _LOCK:
        found = _GOVERNORS.get((key, rate))
        if found is None:
            found = _GOVERNORS[(key, rate)] = RateGovernor(rate)
        return found


def _forget_in_child() -> None:
    """FORK-RESET: a forked reader paces itself (its own share, from its own world), and a
    lock its parent held at the fork would never be released here."""
    global _LOCK
    _LOCK = threading.Lock()
    _GOVERNORS.clear()


at_fork_in_child("sessions", _forget_in_child)
