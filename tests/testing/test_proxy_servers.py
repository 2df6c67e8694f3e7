"""The network test servers under real clients, over real loopback sockets: urllib and
http.client through ForwardProxy (absolute-form, CONNECT, Basic credentials, keep-alive,
502s), boto3 and s3fs uploads through it to the S3 test server, TLSFront's private CA, and
64 MiB bodies streamed both ways in bounded memory."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import io
import json
import os
import socket
import ssl
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from streamdata.testing import (
    ForwardProxy,
    HTTPServer,
    S3Endpoint,
    S3Server,
    TLSFront,
    free_port,
    make_certificates,
)

FAKE = "bucket.corp.test"  # .test is reserved (RFC 6761): only the proxy's hosts resolve it
MIRROR = "mirror.corp.test"
PAYLOAD = bytes(range(256)) * 64  # 16 KiB, every offset distinguishable
BIG = 64 * 1024 * 1024
PIECES = [b"first piece|", b"x" * 70_000, b"|last"]  # the sink's chunked answer


@pytest.fixture
def site(http_server: Callable[..., HTTPServer], tmp_path: Path) -> HTTPServer:
    (tmp_path / "a.bin").write_bytes(PAYLOAD)
    return http_server(tmp_path)


@pytest.fixture
def proxy() -> Iterator[ForwardProxy]:
    with ForwardProxy({FAKE: "127.0.0.1", MIRROR: "127.0.0.1"}, timeout=10) as server:
        yield server


def _opener(proxy_url: str) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url, "https": proxy_url}))


def _get(conn: http.client.HTTPConnection, target: str, method: str = "GET",
         headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn.request(method, target, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read(), response


# --------------------------------------------------------------------------- an origin that takes bodies


class _Sink(http.server.BaseHTTPRequestHandler):
    """Takes PUT/POST bodies (Content-Length or chunked) and answers their length and
    SHA-256; GET /chunked answers chunked with a trailer, GET /until-close with no length."""

    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle keep-alive connection's thread ends by itself

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_PUT(self) -> None:
        digest, size = hashlib.sha256(), 0

        def take(count: int) -> None:
            nonlocal size
            while count:
                piece = self.rfile.read(min(count, 1 << 20))
                if not piece:
                    raise ConnectionError("body cut short")
                digest.update(piece)
                size += len(piece)
                count -= len(piece)

        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if chunked:
            while (count := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                take(count)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
        else:
            take(int(self.headers.get("Content-Length", "0")))
        body = json.dumps({"size": size, "sha256": digest.hexdigest(), "chunked": chunked,
                           "method": self.command, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in PIECES:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\nX-Checksum: none\r\n\r\n")
        else:  # the end of the body is the end of the connection
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PAYLOAD)
            self.close_connection = True


@pytest.fixture
def sink() -> Iterator[int]:
    """The port of a running _Sink."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# --------------------------------------------------------------------------- names


def test_the_fake_name_does_not_resolve_here() -> None:
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(FAKE, 80)


def test_hosts_map_names_and_wildcards() -> None:
    proxy = ForwardProxy({"Bucket.Corp.Test": "10.0.0.1", "*.corp.test": "10.0.0.2",
                          "*.s3.corp.test": "10.0.0.3"})
    assert proxy.resolve("bucket.corp.test.") == "10.0.0.1"
    assert proxy.resolve("other.corp.test") == "10.0.0.2"
    assert proxy.resolve("b1.s3.corp.test") == "10.0.0.3"  # the longest suffix wins
    assert proxy.resolve("example.org") == "example.org"


# --------------------------------------------------------------------------- absolute-form


def test_get_through_the_proxy_with_urllib(site: HTTPServer, proxy: ForwardProxy) -> None:
    url = f"http://{FAKE}:{site.port}/a.bin"
    with _opener(proxy.url).open(url, timeout=10) as response:
        assert response.read() == PAYLOAD
    request = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
    with _opener(proxy.url).open(request, timeout=10) as response:
        assert (response.status, response.read()) == (206, PAYLOAD[10:20])
    assert proxy.requests == [("GET", url), ("GET", url)]
    assert [r[:3] for r in site.requests] == [("GET", "/a.bin", None), ("GET", "/a.bin", "bytes=10-19")]


