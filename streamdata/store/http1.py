"""A small HTTP/1.1 client on asyncio for LITE-S3's GETs (LITE-HTTP): no aiohttp to import.

Everything LITE-S3 (``s3lite``) sends after the listing is a GET of a presigned URL. This
client sends it over a per-loop pool of keep-alive connections (at most ``limit`` in use,
as aiohttp's ``TCPConnector(limit=)`` did) and streams the body as the chunks the socket
delivered, uncopied. Importing aiohttp cost 0.3 s of CPU in the process that builds a dataset
on a 2-core machine (benchmarks/README.md, "Start-up"); this module needs only the standard
library, which torch has imported already.

Rules, each a test in tests/test_h1.py:

- every wait is bounded: connecting, and each wait for the next bytes of an answer, by
  ``timeout`` (``TimeoutError``); the caller bounds the whole request too (``client``);
- a bad answer (status line, a head over ``MAX_HEAD`` bytes or ``MAX_HEADERS`` lines, a bad
  chunk, an unknown transfer coding) is ``ProtocolError``, a connection that ends before the
  body does ``IncompleteRead`` (both ``ConnectionError``: ``retry.classify`` retries them);
- a connection is reused only after its answer was read to the end, with nothing extra, from a
  server that keeps it alive; one that failed, was cut or left half read is closed;
- nothing is ever re-sent here: retries are the caller's (by deadline, counted); a redirect
  with a ``Location`` is followed (at most ``MAX_REDIRECTS``), with the same headers, as
  aiohttp did;
- after fork the child drops an inherited pool without touching its sockets (``forget``);
- a new plain-http connection is first claimed from ``handover`` (WARM-HANDOVER): an idle
  one the constructor left (``adopted``, not ``opened``);
- ``connect_ahead`` opens connections before the requests that will use them (CONNECT-AHEAD):
  a reader's window goes out on connections already open, one round trip earlier.
"""

from __future__ import annotations

import asyncio
import collections
import re
import urllib.parse
from typing import Any

from streamdata.store.handover import claim, waiting
from streamdata.store.http1_response import (
    MAX_HEAD,
    MAX_HEADERS,
    Disconnected,
    Headers,
    IncompleteRead,
    ProtocolError,
    Response,
)

__all__ = ["Disconnected", "IncompleteRead", "Pool", "ProtocolError", "Response", "default_ssl_context"]

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


