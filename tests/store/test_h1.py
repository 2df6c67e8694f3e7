"""LITE-HTTP (streamdata/store/http1.py): the HTTP/1.1 client of LITE-S3's GETs, against real sockets.

A scripted server (a thread per connection, bytes written by each test) plays the faults; the
last tests run a LITE-S3 epoch on the embedded S3 server and check no process imports aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from streamdata.errors import BadResponseError, ConnectionLostError, ShortBodyError
from streamdata.store import http1 as h1
from streamdata.store.retry import classify

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers import make_samples, tar_bytes  # noqa: E402

Answer = Callable[[socket.socket, int, bytes], bool]  # (conn, request number, head) -> keep open


class Script:
    """A TCP server that hands each request's head to ``answer``; counts connections and requests."""

    def __init__(self, answer: Answer, tls: object = None) -> None:
        self.answer, self.tls = answer, tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.stopped = False
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def url(self, path: str = "/o", scheme: str = "http", host: str = "127.0.0.1") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    continue
            self.connections += 1
            self.socks.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head)
                if not self.answer(conn, len(self.requests) - 1, head):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped = True
        self.threads[0].join(5)
        self.listener.close()
        for conn in self.socks:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def script():
    made: list[Script] = []

    def make(answer: Answer, tls: object = None) -> Script:
        made.append(Script(answer, tls))
        return made[-1]

    yield make
    for server in made:
        server.close()


def ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def run(coro):
    return asyncio.run(coro)


async def fetch(pool: h1.Pool, url: str, headers: dict | None = None) -> tuple[int, bytes]:
    async with pool.get(url, headers) as resp:
        return resp.status, await resp.read()


def fetch_once(server: Script, timeout: float = 10, pools: list | None = None) -> tuple[int, bytes]:
    """One GET of ``server.url()`` through a fresh pool (appended to ``pools``), closed after."""
    async def go():
        pool = h1.Pool(4, timeout=timeout)
        if pools is not None:
            pools.append(pool)
        try:
            return await fetch(pool, server.url())
        finally:
            await pool.close()

    return run(go())


def test_keep_alive_reuses_one_connection(script) -> None:
    server = script(lambda c, i, head: c.sendall(ok(b"x" * (1000 + i))) or True)

    async def go():
        pool = h1.Pool(4, timeout=10)
        got = [await fetch(pool, server.url(), {"Range": "bytes=0-9"}) for _ in range(5)]
        await pool.close()
        return got, pool.opened

    got, opened = run(go())
    assert got == [(200, b"x" * (1000 + i)) for i in range(5)]
    assert opened == 1 and server.connections == 1 and len(server.requests) == 5
    assert b"Range: bytes=0-9" in server.requests[0] and b"Host: 127.0.0.1:" in server.requests[0]


def test_a_partly_read_answer_never_reuses_its_connection(script) -> None:
    big = os.urandom(4 << 20)
    server = script(lambda c, i, head: c.sendall(ok(big)) or True)

    async def go():
        pool = h1.Pool(4, timeout=10)
        async with pool.get(server.url()) as resp:
            async for _ in resp.chunks():
                break  # leave the rest unread
        assert pool.idle == 0
        whole = await fetch(pool, server.url())
        await pool.close()
        return whole, pool.opened

    whole, opened = run(go())
    assert whole == (200, big)
    assert opened == 2 and server.connections == 2


def test_a_truncated_body_is_an_incomplete_read_retried_as_short(script) -> None:
    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n\r\n" + b"y" * 400)
        return False  # close cleanly, 600 bytes short

    server = script(answer)
    pieces: list[bytes] = []

    async def go():
        pool = h1.Pool(4, timeout=10)
        try:
            async with pool.get(server.url()) as resp:
                async for piece in resp.chunks():
                    pieces.append(piece)
        finally:
            assert pool.idle == 0
            await pool.close()

    with pytest.raises(ShortBodyError, match="400 of 1000") as info:
        run(go())
    assert b"".join(pieces) == b"y" * 400  # what arrived was handed over (RESUME keeps it)
    assert classify(info.value) == "short"