def test_keep_alive_across_requests_and_origins(site: HTTPServer, proxy: ForwardProxy,
                                                http_server: Callable[..., HTTPServer],
                                                tmp_path: Path) -> None:
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "m.bin").write_bytes(b"mirrored")
    mirror = http_server(tmp_path / "mirror")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        assert _get(conn, f"http://{FAKE}:{site.port}/a.bin")[:2] == (200, PAYLOAD)
        sock = conn.sock
        status, body, response = _get(conn, f"http://{FAKE}:{site.port}/a.bin", "HEAD")
        assert (status, body, response.getheader("Content-Length")) == (200, b"", str(len(PAYLOAD)))
        assert _get(conn, f"http://{MIRROR}:{mirror.port}/m.bin")[:2] == (200, b"mirrored")
        # http.server answers errors with "Connection: close": that ends the upstream
        # connection only; the client's stays open.
        status, _, response = _get(conn, f"http://{FAKE}:{site.port}/missing")
        assert (status, response.will_close) == (404, False)
        status, body, response = _get(conn, f"http://{FAKE}:{site.port}/a.bin")
        assert (status, body, response.will_close) == (200, PAYLOAD, False)
        assert conn.sock is sock
    finally:
        conn.close()
    assert proxy.connections == 1
    assert (site.connections, mirror.connections) == (2, 1)  # reused, but for the one closed


def test_chunked_and_until_close_answers_are_relayed(sink: int, proxy: ForwardProxy) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        status, body, response = _get(conn, f"http://{FAKE}:{sink}/chunked")
        assert (status, body, response.will_close) == (200, b"".join(PIECES), False)
        status, body, response = _get(conn, f"http://{FAKE}:{sink}/until-close")
        assert (status, body, response.will_close) == (200, PAYLOAD, True)
    finally:
        conn.close()
    assert proxy.connections == 1


def test_put_with_100_continue(sink: int, proxy: ForwardProxy) -> None:
    """The origin's "100 Continue" reaches the client, which sends its body only then."""
    body = b"abc" * 1000
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"PUT http://{FAKE}:{sink}/up HTTP/1.1\r\nHost: {FAKE}:{sink}\r\n"
                     f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"HTTP/1.1 100")
        assert reader.readline() == b"\r\n"
        sock.sendall(body)
        assert reader.readline().startswith(b"HTTP/1.1 200")
        length = 0
        while (line := reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        answer = json.loads(reader.read(length))
    assert answer == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                      "chunked": False, "method": "PUT", "path": "/up"}


def test_what_is_not_a_proxy_request_gets_400(proxy: ForwardProxy) -> None:
    for request in (b"GET /a.bin HTTP/1.1\r\nHost: x\r\n\r\n",  # origin-form: for a server
                    b"GET https://bucket.corp.test/ HTTP/1.1\r\n\r\n",  # https goes by CONNECT
                    b"CONNECT bucket.corp.test HTTP/1.1\r\n\r\n",  # no port
                    b"PUT http://bucket.corp.test/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(request)
            answer = b""
            while piece := sock.recv(65536):  # then the proxy closes the connection
                answer += piece
        assert answer.startswith(b"HTTP/1.1 400 "), (request, answer)


def test_unreachable_origins_get_502(proxy: ForwardProxy) -> None:
    closed = free_port()
    for url in (f"http://{FAKE}:{closed}/x", f"http://nowhere.corp.test:{closed}/x"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            _opener(proxy.url).open(url, timeout=10)
        assert caught.value.code == 502
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10)
    conn.set_tunnel(FAKE, closed)
    with pytest.raises(OSError, match="502"):
        conn.request("GET", "/")
    conn.close()


# --------------------------------------------------------------------------- credentials


def test_credentials_are_required(site: HTTPServer) -> None:
    url = f"http://{FAKE}:{site.port}/a.bin"
    with ForwardProxy({FAKE: "127.0.0.1"}, auth=("alice", "s3cr:t"), timeout=10) as proxy:
        with pytest.raises(urllib.error.HTTPError) as caught:
            _opener(proxy.url).open(url, timeout=10)
        assert caught.value.code == 407
        assert caught.value.headers["Proxy-Authenticate"].startswith('Basic realm="')
        with pytest.raises(urllib.error.HTTPError, match="407"):
            _opener(f"http://alice:wrong@127.0.0.1:{proxy.port}").open(url, timeout=10)
        assert proxy.url_with_auth == f"http://alice:s3cr%3At@127.0.0.1:{proxy.port}"
        with _opener(proxy.url_with_auth).open(url, timeout=10) as response:
            assert response.read() == PAYLOAD

        # On one connection: denied, then let through (a 407 without a body keeps it open).
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        try:
            assert _get(conn, url)[0] == 407
            assert _get(conn, url, headers={"Proxy-Authorization": proxy.authorization or ""})[:2] \
                == (200, PAYLOAD)
        finally:
            conn.close()

        with TLSFront(site.endpoint_url, [FAKE]) as front:
            tunnel = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10,
                                                 context=front.ssl_context())
            tunnel.set_tunnel(FAKE, front.port)
            with pytest.raises(OSError, match="407"):
                tunnel.request("GET", "/a.bin")
            tunnel.close()
            tunnel.set_tunnel(FAKE, front.port, headers={"Proxy-Authorization": proxy.authorization or ""})
            try:
                assert _get(tunnel, "/a.bin")[:2] == (200, PAYLOAD)
            finally:
                tunnel.close()
        assert proxy.denied == 4
        assert [method for method, _ in proxy.requests] == ["GET"] * 5 + ["CONNECT"] * 2


