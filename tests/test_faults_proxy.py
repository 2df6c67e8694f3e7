"""The fault-injection proxy itself: exact pass-through, each fault as a raw client sees it,
outages, counters, and a clean shutdown."""

from __future__ import annotations

import http.client
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds benchmarks/
from benchmarks.faults import S3_SLOWDOWN_XML, Fault, FaultProxy, parse_fault, request_kind  # noqa: E402

DATA = os.urandom(200_000)


@pytest.fixture
def served(tmp_path: Path, http_server) -> Iterator[tuple[object, FaultProxy]]:
    """The HTTP test server with one 200 kB file ``/a.bin``, and a FaultProxy in front."""
    (tmp_path / "a.bin").write_bytes(DATA)
    server = http_server(tmp_path)
    with FaultProxy(server.endpoint_url) as proxy:
        yield server, proxy


def _conn(proxy: FaultProxy, timeout: float = 10.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout)


def _get(conn: http.client.HTTPConnection, path: str = "/a.bin", **headers: str):
    conn.request("GET", path, headers=headers)
    return conn.getresponse()


def test_request_kinds() -> None:
    assert request_kind("GET", "/bucket", "list-type=2&prefix=a", signed=True) == "list"
    assert request_kind("GET", "/bucket", "", signed=True) == "list"
    assert request_kind("GET", "/bucket", "location", signed=True) == "other"
    assert request_kind("GET", "/bucket/key/x.tar", "", signed=True) == "get"
    assert request_kind("HEAD", "/bucket/key", "") == "head"
    assert request_kind("PUT", "/bucket/key", "") == "put"
    assert request_kind("GET", "/storage/v1/b/bkt/o", "prefix=a&alt=json") == "list"
    assert request_kind("GET", "/storage/v1/b/bkt/o/a%2Fb.tar", "alt=json") == "head"
    assert request_kind("GET", "/storage/v1/b/bkt/o/a%2Fb.tar", "alt=media") == "get"
    assert request_kind("GET", "/download/storage/v1/b/bkt/o/a.tar", "alt=media") == "get"
    assert request_kind("GET", "/a.bin", "") == "get"  # unsigned: a file of an HTTP server
    assert request_kind("GET", "/dir/", "") == "list"


def test_pass_through_is_exact_and_keeps_connections_alive(served) -> None:
    server, proxy = served
    conn = _conn(proxy)
    for _ in range(3):
        resp = _get(conn)
        assert resp.status == 200 and resp.read() == DATA
    resp = _get(conn, Range="bytes=1000-1999")
    assert resp.status == 206 and resp.read() == DATA[1000:2000]
    conn.request("HEAD", "/a.bin")
    resp = conn.getresponse()
    assert resp.getheader("Content-Length") == str(len(DATA)) and resp.read() == b""
    conn.close()
    assert proxy.requests == {"get": 4, "head": 1}
    assert proxy.faults_injected == {}
    assert server.connections == 1  # one upstream connection, kept alive across requests


def test_pass_through_s3_ranges_and_listing(s3_bucket) -> None:
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    s3.put_object(Bucket=bucket, Key="d/x.bin", Body=DATA)
    with FaultProxy(server.endpoint_url) as proxy:
        import boto3

        client = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1",
                              aws_access_key_id=server.key, aws_secret_access_key=server.secret)
        assert client.get_object(Bucket=bucket, Key="d/x.bin")["Body"].read() == DATA
        got = client.get_object(Bucket=bucket, Key="d/x.bin", Range="bytes=7-70006")
        assert got["Body"].read() == DATA[7:70007]
        listing = client.list_objects_v2(Bucket=bucket, Prefix="d/")
        assert [o["Key"] for o in listing["Contents"]] == ["d/x.bin"]
        assert client.head_object(Bucket=bucket, Key="d/x.bin")["ContentLength"] == len(DATA)
        assert proxy.requests == {"get": 2, "list": 1, "head": 1}
        client.close()


def test_status_fault_answers_s3_error_and_keeps_the_connection(served) -> None:
    server, proxy = served
    proxy.add(Fault("status", status=503, match="get", times=2))
    conn = _conn(proxy)
    for _ in range(2):
        resp = _get(conn)
        assert resp.status == 503 and resp.read() == S3_SLOWDOWN_XML
    assert b"<Code>SlowDown</Code>" in S3_SLOWDOWN_XML
    resp = _get(conn)  # times used up: the request passes, on the same connection
    assert resp.status == 200 and resp.read() == DATA
    assert proxy.faults_injected == {"status": 2}
    assert server.requests == [("GET", "/a.bin", None)]  # faulted requests never reached it


def test_status_fault_with_body_and_callable_match(served) -> None:
    _, proxy = served
    proxy.add(Fault("status", status=500, body=b"oops", times=None,
                    match=lambda method, path, query: query == "x=1"))
    conn = _conn(proxy)
    for _ in range(3):
        resp = _get(conn, "/a.bin?x=1")
        assert resp.status == 500 and resp.read() == b"oops"
    assert _get(conn, "/a.bin?x=2").read() == DATA
    assert proxy.faults_injected == {"status": 3}