def test_a_reset_mid_body_is_a_connection_error(script) -> None:
    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"z" * 1000)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        return False

    server = script(answer)
    pools: list[h1.Pool] = []
    with pytest.raises((ConnectionResetError, ShortBodyError)) as info:
        fetch_once(server, pools=pools)
    assert classify(info.value) in ("connection", "short")
    assert pools[0].idle == 0


@pytest.mark.parametrize("head", [b"HTTP/1.1 2OO OK", b"ICY 200 OK", b"HTTP/2 200", b"garbage",
                                  b"HTTP/1.1 200 OK\r\nno colon here",
                                  b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6"])
def test_a_bad_answer_is_a_protocol_error(script, head: bytes) -> None:
    server = script(lambda c, i, _: c.sendall(head + b"\r\n\r\nhello") or True)

    with pytest.raises(BadResponseError) as info:
        fetch_once(server)
    assert classify(info.value) == "connection"


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (h1.MAX_HEAD + 10),
                                  b"HTTP/1.1 200 OK" + b"\r\nX-N: 1" * (h1.MAX_HEADERS + 1)])
def test_oversized_heads_are_refused(script, head: bytes) -> None:
    server = script(lambda c, i, _: c.sendall(head + b"\r\nContent-Length: 0\r\n\r\n") or True)

    with pytest.raises(BadResponseError, match="over"):
        fetch_once(server)


@pytest.mark.parametrize("sent", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"])
def test_a_silent_server_hits_the_timeout(script, sent: bytes) -> None:
    release = threading.Event()

    def answer(c, i, head):
        c.sendall(sent)
        release.wait(30)  # then silence: no more bytes, connection open
        return False

    server = script(answer)
    try:
        with pytest.raises(TimeoutError, match="no data") as info:
            fetch_once(server, timeout=0.5)
    finally:
        release.set()
    assert classify(info.value) == "timeout"


def test_chunked_bodies_and_trailers(script) -> None:
    bodies = [b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n",
              b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"]

    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + bodies[i])
        return True

    server = script(answer)

    async def go():
        pool = h1.Pool(4, timeout=10)
        got = [await fetch(pool, server.url()) for _ in bodies]
        await pool.close()
        return got, pool.opened

    got, opened = run(go())
    assert got == [(200, b"hello world"), (200, b"abc")]
    assert opened == 1  # read to the end: reused


def test_a_bad_chunk_is_a_protocol_error(script) -> None:
    server = script(lambda c, i, _: c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                              b"zz\r\nhello\r\n0\r\n\r\n") or True)

    with pytest.raises(BadResponseError, match="chunk size"):
        fetch_once(server)


def answer_once_then_close(c, i, head):
    """A script that answers its first request and closes on the second, unanswered."""
    if i == 0:
        c.sendall(ok(b"first"))
        return True
    return False  # read the second request, close without an answer


def test_no_hidden_resend_when_a_kept_alive_connection_drops(script) -> None:
    """aiohttp re-sends at once, unseen, when a reused connection drops before the answer
    (``_compat.aiohttp_no_hidden_retry``); this client reports it, and the request was sent once."""
    server = script(answer_once_then_close)

    async def go():
        pool = h1.Pool(4, timeout=10)
        try:
            assert await fetch(pool, server.url()) == (200, b"first")
            await fetch(pool, server.url())
        finally:
            await pool.close()

    with pytest.raises(ConnectionLostError) as info:
        run(go())
    assert classify(info.value) == "connection"
    assert len(server.requests) == 2 and server.connections == 1  # never re-sent


