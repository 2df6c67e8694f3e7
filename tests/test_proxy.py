"""The benchmark latency proxy: exact, ordered, delayed delivery; counters; clean shutdown."""

from __future__ import annotations

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
from benchmarks.proxy import LatencyProxy  # noqa: E402


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _echo_through(port: int, payload: bytes, timeout: float = 20.0) -> bytes:
    """Send ``payload`` (from a thread) and read the same number of bytes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        received = bytearray()
        while len(received) < len(payload):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            received += chunk
        sender.join(timeout)
        return bytes(received)


def _round_trip(sock: socket.socket, message: bytes) -> float:
    start = time.perf_counter()
    sock.sendall(message)
    got = b""
    while len(got) < len(message):
        got += sock.recv(65536)
    assert got == message
    return time.perf_counter() - start


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "latency-proxy"]


def test_exact_and_in_order_with_split_and_delay(echo_server):
    payload = os.urandom(1 << 20)
    with LatencyProxy(*echo_server, delay_s=0.02, split=1500, seed=1) as proxy:
        assert _echo_through(proxy.port, payload) == payload
        assert proxy.bytes_up == proxy.bytes_down == len(payload)


def test_many_connections_at_once(echo_server):
    payloads = [os.urandom(100_000 + i) for i in range(8)]
    results: dict[int, bytes] = {}
    with LatencyProxy(*echo_server, delay_s=0.01, split=4096) as proxy:

        def one(i: int) -> None:
            results[i] = _echo_through(proxy.port, payloads[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(payloads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert proxy.connections == len(payloads)
    assert [results[i] for i in range(len(payloads))] == payloads


def test_delay_is_applied_each_way(echo_server):
    delay = 0.05
    with LatencyProxy(*echo_server, delay_s=delay, handshake_rtts=1) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            first = _round_trip(sock, b"ping")
            second = _round_trip(sock, b"pong")
            proxy.set_delay(2 * delay)
            third = _round_trip(sock, b"again")
    assert first >= 4 * delay  # the handshake round trip, then the request's
    assert second >= 2 * delay
    assert third >= 4 * delay


def test_bandwidth_cap_is_applied(echo_server):
    payload = os.urandom(200_000)
    with LatencyProxy(*echo_server, delay_s=0.0, bandwidth=1_000_000) as proxy:
        start = time.perf_counter()
        assert _echo_through(proxy.port, payload) == payload
        elapsed = time.perf_counter() - start
    assert elapsed >= 0.2  # 200 kB at 1 MB/s, one way at least


def test_a_shared_link_caps_all_connections_together(echo_server):
    """Per-connection bandwidth lets four connections move four times the bytes; one shared
    link does not: four echoes of 100 kB at 1 MB/s take at least 0.4 s."""
    import concurrent.futures

    payload = os.urandom(100_000)
    for link, least in ((None, 0.1), (1_000_000, 0.4)):
        with LatencyProxy(*echo_server, delay_s=0.0, bandwidth=1_000_000, link_bandwidth=link) as proxy:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                echoed = list(pool.map(lambda _: _echo_through(proxy.port, payload), range(4)))
            elapsed = time.perf_counter() - start
        assert echoed == [payload] * 4
        assert elapsed >= least
    with pytest.raises(ValueError):
        LatencyProxy(*echo_server, link_bandwidth=0)


def test_counters_and_reset(echo_server):
    with LatencyProxy(*echo_server, delay_s=0.0) as proxy:
        assert _echo_through(proxy.port, b"x" * 1000) == b"x" * 1000
        assert (proxy.bytes_up, proxy.bytes_down, proxy.connections) == (1000, 1000, 1)
        proxy.reset_counters()
        assert (proxy.bytes_up, proxy.bytes_down, proxy.connections) == (0, 0, 0)
        assert _echo_through(proxy.port, b"y" * 10) == b"y" * 10
        assert (proxy.bytes_up, proxy.bytes_down) == (10, 10)


def test_url_for_keeps_scheme_and_path():
    proxy = LatencyProxy("127.0.0.1", 1, port=4321)
    assert proxy.url_for("http://localhost:9000/bkt?x=1") == "http://127.0.0.1:4321/bkt?x=1"


def test_close_with_open_connection_leaves_no_thread(echo_server):
    before = len(_proxy_threads())
    proxy = LatencyProxy(*echo_server, delay_s=0.2).start()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    try:
        sock.sendall(b"data still in flight")
        time.sleep(0.05)
        proxy.close(timeout=10)
        assert len(_proxy_threads()) == before
        assert sock.recv(100) == b""  # the proxy closed (or reset) our connection
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    proxy.close()  # idempotent


def test_unreachable_upstream_closes_client():
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    with LatencyProxy("127.0.0.1", dead_port, delay_s=0.0) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            try:
                assert sock.recv(10) == b""
            except ConnectionResetError:
                pass


def test_s3_object_through_proxy_is_exact(s3_bucket):
    from urllib.parse import urlsplit

    import boto3
    from botocore.config import Config

    server, bucket = s3_bucket
    payload = os.urandom(3 << 20)
    server.boto3_client().put_object(Bucket=bucket, Key="blob", Body=payload)
    upstream = urlsplit(server.endpoint_url)
    with LatencyProxy(upstream.hostname, upstream.port, delay_s=0.01, split=9000) as proxy:
        client = boto3.client(
            "s3",
            endpoint_url=proxy.url_for(server.endpoint_url),
            aws_access_key_id=server.key,
            aws_secret_access_key=server.secret,
            region_name=server.region,
            config=Config(s3={"addressing_style": "path"}),
        )
        assert client.get_object(Bucket=bucket, Key="blob")["Body"].read() == payload
        assert proxy.bytes_down >= len(payload)
        client.close()
