"""The loop servers' common part (:mod:`streamdata.testing.proxy`, :mod:`streamdata.testing.tls`):
HTTP/1.1 message heads and their framing, and :class:`_LoopServer`, a server on its own asyncio
loop thread that streams bodies in bounded pieces.

Rules every loop server keeps:

- nothing is mocked: each server listens on 127.0.0.1 and real clients (urllib,
  http.client, boto3, s3fs/aiohttp) reach it over TCP;
- bodies are streamed in pieces of at most ``_CHUNK`` bytes with backpressure, never held
  whole, so hundreds of MB pass through in constant memory;
- every wait (connect, handshake, read, write) is bounded by ``timeout``; a failure mid-body
  closes the client's connection: a client never hangs on a server error;
- each server runs its own asyncio loop on one daemon thread named ``streamdata-testing-*``
  (a name lookup gets a short-lived daemon thread of its own); ``stop()`` aborts every
  connection and joins that thread (bounded), so the suite's leak guard finds nothing left;
- a process forked while a server runs (a DataLoader worker) closes its copies of the
  server's sockets at once (``_close_in_child``, a FORK-RESET of stage "sessions", see
  ``streamdata._fork``): a copy left open would keep a connection alive after the server
  closed it, and the client would wait for an end that never comes;
- the standard library only at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
import threading
import weakref
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from streamdata._fork import at_fork_in_child, install
from streamdata.testing._process import (
    _READY_TIMEOUT_S,
    _STOP_TIMEOUT_S,
    ServerError,
    _Managed,
)

__all__: list[str] = []

_T = TypeVar("_T")

_CHUNK = 256 * 1024  # the largest piece held per read; also the stream buffers' limit
_CHUNKED = -1  # body framings besides a Content-Length (>= 0)
_UNTIL_CLOSE = -2
# Hop-by-hop fields are the proxy's own business and never forwarded (RFC 9110 7.6.1); Upgrade
# too, so that an origin never switches protocols under an HTTP/1.1 relay.
_REQUEST_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization",
                          "te", "upgrade"})
_RESPONSE_HOP = frozenset({"connection", "proxy-connection", "keep-alive"})


_RUNNING: weakref.WeakSet[_LoopServer] = weakref.WeakSet()


class _BadMessage(Exception):
    """The peer sent something this relay cannot frame as HTTP/1.x."""


# What ends one connection and only that one: the peer hung up, stalled, or spoke no HTTP.
_PEER_ERRORS = (OSError, EOFError, asyncio.LimitOverrunError, _BadMessage)


async def _within(timeout: float, awaitable: Awaitable[_T]) -> _T:
    async with asyncio.timeout(timeout):
        return await awaitable


# --------------------------------------------------------------------------- HTTP/1.x heads


@dataclass
class _Head:
    """A request or status line and its header fields, as received (names keep their case)."""

    line: str
    fields: list[tuple[str, str]]

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw.decode("latin-1").lstrip("\r\n").split("\r\n")
        fields = []
        for item in lines[1:]:
            if not item:
                continue
            name, colon, value = item.partition(":")
            if not colon or not name or name != name.strip() or item[0] in " \t":
                raise _BadMessage(f"malformed header line {item[:80]!r}")
            fields.append((name, value.strip()))
        return cls(lines[0], fields)

    def get(self, name: str) -> str | None:
        return next((value for key, value in self.fields if key.lower() == name), None)

    def tokens(self, *names: str) -> list[str]:
        """The comma-separated, lower-cased tokens of every field named in ``names``."""
        return [token.strip().lower() for key, value in self.fields if key.lower() in names
                for token in value.split(",") if token.strip()]

    @staticmethod
    def render(line: str, fields: Iterable[tuple[str, str]]) -> bytes:
        return "".join([f"{line}\r\n", *(f"{k}: {v}\r\n" for k, v in fields), "\r\n"]).encode("latin-1")


def _request_framing(head: _Head) -> int:
    codings = head.tokens("transfer-encoding")
    if codings:
        if codings[-1] != "chunked":  # no way to find the end of such a request (RFC 9112 6.3)
            raise _BadMessage(f"request Transfer-Encoding {codings} does not end in chunked")
        return _CHUNKED
    return _content_length(head, default=0)


def _response_framing(method: str, status: int, head: _Head) -> int:
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return 0
    codings = head.tokens("transfer-encoding")
    if codings:
        return _CHUNKED if codings[-1] == "chunked" else _UNTIL_CLOSE
    return _content_length(head, default=_UNTIL_CLOSE)


def _content_length(head: _Head, default: int) -> int:
    values = {value.strip() for value in head.tokens("content-length")}
    if not values:
        return default
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise _BadMessage(f"bad Content-Length {sorted(values)}")
    return int(values.pop())


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int,
                timeout: float) -> None:
    left = size
    while left > 0:
        data = await _within(timeout, reader.read(min(_CHUNK, left)))
        if not data:
            raise _BadMessage(f"connection closed {left} bytes before the end of a body")
        writer.write(data)
        await _within(timeout, writer.drain())
        left -= len(data)


async def _relay_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: int,
                      timeout: float) -> None:
    """Copy one message body as it is framed, chunk lines and trailers included."""
    if framing >= 0:
        await _copy(reader, writer, framing, timeout)
    elif framing == _UNTIL_CLOSE:
        while data := await _within(timeout, reader.read(_CHUNK)):
            writer.write(data)
            await _within(timeout, writer.drain())
    else:
        while True:
            line = await _within(timeout, reader.readuntil(b"\n"))
            writer.write(line)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadMessage(f"bad chunk size line {line[:80]!r}") from None
            if size < 0:
                raise _BadMessage(f"bad chunk size line {line[:80]!r}")
            if size == 0:
                while (line := await _within(timeout, reader.readuntil(b"\n"))) not in (b"\r\n", b"\n"):
                    writer.write(line)  # a trailer field
                writer.write(line)
                break
            await _copy(reader, writer, size + 2, timeout)  # the data and its CRLF
    await _within(timeout, writer.drain())


async def _splice(a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                  b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter,
                  timeout: float) -> None:
    """Copy bytes both ways until both directions end, or either fails. An end seen on one
    side is passed on as a half-close where the other side can take one (TCP); where it cannot
    (TLS), the splice ends there. The splice is idle, and fails, only when neither direction
    moved for ``timeout``: a long download must not be cut for its silent request direction."""
    loop = asyncio.get_running_loop()
    last = [loop.time()]

    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> bool:
        while True:
            try:
                async with asyncio.timeout(last[0] + timeout - loop.time()):
                    data = await source.read(_CHUNK)
            except TimeoutError:
                if loop.time() - last[0] < timeout:
                    continue  # the other direction moved meanwhile
                raise
            last[0] = loop.time()
            if not data:
                if sink.can_write_eof():
                    sink.write_eof()
                    return True
                return False
            sink.write(data)
            await _within(timeout, sink.drain())
            last[0] = loop.time()

    tasks = [asyncio.create_task(pump(a_reader, b_writer)), asyncio.create_task(pump(b_reader, a_writer))]
    try:
        for finished in asyncio.as_completed(tasks):
            if not await finished:
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _authority(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a (host, port) pair; ValueError when it is not one."""
    host, colon, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not host:port: {target!r}")
    return host, int(port)