def test_redirects_are_followed_with_the_same_headers(script) -> None:
    def answer(c, i, head):
        if i == 0:
            c.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /moved?x=1\r\n"
                      b"Content-Length: 4\r\n\r\nmove")
        else:
            c.sendall(ok(b"here"))
        return True

    server = script(answer)

    async def go():
        pool = h1.Pool(2, timeout=10)
        got = await fetch(pool, server.url(), {"Range": "bytes=0-3"})
        await pool.close()
        return got, pool.opened

    assert run(go()) == ((200, b"here"), 1)  # the redirect's body read: its connection reused
    moved = server.requests[1]
    assert moved.startswith(b"GET /moved?x=1 HTTP/1.1") and b"Range: bytes=0-3" in moved


def test_limit_bounds_connections_in_use(script) -> None:
    gate = threading.Event()

    def answer(c, i, head):
        gate.wait(10)
        c.sendall(ok(b"k"))
        return True

    server = script(answer)

    async def go():
        pool = h1.Pool(2, timeout=10)
        tasks = [asyncio.ensure_future(fetch(pool, server.url())) for _ in range(6)]
        await asyncio.sleep(0.3)
        in_flight = server.connections
        gate.set()
        got = await asyncio.gather(*tasks)
        await pool.close()
        return in_flight, got, pool.opened

    in_flight, got, opened = run(go())
    assert in_flight <= 2 and opened == 2 and got == [(200, b"k")] * 6


def test_forget_leaves_the_sockets_open(script) -> None:
    """FORK-RESET: an inherited pool is dropped, its connections (the parent's) not closed."""
    server = script(lambda c, i, head: c.sendall(ok(b"v")) or True)

    async def go():
        pool = h1.Pool(2, timeout=10)
        await fetch(pool, server.url())
        conn = pool._idle[("http", "127.0.0.1", server.port)][0]
        pool.forget()
        assert pool.idle == 0 and pool.closed and conn in h1._ABANDONED
        assert not conn.transport.is_closing()
        h1._ABANDONED.remove(conn)
        conn.abort()

    run(go())


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    crypto = pytest.importorskip("cryptography")  # noqa: F841
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_https_verifies_the_server(script, tmp_path: Path) -> None:
    import ssl

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = script(lambda c, i, head: c.sendall(ok(b"secret bytes")) or True, tls=server_ctx)
    trusting = ssl.create_default_context(cafile=cert)

    async def go(ctx):
        pool = h1.Pool(2, timeout=10, ssl_context=ctx)
        try:
            url = server.url(scheme="https", host="localhost")
            return [await fetch(pool, url) for _ in range(2)], pool.opened
        finally:
            await pool.close()

    assert run(go(trusting)) == ([(200, b"secret bytes")] * 2, 1)
    with pytest.raises(ssl.SSLCertVerificationError):  # the default context does not trust it
        run(go(None))


# ---- LITE-S3 epochs: no aiohttp anywhere ---------------------------------------------------

_CHILD = """
import json, sys
import streamdata as sd
opts, spec = json.loads(sys.argv[1])
ds = sd.TarDataset(spec, storage_options=opts)
ds.map = lambda s: dict(s, aiohttp="aiohttp" in sys.modules)
keys, workers = [], set()
for sample in sd.loader(ds, batch_size=None, num_workers=2, pin_memory=False):
    keys.append(sample["__key__"])
    workers.add(sample["aiohttp"])
print(json.dumps({"main": "aiohttp" in sys.modules, "workers": sorted(workers), "keys": sorted(keys)}))
"""


@pytest.mark.parametrize("lite_http", ["1", pytest.param("0", marks=pytest.mark.slow)])
def test_a_lite_s3_epoch_never_imports_aiohttp(s3_bucket, lite_http: str) -> None:
    server, bucket = s3_bucket
    counts = [3, 4]
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(counts)):
        s3.put_object(Bucket=bucket, Key=f"e/s-{i}.tar", Body=tar_bytes(shard))
    spec = f"s3://{bucket}/e/s-{{0..1}}.tar"
    env = dict(os.environ, STREAMDATA_LITE_HTTP=lite_http)
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([server.storage_options, spec])],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    keys = sorted(s["__key__"] for shard in make_samples(counts) for s in shard)
    imported = lite_http == "0"  # the A/B switch: aiohttp again, everywhere
    assert got == {"main": imported, "workers": [imported], "keys": keys}


