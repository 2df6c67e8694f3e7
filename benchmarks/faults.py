"""A fault-injecting HTTP/1.1 reverse proxy, for tests and benchmarks.

Listens on a loopback port and forwards every request to one upstream endpoint (moto's S3
server, fake-gcs-server, the HTTP test server), one upstream connection per client
connection, keep-alive on both sides. Requests and responses are parsed (Content-Length and
chunked bodies, bodies read to EOF), so faults hit exact points of a response::

    from benchmarks.faults import FaultProxy, Fault
    with FaultProxy("http://127.0.0.1:9000") as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        proxy.add(Fault("reset", after_bytes=1000, match="get", times=3))
        proxy.add(Fault("status", status=503, match="get", times=5))   # S3's SlowDown body
        proxy.outage(seconds=3.0, mode="refuse")
        proxy.requests, proxy.faults_injected                          # counts by kind

Fault kinds (``Fault(kind, ...)``):

- ``"status"``: answer ``status`` (503 by default) with ``body`` (S3's XML error for the
  status when ``None``) without asking the upstream; the connection stays open.
- ``"reset"``: forward the request, pass the response headers and ``after_bytes`` body bytes,
  then reset the connection (RST). ``after_bytes=None``: reset before any response byte.
- ``"truncate"``: like reset, but close cleanly (FIN) after ``after_bytes`` body bytes
  (``None``: right after the headers): the promised Content-Length is never met.
- ``"stall"``: pass the headers and ``after_bytes`` body bytes (``None``: none), then send
  nothing until the client gives up (or for ``seconds``, then go on normally).
- ``"hang"``: accept the request and answer nothing, not even headers, until the client
  gives up (or for ``seconds``, then forward it: a slow answer).

``after_bytes`` counts body bytes as sent (chunk framing included); for reset and truncate it
is capped at the body's length minus one, so a faulted response is always incomplete.
``match`` selects requests: ``None`` (every request), a kind (see :func:`request_kind`), a
tuple of kinds, or a callable ``(method, path, query) -> bool`` on the raw request target.
``times``: how many requests the fault hits (``None``: all). The first fault that matches a
request (in the order added) and has hits left applies; one fault per request.

``outage(seconds, mode)``: for the next ``seconds`` every request fails: ``"refuse"`` stops
listening (new connections are refused; requests on open ones are reset), ``"reset"``
resets every request, ``"503"`` answers 503 ServiceUnavailable.

Only the standard library is used (like ``benchmarks.proxy``)::

    python -m benchmarks.faults --upstream http://127.0.0.1:9000 --fault status:status=503,match=get,times=5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from ._looped import LoopedServer

__all__ = ["FAULT_KINDS", "S3_SLOWDOWN_XML", "Fault", "FaultProxy", "main", "request_kind",
           "s3_error_xml"]

CHUNK = 256 * 1024
HEAD_LIMIT = 1 << 20  # longest request or response head accepted
FAULT_KINDS = ("status", "reset", "truncate", "stall", "hang")
OUTAGE_MODES = ("refuse", "reset", "503")


def s3_error_xml(code: str, message: str) -> bytes:
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>FAULTPROXY0000001</RequestId><HostId>faultproxy</HostId></Error>").encode()


S3_SLOWDOWN_XML = s3_error_xml("SlowDown", "Please reduce your request rate.")
_ERROR_BODIES = {
    500: s3_error_xml("InternalError", "We encountered an internal error. Please try again."),
    503: S3_SLOWDOWN_XML,
    429: s3_error_xml("TooManyRequests", "Please reduce your request rate."),
}
_OUTAGE_BODY = s3_error_xml("ServiceUnavailable", "Service is unable to handle the request.")
_REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
# query keys of an S3 ListObjects(V2) request; any other key on a bucket GET is another call
_S3_LIST_KEYS = {"list-type", "prefix", "delimiter", "max-keys", "marker", "continuation-token",
                 "start-after", "encoding-type", "fetch-owner"}


def request_kind(method: str, path: str, query: str, *, signed: bool = False) -> str:
    """What a request does: ``"list"`` (S3 ``?list-type=2`` or ``GET /bucket?...``, GCS
    ``/storage/v1/b/B/o``, an HTTP directory ``GET .../``), ``"head"`` (HEAD, or a GCS object
    metadata GET), ``"get"`` (an object's bytes, ranged or whole), else the lower-case method
    (``"put"``, ``"post"``, ``"delete"``) or ``"other"`` (other bucket-level GETs).
    ``signed``: the request carries an S3 signature, so a bare ``GET /name`` lists bucket
    ``name`` (unsigned, it is a file of an HTTP server)."""
    method = method.upper()
    if method == "HEAD":
        return "head"
    if method != "GET":
        return method.lower()
    keys = set(parse_qs(query, keep_blank_values=True))
    parts = path.split("?", 1)[0].strip("/").split("/")
    if "list-type" in keys:
        return "list"
    if "/storage/v1/b/" in path or path.startswith("/download/storage/v1/b/"):
        at = parts.index("b") if "b" in parts else 0
        rest = parts[at + 1:]  # bucket, "o", object...
        if len(rest) == 2 and rest[1] == "o":
            return "list"
        if len(rest) >= 3 and rest[1] == "o":
            alt = parse_qs(query).get("alt", [""])[0]
            return "get" if alt == "media" or parts[0] == "download" else "head"
        return "other"
    if len(parts) == 1 and parts[0] and (signed or keys):
        # GET /bucket, /bucket?prefix=...; other keys: GET /bucket?location and the like
        return "list" if keys <= _S3_LIST_KEYS else "other"
    if path.endswith("/"):
        return "list"  # an HTTP directory listing
    return "get"


Match = str | tuple[str, ...] | Callable[[str, str, str], bool] | None


@dataclass
class Fault:
    """One fault rule (see the module docstring for each kind)."""

    kind: str
    status: int = 503
    body: bytes | None = None
    after_bytes: int | None = None
    match: Match = None
    times: int | None = 1
    seconds: float | None = None  # stall, hang: how long (None: until the client gives up)
    headers: dict[str, str] = field(default_factory=dict)  # status: extra response headers

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, not {self.kind!r}")
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0 or None")
        if self.after_bytes is not None and self.after_bytes < 0:
            raise ValueError("after_bytes must be >= 0 or None")

    def matches(self, method: str, path: str, query: str, kind: str) -> bool:
        m = self.match
        if m is None:
            return True
        if isinstance(m, str):
            return m == kind
        if isinstance(m, tuple):
            return kind in m
        return bool(m(method, path, query))


class _Closed(Exception):
    """The client connection is done (EOF between requests, or a fault ended it)."""


@dataclass
class _Message:
    head: bytes
    start_line: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def wants_close(self) -> bool:
        conn = (self.get("connection") or "").lower()
        return "close" in conn or (self.start_line.endswith("HTTP/1.0") and "keep-alive" not in conn)


async def _read_head(reader: asyncio.StreamReader) -> _Message | None:
    """A request or response head, or None at EOF before its first byte."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial.strip():
            return None
        raise ConnectionError("connection closed inside a message head") from err
    lines = head[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return _Message(head, lines[0], headers)


async def _body_pieces(reader: asyncio.StreamReader, msg: _Message, *, no_body: bool):
    """The raw body bytes of ``msg`` as they arrive (chunk framing kept); yields nothing for a
    body-less message; reads to EOF when the message has no framing."""
    if no_body:
        return
    if "chunked" in (msg.get("transfer-encoding") or "").lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            yield line
            if size == 0:  # trailers, then an empty line
                while True:
                    line = await reader.readuntil(b"\r\n")
                    yield line
                    if line == b"\r\n":
                        return
            left = size + 2  # the data and its CRLF
            while left:
                data = await reader.read(min(left, CHUNK))
                if not data:
                    raise ConnectionError("connection closed inside a chunked body")
                left -= len(data)
                yield data
    length = msg.get("content-length")
    if length is not None:
        left = int(length)
        while left:
            data = await reader.read(min(left, CHUNK))
            if not data:
                raise ConnectionError("connection closed inside a body")
            left -= len(data)
            yield data
        return
    while data := await reader.read(CHUNK):  # a response framed by the connection's end
        yield data


class FaultProxy(LoopedServer):
    """HTTP/1.1 reverse proxy injecting faults by rule, on its own loop in a background thread.

    ``url`` is the proxy's base URL (use it as ``endpoint_url``); ``requests`` counts requests
    by kind (:func:`request_kind`), ``faults_injected`` faults by kind (outages as
    ``"outage"``); ``history`` keeps the last requests as ``(kind, method, target, outcome)``;
    ``transfers`` the last forwarded answers as ``(kind, path, range, body_bytes)``: the
    request's Range header (None without one) and the body bytes the client was sent.
    """

    thread_name = "fault-proxy"

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(upstream if "//" in upstream else f"http://{upstream}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, not {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._requests: collections.Counter[str] = collections.Counter()
        self._injected: collections.Counter[str] = collections.Counter()
        self.history: collections.deque[tuple[str, str, str, str]] = collections.deque(maxlen=1000)
        self.transfers: collections.deque[tuple[str, str, str | None, int]] = collections.deque(maxlen=1000)
        self._outage_until = 0.0
        self._outage_mode = ""
        super().__init__()
        self._server: asyncio.Server | None = None
        self._reopen: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- public API ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests)

    @property
    def faults_injected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._injected)

    def add(self, fault: Fault) -> Fault:
        """Apply ``fault`` to matching requests from now on; returns it (its ``times`` counts
        down as it hits)."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault and end any outage (the counters stay; see reset_counters)."""
        with self._lock:
            self._faults.clear()
            self._outage_until = 0.0
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10.0)

    def reset_counters(self) -> None:
        with self._lock:
            self._requests.clear()
            self._injected.clear()
            self.history.clear()
            self.transfers.clear()

    def outage(self, seconds: float, mode: str = "refuse") -> None:
        """Fail every request for the next ``seconds`` (see the module docstring); returns at once."""
        if mode not in OUTAGE_MODES:
            raise ValueError(f"outage mode must be one of {OUTAGE_MODES}, not {mode!r}")
        with self._lock:
            self._outage_until = time.monotonic() + seconds
            self._outage_mode = mode
        if mode == "refuse" and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._refuse(seconds), self._loop).result(10.0)

    async def _startup(self) -> None:
        await self._listen()

    async def _listen(self) -> None:
        """Listen (again) on the port, unless already listening."""
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  limit=HEAD_LIMIT, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self, seconds: float) -> None:
        """Stop listening for ``seconds`` (connection attempts are refused meanwhile)."""
        if self._server is not None:
            self._server.close()  # not wait_closed: that waits for open connections too
            self._server = None
        if self._reopen is not None:
            self._reopen.cancel()
        loop = asyncio.get_running_loop()
        self._reopen = loop.call_later(seconds, lambda: loop.create_task(self._listen()))

    async def _shutdown(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)

    # -- one client connection ----------------------------------------------------------------

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up: list = [None, None]  # upstream reader, writer (opened on first forwarded request)
        graceful = False
        try:
            while await self._exchange(client_r, client_w, up):
                pass
            graceful = True
        except (_Closed, ConnectionError, OSError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            pass  # either side went away, or a fault ended the connection
        except asyncio.CancelledError:
            pass  # shutdown; returning normally keeps asyncio's stream callback quiet
        finally:
            if up[1] is not None:
                up[1].close()  # FIN: the upstream server sees a client that left
            if graceful or client_w.is_closing():  # is_closing: a truncate's clean close
                client_w.close()
            else:
                _reset(client_w)
            self._tasks.discard(task)

    def _pick(self, method: str, path: str, query: str,
              signed: bool) -> tuple[str, Fault | str | None]:
        """The request's kind and what to do with it: a Fault, an outage mode, or None."""
        kind = request_kind(method, path, query, signed=signed)
        with self._lock:
            self._requests[kind] += 1
            if time.monotonic() < self._outage_until:
                self._injected["outage"] += 1
                return kind, self._outage_mode
            for fault in self._faults:
                if (fault.times is None or fault.times > 0) and fault.matches(method, path, query,
                                                                              kind):
                    if fault.times is not None:
                        fault.times -= 1
                    self._injected[fault.kind] += 1
                    return kind, fault
        return kind, None

    async def _exchange(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                        up: list) -> bool:
        """Serve one request; False when the client connection should end cleanly."""
        req = await _read_head(client_r)
        if req is None:
            return False
        method, target = req.start_line.split(" ", 2)[:2]
        path, _, query = target.partition("?")
        signed = req.get("authorization") is not None or "X-Amz-Signature" in query
        kind, action = self._pick(method, path, query, signed)
        expect = (req.get("expect") or "").lower() == "100-continue"
        answer_now = action in ("refuse", "reset", "503") or (isinstance(action, Fault) and (
            action.kind == "status" or action.kind == "reset" and action.after_bytes is None))
        if expect and not answer_now:
            client_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # a client that asked for a 100 Continue holds its body back: a fault answered at once
        # reads none (none comes), and the connection ends after it
        body = [p async for p in _body_pieces(client_r, req, no_body=False)] \
            if (req.get("content-length") or req.get("transfer-encoding")) and not (expect and answer_now) \
            else []
        outcome = action.kind if isinstance(action, Fault) else f"outage-{action}" if action else ""
        if action in ("refuse", "reset") or (isinstance(action, Fault) and action.kind == "reset"
                                              and action.after_bytes is None):
            self.history.append((kind, method, target, outcome))
            raise _Closed
        if action == "503" or (isinstance(action, Fault) and action.kind == "status"):
            fault = action if isinstance(action, Fault) else Fault("status", body=_OUTAGE_BODY)
            await self._answer(client_w, fault, no_body=method == "HEAD")
            self.history.append((kind, method, target, f"{outcome} {fault.status}"))
            return not (req.wants_close() or expect)
        if isinstance(action, Fault) and action.kind == "hang":
            self.history.append((kind, method, target, outcome))
            await self._fault_after_body(action, client_r, client_w)  # returns after seconds
        # forward
        if up[1] is None or up[1].is_closing():
            up[0], up[1] = await asyncio.open_connection(self.upstream_host, self.upstream_port,
                                                         limit=HEAD_LIMIT)
        head = req.head
        if expect:
            head = b"".join(line for line in head.splitlines(keepends=True)
                            if not line.lower().startswith(b"expect:"))
        up[1].write(head + b"".join(body))
        await up[1].drain()
        resp = await _read_head(up[0])
        if resp is None:
            raise ConnectionError("upstream closed the connection before answering")
        while resp.start_line.split(" ", 2)[1].startswith("1"):  # 1xx: pass on, read the next
            client_w.write(resp.head)
            resp = await _read_head(up[0])
            if resp is None:
                raise ConnectionError("upstream closed the connection before answering")
        status = resp.start_line.split(" ", 2)[1]
        self.history.append((kind, method, target, f"{status} {outcome}".strip()))
        client_w.write(resp.head)
        no_body = method == "HEAD" or status in ("204", "304")
        fault = action if isinstance(action, Fault) else None
        limit = None if fault is None else (fault.after_bytes or 0)
        if fault is not None and fault.kind in ("reset", "truncate"):
            length = resp.get("content-length")
            if length is not None and not no_body and int(length) > 0:
                limit = min(limit or 0, int(length) - 1)
        sent = 0
        async for piece in _body_pieces(up[0], resp, no_body=no_body):
            if limit is not None and sent + len(piece) >= limit:
                client_w.write(piece[: limit - sent])
                await client_w.drain()
                await self._fault_after_body(fault, client_r, client_w)
                piece, limit = piece[limit - sent:], None  # a stall that ended: carry on
            client_w.write(piece)
            sent += len(piece)
            await client_w.drain()
        if limit is not None:  # the body ended before the fault's point
            await client_w.drain()
            await self._fault_after_body(fault, client_r, client_w)
        await client_w.drain()
        self.transfers.append((kind, path, req.get("range"), sent))
        if resp.get("content-length") is None and "chunked" not in (
                resp.get("transfer-encoding") or "").lower() and not no_body:
            return False  # a body framed by the connection's end
        return not (req.wants_close() or resp.wants_close())

    async def _fault_after_body(self, fault: Fault | None, client_r: asyncio.StreamReader,
                                client_w: asyncio.StreamWriter) -> None:
        assert fault is not None
        if fault.kind == "truncate":
            client_w.close()
            raise _Closed
        if fault.kind == "reset":
            client_w.transport.set_write_buffer_limits(high=0)  # drain: every byte handed on
            await client_w.drain()
            raise _Closed  # the connection is aborted (RST) by _handle
        # stall, hang: until the client closes, or for fault.seconds (then the response goes on)
        try:
            await asyncio.wait_for(_drain_until_eof(client_r), fault.seconds)
        except TimeoutError:
            return
        raise _Closed

    async def _answer(self, client_w: asyncio.StreamWriter, fault: Fault, *, no_body: bool) -> None:
        body = fault.body if fault.body is not None else _ERROR_BODIES.get(
            fault.status, s3_error_xml("Error", _REASONS.get(fault.status, "Error")))
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(body)),
                   "x-amz-request-id": "FAULTPROXY0000001", **fault.headers}
        reason = _REASONS.get(fault.status, "Error")
        head = f"HTTP/1.1 {fault.status} {reason}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        client_w.write(head.encode("latin-1") + (b"" if no_body else body))
        await client_w.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), not a FIN: linger on, zero seconds."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _drain_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(CHUNK):
        pass


