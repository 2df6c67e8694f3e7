"""Work a dataset's constructor has to do anyway, done while its listing's request is in flight.

Invariant (IDLE-WHILE-LISTING): the constructor queues work around its listing
(``with pending(fn, ...)``); the LITE-S3 listing runs it after its first request is sent and
before it reads the answer (``run_pending``, from ``s3lite.LiteS3.list``'s ``while_waiting``),
where the round trip hides it; what no listing ran (another backend, ``listing=False``, rank
1+ of a job, local files) runs when the block ends. Queued work must not need the listing's
result, do I/O or take long; an exception it raises is raised when the block ends, never
inside the listing (where it would look like a listing failure and be retried). Queued by
``TarDataset``: its decoders (with a webdataset decode spec, their import: webdataset and yaml,
~12-30 ms on a 2-core machine; ``decode=True`` imports nothing, LAZY-DECODERS in ``decode``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["pending", "run_pending"]

_LOCAL = threading.local()  # this thread's queue: (work left, the first exception)


@contextlib.contextmanager
def pending(*work: Callable[[], None]) -> Iterator[None]:
    """Queue ``work`` for the listing inside the block to run while it waits; the rest runs
    (and the first exception of any of it is raised) when the block ends without an error."""
    outer = getattr(_LOCAL, "queue", None)
    queue = _LOCAL.queue = (list(work), [])
    try:
        yield
        run_pending()
    finally:
        _LOCAL.queue = outer
    if queue[1]:
        raise queue[1][0]


def run_pending() -> None:
    """Run this thread's queued work now (a listing that waits for its answer); never raises."""
    queue = getattr(_LOCAL, "queue", None)
    while queue is not None and queue[0]:
        try:
            queue[0].pop(0)()
        except Exception as exc:  # raised by pending() when its block ends
            queue[1].append(exc)