# --------------------------------------------------------------------------- TLS


def test_connect_tunnel_to_the_tls_front(site: HTTPServer, proxy: ForwardProxy) -> None:
    with TLSFront(site.endpoint_url, [FAKE]) as front:
        conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10,
                                           context=ssl.create_default_context(cafile=front.ca_file))
        conn.set_tunnel(FAKE, front.port)
        try:
            assert _get(conn, "/a.bin")[:2] == (200, PAYLOAD)
            assert _get(conn, "/a.bin", headers={"Range": "bytes=0-3"})[:2] == (206, PAYLOAD[:4])
        finally:
            conn.close()
        assert proxy.requests == [("CONNECT", f"{FAKE}:{front.port}")]
        assert (proxy.connections, front.connections, site.connections) == (1, 1, 1)


def test_the_front_is_trusted_only_with_its_ca(site: HTTPServer) -> None:
    with TLSFront(site.endpoint_url, [FAKE]) as front:
        assert front.url == f"https://127.0.0.1:{front.port}"
        for host in ("127.0.0.1", "localhost"):
            conn = http.client.HTTPSConnection(host, front.port, timeout=10, context=front.ssl_context())
            try:
                assert _get(conn, "/a.bin")[:2] == (200, PAYLOAD)
            finally:
                conn.close()
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw, \
                front.ssl_context().wrap_socket(raw, server_hostname=FAKE) as tls:
            assert tls.selected_alpn_protocol() in (None, "http/1.1")
        untrusted = http.client.HTTPSConnection("127.0.0.1", front.port, timeout=10,
                                                context=ssl.create_default_context())
        with pytest.raises(ssl.SSLCertVerificationError):
            untrusted.request("GET", "/a.bin")
        untrusted.close()
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw, \
                pytest.raises(ssl.SSLCertVerificationError, match="other.corp.test"):
            front.ssl_context().wrap_socket(raw, server_hostname="other.corp.test")


def test_one_ca_for_several_fronts(site: HTTPServer, tmp_path: Path) -> None:
    from cryptography import x509

    certificates = make_certificates(tmp_path / "ca", ["127.0.0.1", "a.corp.test", "b.corp.test"])
    ca = x509.load_pem_x509_certificate(Path(certificates.ca_file).read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert os.stat(certificates.key_file).st_mode & 0o077 == 0
    with TLSFront(site.endpoint_url, certificates=certificates) as one, \
            TLSFront(("127.0.0.1", site.port), certificates=certificates) as two, \
            TLSFront(f"localhost:{site.port}", certificates=certificates) as three:
        context = ssl.create_default_context(cafile=certificates.ca_file)
        for front in (one, two, three):
            assert front.ca_file == certificates.ca_file
            conn = http.client.HTTPSConnection("127.0.0.1", front.port, timeout=10, context=context)
            try:
                assert _get(conn, "/a.bin")[:2] == (200, PAYLOAD)
            finally:
                conn.close()


# --------------------------------------------------------------------------- S3 through the proxy


def test_s3_uploads_through_the_proxy(s3_bucket: tuple[S3Server | S3Endpoint, str]) -> None:
    import boto3
    import fsspec
    from botocore.config import Config

    server, bucket = s3_bucket
    origin = urlsplit(server.endpoint_url)
    assert origin.hostname is not None and origin.port is not None
    # Path-style under a name only the proxy resolves (the S3 test server takes path-style
    # whatever the host name, as MinIO does).
    hosts, host = {FAKE: origin.hostname}, f"{FAKE}:{origin.port}"
    endpoint = f"http://{host}"
    data = os.urandom(3 * 1024 * 1024 + 5)
    with ForwardProxy(hosts, timeout=20) as proxy:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=server.key,
                              aws_secret_access_key=server.secret, region_name=server.region,
                              config=Config(proxies={"http": proxy.url}, s3={"addressing_style": "path"}))
        client.put_object(Bucket=bucket, Key="up/one", Body=io.BytesIO(data))
        assert client.get_object(Bucket=bucket, Key="up/one")["Body"].read() == data
        client.delete_object(Bucket=bucket, Key="up/one")

        fs = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint, key=server.key,
                               secret=server.secret, client_kwargs={"region_name": server.region},
                               config_kwargs={"s3": {"addressing_style": "path"},
                                              "proxies": {"http": proxy.url}})
        fs.pipe(f"{bucket}/up/two", data)
        assert fs.cat(f"{bucket}/up/two") == data
        seen = proxy.requests
    one, two = f"http://{host}/{bucket}/up/one", f"http://{host}/{bucket}/up/two"
    assert seen[:3] == [("PUT", one), ("GET", one), ("DELETE", one)]
    assert ("PUT", two) in seen


