"""A user-space TCP latency proxy, for benchmarks and tests.

Listens on a loopback port and forwards every connection to ``upstream_host:upstream_port``.
Each chunk, in each direction, is delivered ``delay_s`` after it arrived (one-way delay, so a
round trip costs ``2 * delay_s``). Delivery is pipelined: a chunk waits for its own deadline,
not behind the previous chunk's delay, so throughput is not limited by the delay (up to
``window_bytes`` in flight per direction and connection, like a TCP window). Optional:

- ``bandwidth``: bytes/s per connection and direction (a serialisation delay before the
  one-way delay, as on a real link);
- ``link_bandwidth``: bytes/s per direction shared by all connections (one network link:
  the client's NIC or the path to the bucket), applied after ``bandwidth``;
- ``split``: forward data in random pieces of 1..split bytes (to exercise parsers that
  see partial arrivals);
- ``handshake_rtts``: round trips a new connection pays before its first byte reaches the
  upstream (the proxy accepts locally at once; a real TCP handshake costs one RTT).

Only the standard library is used, so tests and the CLI import it cheaply::

    python -m benchmarks.proxy --upstream 127.0.0.1:9000 --delay 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import threading
from urllib.parse import urlsplit, urlunsplit

from ._looped import LoopedServer

__all__ = ["LatencyProxy", "main"]

CHUNK = 256 * 1024
DEFAULT_WINDOW = 16 * 1024 * 1024


class _DelayLine:
    """One direction of one connection: read chunks, deliver each at its deadline, in order."""

    def __init__(
        self,
        proxy: LatencyProxy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        upstream: bool,
        ready_at: float,
        conn: int = 0,
    ) -> None:
        self.proxy = proxy
        self.conn = conn
        self.reader = reader
        self.writer = writer
        self.upstream = upstream
        self.ready_at = ready_at  # no byte is delivered before this loop time
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.in_flight = 0
        self.has_items = asyncio.Event()
        self.has_room = asyncio.Event()
        self.has_room.set()

    async def run(self) -> None:
        await _all_or_none(self._receive(), self._deliver())

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        link_free = 0.0
        while True:
            data = await self.reader.read(CHUNK)
            now = loop.time()
            if self.upstream and data and self.proxy.events is not None:
                self.proxy._event("request", now, self.conn, data)
            sent = now
            bandwidth = self.proxy.bandwidth
            if bandwidth and data:
                link_free = max(now, link_free) + len(data) / bandwidth
                sent = link_free
            shared = self.proxy.link_bandwidth
            if shared and data:  # one link for every connection: one serialisation queue
                free = self.proxy._link_free
                free[self.upstream] = max(sent, free[self.upstream]) + len(data) / shared
                sent = free[self.upstream]
            self.queue.append((max(sent, self.ready_at) + self.proxy.delay_s, data))
            self.in_flight += len(data)
            self.has_items.set()
            if not data:  # EOF travels with the same delay as data
                return
            while self.in_flight >= self.proxy.window_bytes:
                self.has_room.clear()
                await self.has_room.wait()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.has_items.clear()
                await self.has_items.wait()
            deadline, data = self.queue.popleft()
            wait = deadline - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            if not self.upstream and self.proxy.events is not None:
                self.proxy._event("response", loop.time(), self.conn, data)
            for piece in self.proxy._pieces(data):
                self.proxy._count(len(piece), upstream=self.upstream)  # before the peer can see it
                self.writer.write(piece)
                await self.writer.drain()
                if self.proxy.split:
                    await asyncio.sleep(0)  # let each piece leave as its own segment
            self.in_flight -= len(data)
            if self.in_flight < self.proxy.window_bytes:
                self.has_room.set()


async def _all_or_none(*coros) -> None:
    """Run ``coros`` concurrently; the first failure (or a cancellation) cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=5.0)
    for t in done:
        t.result()  # re-raise the first failure


