"""The constructor's waits are bounded: listing, stat and glob against an endpoint that never
answers fail with FetchTimeoutError within about 2 x timeout; a refused connection and missing
GCS credentials fail fast with our error and no third-party traceback on stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamdata as sd
from streamdata.testing import free_port

TIMEOUT = 1.5
# documented: a listing or stat gives up after 2 x timeout (its retries included); slack for
# creating the filesystem and the backoff
BOUND = 2 * TIMEOUT + 1.5
KEYS = {"key": "testing", "secret": "testing"}
REPO = Path(__file__).resolve().parents[2]


class SilentListener:
    """A loopback TCP server that accepts connections and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-listener")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the accept timeout: look at the stop flag again
                continue
            self.accepted.append(conn)

    def requests(self) -> list[str]:
        """The request line each accepted connection sent (read from what the kernel holds:
        nothing is ever answered), ``""`` for one that sent nothing."""
        lines = []
        for conn in list(self.accepted):
            conn.settimeout(0.5)
            try:
                head = conn.recv(65536, socket.MSG_PEEK)
            except OSError:
                head = b""
            lines.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
        return lines

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentListener]:
    listener = SilentListener()
    yield listener
    listener.close()


@pytest.mark.parametrize("spec, named, ahead", [
    ("s3://bkt/x-{0..3}.tar", "s3://bkt", 1),          # brace pattern: one listing of the parent
    ("s3://bkt/prefix/", "s3://bkt/prefix/", 1),      # prefix: a listing
    ("s3://bkt/x-*.tar", "s3://bkt/x-*.tar", 2),      # glob
    ("s3://bkt/x.tar", "s3://bkt/x.tar", 2),          # one object: a stat
])
@pytest.mark.parametrize("index", [pytest.param(None, marks=pytest.mark.slow), "auto"])
def test_silent_s3_endpoint_times_out_in_the_constructor(silent, spec, named, ahead, index, monkeypatch):
    start = time.monotonic()
    with pytest.raises(sd.FetchTimeoutError) as info:
        sd.TarDataset(spec, storage_options={"endpoint_url": silent.url, **KEYS}, timeout=TIMEOUT,
                      index=index)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND, f"took {elapsed:.1f} s"
    assert info.value.url == named and named in str(info.value)
    # the listing (or stat) gives up after `timeout` (botocore's read timeout, or ours) and is
    # tried once more within the bound; botocore's and s3fs's own retries are off. With the
    # default index="auto" the index GETs go out beside the listing (INDEX-AHEAD), once each:
    # the index's name only where the listing covers its directory, else both names (LISTED-NAMES);
    # under LITE-S3 an early GET that failed is read again only after a listing that worked.
    # The listing's first wait overlaps the readers' imports (backends.warm_imports): on a loaded
    # machine those can outlast the deadline, and then no second attempt starts
    time.sleep(0.2)  # the accept thread's last append
    requests = silent.requests()
    index_gets = [r for r in requests if ".sdx" in r]
    assert len(index_gets) == (ahead if index == "auto" else 0), requests
    assert 1 <= len(requests) - len(index_gets) <= 2, requests


def test_refused_connection_fails_fast_with_our_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(sd.ShardFetchError, match="s3://bkt") as info:
        sd.TarDataset("s3://bkt/x-{0..3}.tar", storage_options={"endpoint_url": url, **KEYS},
                      timeout=TIMEOUT)
    assert time.monotonic() - start < BOUND
    assert "attempts" in str(info.value)  # retried with backoff, within the bound


def test_storage_options_win_over_our_timeouts():
    from streamdata.store.backends import filesystem

    mine = filesystem("s3", {**KEYS, "config_kwargs": {"read_timeout": 7}}, timeout=TIMEOUT)
    assert mine.config_kwargs["read_timeout"] == 7 and mine.config_kwargs["connect_timeout"] == TIMEOUT


def test_http_sizes_obey_the_timeout(silent):
    pytest.importorskip("pyarrow")
    start = time.monotonic()
    with pytest.raises(sd.FetchTimeoutError) as info:
        sd.ParquetDataset([f"{silent.url}/a.parquet", f"{silent.url}/b.parquet"], timeout=TIMEOUT)
    assert time.monotonic() - start < BOUND
    assert info.value.url.startswith(silent.url)


_GCS_SCRIPT = textwrap.dedent("""
    import http.server, json, sys, threading, time
    import streamdata as sd

    class Deny(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"error": {"code": 401, "message": "Anonymous caller has no access"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, address):  # the client may hang up on the other 401s
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, address)

    server = Server(("127.0.0.1", 0), Deny)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    denied = {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "token": "anon"}
    out = {}
    for name, spec, options in json.loads(sys.argv[1]) + [["denied", "gs://bkt/x-{0..3}.tar", denied]]:
        start = time.monotonic()
        try:
            sd.TarDataset(spec, storage_options=options, timeout=float(sys.argv[2]))
            out[name] = ["ok", "", 0]
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc), time.monotonic() - start]
    print(json.dumps(out))
""")


@pytest.mark.slow  # ~12 s: a fresh interpreter imports torch and gcsfs
def test_gcs_without_credentials_fails_fast_with_a_hint_and_a_quiet_stderr(tmp_path):
    """No credentials anywhere (and no metadata server: it points at a closed loopback port)
    -> AccessDeniedError naming what was tried, before any request; an emulator endpoint that
    refuses -> our error within the bound. Neither floods stderr with gcsfs's tracebacks."""
    pytest.importorskip("gcsfs")
    closed = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "GCE_", "CLOUDSDK_", "STORAGE_EMULATOR"))}
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="true",
               GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed, PYTHONPATH=str(REPO),
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    cases = [("nocreds", "gs://bucket/x.tar", {}),
             ("refused", "gs://bkt/x-{0..3}.tar", {"endpoint_url": f"http://{closed}", "token": "anon"})]
    proc = subprocess.run([sys.executable, "-c", _GCS_SCRIPT, json.dumps(cases), str(TIMEOUT)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kind, text, elapsed = out["nocreds"]
    assert kind == "AccessDeniedError" and elapsed < BOUND
    for hint in ("GOOGLE_APPLICATION_CREDENTIALS", "gcloud", "metadata server", "'token': 'anon'"):
        assert hint in text
    kind, text, elapsed = out["refused"]
    assert kind in ("FetchTimeoutError", "ShardFetchError") and "gs://bkt" in text and elapsed < BOUND
    kind, text, elapsed = out["denied"]

    assert kind == "AccessDeniedError" and "gs://bkt" in text and elapsed < BOUND
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr[-3000:]