# --------------------------------------------------------------------------- the loop thread


class _LoopServer(_Managed):
    """A listening socket served by an asyncio loop on its own thread. Subclasses implement
    ``_serve`` (one accepted connection) and may return a TLS context from ``_ssl_context``."""

    _kind = "server"

    def __init__(self, host: str, port: int | None, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, not {timeout}")
        self.host, self.port, self.timeout = host, port, float(timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # every open connection, both sides
        self._lock = threading.Lock()  # the counters, read from the test's thread
        self._connections = 0

    @property
    def connections(self) -> int:
        """Client connections accepted (TLS: handshakes completed) since start or reset."""
        with self._lock:
            return self._connections

    def reset_counters(self) -> None:
        with self._lock:
            self._connections = 0

    def _ssl_context(self) -> ssl.SSLContext | None:
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _address(self) -> tuple[str, int]:
        if self.port is None:  # after stop() the port is kept: a URL that refuses connections
            raise ServerError(f"{type(self).__name__} is not started")
        return self.host, self.port

    def __enter__(self) -> Self:
        return self.start()

    def start(self) -> Self:
        """Listen and serve from a background thread (returns once the socket listens)."""
        if self._thread is not None:
            return self
        context = self._ssl_context()
        install()  # a child forked from now on inherits this server's sockets: FORK-RESET
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=_run_loop, args=(loop,), daemon=True,
                                        name=f"streamdata-testing-{self._kind}")
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(context), loop).result(_READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """Stop listening, abort every connection (client and upstream), join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            with contextlib.suppress(Exception):  # a stuck connection must not keep the thread
                future.result(2 * _STOP_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(_STOP_TIMEOUT_S)
        _RUNNING.discard(self)
        self._loop = self._thread = self._server = self._listener = None
        if thread.is_alive():
            raise ServerError(f"{type(self).__name__} thread did not stop within {_STOP_TIMEOUT_S} s")

    async def _listen(self, context: ssl.SSLContext | None) -> None:
        extra: dict[str, Any] = {}
        if context is not None:
            extra = {"ssl": context, "ssl_handshake_timeout": self.timeout,
                     "ssl_shutdown_timeout": _STOP_TIMEOUT_S}
        # Our own listening socket (not one asyncio makes), so that _close_in_child has it.
        self._listener = socket.create_server((self.host, self.port or 0), backlog=1024)
        self._server = await asyncio.start_server(self._accept, sock=self._listener, limit=_CHUNK,
                                                  **extra)
        self.port = int(self._listener.getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(writer)
        with self._lock:
            self._connections += 1
        try:
            await self._serve(reader, writer)
        except _PEER_ERRORS:
            pass  # a peer that hangs up, stalls or garbles ends its own connection only
        except asyncio.CancelledError:
            # stop(): end quietly. Python 3.11's stream callback calls exception() on the
            # finished task, which raises (and logs a traceback) for a cancelled one.
            pass
        finally:
            self._release(writer)
            if task is not None:
                self._tasks.discard(task)

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to ``host:port``, trying each of its addresses in turn (each try
        bounded by ``timeout``); ``stop()`` closes it."""
        error: OSError = OSError(f"{host} has no address")
        for address in await self._lookup(host, port):
            try:
                reader, writer = await _within(self.timeout,
                                               asyncio.open_connection(address, port, limit=_CHUNK))
            except OSError as err:
                error = err
                continue
            self._writers.add(writer)
            return reader, writer
        raise error

    async def _lookup(self, host: str, port: int) -> list[str]:
        """The addresses of ``host``. A name is looked up on a daemon thread of its own, not
        on the loop's executor: that one's threads are not daemons, and would outlive a test
        while a server that spans tests runs (the leak guard fails such a test)."""
        try:
            return [str(ipaddress.ip_address(host))]
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[str]] = loop.create_future()

        def settle(result: list[str] | None, error: OSError | None) -> None:
            if not answer.done():  # not given up on (timeout, stop)
                if error is not None:
                    answer.set_exception(error)
                else:
                    answer.set_result(result or [])

        def look_up() -> None:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                result, error = list(dict.fromkeys(str(info[4][0]) for info in infos)), None
            except OSError as err:
                result, error = None, err
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=look_up, name="streamdata-testing-lookup", daemon=True).start()
        return await _within(self.timeout, answer)

    def _release(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        writer.close()

    def _sockets(self) -> list[socket.socket]:
        """The listening socket and every connection's. asyncio shows a connection's socket
        only wrapped (``TransportSocket``, which has no ``close``): the socket itself is its
        ``_sock`` (a private name; tests/testing/test_proxy_servers.py notices if it goes)."""
        found = [] if self._listener is None else [self._listener]
        for writer in list(self._writers):
            sock = getattr(writer.get_extra_info("socket"), "_sock", None)
            if isinstance(sock, socket.socket):
                found.append(sock)
        return found


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=_STOP_TIMEOUT_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _close_in_child() -> None:
    """FORK-RESET in a forked child: close this process's copies of every running server's
    sockets (the descriptors only, never ``shutdown``: the connections are the parent's, and
    its server goes on). No lock, no I/O besides the closes, never raises."""
    for server in list(_RUNNING):
        for sock in server._sockets():
            with contextlib.suppress(OSError):
                sock.close()
    _RUNNING.clear()


at_fork_in_child("sessions", _close_in_child)
