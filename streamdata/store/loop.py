"""The only module that touches asyncio directly: a private event-loop thread per reader.

Invariant (LOOP-AFTER-FORK): a loop thread and every filesystem object bound to it are
created lazily in the process that uses them (a DataLoader worker), never inherited
through fork.  s3fs, gcsfs and aiohttp sessions hang when used across a fork
(fsspec#835, s3fs#914, gcsfs#379); a loop inherited by a child is marked dead at the
"loops" stage of FORK-RESET (``_fork``) and refuses work instead of hanging.

Invariant (CLOSE-AT-EXIT): no loop thread outlives the interpreter's ``atexit`` stage. A loop
thread is a daemon: at exit Python does not wait for it, and once finalisation has begun a
daemon thread that wakes up (a timer, a socket) is stopped the moment it needs the
interpreter, in whatever native code it is in, and cannot finish what its owner's
``__del__`` asks of it (seen: each exit with an open iterator waited out a 5 s close time-out;
asyncio printed "Task was destroyed but it is pending!"). So an ``atexit`` hook, registered
when the first loop starts, closes every loop still open: through its owner's close where one
was named (``close_at_exit``: connections and caches closed too), else cancelling and awaiting
its tasks; each within a bounded time-out. An owner's ``__del__`` at finalisation then finds
its loop closed and returns at once.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from streamdata._compat import default_executor, executor_threads
from streamdata._fork import at_fork_in_child, install
from streamdata.errors import FetchTimeoutError, StreamDataError

__all__ = ["LoopThread", "wait_future", "wait_threads_gone"]

T = TypeVar("T")

_POLL = 0.1  # seconds: waits are taken in slices this long so Ctrl-C and shutdown work
_counter = itertools.count()
_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_exit_hooks = itertools.count()  # next() is atomic: the first loop registers CLOSE-AT-EXIT
_EXIT_TIMEOUT = 5.0  # seconds, per loop, that closing at exit may take
_CANCEL_ROUND_S = 0.05  # a close cancels what is left of its tasks again after this long


class LoopThread:
    """A daemon thread running one asyncio loop; sync code submits coroutines to it."""

    def __init__(self, name: str = "io") -> None:
        install()  # a child forked from now on inherits this loop: FORK-RESET must run there
        if next(_exit_hooks) == 0:
            atexit.register(_close_at_exit)
        self._inherited = False  # set in a forked child (FORK-RESET)
        self._owner_close: weakref.WeakMethod | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"streamdata-{name}-{next(_counter)}", daemon=True
        )
        self._closed = False
        self._thread.start()
        _live.add(self)

    def close_at_exit(self, close: Callable[[], None]) -> None:
        """CLOSE-AT-EXIT: at interpreter exit, close this loop by calling ``close`` (a bound
        method of the loop's owner, held weakly) if the loop is still open then."""
        self._owner_close = weakref.WeakMethod(close)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def inherited(self) -> bool:
        """True in a process forked from the one that made this loop (it refuses work there)."""
        return self._inherited

    def _check(self) -> None:
        if self._inherited:
            raise StreamDataError("an event loop was inherited across fork; create readers in the child")
        if self._closed:
            raise StreamDataError("the I/O loop of this reader is closed")

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        self._check()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (no-op once closed)."""
        if not self._closed:
            self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Awaitable[T], timeout: float, what: str = "request") -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds."""
        return wait_future(self.submit(coro), timeout, what=what)

    def close(self, cleanup: Callable[[], Awaitable[Any]] | None = None, timeout: float = 5.0) -> None:
        """Cancel pending tasks, run ``cleanup`` (closing sessions), stop the loop, join the thread."""
        if self._closed:  # closed, or inherited (FORK-RESET marks it closed)
            return

        helpers: list[threading.Thread] = []

        async def shutdown() -> None:
            await _cancel_all(self.loop.time() + timeout / 2)
            if cleanup is not None:
                try:
                    await asyncio.wait_for(cleanup(), timeout)
                except Exception:  # closing is best effort; the loop is going away anyway
                    pass
            helpers.extend(executor_threads(default_executor(self.loop)))  # aiobotocore uses it
            await self.loop.shutdown_default_executor()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            wait_threads_gone([self._thread, *helpers], timeout)


async def _cancel_all(end: float) -> None:
    """Cancel every other task of the running loop, in rounds, until none is left or the loop's
    clock passes ``end``: a task may take its cancellation and then wait for a task it started
    (``asyncio.wait_for`` waits for its inner task), or a task may start another as it ends;
    each round cancels what is still there, and every outcome is retrieved (no asyncio
    "never retrieved" or "destroyed but pending" message later)."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    while True:
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        if not tasks or loop.time() >= end:
            return
        for task in tasks:
            task.cancel()
        done, _ = await asyncio.wait(tasks, timeout=_CANCEL_ROUND_S)
        for task in done:
            if not task.cancelled():
                task.exception()


def wait_future(fut: concurrent.futures.Future[T], timeout: float | None, *, what: str = "request",
                url: str | None = None, check: Callable[[], None] | None = None) -> T:
    """Wait for ``fut`` in short slices; raise FetchTimeoutError after ``timeout`` seconds.

    ``check`` is called between slices and raises when the producer has died, so a
    consumer never hangs on it.
    """
    waited = 0.0
    while True:
        # wait() rather than result(timeout): the result may itself be a TimeoutError
        done, _ = concurrent.futures.wait([fut], timeout=_POLL)
        if done:
            return fut.result()
        waited += _POLL
        if check is not None:
            check()
        if timeout is not None and waited >= timeout:
            fut.cancel()
            raise FetchTimeoutError(f"{what} did not complete within {timeout:.0f} s", url=url)


def wait_threads_gone(threads: list[threading.Thread], timeout: float = 5.0) -> None:
    """Join ``threads`` and wait until the OS has retired them too.

    Invariant (FORK-AFTER-CLOSE): a thread that used OpenSSL runs OpenSSL's thread-exit
    handler under a global lock *after* ``Thread.join`` has returned.  A DataLoader worker
    forked in that instant inherits the lock held and hangs in its first ``SSLContext()``.
    So closing a reader waits until its threads are gone from ``/proc/self/task`` (Linux;
    elsewhere they are only joined).
    """
    deadline = time.monotonic() + timeout
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    tids = [t.native_id for t in threads if t.native_id is not None]
    while os.path.isdir("/proc/self/task") and time.monotonic() < deadline and any(
            os.path.exists(f"/proc/self/task/{tid}") for tid in tids):
        time.sleep(0.001)


def _close_at_exit() -> None:
    """CLOSE-AT-EXIT: close every loop still open, through its owner where one was named."""
    for lt in list(_live):
        if lt._closed:
            continue
        owner_close = lt._owner_close() if lt._owner_close is not None else None
        try:
            if owner_close is not None:
                owner_close()
            if not lt._closed:
                lt.close(timeout=_EXIT_TIMEOUT)
        except Exception:  # the process is ending: one loop failing to close keeps no other open
            pass


def _forget_loops() -> None:
    """FORK-RESET, stage "loops": an inherited loop has no thread; it refuses work from now on."""
    for lt in list(_live):
        lt._inherited = lt._closed = True
    _live.clear()


at_fork_in_child("loops", _forget_loops)
