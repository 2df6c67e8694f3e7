"""Plain HTTP: :class:`HTTPServer` serves a directory from a thread of this process, with
HEAD, single byte ranges (206) and HTTP/1.1 keep-alive."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO

from streamdata.testing._process import _POLL_S, _STOP_TIMEOUT_S, ServerError, _Managed

_COPY_CHUNK = 1 << 20


class _ByteRange:
    """The half-open span [start, stop) that a single-range ``Range`` header asks for."""

    UNSATISFIABLE = "unsatisfiable"

    @staticmethod
    def parse(header: str | None, size: int) -> tuple[int, int] | str | None:
        """(start, stop), ``UNSATISFIABLE``, or None (absent, malformed or multi-range:
        the whole object is sent, as RFC 9110 allows)."""
        if not header or not header.startswith("bytes=") or "," in header:
            return None
        first, _, last = header[len("bytes="):].strip().partition("-")
        try:
            if first == "":  # suffix: the last N bytes
                count = int(last)
                if count <= 0 or size == 0:
                    return _ByteRange.UNSATISFIABLE
                return max(0, size - count), size
            start = int(first)
            stop = size if last == "" else min(int(last) + 1, size)
        except ValueError:
            return None
        if start >= size:
            return _ByteRange.UNSATISFIABLE
        return (start, stop) if stop > start else None


class _RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """GET/HEAD of files with single byte ranges (206), over HTTP/1.1 keep-alive."""

    protocol_version = "HTTP/1.1"
    server: _ThreadedHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def _respond(self, send_body: bool) -> None:
        self.server.record(self.command, self.path, self.headers.get("Range"))
        if self.server.latency > 0:
            time.sleep(self.server.latency)
        path = self.translate_path(self.path)
        if os.path.isdir(path):  # listing or trailing-slash redirect, from the stdlib
            listing = self.send_head()
            if listing is not None:
                with listing:
                    if send_body:
                        self.copyfile(listing, self.wfile)
            return
        try:
            file = open(path, "rb")
        except OSError:
            self.send_error(404, "File not found")
            return
        with file:
            self._send_file(file, self.guess_type(path), send_body)

    def _send_file(self, file: BinaryIO, content_type: str, send_body: bool) -> None:
        stat = os.fstat(file.fileno())
        size = stat.st_size
        span = _ByteRange.parse(self.headers.get("Range"), size)
        if span == _ByteRange.UNSATISFIABLE:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, stop = span if isinstance(span, tuple) else (0, size)
        self.send_response(206 if isinstance(span, tuple) else 200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", self.date_time_string(int(stat.st_mtime)))
        if isinstance(span, tuple):
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if not send_body:
            return
        file.seek(start)
        left = stop - start
        try:
            while left > 0:
                chunk = file.read(min(_COPY_CHUNK, left))
                if not chunk:  # the file shrank under us: the client sees a short body
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                left -= len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client stopped reading; fine


class _ThreadedHTTPServer(http.server.ThreadingHTTPServer):
    """One thread per connection, each tracked so that stop() can close and join it."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: Any, latency: float) -> None:
        self.latency = latency
        self.requests: list[tuple[str, str, str | None]] = []
        self.connections = 0
        self._lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}
        super().__init__(address, handler)

    def record(self, method: str, path: str, byte_range: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, byte_range))

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address),
                                  name="streamdata-testing-http-conn", daemon=True)
        with self._lock:
            self._open[request] = thread
            self.connections += 1
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a reset idle connection, an aborted read) is no server error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def close_connections(self, timeout: float) -> None:
        """Shut every open connection's socket, then join its thread (bounded)."""
        with self._lock:
            items = list(self._open.items())
        for sock, _ in items:
            with contextlib.suppress(OSError):  # already closed by the client
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in items:
            thread.join(max(0.0, deadline - time.monotonic()))


class HTTPServer(_Managed):
    """Serve ``root_dir`` over HTTP/1.1 from a background thread of this process.

    Files support HEAD (Content-Length) and single byte ranges (206); directories get
    the stdlib's HTML listing. ``requests`` logs (method, path, Range header) and
    ``connections`` counts accepted TCP connections; ``latency`` is slept per request.
    """

    def __init__(self, root_dir: str | os.PathLike[str], *, port: int | None = None,
                 host: str = "127.0.0.1", latency: float = 0.0) -> None:
        self.root_dir = Path(root_dir)
        self.host, self.port, self.latency = host, port, latency
        self._server: _ThreadedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise ServerError("HTTPServer is not started")
        return f"http://{self.host}:{self.port}"

    def url(self, relpath: str = "") -> str:
        """The URL of ``relpath`` (relative to ``root_dir``)."""
        return f"{self.endpoint_url}/{urllib.parse.quote(str(relpath).lstrip('/'))}"

    @property
    def requests(self) -> list[tuple[str, str, str | None]]:
        return list(self._server.requests) if self._server else []

    @property
    def connections(self) -> int:
        return self._server.connections if self._server else 0

    def start(self) -> HTTPServer:
        """Bind the socket and start serving (returns at once: the socket is listening)."""
        if self._server is not None:
            return self
        handler = functools.partial(_RangeRequestHandler, directory=str(self.root_dir))
        self._server = _ThreadedHTTPServer((self.host, self.port or 0), handler, self.latency)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_S,),
                                        name="streamdata-testing-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close open connections, join every thread (bounded)."""
        if self._server is None or self._thread is None:
            return
        self._server.shutdown()  # returns within one poll interval of serve_forever
        self._thread.join(_STOP_TIMEOUT_S)
        self._server.server_close()
        self._server.close_connections(_STOP_TIMEOUT_S)
        self._server = self._thread = None

    def __repr__(self) -> str:
        return f"HTTPServer({str(self.root_dir)!r}, port={self.port})"

