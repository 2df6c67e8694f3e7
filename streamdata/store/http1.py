"""A small HTTP/1.1 client on asyncio for LITE-S3's GETs (LITE-HTTP): no aiohttp to import.

Everything LITE-S3 (``s3lite``) sends after the listing is a GET of a presigned URL. This
client sends it over a per-loop pool of keep-alive connections (at most ``limit`` in use,
as aiohttp's ``TCPConnector(limit=)`` did) and streams the body as the chunks the socket
delivered, uncopied. Importing aiohttp cost 0.3 s of CPU in the process that builds a dataset
on a 2-core machine (benchmarks/README.md, "Start-up"); this module needs only the standard
library, which torch has imported already.

``Pool`` is a ``session.Session`` (the one GET contract); its ``Response`` streams the body
through the connection it came on (``_Conn``) and gives the connection back to the pool when
released. Rules, each a test in tests/store/test_h1.py:

- every wait is bounded: connecting, and each wait for the next bytes of an answer, by
  ``timeout`` (``TransportTimeoutError``); the caller bounds the whole request too (``client``);
- failures are typed as aiohttp's are (TYPED-TRANSPORT-ERRORS, ``session``): a bad answer
  (status line, a head over ``MAX_HEAD`` bytes or ``MAX_HEADERS`` lines, a bad chunk, an
  unknown transfer coding) is ``BadResponseError``, a connection that ends cleanly before the
  body does ``ShortBodyError``, one reset or closed before the head ``ConnectionLostError``,
  a refused connect ``ConnectRefusedError``, an untrusted certificate ``CertificateError``;
- a connection is reused only after its answer was read to the end, with nothing extra, from a
  server that keeps it alive; one that failed, was cut or left half read is closed;
- nothing is ever re-sent here: retries are the caller's (by deadline, counted); a redirect
  with a ``Location`` is followed (at most ``MAX_REDIRECTS``), with the same headers, as
  aiohttp did, but for ``Authorization``, which goes to no other origin (scheme, host, port:
  the Hub's token stays off its CDN's requests);
- after fork the child drops an inherited pool without touching its sockets (``forget``);
- a pool made with a ``network.Network`` goes through the proxy it names for each URL:
  ``http://`` as absolute-form requests on a connection to the proxy,
  ``https://`` through a ``CONNECT`` tunnel, TLS then started inside it. TLS verifies with the
  network's context; a certificate that fails is a ``CertificateError`` whose message says what to do.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from typing import Any

from streamdata.errors import (
    BadResponseError,
    ConnectionLostError,
    ProxyAuthError,
    ProxyError,
    ShortBodyError,
    TransportError,
    TransportTimeoutError,
)
from streamdata.store.network import Network, Proxy
from streamdata.store.session import connect_error, transport_error

__all__ = ["MAX_HEAD", "MAX_HEADERS", "Headers", "Pool", "Response", "default_ssl_context"]

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_HEADERS = 128  # header lines
MAX_LINE = 8 * 1024  # a chunk-size line
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HIGH_WATER = 1 << 20  # bytes buffered per connection before reading pauses
_LOW_WATER = 256 * 1024
_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-5]\d\d)(?: [^\r\n]*)?")
_ABANDONED: list[Any] = []  # inherited connections, kept unclosed (``Pool.forget``)
_SSL: Any = None


def default_ssl_context() -> Any:
    """The process's one verifying SSL context (loading the CA bundle costs ~0.1 s: once)."""
    global _SSL
    if _SSL is None:
        import ssl

        _SSL = ssl.create_default_context()
    return _SSL


