"""A server running on its own asyncio loop in a daemon thread: the lifecycle the latency
proxy and the fault proxy share (start, bounded close, context manager). Standard library only.

A process forked while a server runs (a DataLoader worker in a test) closes its copies of the
server's sockets (``_close_in_child``): a remote server's sockets are never in the client's
processes, and a copy left open would keep a connection alive after the server closed or reset
it (the peer then sees neither: seen with a keep-alive connection open across the fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Self

__all__ = ["LoopedServer"]

_RUNNING: weakref.WeakSet[LoopedServer] = weakref.WeakSet()


class LoopedServer:
    """Subclasses set ``thread_name`` and implement ``_startup()`` (start listening) and
    ``_shutdown()`` (close every connection), both coroutines run on the server's loop."""

    thread_name = "looped-server"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def _startup(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def start(self, timeout: float = 10.0) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"{self.thread_name} already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=self.thread_name, daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        try:
            asyncio.run_coroutine_threadsafe(self._startup(), self._loop).result(timeout)
        except BaseException:
            self.close(timeout)
            raise
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection, stop the loop and join the thread (each step bounded)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            with contextlib.suppress(Exception):  # a stuck connection must not keep the thread
                future.result(timeout)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"{self.thread_name} thread did not stop within {timeout} s")
        self._loop = self._thread = None
        _RUNNING.discard(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def serve_until_signalled(self, started: dict, counters: Callable[[], dict]) -> None:
        """The CLIs' main loop: print ``started`` as JSON, serve until SIGINT/SIGTERM, then
        print ``counters()`` as JSON."""
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        print(json.dumps(started), flush=True)
        while not stop.wait(1.0):
            pass
        print(json.dumps(counters()), flush=True)

    def _run_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def _close_in_child() -> None:
    """In a forked child: close this process's copies of every running server's sockets
    (listening and connected; the descriptors only, the parent's server goes on)."""
    for server in list(_RUNNING):
        loop = server._loop
        socks = [getattr(t, "_sock", None) for t in list(getattr(loop, "_transports", {}).values())]
        listener = getattr(server, "_server", None)
        socks += list(getattr(listener, "_sockets", None) or ())
        for sock in socks:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
    _RUNNING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
