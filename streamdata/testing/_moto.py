"""The S3 server's child side: moto's WSGI app under werkzeug, with HTTP/1.1 keep-alive
and an optional per-request latency (``python -m streamdata.testing s3``)."""

from __future__ import annotations

import io
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


class _BodyReader(io.RawIOBase):
    """A request body that ends at Content-Length, so a kept-alive connection's next
    request is never read (or drained) as part of this one."""

    def __init__(self, raw: BinaryIO, length: int) -> None:
        super().__init__()
        self._raw, self._left = raw, length

    def readable(self) -> bool:
        return True

    def _read_with(self, method: Callable[[int], bytes], size: int | None) -> bytes:
        want = self._left if size is None or size < 0 else min(size, self._left)
        if want <= 0:
            return b""
        data = method(want)
        self._left = self._left - len(data) if data else 0  # b"": the client went away
        return data

    def read(self, size: int | None = -1) -> bytes:
        return self._read_with(self._raw.read, size)

    def readline(self, size: int | None = -1) -> bytes:
        return self._read_with(self._raw.readline, size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _keep_alive_handler(base: type) -> type:
    """Subclass werkzeug's request handler ``base`` so that HTTP/1.1 connections stay open.

    Werkzeug's dev server sends ``Connection: close`` on every response and, after each
    one, drains whatever the socket holds. Here the body is bounded by Content-Length
    (drain reads only what is left of it) and the close header is dropped. Requests with
    a chunked body keep the stock behaviour (closed after the response).
    """

    class KeepAliveHandler(base):
        protocol_version = "HTTP/1.1"
        _keep_alive = False
        rfile: Any  # set by the base handler per connection (annotated here: ``base`` is a plain type)

        def run_wsgi(self) -> None:
            length = (self.headers.get("Content-Length") or "0").strip()
            chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
            self._keep_alive = (self.request_version == "HTTP/1.1" and not chunked
                                and length.isdigit())
            if not self._keep_alive:
                super().run_wsgi()
                return
            raw = self.rfile
            self.rfile = _BodyReader(raw, int(length))
            try:
                super().run_wsgi()
            finally:
                self.rfile = raw
                self._keep_alive = False

        def send_header(self, keyword: str, value: str) -> None:
            if (self._keep_alive and keyword.lower() == "connection"
                    and value.lower() == "close"):
                return
            super().send_header(keyword, value)

        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            pass  # one line per request would dominate the log and cost time

    return KeepAliveHandler


def _with_latency(app: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """Wrap a WSGI app so every request first sleeps ``seconds``."""

    def delayed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        time.sleep(seconds)
        return app(environ, start_response)

    return delayed


def _serve_s3(host: str, port: int, latency: float, ready_file: str | None) -> None:
    """Serve moto's S3 until killed (runs in the server subprocess)."""
    # Bind before the slow imports, so that a taken port fails at once.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    bound = listener.getsockname()[1]
    # path-style always, as an S3-compatible store on its own host name (MinIO, Ceph) answers:
    # moto would take the first label of a dotted host (``bucket.corp.test``, reached through a
    # proxy) for a bucket name; read by moto's settings at import
    from streamdata.config import env_setdefault

    env_setdefault("S3_IGNORE_SUBDOMAIN_BUCKETNAME", "true")

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app: Callable[..., Any] = DomainDispatcherApplication(create_backend_app)
    if latency > 0:
        app = _with_latency(app, latency)
    server = make_server(host, bound, app, threaded=True, fd=listener.fileno(),
                         request_handler=_keep_alive_handler(MotoRequestHandler))
    listener.close()  # the server holds its own duplicate of the socket
    if ready_file:
        tmp = ready_file + ".tmp"
        Path(tmp).write_text(str(bound))
        os.replace(tmp, ready_file)  # the parent never sees a half-written port
    print(f"S3 (moto) listening on http://{host}:{bound}", flush=True)
    server.serve_forever()