class LatencyProxy(LoopedServer):
    """Delaying TCP forwarder running on its own event loop in a background thread.

    Use as a context manager; ``port`` is the listening port, ``url_for(endpoint)`` rewrites an
    endpoint URL to go through the proxy. ``bytes_up`` counts client->upstream bytes delivered,
    ``bytes_down`` upstream->client; ``connections`` counts accepted connections.
    """

    thread_name = "latency-proxy"

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        delay_s: float = 0.1,
        bandwidth: float | None = None,
        split: int | None = None,
        *,
        handshake_rtts: int = 1,
        window_bytes: int = DEFAULT_WINDOW,
        link_bandwidth: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ) -> None:
        if delay_s < 0 or any(b is not None and b <= 0 for b in (bandwidth, link_bandwidth)):
            raise ValueError("delay_s must be >= 0, bandwidth and link_bandwidth > 0")
        if split is not None and split < 1:
            raise ValueError("split must be >= 1")
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.delay_s = float(delay_s)
        self.bandwidth = bandwidth
        self.link_bandwidth = link_bandwidth
        self._link_free = {True: 0.0, False: 0.0}  # per direction: when the link is next idle
        self.split = split
        self.handshake_rtts = handshake_rtts
        self.window_bytes = window_bytes
        self.host = host
        self.port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._up = 0
        self._down = 0
        self._connections = 0
        self.events: list[tuple[str, float, int, str]] | None = None  # see record_events
        super().__init__()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- public API ---------------------------------------------------------------------------

    @property
    def bytes_up(self) -> int:
        with self._lock:
            return self._up

    @property
    def bytes_down(self) -> int:
        with self._lock:
            return self._down

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections

    def reset_counters(self) -> None:
        with self._lock:
            self._up = self._down = self._connections = 0

    def record_events(self, on: bool = True) -> None:
        """Start (again, emptied) or stop logging ``events``: ``(kind, time, connection, line)``
        for every chunk a client sends that starts an HTTP request (``kind`` "request", the
        time it reached the proxy) and every chunk delivered to a client that starts an HTTP
        response ("response", the time it was handed to the client), ``line`` its first line;
        and every connection accepted ("accept", ``line`` empty).
        Times are ``time.monotonic()`` (the loop's clock), comparable across processes."""
        with self._lock:
            self.events = [] if on else None

    def _event(self, kind: str, when: float, conn: int, data: bytes) -> None:
        head = data[:4096]
        if not (head.startswith(b"HTTP/1.") if kind == "response" else head[:1].isupper()):
            return
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        if kind == "request" and not line.endswith(("HTTP/1.1", "HTTP/1.0")):
            return
        with self._lock:
            if self.events is not None:
                self.events.append((kind, when, conn, line))

    def set_delay(self, delay_s: float) -> None:
        """Change the one-way delay; applies to chunks that arrive from now on."""
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        self.delay_s = float(delay_s)

    def url_for(self, endpoint_url: str) -> str:
        """``endpoint_url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(endpoint_url)
        return urlunsplit(parts._replace(netloc=f"{self.host}:{self.port}"))

    async def _startup(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            except TimeoutError:  # asyncio.TimeoutError is this builtin since 3.11
                pass

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._connections += 1
            conn = self._connections
            if self.events is not None:
                self.events.append(("accept", asyncio.get_running_loop().time(), conn, ""))
        upstream_w: asyncio.StreamWriter | None = None
        graceful = False
        try:
            upstream_r, upstream_w = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
            ready_at = asyncio.get_running_loop().time() + self.handshake_rtts * 2 * self.delay_s
            up = _DelayLine(self, client_r, upstream_w, upstream=True, ready_at=ready_at,
                            conn=conn)
            down = _DelayLine(self, upstream_r, client_w, upstream=False, ready_at=0.0, conn=conn)
            await _all_or_none(up.run(), down.run())
            graceful = True
        except (ConnectionError, OSError):
            pass  # a reset on either side ends the connection; the peers see it closed
        except asyncio.CancelledError:
            pass  # shutdown; returning normally keeps asyncio's stream callback quiet
        finally:
            for writer in (client_w, upstream_w):
                if writer is None:
                    continue
                if graceful:
                    writer.close()
                else:
                    writer.transport.abort()
            self._tasks.discard(task)

    def _pieces(self, data: bytes) -> list[bytes]:
        if not self.split:
            return [data]
        pieces, i = [], 0
        while i < len(data):
            n = self._rng.randint(1, self.split)
            pieces.append(data[i : i + n])
            i += n
        return pieces

    def _count(self, n: int, *, upstream: bool) -> None:
        with self._lock:
            if upstream:
                self._up += n
            else:
                self._down += n


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TCP proxy adding a one-way delay to every chunk.")
    p.add_argument("--upstream", required=True, help="host:port to forward to")
    p.add_argument("--port", type=int, default=0, help="listening port (0: any free one)")
    p.add_argument("--delay", type=float, default=0.1, help="one-way delay in seconds")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s per connection")
    p.add_argument("--link", type=float, default=None,
                   help="bytes/s per direction shared by all connections (one link)")
    p.add_argument("--split", type=int, default=None, help="forward in pieces of 1..N bytes")
    p.add_argument("--handshake-rtts", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run until SIGINT/SIGTERM; print the port on start and the byte counters on exit."""
    args = _parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    with LatencyProxy(
        host or "127.0.0.1",
        int(port),
        args.delay,
        args.bandwidth,
        args.split,
        handshake_rtts=args.handshake_rtts,
        port=args.port,
        link_bandwidth=args.link,
    ) as proxy:
        proxy.serve_until_signalled({"port": proxy.port, "delay_s": proxy.delay_s}, lambda: {
            "bytes_up": proxy.bytes_up, "bytes_down": proxy.bytes_down})


if __name__ == "__main__":
    main()