class _Conn(asyncio.Protocol):
    """One connection: the bytes received, as the ``bytes`` objects the transport handed over."""

    def __init__(self, key: tuple[str, str, int], timeout: float) -> None:
        self.key, self.timeout = key, timeout
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
        timer = loop.call_later(self.timeout, lambda: waiter.done() or waiter.set_result(False))
        try:
            if not await waiter:
                host = self.key[1]
                raise TimeoutError(f"no data from {host}:{self.key[2]} for {self.timeout:g} s")
        finally:
            timer.cancel()
            self.waiter = None

    async def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes, as they came; ``b""`` at a clean end of the connection."""
        while not self.chunks:
            if self.eof:
                if self.error is not None:  # a reset, or a TLS failure
                    raise self.error
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
        """The bytes before ``sep`` (consumed); ``ProtocolError`` past ``limit`` bytes."""
        buf = bytearray()
        while True:
            piece = await self.read_some(1 << 30)
            if not piece:
                if what == "response head":
                    raise Disconnected(f"{self.key[1]} closed the connection before a complete "
                                       f"response head ({len(buf)} bytes of it)")
                raise IncompleteRead(f"{self.key[1]} closed the connection in a {what}")
            if not buf:  # usually the whole head is in the first piece: one copy, of the rest
                at = piece.find(sep)
                if 0 <= at <= limit:
                    self.unread(piece[at + len(sep):])
                    return piece[:at]
            start = max(0, len(buf) - len(sep) + 1)
            buf += piece
            at = buf.find(sep, start)
            if at > limit or (at < 0 and len(buf) > limit):
                raise ProtocolError(f"{what} from {self.key[1]} is over {limit} bytes")
            if at >= 0:
                self.unread(bytes(buf[at + len(sep):]))
                return bytes(buf[:at])


class _Get:
    def __init__(self, pool: Pool, url: str, headers: dict[str, str] | None) -> None:
        self.pool, self.url, self.headers = pool, url, headers
        self.resp: Response | None = None

    async def __aenter__(self) -> Response:
        url = self.url
        for hop in range(MAX_REDIRECTS + 1):  # followed as aiohttp did: a new GET, not a re-send
            resp = await self.pool._send(url, self.headers or {})
            location = resp.headers.get("location")
            if resp.status not in _REDIRECTS or not location or hop == MAX_REDIRECTS:
                self.resp = resp
                return resp
            try:
                seen = 0
                async for piece in resp.iter_chunks():  # a redirect's small body, read to reuse
                    seen += len(piece)
                    if seen > MAX_HEAD:
                        break
            finally:
                resp.release()  # reused only if read to the end
            url = urllib.parse.urljoin(url, location)
        raise AssertionError("unreachable")

    async def __aexit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self.resp is not None:
            self.resp.release(failed=kind is not None)


class Pool:
    """Keep-alive connections for one event loop: at most ``limit`` in use at once."""

    def __init__(self, limit: int, timeout: float, ssl_context: Any = None) -> None:
        self.limit, self.timeout, self._ssl = limit, timeout, ssl_context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._busy: set[_Conn] = set()
        self.opened = 0  # connections opened (tests count reuse with it)
        self.adopted = 0  # connections taken over from the constructor (WARM-HANDOVER, ``handover``)
        self.closed = False
        self._ahead: dict[tuple[str, str, int], list[asyncio.Task]] = {}  # CONNECT-AHEAD, not taken yet
        self._opening: dict[tuple[str, str, int], int] = {}  # connections requests are opening now
        self.ahead_failed = 0  # connections opened ahead that failed (a request opens its own)

    def get(self, url: str, headers: dict[str, str] | None = None) -> _Get:
        """``async with pool.get(url, headers) as resp``: one GET, never re-sent."""
        return _Get(self, url, headers)

    async def _send(self, url: str, headers: dict[str, str]) -> Response:
        if self.closed:
            raise ConnectionError("the HTTP connection pool is closed")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProtocolError(f"not an http(s) URL: {parts.scheme}://{parts.hostname}")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        host = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity",
                 "User-Agent: streamdata", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        try:
            async with asyncio.timeout(self.timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise TimeoutError(f"no free connection to {key[1]} within {self.timeout:g} s") from None
        conn = None
        try:
            conn = self._reuse(key)
            if conn is None and not waiting(key):  # a handed-over connection goes first
                conn = await self._take_ahead(key)
            if conn is None:
                self._opening[key] = self._opening.get(key, 0) + 1  # counted by connect_ahead
                try:
                    conn = await self._connect(key)
                finally:
                    self._opening[key] -= 1
            self._busy.add(conn)
            conn.transport.write("\r\n".join(lines).encode("latin-1"))
            return await self._response(conn)
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

    def connect_ahead(self, key: tuple[str, str, int], count: int) -> None:
        """CONNECT-AHEAD: start opening connections to ``key`` now (TCP, and TLS for https),
        so that the requests to come find them ready (a round trip earlier): up to ``count``
        (at most ``limit``) with those idle, in use, opening or handed over (WARM-HANDOVER).
        A request that finds none idle takes one still opening rather than opening another.
        One that fails is dropped (``ahead_failed``): a request then opens its own, retried as
        any connection is. Bounded by ``timeout``."""
        if self.closed:
            return
        pending = self._ahead.setdefault(key, [])
        have = (len(self._idle.get(key, ())) + len(pending) + waiting(key)
                + self._opening.get(key, 0) + sum(conn.key == key for conn in self._busy))
        for _ in range(min(count, self.limit) - have):
            task = asyncio.ensure_future(self._connect(key, handed=False))
            pending.append(task)
            task.add_done_callback(lambda t, key=key: self._ahead_done(key, t))

    def _ahead_done(self, key: tuple[str, str, int], task: asyncio.Task) -> None:
        pending = self._ahead.get(key, [])
        if task not in pending:  # taken by a request, which reads its result itself
            return
        pending.remove(task)
        if task.cancelled() or task.exception() is not None:
            self.ahead_failed += not task.cancelled()
            return
        conn = task.result()
        if self.closed or not conn.usable or len(self._idle.get(key, ())) >= self.limit:
            conn.abort()
        else:
            self._idle.setdefault(key, []).append(conn)

    async def _take_ahead(self, key: tuple[str, str, int]) -> _Conn | None:
        """A connection opened ahead and still opening (``None``: none, or it failed)."""
        pending = self._ahead.get(key)
        if not pending:
            return None
        task = pending.pop(0)
        try:
            conn = await asyncio.shield(task)  # a request cancelled here leaves the open to the pool
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise ConnectionError("the HTTP connection pool is closed") from None  # not this request
            pending.append(task)  # pooled (or closed) by _ahead_done, never lost
            if task.done():
                self._ahead_done(key, task)
            raise
        except OSError:  # TimeoutError and ssl's errors among them
            self.ahead_failed += 1
            return None
        if conn.usable:
            return conn
        conn.abort()
        return None

    async def _connect(self, key: tuple[str, str, int], handed: bool = True) -> _Conn:
        scheme, hostname, port = key
        tls = (self._ssl or default_ssl_context()) if scheme == "https" else None
        loop = asyncio.get_running_loop()
        # WARM-HANDOVER: the constructor's idle one (not for CONNECT-AHEAD: a request takes it)
        sock = claim(key) if tls is None and handed else None
        where = {"sock": sock} if sock is not None else {"host": hostname, "port": port}
        try:
            async with asyncio.timeout(self.timeout):
                _, conn = await loop.create_connection(lambda: _Conn(key, self.timeout), **where,
                                                       ssl=tls, server_hostname=hostname if tls else None)
        except TimeoutError:
            raise TimeoutError(f"connecting to {hostname}:{port} took over {self.timeout:g} s") from None
        if sock is not None:
            self.adopted += 1
        else:
            self.opened += 1
        return conn

    async def _response(self, conn: _Conn) -> Response:
        host = conn.key[1]
        for _ in range(8):  # 1xx interim answers are skipped (a few at most)
            head = await conn.read_until(b"\r\n\r\n", MAX_HEAD, "response head")
            lines = head.split(b"\r\n")
            match = _STATUS.fullmatch(lines[0])
            if match is None:
                raise ProtocolError(f"bad status line {lines[0][:60]!r} from {host}")
            if len(lines) > MAX_HEADERS + 1:
                raise ProtocolError(f"{host} sent over {MAX_HEADERS} header lines")
            status = int(match.group(2))
            if status >= 200:
                break
        else:
            raise ProtocolError(f"{host} sent only interim (1xx) answers")
        headers = Headers()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or name[:1] in b" \t":
                raise ProtocolError(f"bad header line {line[:60]!r} from {host}")
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
                raise ProtocolError(f"{host} sent a body in transfer coding {coding!r}; only chunked is read")
        elif "content-length" in headers:
            text = headers["content-length"].strip()
            if not text.isdigit():  # also two different values joined by ", "
                raise ProtocolError(f"bad Content-Length {text[:40]!r} from {host}")
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
        for task in [t for pending in self._ahead.values() for t in pending]:
            task.cancel()  # one that completes anyway is closed by _ahead_done
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
        _ABANDONED.extend(t for pending in self._ahead.values() for t in pending)
        self._idle, self._busy, self._ahead, self._opening = {}, set(), {}, {}