def _settle(waiter: asyncio.Future, value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


class _Conn(asyncio.Protocol):
    """One connection: the bytes received, as the ``bytes`` objects the transport handed over."""

    def __init__(self, key: tuple[str, str, int], timeout: float) -> None:
        self.key, self.timeout = key, timeout
        self.origin = f"{key[0]}://{key[1]}:{key[2]}"
        self.transport: Any = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.answers = 0  # answers read to the end on this connection

    # ---- protocol callbacks --------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof, self.error = True, exc
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(True)

    # ---- reading ---------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return not self.eof and not self.chunks and not self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def _more(self) -> None:
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(self.timeout, _settle, waiter, False)
        try:
            if not await waiter:
                raise TransportTimeoutError(f"no data from {self.origin} for {self.timeout:g} s",
                                            url=self.origin)
        finally:
            timer.cancel()
            self.waiter = None

    async def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes, as they came; ``b""`` at a clean end of the connection."""
        while not self.chunks:
            if self.eof:
                if self.error is not None:  # a reset, or a TLS failure
                    raise transport_error(self.error, self.origin) from self.error
                return b""
            await self._more()
        piece = self.chunks.popleft()
        if len(piece) > limit:  # the rest belongs to what follows
            self.chunks.appendleft(piece[limit:])
            piece = piece[:limit]
        self.buffered -= len(piece)
        if self.paused and self.buffered < _LOW_WATER:
            self.paused = False
            self.transport.resume_reading()
        return piece

    def unread(self, data: bytes) -> None:
        if data:
            self.chunks.appendleft(data)
            self.buffered += len(data)

    async def read_until(self, sep: bytes, limit: int, what: str) -> bytes:
        """The bytes before ``sep`` (consumed); ``BadResponseError`` past ``limit`` bytes."""
        buf = bytearray()
        while True:
            piece = await self.read_some(1 << 30)
            if not piece:
                if what == "response head":
                    raise ConnectionLostError(f"{self.key[1]} closed the connection before a complete "
                                              f"response head ({len(buf)} bytes of it)", url=self.origin)
                raise ShortBodyError(f"{self.key[1]} closed the connection in a {what}", url=self.origin)
            if not buf:  # usually the whole head is in the first piece: one copy, of the rest
                at = piece.find(sep)
                if 0 <= at <= limit:
                    self.unread(piece[at + len(sep):])
                    return piece[:at]
            start = max(0, len(buf) - len(sep) + 1)
            buf += piece
            at = buf.find(sep, start)
            if at > limit or (at < 0 and len(buf) > limit):
                raise BadResponseError(f"{what} from {self.key[1]} is over {limit} bytes", url=self.origin)
            if at >= 0:
                self.unread(bytes(buf[at + len(sep):]))
                return bytes(buf[:at])


class _Get:
    def __init__(self, pool: Pool, url: str, headers: Mapping[str, str] | None,
                 timeout: float | None) -> None:
        self.pool, self.url, self.headers, self.timeout = pool, url, headers, timeout
        self.resp: Response | None = None

    async def __aenter__(self) -> Response:
        url, headers = self.url, dict(self.headers or {})
        for hop in range(MAX_REDIRECTS + 1):  # followed as aiohttp did: a new GET, not a re-send
            resp = await self.pool._send(url, headers, self.timeout)
            location = resp.headers.get("location")
            if resp.status not in _REDIRECTS or not location or hop == MAX_REDIRECTS:
                self.resp = resp
                return resp
            try:
                seen = 0
                async for piece in resp.chunks():  # a redirect's small body, read to reuse
                    seen += len(piece)
                    if seen > MAX_HEAD:
                        break
            finally:
                resp.release()  # reused only if read to the end
            moved = urllib.parse.urljoin(url, location)
            if _origin(moved) != _origin(url):
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = moved
        raise AssertionError("unreachable")

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self.resp is not None:
            self.resp.release(failed=kind is not None)


def _origin(url: str) -> tuple[str, str, int]:
    """A URL's origin: scheme, host, port (a redirect to another does not carry ``Authorization``)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


class Pool:
    """Keep-alive connections for one event loop: at most ``limit`` in use at once. A
    ``session.Session``."""

    def __init__(self, limit: int, timeout: float, ssl_context: Any = None, *,
                 network: Network | None = None) -> None:
        self.limit, self.timeout, self._ssl = limit, timeout, ssl_context
        self.network = network  # proxies and certificates; None: direct, the default context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._busy: set[_Conn] = set()
        self.opened = 0  # connections opened (tests count reuse with it)
        self.closed = False

    def get(self, url: str, headers: Mapping[str, str] | None = None, timeout: float | None = None) -> _Get:
        """``async with pool.get(url, headers, timeout) as resp``: one GET, never re-sent;
        ``timeout`` bounds each wait for bytes of its answer (the pool's if ``None``)."""
        return _Get(self, url, headers, timeout)

    async def _send(self, url: str, headers: Mapping[str, str], timeout: float | None = None) -> Response:
        if self.closed:
            raise TransportError("the HTTP connection pool is closed", url=url)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadResponseError(f"not an http(s) URL: {parts.scheme}://{parts.hostname}", url=url)
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        host = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        proxy = self._proxy(key)
        via: list[str] = []
        if proxy is not None and parts.scheme == "http":  # absolute-form, to the proxy
            target = f"http://{host}{target}"
            if proxy.authorization:
                via = [f"Proxy-Authorization: {proxy.authorization}"]
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity",
                 "User-Agent: streamdata", *via, *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        try:
            async with asyncio.timeout(self.timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise TransportTimeoutError(f"no free connection to {key[1]} within {self.timeout:g} s",
                                        url=url) from None
        conn = None
        try:
            conn = self._reuse(key)
            if conn is None:
                conn = await self._connect(key)
            self._busy.add(conn)
            conn.timeout = self.timeout if timeout is None else timeout
            sent = time.monotonic()
            conn.transport.write("\r\n".join(lines).encode("latin-1"))
            resp = await self._response(conn)
            resp.sent_at = sent
            return resp
        except BaseException:
            if conn is not None:
                self._busy.discard(conn)
                conn.abort()
            self._slots.release()
            raise

    def _reuse(self, key: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.usable:
                return conn
            conn.abort()
        return None

    def _proxy(self, key: tuple[str, str, int]) -> Proxy | None:
        return None if self.network is None else self.network.proxy(f"{key[0]}://{key[1]}:{key[2]}")

    def _tls(self, origin: str) -> Any:
        if self._ssl is not None:
            return self._ssl
        return self.network.ssl_context(origin) if self.network is not None else default_ssl_context()

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        scheme, hostname, port = key
        origin = f"{scheme}://{hostname}:{port}"
        tls = self._tls(origin) if scheme == "https" else None
        proxy = self._proxy(key)
        if proxy is not None:
            conn = await self._through(proxy, key, tls)
            self.opened += 1
            return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                _, conn = await loop.create_connection(lambda: _Conn(key, self.timeout), hostname, port,
                                                       ssl=tls, server_hostname=hostname if tls else None)
        except TimeoutError:
            raise TransportTimeoutError(f"connecting to {origin} took over {self.timeout:g} s",
                                        url=origin) from None
        except OSError as exc:  # refused, unreachable, a name not resolved, a TLS handshake
            raise connect_error(exc, origin, self.network) from exc
        self.opened += 1
        return conn

    async def _through(self, proxy: Proxy, key: tuple[str, str, int], tls: Any) -> _Conn:
        """A connection to ``key`` by way of ``proxy``: to the proxy itself for
        http (absolute-form requests follow), a ``CONNECT`` tunnel with TLS inside for https."""
        scheme, hostname, port = key
        origin = f"{scheme}://{hostname}:{port}"
        via = f" through proxy {proxy.shown} ({proxy.source})"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                _, conn = await loop.create_connection(lambda: _Conn(key, self.timeout),
                                                       host=proxy.host, port=proxy.port)
                if tls is None:
                    return conn
                try:
                    auth = [f"Proxy-Authorization: {proxy.authorization}"] if proxy.authorization else []
                    authority = f"[{hostname}]:{port}" if ":" in hostname else f"{hostname}:{port}"
                    conn.transport.write("\r\n".join([f"CONNECT {authority} HTTP/1.1", f"Host: {authority}",
                                                        *auth, "", ""]).encode("latin-1"))
                    head = await conn.read_until(b"\r\n\r\n", MAX_HEAD, "response head")
                    match = _STATUS.match(head)
                    status = int(match.group(2)) if match else 0
                    if status == 407:
                        raise ProxyAuthError(
                            f"the proxy {proxy.shown} ({proxy.source}) refused CONNECT {authority}: 407 "
                            "Proxy Authentication Required; give the proxy's user and password in its "
                            "URL (http://user:password@host:port)", url=origin)
                    if not 200 <= status < 300:
                        line = head.split(b"\r\n", 1)[0][:80].decode("latin-1", "replace")
                        raise ProxyError(f"the proxy {proxy.shown} ({proxy.source}) answered CONNECT "
                                         f"{authority} with {line!r}", url=origin)
                    if conn.chunks:
                        raise BadResponseError(f"the proxy {proxy.shown} sent bytes after its CONNECT "
                                               "answer", url=origin)
                    conn.transport = await loop.start_tls(conn.transport, conn, tls, server_hostname=hostname)
                except BaseException:
                    conn.abort()
                    raise
                return conn
        except TimeoutError:
            raise TransportTimeoutError(f"connecting to {origin}{via} took over {self.timeout:g} s",
                                        url=origin) from None
        except TransportError:
            raise
        except OSError as exc:
            raise connect_error(exc, origin, self.network, via) from exc

    async def _response(self, conn: _Conn) -> Response:
        host = conn.key[1]
        for _ in range(8):  # 1xx interim answers are skipped (a few at most)
            head = await conn.read_until(b"\r\n\r\n", MAX_HEAD, "response head")
            lines = head.split(b"\r\n")
            match = _STATUS.fullmatch(lines[0])
            if match is None:
                raise BadResponseError(f"bad status line {lines[0][:60]!r} from {host}", url=conn.origin)
            if len(lines) > MAX_HEADERS + 1:
                raise BadResponseError(f"{host} sent over {MAX_HEADERS} header lines", url=conn.origin)
            status = int(match.group(2))
            if status >= 200:
                break
        else:
            raise BadResponseError(f"{host} sent only interim (1xx) answers", url=conn.origin)
        headers = Headers()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or name[:1] in b" \t":
                raise BadResponseError(f"bad header line {line[:60]!r} from {host}", url=conn.origin)
            name_s, value_s = name.decode("latin-1").lower(), value.strip().decode("latin-1")
            headers[name_s] = f"{headers[name_s]}, {value_s}" if name_s in headers else value_s
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = match.group(1) == b"1" and "close" not in tokens
        coding = headers.get("transfer-encoding")
        length: int | None = None
        if status in (204, 304):
            length = 0
        elif coding is not None:
            if coding.strip().lower() != "chunked":
                raise BadResponseError(f"{host} sent a body in transfer coding {coding!r}; only chunked "
                                       "is read", url=conn.origin)
        elif "content-length" in headers:
            text = headers["content-length"].strip()
            if not text.isdigit():  # also two different values joined by ", "
                raise BadResponseError(f"bad Content-Length {text[:40]!r} from {host}", url=conn.origin)
            length = int(text)
        else:
            keep_alive = False  # the body ends when the server closes the connection
        chunked = coding is not None and length != 0
        return Response(self, conn, status, headers, length, chunked, keep_alive)

    def _release(self, conn: _Conn, reuse: bool) -> None:
        self._busy.discard(conn)
        if reuse and not self.closed and conn.usable and len(self._idle.get(conn.key, ())) < self.limit:
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.abort()
        if self._slots is not None:
            self._slots.release()

    @property
    def idle(self) -> int:
        return sum(map(len, self._idle.values()))

    async def close(self) -> None:
        """Close every connection (on the pool's loop)."""
        self.closed = True
        for conn in [c for idle in self._idle.values() for c in idle] + list(self._busy):
            conn.abort()
        self._idle.clear()
        self._busy.clear()

    def forget(self) -> None:
        """In a forked child: drop the pool without touching its sockets (FORK-RESET): they are
        the parent's too, and its loop does not run here. Kept referenced, never closed."""
        self.closed = True
        _ABANDONED.extend(c for idle in self._idle.values() for c in idle)
        _ABANDONED.extend(self._busy)
        self._idle, self._busy = {}, set()


class Headers(dict):
    """Response headers by lower-case name; ``get`` takes any case."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)


class Response:
    """A response's status and headers; its body streams from ``chunks`` (or ``read``) through
    the connection it came on, which goes back to ``pool`` when released."""

    def __init__(self, pool: Pool, conn: _Conn, status: int, headers: Headers, length: int | None,
                 chunked: bool, keep_alive: bool) -> None:
        self.pool, self.conn, self.status, self.headers = pool, conn, status, headers
        self.length, self.chunked, self.keep_alive = length, chunked, keep_alive
        self.done = length == 0  # the body was read to its end
        self._released = False
        self.sent_at: float | None = None  # when the request went out on its connection (monotonic)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes in the pieces they arrived in (split only at the body's end)."""
        conn, host = self.conn, self.conn.key[1]
        if self.chunked:
            while True:
                line = await conn.read_until(b"\r\n", MAX_LINE, "chunk size line")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadResponseError(f"bad chunk size line {line[:40]!r} from {host}",
                                           url=conn.origin) from None
                if size == 0:
                    if await self._trailer():
                        await conn.read_until(b"\r\n\r\n", MAX_HEAD, "trailer")
                    break
                while size:
                    piece = await conn.read_some(size)
                    if not piece:
                        raise ShortBodyError(f"{host} ended a chunked body mid-chunk", url=conn.origin)
                    size -= len(piece)
                    yield piece
                if await conn.read_until(b"\r\n", 2, "chunk end") != b"":
                    raise BadResponseError(f"a chunk from {host} does not end with CRLF", url=conn.origin)
        elif self.length is not None:
            left = self.length
            while left:
                piece = await conn.read_some(left)
                if not piece:
                    raise ShortBodyError(f"{host} ended the body after {self.length - left} of "
                                         f"{self.length} bytes (Content-Length)", url=conn.origin)
                left -= len(piece)
                yield piece
        else:  # the body ends with the connection
            while piece := await conn.read_some(1 << 30):
                yield piece
        self.done = True

    async def _trailer(self) -> bool:
        """After the last chunk: True if trailer fields follow (then read to the blank line)."""
        first = await self.conn.read_some(2)
        if len(first) == 1:
            first += await self.conn.read_some(1)
        if first == b"\r\n":
            return False
        self.conn.unread(first)
        return True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def release(self, failed: bool = False) -> None:
        """Give the connection back: to the pool if the answer was read whole and it may be
        reused, else closed."""
        if self._released:
            return
        self._released = True
        reuse = self.done and self.keep_alive and not failed
        if reuse:
            self.conn.answers += 1
        self.pool._release(self.conn, reuse)
