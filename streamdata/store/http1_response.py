"""LITE-HTTP's answers (``h1``): the errors a bad one raises, the limits on its head, and a
response whose body streams in the pieces the socket delivered.

The body is read through the connection (``h1._Conn``: ``read_until``, ``read_some``,
``unread``); the connection goes back to its pool (``h1.Pool._release``) when the response is
released: reused only if the answer was read to its end from a server that keeps it alive.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_HEAD", "MAX_HEADERS", "MAX_LINE", "Disconnected", "Headers", "IncompleteRead",
           "ProtocolError", "Response"]

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_HEADERS = 128  # header lines
MAX_LINE = 8 * 1024  # a chunk-size line


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.1 this client can read; the connection is closed."""


class Disconnected(ConnectionError):
    """The server closed the connection before its answer's head was complete."""


class IncompleteRead(ConnectionError):
    """The connection ended before the body did (``Content-Length`` or chunked framing)."""


class Headers(dict):
    """Response headers by lower-case name; ``get`` takes any case."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


class Response:
    """A response's status and headers; its body streams from ``iter_chunks`` (or ``read``)."""

    def __init__(self, pool: Any, conn: Any, status: int, headers: Headers, length: int | None,
                 chunked: bool, keep_alive: bool) -> None:
        self.pool, self.conn, self.status, self.headers = pool, conn, status, headers
        self.length, self.chunked, self.keep_alive = length, chunked, keep_alive
        self.done = length == 0  # the body was read to its end
        self._released = False

    async def iter_chunks(self) -> Any:
        """The body's bytes in the pieces they arrived in (split only at the body's end)."""
        conn, host = self.conn, self.conn.key[1]
        if self.chunked:
            while True:
                line = await conn.read_until(b"\r\n", MAX_LINE, "chunk size line")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {line[:40]!r} from {host}") from None
                if size == 0:
                    if await self._trailer():
                        await conn.read_until(b"\r\n\r\n", MAX_HEAD, "trailer")
                    break
                while size:
                    piece = await conn.read_some(size)
                    if not piece:
                        raise IncompleteRead(f"{host} ended a chunked body mid-chunk")
                    size -= len(piece)
                    yield piece
                if await conn.read_until(b"\r\n", 2, "chunk end") != b"":
                    raise ProtocolError(f"a chunk from {host} does not end with CRLF")
        elif self.length is not None:
            left = self.length
            while left:
                piece = await conn.read_some(left)
                if not piece:
                    raise IncompleteRead(f"{host} ended the body after {self.length - left} of "
                                         f"{self.length} bytes (Content-Length)")
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
        return b"".join([piece async for piece in self.iter_chunks()])

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