def _key(server: Script) -> tuple[str, str, int]:
    return ("http", "127.0.0.1", server.port)


def _sessions(timeout: float = 10):
    """The two implementations of ``session.Session``: ours and aiohttp's, adapted."""
    from streamdata.store.session import AiohttpSession

    return {"http1": lambda: h1.Pool(4, timeout=timeout), "aiohttp": lambda: AiohttpSession.new(4)}


def _fault(make, url: str, timeout: float | None = None) -> BaseException:
    """The exception one GET of ``url`` (body read to its end) raises through a new session."""
    async def go():
        session = make()
        try:
            async with session.get(url, {"Range": "bytes=0-"}, timeout) as resp:
                async for _ in resp.chunks():
                    pass
        finally:
            await session.close()

    with pytest.raises(Exception) as info:
        run(go())
    return info.value


@pytest.mark.parametrize("which", ["http1", "aiohttp"])
def test_a_refused_connection_is_the_same_type_from_both_sessions(which: str) -> None:
    """TYPED-TRANSPORT-ERRORS, as each test of this section: the same fault raises the same
    ``TransportError`` subclass from either session, and ``classify`` decides by it."""
    from streamdata.errors import ConnectRefusedError

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused
    try:
        err = _fault(_sessions()[which], f"http://127.0.0.1:{dead.getsockname()[1]}/o")
    finally:
        dead.close()
    assert type(err) is ConnectRefusedError and isinstance(err, ConnectionRefusedError)
    assert classify(err) == "connection"


@pytest.mark.parametrize("which", ["http1", "aiohttp"])
def test_a_reset_mid_body_is_the_same_type_from_both_sessions(script, which: str) -> None:
    import time

    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"z" * 1000)
        time.sleep(0.3)  # the client has read the 1000 bytes and waits for more
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        return False

    server = script(answer)
    err = _fault(_sessions()[which], server.url())
    assert type(err) is ConnectionLostError and isinstance(err, ConnectionResetError)
    assert classify(err) == "connection"


@pytest.mark.parametrize("which", ["http1", "aiohttp"])
def test_a_body_cut_cleanly_short_is_the_same_type_from_both_sessions(script, which: str) -> None:
    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n\r\n" + b"y" * 400)
        return False  # a clean close, 600 bytes short

    server = script(answer)
    err = _fault(_sessions()[which], server.url())
    assert type(err) is ShortBodyError and classify(err) == "short"


@pytest.mark.parametrize("which", ["http1", "aiohttp"])
def test_a_silent_server_is_the_same_timeout_type_from_both_sessions(script, which: str) -> None:
    from streamdata.errors import TransportTimeoutError

    release = threading.Event()

    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        release.wait(30)  # then silence
        return False

    server = script(answer)
    try:
        err = _fault(_sessions(timeout=0.5)[which], server.url(), timeout=0.5)
    finally:
        release.set()
    assert type(err) is TransportTimeoutError and isinstance(err, TimeoutError)
    assert classify(err) == "timeout"


@pytest.mark.parametrize("which", ["http1", "aiohttp"])
def test_an_untrusted_certificate_is_the_same_type_from_both_sessions_and_never_retried(
        script, tmp_path: Path, which: str) -> None:
    import ssl

    from streamdata.errors import CertificateError

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = script(lambda c, i, head: c.sendall(ok(b"secret bytes")) or True, tls=server_ctx)
    err = _fault(_sessions()[which], server.url(scheme="https", host="localhost"))
    assert type(err) is CertificateError and isinstance(err, ssl.SSLCertVerificationError)
    assert classify(err) is None  # permanent: a retry cannot make the certificate trusted