# -- CLI --------------------------------------------------------------------------------------


def parse_fault(text: str) -> Fault:
    """``KIND[:key=value,...]`` (keys: status, after_bytes, match, times, seconds) as a Fault;
    ``times=all`` means every request, ``match`` takes kinds joined by ``+``."""
    kind, _, rest = text.partition(":")
    kwargs: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key in ("status", "after_bytes"):
            kwargs[key] = int(value)
        elif key == "times":
            kwargs[key] = None if value == "all" else int(value)
        elif key == "seconds":
            kwargs[key] = float(value)
        elif key == "match":
            kinds = tuple(value.split("+"))
            kwargs[key] = kinds[0] if len(kinds) == 1 else kinds
        else:
            raise ValueError(f"unknown fault option {key!r} in {text!r}")
    return Fault(kind, **kwargs)


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="HTTP/1.1 reverse proxy injecting faults by rule.")
    p.add_argument("--upstream", required=True, help="upstream endpoint URL (http://host:port)")
    p.add_argument("--port", type=int, default=0, help="listening port (0: any free one)")
    p.add_argument("--fault", action="append", default=[], type=parse_fault,
                   help="KIND[:status=..,after_bytes=..,match=get+list,times=N|all,seconds=..]")
    p.add_argument("--outage", type=float, default=None, help="an outage of N s at start")
    p.add_argument("--outage-mode", choices=OUTAGE_MODES, default="refuse")
    return p.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> None:
    """Run until SIGINT/SIGTERM; print the URL on start and the counters on exit."""
    args = _parse_args(argv)
    with FaultProxy(args.upstream, port=args.port) as proxy:
        for fault in args.fault:
            proxy.add(fault)
        if args.outage:
            proxy.outage(args.outage, args.outage_mode)
        proxy.serve_until_signalled({"url": proxy.url, "port": proxy.port}, lambda: {
            "requests": proxy.requests, "faults_injected": proxy.faults_injected})


if __name__ == "__main__":
    main()
