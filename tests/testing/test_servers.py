"""The test servers themselves: real clients (s3fs, gcsfs, fsspec HTTP, http.client)
against real sockets, plus the leak guard in conftest.py."""

from __future__ import annotations

import http.client
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from streamdata.testing import (
    GCSServer,
    HTTPServer,
    S3Endpoint,
    S3Server,
    ServerError,
    free_port,
    gcs_from_env,
    s3_from_env,
)

PAYLOAD = bytes(range(256)) * 40  # 10 KiB, every offset distinguishable


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------- S3


def test_s3_put_get_list_and_range(s3_bucket: tuple[S3Server | S3Endpoint, str]) -> None:
    server, bucket = s3_bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
    fs.pipe(f"{bucket}/shards/a.tar", PAYLOAD)
    assert fs.cat(f"{bucket}/shards/a.tar") == PAYLOAD
    assert fs.info(f"{bucket}/shards/a.tar")["size"] == len(PAYLOAD)
    assert fs.cat_file(f"{bucket}/shards/a.tar", start=1000, end=1010) == PAYLOAD[1000:1010]
    with fs.open(f"{bucket}/shards/a.tar", "rb") as file:
        file.seek(len(PAYLOAD) - 5)
        assert file.read() == PAYLOAD[-5:]
    assert fs.ls(f"{bucket}/shards", detail=False) == [f"{bucket}/shards/a.tar"]
    listed = server.boto3_client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("shards/a.tar", len(PAYLOAD))]


def test_s3_keeps_connections_alive(s3_server: S3Server | S3Endpoint) -> None:
    host, port = s3_server.endpoint_url.split("://")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        assert sock is not None and not first.will_close, first.getheaders()
        # A body the server answers without reading (no such bucket) must not be taken
        # for the next request on this connection.
        conn.request("PUT", "/sd-no-such-bucket/key", body=b"x" * 200_000)
        rejected = conn.getresponse()
        rejected.read()
        assert rejected.status >= 400 and not rejected.will_close
        conn.request("GET", "/")
        again = conn.getresponse()
        again.read()
        assert again.status == first.status and conn.sock is sock
    finally:
        conn.close()


