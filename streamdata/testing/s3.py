"""S3: moto in a subprocess (:class:`S3Server`), or an endpoint already running
(:class:`S3Endpoint`, :func:`s3_from_env`); both with bucket helpers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from streamdata.config import env_str
from streamdata.errors import BackendMissingError
from streamdata.testing._process import (
    _INSTALL_HINT,
    ServerError,
    _cli_argv,
    _http_status,
    _Managed,
    _require,
    _ServerProcess,
    _Subprocess,
)

DUMMY_CREDENTIAL = "testing"


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