def _raw_get(proxy: FaultProxy, path: str = "/a.bin", timeout: float = 5.0) -> tuple[bytes, bytes, str]:
    """One GET on a raw socket: (response head, body bytes received, how it ended:
    "eof", "reset" or "timeout")."""
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data, ended = b"", "eof"
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            ended = "reset"
        except TimeoutError:
            ended = "timeout"
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, ended


@pytest.mark.parametrize("kind", ["reset", "truncate"])
def test_reset_and_truncate_cut_the_body_after_k_bytes(served, kind: str) -> None:
    _, proxy = served
    proxy.add(Fault(kind, after_bytes=12_345, match="get"))
    head, body, ended = _raw_get(proxy)
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
    assert f"Content-Length: {len(DATA)}".encode() in head
    assert body == DATA[:12_345]
    assert ended == ("reset" if kind == "reset" else "eof")
    assert _get(_conn(proxy)).read() == DATA  # the next request gets everything
    assert proxy.faults_injected == {kind: 1}


def test_reset_before_the_response(served) -> None:
    _, proxy = served
    proxy.add(Fault("reset", match="get"))  # after_bytes=None: no response byte at all
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        _get(_conn(proxy))


def test_after_bytes_past_the_body_still_cuts_it(served) -> None:
    _, proxy = served
    proxy.add(Fault("truncate", after_bytes=10 * len(DATA), match="get"))
    resp = _get(_conn(proxy))
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert len(info.value.partial) == len(DATA) - 1


def test_stall_sends_headers_then_nothing(served) -> None:
    _, proxy = served
    proxy.add(Fault("stall", match="get"))
    head, body, ended = _raw_get(proxy, timeout=0.5)
    assert head.split(b" ")[1] == b"200" and body == b"" and ended == "timeout"
    proxy.add(Fault("stall", after_bytes=5000, match="get"))
    head, body, ended = _raw_get(proxy, timeout=0.5)
    assert body == DATA[:5000] and ended == "timeout"


def test_stall_for_seconds_then_goes_on(served) -> None:
    _, proxy = served
    proxy.add(Fault("stall", after_bytes=1000, seconds=0.3, match="get"))
    resp = _get(_conn(proxy))
    assert resp.read() == DATA
    assert proxy.faults_injected == {"stall": 1}


def test_outage_refuse_then_recover(served) -> None:
    _, proxy = served
    idle = _conn(proxy)
    assert _get(idle).read() == DATA  # an open keep-alive connection
    proxy.outage(seconds=1.0, mode="refuse")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((proxy.host, proxy.port), timeout=2).close()
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _get(idle).read()  # requests on open connections fail too
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _get(_conn(proxy)).read() == DATA
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the proxy did not listen again"
            time.sleep(0.1)
    assert proxy.faults_injected == {"outage": 1}


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_outage_fails_every_request_for_its_window(served, mode: str) -> None:
    _, proxy = served
    proxy.outage(seconds=0.5, mode=mode)
    for _ in range(3):
        if mode == "503":
            assert _get(_conn(proxy)).status == 503
        else:
            with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
                _get(_conn(proxy))
    time.sleep(0.6)
    assert _get(_conn(proxy)).read() == DATA
    assert proxy.faults_injected == {"outage": 3}
    proxy.outage(seconds=60, mode=mode)
    proxy.clear()  # ends the outage
    assert _get(_conn(proxy)).read() == DATA


class _Chunked(socketserver.StreamRequestHandler):
    """Answers every request with a chunked body: 3 chunks of DATA's first 30 kB."""

    def handle(self) -> None:
        while self.rfile.readline().strip():
            pass
        self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            piece = DATA[i * 10_000:(i + 1) * 10_000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")


def test_chunked_responses_pass_whole() -> None:
    server = socketserver.TCPServer(("127.0.0.1", 0), _Chunked)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as proxy:
            resp = _get(_conn(proxy), "/x")
            assert resp.read() == DATA[:30_000]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_close_leaves_no_thread_and_stops_listening(tmp_path: Path, http_server) -> None:
    server = http_server(tmp_path)
    before = set(threading.enumerate())
    proxy = FaultProxy(server.endpoint_url).start()
    proxy.add(Fault("stall", match="get"))
    (tmp_path / "a.bin").write_bytes(DATA)
    conn = _conn(proxy, timeout=5)
    assert _get(conn).status == 200  # a connection stalled inside its body
    proxy.close()
    left = {t for t in set(threading.enumerate()) - before
            if not t.name.startswith("streamdata-testing")}  # the upstream's may take a moment
    assert left == set()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((proxy.host, proxy.port), timeout=2).close()
    conn.close()


def test_cli_fault_syntax() -> None:
    fault = parse_fault("status:status=429,match=get+list,times=all")
    assert (fault.kind, fault.status, fault.match, fault.times) == ("status", 429, ("get", "list"),
                                                                     None)
    assert parse_fault("reset:after_bytes=10").after_bytes == 10
    with pytest.raises(ValueError):
        parse_fault("explode")


def test_hang_answers_nothing_then_optionally_forwards(served) -> None:
    _, proxy = served
    proxy.add(Fault("hang", match="get"))
    assert _raw_get(proxy, timeout=0.5) == (b"", b"", "timeout")
    proxy.add(Fault("hang", seconds=0.2, match="get"))
    assert _get(_conn(proxy)).read() == DATA
    assert proxy.faults_injected == {"hang": 2}