def test_s3_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMDATA_TEST_S3_ENDPOINT", raising=False)
    assert s3_from_env() is None
    monkeypatch.setenv("STREAMDATA_TEST_S3_ENDPOINT", "http://127.0.0.1:9000/")
    monkeypatch.setenv("STREAMDATA_TEST_S3_KEY", "minio")
    monkeypatch.setenv("STREAMDATA_TEST_S3_SECRET", "minio123")
    monkeypatch.setenv("STREAMDATA_TEST_S3_REGION", "eu-west-1")
    endpoint = s3_from_env()
    assert isinstance(endpoint, S3Endpoint)
    with endpoint as same:
        assert same is endpoint
    assert endpoint.storage_options == {
        "endpoint_url": "http://127.0.0.1:9000", "key": "minio", "secret": "minio123",
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


@pytest.mark.s3
def test_s3_server_start_failure_is_reported() -> None:
    pytest.importorskip("moto")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = S3Server(port=taken.getsockname()[1])
        with pytest.raises(ServerError, match="exited with code"):
            server.start()
    server.stop()  # a no-op; start() already cleaned up


# --------------------------------------------------------------------------- GCS


@pytest.mark.timeout(60)
def test_gcs_write_list_and_range(gcs_bucket: tuple[GCSServer, str]) -> None:
    import gcsfs.core

    server, bucket = gcs_bucket
    fs = fsspec.filesystem("gs", skip_instance_cache=True, **server.storage_options)
    assert type(fs) is gcsfs.core.GCSFileSystem  # not the gRPC-probing extended class
    fs.pipe(f"{bucket}/shards/a.tar", PAYLOAD)
    fs.pipe(f"{bucket}/shards/b.tar", b"b")
    assert fs.ls(f"{bucket}/shards", detail=False) == [f"{bucket}/shards/a.tar",
                                                        f"{bucket}/shards/b.tar"]
    assert fs.info(f"{bucket}/shards/a.tar")["size"] == len(PAYLOAD)
    assert fs.cat_file(f"{bucket}/shards/a.tar", start=5, end=300) == PAYLOAD[5:300]
    with fs.open(f"{bucket}/shards/a.tar", "rb") as file:
        file.seek(len(PAYLOAD) - 7)
        assert file.read() == PAYLOAD[-7:]


def test_gcs_existing_endpoint_from_env(gcs_server: GCSServer,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMDATA_TEST_GCS_ENDPOINT", raising=False)
    assert gcs_from_env() is None
    monkeypatch.setenv("STREAMDATA_TEST_GCS_ENDPOINT", gcs_server.endpoint_url + "/")
    existing = gcs_from_env()
    assert existing is not None and existing.endpoint_url == gcs_server.endpoint_url
    with existing as same:
        assert same is existing
        same.create_bucket("sd-existing")
        same.delete_bucket("sd-existing")
    assert existing.storage_options == gcs_server.storage_options  # stop() left it running


# --------------------------------------------------------------------------- HTTP


def test_http_fsspec_info_and_ranged_reads(http_server: Callable[..., HTTPServer],
                                           tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a b.tar").write_bytes(PAYLOAD)
    server = http_server()
    url = server.url("shards/a b.tar")
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert fs.info(url)["size"] == len(PAYLOAD)
    assert fs.cat_file(url, start=10, end=20) == PAYLOAD[10:20]
    with fs.open(url, "rb", block_size=1024) as file:
        file.seek(5000)
        assert file.read(100) == PAYLOAD[5000:5100]
    assert fs.cat(url) == PAYLOAD
    assert any(rng for method, _, rng in server.requests if method == "GET")


def test_http_range_forms_and_keep_alive(http_server: Callable[..., HTTPServer],
                                         tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(PAYLOAD)
    server = http_server()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    size = len(PAYLOAD)
    cases = [  # (Range header, status, body)
        (None, 200, PAYLOAD),
        ("bytes=0-9", 206, PAYLOAD[:10]),
        ("bytes=10000-", 206, PAYLOAD[10000:]),
        ("bytes=-3", 206, PAYLOAD[-3:]),
        ("bytes=10200-99999", 206, PAYLOAD[10200:]),
        (f"bytes={size}-", 416, b""),
    ]
    try:
        for header, status, body in cases:
            conn.request("GET", "/x.bin", headers={"Range": header} if header else {})
            response = conn.getresponse()
            assert (response.status, response.read()) == (status, body), header
        conn.request("HEAD", "/x.bin")
        head = conn.getresponse()
        head.read()
        assert head.getheader("Content-Length") == str(size)
        assert head.getheader("Accept-Ranges") == "bytes"
        conn.request("GET", "/missing.bin")
        assert conn.getresponse().status == 404
    finally:
        conn.close()
    assert server.connections == 1  # every request above rode one connection


def test_http_stop_closes_idle_connections(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"abc")
    server = HTTPServer(tmp_path).start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/x.bin")
    assert conn.getresponse().read() == b"abc"
    server.stop()  # the client still holds its connection open; the leak guard checks
    conn.close()


def test_http_client_that_resets_mid_request_prints_no_traceback(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A client that aborts (RST) while the server reads its request is no server error: tests
    that check a quiet stderr must not fail on the test server's own noise."""
    import struct
    import time

    server = HTTPServer(tmp_path).start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"GET /x.bin HTTP/1.1\r\nHost: x\r\n")  # headers not finished
        time.sleep(0.2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # linger 0: an abort, the server's read raises ConnectionResetError
        deadline = time.monotonic() + 5
        while server._server._open and time.monotonic() < deadline:  # the handler has finished
            time.sleep(0.02)
    finally:
        server.stop()
    assert "Traceback" not in capfd.readouterr().err


# --------------------------------------------------------------------------- leak guard


def test_leak_guard_fails_a_test_that_leaves_threads_or_processes(
        pytester: pytest.Pytester) -> None:
    conftest = (Path(__file__).parents[1] / "conftest.py").read_text()
    conftest = conftest.replace('pytest_plugins = ("pytester",)', "")
    pytester.makeconftest(conftest.replace("_LEAK_GRACE_S = 2.0", "_LEAK_GRACE_S = 0.2"))
    pytester.makepyfile(test_leaky=f"""
        import subprocess, threading, time

        def test_threads():
            threading.Thread(target=time.sleep, args=(1.0,), name="streamdata-leaky",
                             daemon=True).start()
            threading.Thread(target=time.sleep, args=(1.0,), name="plain-leaky").start()

        def test_process():
            subprocess.Popen([{sys.executable!r}, "-c", "import time; time.sleep(30)"])

        def test_fails_and_leaks():  # one failure is enough: the leak only warns
            subprocess.Popen([{sys.executable!r}, "-c", "import time; time.sleep(30)"])
            assert False

        def test_clean():
            thread = threading.Thread(target=time.sleep, args=(0.05,))
            thread.start()
            thread.join(5)
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2, failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*test left running:*", "*thread 'plain-leaky'*",
                                 "*thread 'streamdata-leaky'*", "*process pid *sleep(30)*"])
    import threading
    import time

    deadline = time.monotonic() + 5  # let the inner leaked thread end before our own check
    while any(t.name.endswith("-leaky") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