# --------------------------------------------------------------------------- large bodies


def _traced_peak(action: Callable[[], None]) -> int:
    """The peak of Python allocations (all threads: the servers' too) while ``action`` runs."""
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_large_download_streams_through_proxy_and_front(http_server: Callable[..., HTTPServer],
                                                          proxy: ForwardProxy, tmp_path: Path) -> None:
    block = os.urandom(1 << 20)
    with open(tmp_path / "big.bin", "wb") as file:
        for _ in range(BIG // len(block)):
            file.write(block)
    expected = hashlib.sha256(block * (BIG // len(block))).hexdigest()
    site = http_server(tmp_path)
    got: dict[str, object] = {}
    with TLSFront(site.endpoint_url, [FAKE]) as front:
        def download() -> None:
            conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=20,
                                               context=front.ssl_context())
            conn.set_tunnel(FAKE, front.port)
            try:
                conn.request("GET", "/big.bin")
                response = conn.getresponse()
                digest, size = hashlib.sha256(), 0
                while piece := response.read(1 << 20):
                    digest.update(piece)
                    size += len(piece)
                got.update(status=response.status, size=size, sha256=digest.hexdigest())
            finally:
                conn.close()

        peak = _traced_peak(download)
    assert got == {"status": 200, "size": BIG, "sha256": expected}
    assert peak < 16 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held at once: not streamed"


def test_a_large_chunked_upload_streams_through_the_proxy(sink: int, proxy: ForwardProxy) -> None:
    block = os.urandom(1 << 20)
    count = BIG // len(block)
    got: dict[str, object] = {}

    def upload() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        try:
            conn.request("POST", f"http://{FAKE}:{sink}/big", body=(block for _ in range(count)),
                         encode_chunked=True)
            response = conn.getresponse()
            got.update(json.loads(response.read()))
        finally:
            conn.close()

    peak = _traced_peak(upload)
    assert got == {"size": BIG, "sha256": hashlib.sha256(block * count).hexdigest(), "chunked": True,
                   "method": "POST", "path": "/big"}
    assert peak < 16 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held at once: not streamed"


# --------------------------------------------------------------------------- stopping


def _ends_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_stop_closes_every_connection_at_once(site: HTTPServer) -> None:
    with TLSFront(site.endpoint_url) as front:
        proxy = ForwardProxy({FAKE: "127.0.0.1"}, timeout=30).start()
        try:
            kept = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            kept.sendall(f"GET http://{FAKE}:{site.port}/a.bin HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            tunnel = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            tunnel.sendall(f"CONNECT {FAKE}:{front.port} HTTP/1.1\r\n\r\n".encode())
            assert tunnel.recv(100).startswith(b"HTTP/1.1 200")
            idle = socket.create_connection(("127.0.0.1", front.port), timeout=10)
            deadline = time.monotonic() + 5
            while (proxy.connections, len(site.requests)) != (2, 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            started = time.monotonic()
        finally:
            proxy.stop()
            front.stop()
        assert time.monotonic() - started < 2.0
        with kept, tunnel, idle:
            assert _ends_within(kept, 2.0) and _ends_within(tunnel, 2.0) and _ends_within(idle, 2.0)


def test_a_forked_child_does_not_keep_connections_open(site: HTTPServer) -> None:
    proxy = ForwardProxy({FAKE: "127.0.0.1"}, timeout=30).start()
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    client.sendall(f"GET http://{FAKE}:{site.port}/a.bin HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    received = b""
    while len(received) < len(PAYLOAD):  # the answer is in: the connection is open and idle
        received += client.recv(65536)
    hold_read, hold_write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: hold on (as a DataLoader worker would) until told to go
        os.close(hold_write)
        os.read(hold_read, 1)
        os._exit(0)
    os.close(hold_read)
    try:
        proxy.stop()
        with client:
            assert _ends_within(client, 3.0), "the child's copy kept the proxy's side open"
    finally:
        os.close(hold_write)
        os.waitpid(pid, 0)
