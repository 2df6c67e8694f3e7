"""Corporate networks on loopback: :class:`ForwardProxy` (an HTTP forward proxy that knows
host names the machine cannot resolve, optionally behind Basic credentials) and
:class:`TLSFront` (a TLS-terminating front signed by a private certificate authority, made
by :func:`make_certificates`). End-to-end tests use them to check that the package works
behind a proxy and with a private CA.

Rules they keep:

- nothing is mocked: each server listens on 127.0.0.1 and real clients (urllib,
  http.client, boto3, s3fs/aiohttp) reach it over TCP;
- bodies are streamed in pieces of at most ``_CHUNK`` bytes with backpressure, never held
  whole, so hundreds of MB pass through in constant memory;
- every wait (connect, handshake, read, write) is bounded by ``timeout``; an upstream the
  proxy cannot reach gets the client a 502 (absolute-form) or a refused tunnel, and a failure
  mid-body closes the client's connection: a client never hangs on a server error;
- each server runs its own asyncio loop on one daemon thread named ``streamdata-testing-*``
  (a name lookup gets a short-lived daemon thread of its own); ``stop()`` aborts every
  connection and joins that thread (bounded), so the suite's leak guard finds nothing left;
- a process forked while a server runs (a DataLoader worker) closes its copies of the
  server's sockets at once (``_close_in_child``, a FORK-RESET of stage "sessions", see
  ``streamdata._fork``): a copy left open would keep a connection alive after the server
  closed it, and the client would wait for an end that never comes;
- the standard library only at import; ``cryptography`` is imported by
  :func:`make_certificates` when certificates are made.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile
import threading
import weakref
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import quote, urlsplit

from streamdata._fork import at_fork_in_child, install
from streamdata.errors import BackendMissingError
from streamdata.testing._process import (
    _INSTALL_HINT,
    _READY_TIMEOUT_S,
    _STOP_TIMEOUT_S,
    ServerError,
    _Managed,
)

__all__ = ["CertificatePaths", "ForwardProxy", "TLSFront", "make_certificates"]

_T = TypeVar("_T")

_CHUNK = 256 * 1024  # the largest piece held per read; also the stream buffers' limit
_CHUNKED = -1  # body framings besides a Content-Length (>= 0)
_UNTIL_CLOSE = -2
# Hop-by-hop fields are the proxy's own business and never forwarded (RFC 9110 7.6.1); Upgrade
# too, so that an origin never switches protocols under an HTTP/1.1 relay.
_REQUEST_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization",
                          "te", "upgrade"})
_RESPONSE_HOP = frozenset({"connection", "proxy-connection", "keep-alive"})

DEFAULT_NAMES = ("127.0.0.1", "localhost")  # what a TLSFront's certificate always names

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


# --------------------------------------------------------------------------- forward proxy


@dataclass
class _Upstream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False


class ForwardProxy(_LoopServer):
    """An HTTP/1.1 forward proxy on a loopback port, as a corporate network has one.

    - ``http://`` URLs come as absolute-form requests (``GET http://host:port/path``): each
      is forwarded to its origin and the answer relayed, bodies streamed as framed
      (Content-Length, chunked, or up to the close); the client's connection is kept alive
      across requests, each client connection keeping one upstream connection per origin.
    - ``https://`` goes through ``CONNECT host:port`` tunnels (bytes spliced both ways).
    - ``hosts`` maps names to addresses that only the proxy knows (``{"bucket.corp.test":
      "127.0.0.1"}``); a ``"*.corp.test"`` key covers every name under ``corp.test`` (for
      virtual-hosted S3: ``<bucket>.s3.corp.test``); other names go to the system resolver.
    - ``auth=(user, password)`` requires ``Proxy-Authorization: Basic`` on every request and
      CONNECT, answering 407 with ``Proxy-Authenticate`` otherwise.
    - An origin that cannot be reached or fails before its answer gets the client a 502.

    Counters: ``requests`` ((method, target) of every request seen, denied ones included),
    ``connections`` (client connections accepted) and ``denied`` (407s sent).

    Clients take it as ``url`` (``url_with_auth`` carries the credentials) for both schemes:
    urllib ``ProxyHandler({"http": url, "https": url})``; botocore/boto3
    ``Config(proxies={"http": url, "https": url})``; s3fs ``config_kwargs={"proxies": {...}}``;
    aiohttp ``session.get(..., proxy=url)``; http.client a connection to the proxy with
    absolute URLs, or ``HTTPSConnection(proxy).set_tunnel(host, port, headers=...)``
    (``authorization`` is the header's value). Environment variables (``HTTP_PROXY``...)
    work for clients that read them, but ``NO_PROXY`` often lists 127.0.0.1 and localhost:
    use names from ``hosts``.
    """

    _kind = "proxy"

    def __init__(self, hosts: Mapping[str, str] | None = None, *, auth: tuple[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 60.0,
                 realm: str = "streamdata test proxy") -> None:
        super().__init__(host, port, timeout)
        # Lower-case names, without a trailing dot; may be changed while the proxy runs.
        self.hosts = {name.lower().rstrip("."): address for name, address in (hosts or {}).items()}
        self.auth = auth
        self.realm = realm
        self._requests: list[tuple[str, str]] = []
        self._denied = 0

    @property
    def url(self) -> str:
        host, port = self._address()
        return f"http://{host}:{port}"

    @property
    def url_with_auth(self) -> str:
        """``url`` with the credentials in it (``http://user:pass@host:port``); ``url`` without auth."""
        host, port = self._address()
        if self.auth is None:
            return self.url
        user, password = (quote(part, safe="") for part in self.auth)
        return f"http://{user}:{password}@{host}:{port}"

    @property
    def authorization(self) -> str | None:
        """The ``Proxy-Authorization`` value the proxy wants (for ``set_tunnel(headers=...)``)."""
        if self.auth is None:
            return None
        return "Basic " + base64.b64encode(":".join(self.auth).encode()).decode("ascii")

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._requests)

    @property
    def denied(self) -> int:
        with self._lock:
            return self._denied

    def reset_counters(self) -> None:
        super().reset_counters()
        with self._lock:
            self._requests.clear()
            self._denied = 0

    def resolve(self, name: str) -> str:
        """The address the proxy connects to for ``name``: its entry in ``hosts``, else the
        longest matching ``*.suffix`` entry there, else ``name`` itself (the system resolver)."""
        name = name.lower().rstrip(".")
        if name in self.hosts:
            return self.hosts[name]
        labels = name.split(".")
        for start in range(1, len(labels)):
            address = self.hosts.get("*." + ".".join(labels[start:]))
            if address is not None:
                return address
        return name

    def __repr__(self) -> str:
        return f"ForwardProxy(port={self.port}, hosts={self.hosts}, auth={self.auth is not None})"

    # -- one client connection ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstreams: dict[tuple[str, int], _Upstream] = {}
        try:
            while True:
                try:  # an idle keep-alive connection waits for its next request up to `timeout`
                    raw = await _within(self.timeout, reader.readuntil(b"\r\n\r\n"))
                except asyncio.IncompleteReadError:
                    return  # the client hung up between requests
                if not await self._request(raw, reader, writer, upstreams):
                    return
        finally:
            for upstream in upstreams.values():
                self._release(upstream.writer)

    async def _request(self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       upstreams: dict[tuple[str, int], _Upstream]) -> bool:
        """Answer one request; whether the client connection stays open for another."""
        try:
            head = _Head.parse(raw)
            method, target, version = head.line.split(" ")
            if not version.startswith("HTTP/1."):
                raise _BadMessage(f"not HTTP/1.x: {head.line[:80]!r}")
            with self._lock:
                self._requests.append((method, target))
            framing = _request_framing(head)
        except (ValueError, _BadMessage) as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return False
        if not self._authorized(head):
            with self._lock:
                self._denied += 1
            # With a body on its way the connection cannot be reused: this proxy reads none.
            close = framing != 0
            await self._answer(writer, 407, "Proxy Authentication Required",
                               "proxy authentication required\n", close=close,
                               fields=[("Proxy-Authenticate", f'Basic realm="{self.realm}"')])
            return not close
        if method == "CONNECT":
            await self._tunnel(target, reader, writer)
            return False
        return await self._forward(method, target, version, head, framing, reader, writer, upstreams)

    def _authorized(self, head: _Head) -> bool:
        if self.auth is None:
            return True
        scheme, _, token = (head.get("proxy-authorization") or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return given == ":".join(self.auth)

    async def _answer(self, writer: asyncio.StreamWriter, status: int, reason: str, text: str, *,
                      close: bool = True, fields: Iterable[tuple[str, str]] = ()) -> None:
        body = text.encode("utf-8", "replace")
        head = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                *fields, *([("Connection", "close")] if close else [])]
        writer.write(_Head.render(f"HTTP/1.1 {status} {reason}", head) + body)
        await _within(self.timeout, writer.drain())

    async def _tunnel(self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            host, port = _authority(target)
        except ValueError as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return
        try:
            up_reader, up_writer = await self._open(self.resolve(host), port)
        except OSError as err:
            await self._answer(writer, 502, "Bad Gateway", f"cannot reach {target}: {err!r}\n")
            return
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await _splice(reader, writer, up_reader, up_writer, self.timeout)
        finally:
            self._release(up_writer)

    async def _forward(self, method: str, target: str, version: str, head: _Head, framing: int,
                       reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       upstreams: dict[tuple[str, int], _Upstream]) -> bool:
        parts = urlsplit(target)
        try:
            if parts.scheme.lower() != "http" or not parts.hostname:
                raise ValueError(f"this proxy forwards http:// absolute-form requests and CONNECT, "
                                 f"not {target[:80]!r}")
            port = parts.port or 80
        except ValueError as err:
            await self._answer(writer, 400, "Bad Request", f"{err}\n")
            return False
        origin = (parts.hostname, port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        tokens = set(head.tokens("connection", "proxy-connection"))
        client_close = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        fields = [(k, v) for k, v in head.fields if k.lower() not in _REQUEST_HOP | tokens]
        if head.get("host") is None:
            fields.insert(0, ("Host", parts.netloc.rpartition("@")[2]))
        request = _Head.render(f"{method} {path} {version}", fields)

        may_retry = True
        while True:
            upstream = upstreams.pop(origin, None)
            if upstream is not None and (upstream.reader.at_eof() or upstream.writer.is_closing()):
                self._release(upstream.writer)
                upstream = None
            if upstream is None:
                try:
                    upstream = _Upstream(*await self._open(self.resolve(origin[0]), origin[1]))
                except OSError as err:
                    await self._answer(writer, 502, "Bad Gateway",
                                       f"cannot reach {origin[0]}:{origin[1]}: {err!r}\n")
                    return False
            upstream.writer.write(request)
            # The body goes up while the answer is awaited: an origin may answer
            # "100 Continue" first (the client waits for it) or a final status early.
            sender = (asyncio.create_task(_relay_body(reader, upstream.writer, framing, self.timeout))
                      if framing else None)
            try:
                status, answer = await self._answer_head(upstream, writer)
                response_framing = _response_framing(method, status, answer)
            except _PEER_ERRORS as err:
                self._release(upstream.writer)
                if sender is not None:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
                elif upstream.reused and may_retry:
                    may_retry = False  # a kept connection the origin had closed meanwhile:
                    continue           # once more on a new one (nothing was taken from the client)
                await self._answer(writer, 502, "Bad Gateway",
                                   f"{origin[0]}:{origin[1]} did not answer: {err!r}\n")
                return False
            break

        reply_tokens = set(answer.tokens("connection"))
        upstream_close = ("close" in reply_tokens or response_framing == _UNTIL_CLOSE
                          or (answer.line.startswith("HTTP/1.0") and "keep-alive" not in reply_tokens))
        client_close = client_close or response_framing == _UNTIL_CLOSE
        fields = [(k, v) for k, v in answer.fields if k.lower() not in _RESPONSE_HOP | reply_tokens]
        if client_close:
            fields.append(("Connection", "close"))
        try:
            writer.write(_Head.render(answer.line, fields))
            await _relay_body(upstream.reader, writer, response_framing, self.timeout)
            if sender is not None:
                await _within(self.timeout, sender)
        except _PEER_ERRORS:
            # Mid-body, or a request body not taken whole: neither connection is in step.
            self._release(upstream.writer)
            if sender is not None:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
            return False
        if upstream_close:
            self._release(upstream.writer)
        else:
            upstream.reused = True
            upstreams[origin] = upstream
        return not client_close

    async def _answer_head(self, upstream: _Upstream, writer: asyncio.StreamWriter) -> tuple[int, _Head]:
        """The origin's final status and head; interim (1xx) answers are relayed on the way."""
        while True:
            raw = await _within(self.timeout, upstream.reader.readuntil(b"\r\n\r\n"))
            head = _Head.parse(raw)
            version, _, rest = head.line.partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise _BadMessage(f"not an HTTP/1.x status line: {head.line[:80]!r}")
            status = int(code)
            if status == 101:
                raise _BadMessage("the origin switched protocols, which this relay does not follow")
            if status >= 200:
                return status, head
            writer.write(_Head.render(head.line, head.fields))


# --------------------------------------------------------------------------- TLS front


@dataclass(frozen=True)
class CertificatePaths:
    """PEM files: the test CA's certificate (what clients trust), and the server's
    certificate and unencrypted private key (what a TLS server loads)."""

    ca_file: str
    cert_file: str
    key_file: str


def make_certificates(directory: str | os.PathLike[str], names: Iterable[str], *,
                      days: int = 30) -> CertificatePaths:
    """Make a certificate authority and a server certificate it signs for ``names`` (DNS
    names and IP addresses, as subjectAltName entries), written to ``directory`` as
    ``ca.pem``, ``server.pem`` and ``server.key``. A client that trusts ``ca.pem`` verifies
    the server under any of ``names``; nothing else trusts it. Keys are EC P-256 (fast to make)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as err:
        raise BackendMissingError(f"cryptography is not installed: {_INSTALL_HINT}") from err
    names = list(dict.fromkeys(names))
    if not names:
        raise ValueError("make_certificates needs at least one name")
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=days)

    def usage(*, sign: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=not sign, key_cert_sign=sign,
                             crl_sign=sign, encipher_only=False, decipher_only=False)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "streamdata tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "streamdata test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(usage(sign=True), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = CertificatePaths(str(folder / "ca.pem"), str(folder / "server.pem"), str(folder / "server.key"))
    Path(paths.ca_file).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(paths.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    descriptor = os.open(paths.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key_pem)
    return paths


def _remove_tree(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not from a forked child exiting: the directory is its parent's
        shutil.rmtree(path, ignore_errors=True)


class TLSFront(_LoopServer):
    """A TLS-terminating front on a loopback port: takes TLS (HTTP/1.1 by ALPN) with a
    certificate for ``127.0.0.1``, ``localhost`` and ``names``, and splices the decrypted
    bytes to the plain ``upstream`` (``"host:port"``, or an ``http://host:port`` URL such as
    an ``endpoint_url``); one upstream connection per client connection, no HTTP parsing.

    The certificates (``ca_file``, ``cert_file``, ``key_file``) are made by ``start()`` in a
    temporary directory kept until the front is garbage-collected, so that a restart keeps
    them; pass ``certificates`` (from :func:`make_certificates`) to use one CA for several
    servers. ``connections`` counts completed handshakes.
    """

    _kind = "tls-front"

    def __init__(self, upstream: str | tuple[str, int], names: Iterable[str] = (), *,
                 certificates: CertificatePaths | None = None, host: str = "127.0.0.1",
                 port: int | None = None, timeout: float = 60.0) -> None:
        super().__init__(host, port, timeout)
        if isinstance(upstream, tuple):
            self.upstream_host, self.upstream_port = upstream[0], int(upstream[1])
        elif "://" in upstream:
            parts = urlsplit(upstream)
            if parts.scheme.lower() != "http" or not parts.hostname:
                raise ValueError(f"upstream must be host:port or an http:// URL, not {upstream!r}")
            self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        else:
            self.upstream_host, self.upstream_port = _authority(upstream)
        self.names = list(dict.fromkeys([*DEFAULT_NAMES, *names]))
        self._certificates = certificates

    @property
    def url(self) -> str:
        host, port = self._address()
        return f"https://{host}:{port}"

    @property
    def certificates(self) -> CertificatePaths:
        if self._certificates is None:
            raise ServerError("TLSFront is not started (start() makes its certificates)")
        return self._certificates

    @property
    def ca_file(self) -> str:
        return self.certificates.ca_file

    @property
    def cert_file(self) -> str:
        return self.certificates.cert_file

    @property
    def key_file(self) -> str:
        return self.certificates.key_file

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts this front's CA (and nothing else)."""
        return ssl.create_default_context(cafile=self.ca_file)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._certificates is None:
            directory = tempfile.mkdtemp(prefix="streamdata-tls-")
            weakref.finalize(self, _remove_tree, directory, os.getpid())
            self._certificates = make_certificates(directory, self.names)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._certificates.cert_file, self._certificates.key_file)
        context.set_alpn_protocols(["http/1.1"])
        return context

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await self._open(self.upstream_host, self.upstream_port)
        except OSError:
            return  # closing the client's connection is the answer: no HTTP is spoken here
        try:
            await _splice(reader, writer, up_reader, up_writer, self.timeout)
        finally:
            self._release(up_writer)

    def __repr__(self) -> str:
        return (f"TLSFront(port={self.port}, upstream={self.upstream_host}:{self.upstream_port}, "
                f"names={self.names})")
