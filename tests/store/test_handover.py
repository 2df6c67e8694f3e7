"""WARM-HANDOVER (streamdata/handover.py): the constructor's idle keep-alive connection goes to
the reader that sends next, against the embedded S3 server behind a connection-counting proxy."""

from __future__ import annotations

import contextlib
import io
import select
import socket
import sys
import tarfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import streamdata as sd
from streamdata.store import handover
from streamdata.store.s3lite import LiteS3

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.proxy import LatencyProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [3, 4, 2, 5]
KEYS = sorted(s["__key__"] for shard in make_samples(COUNTS) for s in shard)


@pytest.fixture(autouse=True)
def _empty_registry(monkeypatch):
    """No offer left by another test (the S3 server, and so the key, is the session's); no
    spare connections (WARM-SPARES) but in the tests that ask for them."""
    monkeypatch.setenv("STREAMDATA_SPARE_CONNECTIONS", "0")
    monkeypatch.setattr(handover, "_children", (0, 0.0))  # no share hint left by another test
    def drop() -> None:
        with handover._lock:
            for _, sock, _ in handover._offers:
                sock.close()
            handover._offers.clear()
    drop()
    yield
    drop()


@pytest.fixture
def shards(s3_bucket):
    """COUNTS shards at ``h/s-{i}.tar`` and a connection-counting proxy in front of the server:
    ``(proxy, storage options through it, spec)``."""
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"h/s-{i}.tar", Body=tar_bytes(shard))
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.0) as proxy:
        opts = dict(server.storage_options, endpoint_url=proxy.url_for(server.endpoint_url))
        yield proxy, opts, f"s3://{bucket}/h/s-{{0..{len(COUNTS) - 1}}}.tar"


def _dataset(opts: dict, spec: str) -> sd.TarDataset:
    # one request at a time per reader: each reader needs exactly one connection
    return sd.TarDataset(spec, storage_options=opts, index=None, decode=False, max_requests=1)


def _key(opts: dict) -> tuple[str, str, int]:
    return LiteS3(opts["endpoint_url"], "us-east-1").conn_key


def _epoch_with_workers(ds: sd.TarDataset) -> tuple[list[str], dict[int, dict[str, int]]]:
    """An epoch through two forked workers: the keys, and each worker's ``handover.stats()``."""
    import torch.utils.data

    def tag(sample: dict) -> dict:
        info = torch.utils.data.get_worker_info()
        return dict(sample, worker=info.id, stats=handover.stats())

    ds.map = tag
    keys, stats = [], {}
    loader = sd.loader(ds, batch_size=None, num_workers=2, persistent_workers=False, pin_memory=False)
    for sample in loader:
        keys.append(sample["__key__"])
        stats[sample["worker"]] = sample["stats"]  # the last sample's: after every connect
    return sorted(keys), stats


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_worker_zero_adopts_the_listing_connection(shards, monkeypatch, enabled: str) -> None:
    proxy, opts, spec = shards
    monkeypatch.setenv("STREAMDATA_HANDOVER", enabled)
    before = handover.stats()
    ds = _dataset(opts, spec)
    assert proxy.connections == 1  # the listing's
    offered = enabled == "1"
    assert len(handover._offers) == int(offered)
    keys, stats = _epoch_with_workers(ds)
    assert keys == KEYS and not any(ds.retried.values())
    # worker 0 (forked first) took the listing's connection and nothing else; worker 1 none
    assert stats[0]["claimed"] == int(offered) and stats[0]["offered"] == int(offered)
    assert stats[1]["claimed"] == 0 and stats[1]["offered"] == 0
    # the parent closed its copy at the fork and never holds it again
    assert handover._offers == []
    assert handover.stats()["handed"] - before["handed"] == int(offered)
    # one connection per worker (max_requests=1), the first of worker 0 being the listing's
    assert proxy.connections == (2 if offered else 3)


def test_without_workers_the_reader_adopts_the_listing_connection(shards) -> None:
    proxy, opts, spec = shards
    ds = _dataset(opts, spec)
    before = handover.stats()
    assert sorted(s["__key__"] for s in ds) == KEYS and not any(ds.retried.values())
    assert handover.stats()["claimed"] - before["claimed"] == 1
    assert proxy.connections == 1  # the listing's connection carried the whole epoch


def _close_proxied_connections(proxy: LatencyProxy, *clients: socket.socket) -> None:
    """The server side of every open connection through ``proxy`` goes away (a reset); returns
    once each of ``clients`` has seen it (readable)."""
    done = threading.Event()

    def cancel() -> None:
        for task in list(proxy._tasks):
            task.cancel()
        done.set()

    proxy._loop.call_soon_threadsafe(cancel)
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while proxy._tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    for sock in clients:
        assert select.select([sock], [], [], 5)[0], "the reset did not reach the client"


def test_a_connection_the_server_closed_is_dropped_not_used(shards) -> None:
    proxy, opts, spec = shards
    ds = _dataset(opts, spec)
    assert len(handover._offers) == 1
    _close_proxied_connections(proxy, handover._offers[0][1])
    before = handover.stats()
    assert sorted(s["__key__"] for s in ds) == KEYS
    assert not any(ds.retried.values())  # no request was sent on it: nothing failed, nothing retried
    after = handover.stats()
    assert (after["claimed"] - before["claimed"], after["dropped"] - before["dropped"]) == (0, 1)
    assert proxy.connections == 2


def test_an_offer_past_its_age_is_not_used(shards, monkeypatch) -> None:
    proxy, opts, spec = shards
    ds = _dataset(opts, spec)
    monkeypatch.setattr(handover, "MAX_IDLE_S", 0.0)  # as if MAX_IDLE_S had passed
    before = handover.stats()
    assert sorted(s["__key__"] for s in ds) == KEYS and not any(ds.retried.values())
    after = handover.stats()
    assert (after["claimed"] - before["claimed"], after["dropped"] - before["dropped"]) == (0, 1)
    assert proxy.connections == 2 and handover._offers == []


def test_offer_and_claim(shards) -> None:
    """The registry alone: by key, taken once, a closed one skipped, https never kept."""
    proxy, opts, _ = shards
    key = _key(opts)
    socks = [socket.create_connection((key[1], key[2])) for _ in range(2)]
    deadline = time.monotonic() + 5
    while len(proxy._tasks) < 2 and time.monotonic() < deadline:  # both accepted by the proxy
        time.sleep(0.01)
    assert handover.offer(key, socks[0]) and handover.offer(key, socks[1])
    assert handover.claim(("http", key[1], key[2] + 1)) is None  # another port
    got = handover.claim(key)
    assert got is socks[0]
    _close_proxied_connections(proxy, socks[1])  # the other one: closed by the server while idle
    before = handover.stats()
    assert handover.claim(key) is None and socks[1].fileno() == -1
    assert handover.stats()["dropped"] - before["dropped"] == 1
    got.close()
    tls = socket.create_connection((key[1], key[2]))
    assert not handover.offer(("https", key[1], key[2]), tls) and tls.fileno() == -1


def _wait_for(what, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not what() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_spares_open_with_the_listing_and_sd_loader_workers_share_them(shards, monkeypatch) -> None:
    """WARM-SPARES: the constructor opens 4 connections while its listing travels and offers
    them with the listing's (5); ``sd.loader`` tells the fork hooks 2 workers are coming, so
    worker 0 gets 3 and worker 1 the other 2, and neither opens a connection of its own."""
    proxy, opts, spec = shards
    monkeypatch.setenv("STREAMDATA_SPARE_CONNECTIONS", "4")
    before = handover.stats()
    ds = _dataset(opts, spec)
    _wait_for(lambda: proxy.connections == 5)
    assert proxy.connections == 5 and len(handover._offers) == 5
    assert handover.stats()["spared"] - before["spared"] == 4
    keys, stats = _epoch_with_workers(ds)
    assert keys == KEYS and not any(ds.retried.values())
    assert (stats[0]["offered"], stats[1]["offered"]) == (3, 2)
    assert stats[0]["claimed"] >= 1 and stats[1]["claimed"] >= 1
    assert handover._offers == [] and handover.stats()["handed"] - before["handed"] == 5
    assert proxy.connections == 5  # every request rode a connection the constructor opened


def test_a_plain_dataloader_hands_one_offer_to_each_worker(shards, monkeypatch) -> None:
    """Without ``share_among`` (a DataLoader of the user's own) each child gets one offer, as
    before WARM-SPARES; the parent keeps the rest until they age."""
    import torch.utils.data

    proxy, opts, spec = shards
    monkeypatch.setenv("STREAMDATA_SPARE_CONNECTIONS", "3")
    ds = _dataset(opts, spec)
    _wait_for(lambda: proxy.connections == 4)
    before = handover.stats()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(s["__key__"] for s in loader) == KEYS
    assert len(handover._offers) == 2 and handover.stats()["handed"] - before["handed"] == 2


_FRESH_PLAIN_LOADER = r"""
import json, os, sys
import torch.utils.data
import streamdata as sd
from streamdata import _fork
from streamdata.store import handover

spec, out = sys.argv[1], sys.argv[2]
ds = sd.TarDataset(spec, storage_options=json.loads(os.environ["SD_OPTIONS"]), index=None,
                   decode=False, max_requests=1)
offered = [s.getsockname()[1] for _, s, _ in handover._offers]

def report(worker):  # in the child, after FORK-RESET: the connections it may send on
    with open(f"{out}/worker{worker}.json", "w") as f:
        json.dump([s.getsockname()[1] for _, s, _ in handover._offers], f)

loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=report)
keys = sorted(s["__key__"] for s in loader)
print(json.dumps({"installed": _fork.installed(), "offered": offered, "keys": keys,
                  "kept": [s.getsockname()[1] for _, s, _ in handover._offers]}))
"""


def test_a_fresh_process_never_shares_an_offer_between_plain_dataloader_workers(shards, tmp_path) -> None:
    """FORK-RESET from the first offer: in a fresh interpreter whose only streamdata work before
    a plain DataLoader forks is the constructor's listing (no iteration, no loop thread), the
    offers its listing left are still split: each worker holds connections no other process
    holds (without the reset both workers inherit them all and read each other's answers)."""
    import json
    import os
    import subprocess

    proxy, opts, spec = shards
    env = {**os.environ, "SD_OPTIONS": json.dumps(opts), "STREAMDATA_SPARE_CONNECTIONS": "3",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", _FRESH_PLAIN_LOADER, spec, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["keys"] == KEYS and report["installed"]
    assert len(report["offered"]) == 4  # the listing's connection and three spares
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in (0, 1)]
    assert [len(w) for w in workers] == [1, 1]
    held = workers[0] + workers[1] + report["kept"]
    assert sorted(held) == sorted(report["offered"])  # every offer in exactly one process


def test_a_spare_that_could_not_connect_is_dropped_not_claimed() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    key = ("http", "127.0.0.1", port)
    before = handover.stats()
    assert len(handover.spare(key, ("127.0.0.1", port), 2)) == 2
    _wait_for(lambda: all(handover._state(entry[1]) != handover._OPENING for entry in handover._offers))
    assert handover.waiting(key) == 2 and handover.claim(key) is None  # refused: both dropped
    after = handover.stats()
    assert after["dropped"] - before["dropped"] == 2 and handover._offers == []
    assert handover.spare(("https", "127.0.0.1", port), ("127.0.0.1", port), 2) == []  # TLS: never


def test_a_fork_hook_that_times_out_leaves_another_threads_fork_alone() -> None:
    """Two threads forking at once: the one whose hook could not take the registry's lock (1 s)
    must not overwrite the other's fork state, or the other's after-fork hook never releases
    the lock and every later claim hangs (found in review)."""
    handover._before_fork()  # this thread takes the lock, as its fork would
    try:
        other = threading.Thread(target=lambda: (handover._before_fork(), handover._in_parent()))
        other.start()
        other.join(10)  # its wait for the lock times out after 1 s
        assert not other.is_alive()
    finally:
        handover._in_parent()
    assert not handover._lock.locked() and handover._forking == {}


def test_no_spares_where_no_reader_would_claim_them(shards, monkeypatch) -> None:
    """Readers off LITE-HTTP (aiohttp) claim nothing: the constructor opens no spare for them;
    and an https or hand-over-off process never reads the spare count (a bad value is harmless)."""
    proxy, opts, spec = shards
    monkeypatch.setenv("STREAMDATA_SPARE_CONNECTIONS", "4")
    monkeypatch.setenv("STREAMDATA_LITE_HTTP", "0")
    before = handover.stats()
    ds = _dataset(opts, spec)
    assert handover.stats()["spared"] == before["spared"] and len(handover._offers) == 1
    assert sorted(s["__key__"] for s in ds) == KEYS
    monkeypatch.setenv("STREAMDATA_SPARE_CONNECTIONS", "many")
    assert handover.spare(("https", "127.0.0.1", 1), ("127.0.0.1", 1)) == []
    monkeypatch.setenv("STREAMDATA_HANDOVER", "0")
    assert handover.spare(("http", "127.0.0.1", 1), ("127.0.0.1", 1)) == []


def test_spares_count_what_is_offered_already(shards) -> None:
    proxy, opts, _ = shards
    key = _key(opts)
    address = (key[1], key[2])
    assert len(handover.spare(key, address, 3)) == 3
    assert handover.spare(key, address, 3) == []  # three are there
    assert len(handover.spare(key, address, 5)) == 2
    _wait_for(lambda: proxy.connections == 5)
    got = [handover.claim(key) for _ in range(5)]
    assert all(sock is not None for sock in got) and handover.claim(key) is None
    for sock in got:
        sock.close()


_PAGE = ('<?xml version="1.0"?><ListBucketResult><IsTruncated>{more}</IsTruncated>{token}'
         '<Contents><Key>{key}</Key><Size>3</Size></Contents></ListBucketResult>')


@contextlib.contextmanager
def _listing_server(pages: int = 1, tls=None, advertised: int | None = None, stall: float = 0.0):
    """A keep-alive HTTP/1.1 server answering every GET with a listing page of one key
    (``a.tar``, ``b.tar``, ...), ``pages`` pages (``advertised`` said to be there); a request for
    a page past them is answered by closing the connection (after ``stall`` seconds)."""
    advertised = advertised or pages
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keeps connections alive

        def do_GET(self) -> None:  # noqa: N802
            page = int(self.path.partition("continuation-token=")[2].partition("&")[0] or 0)
            if page >= pages:
                time.sleep(stall)
                self.close_connection = True
                return
            more = page + 1 < advertised
            body = _PAGE.format(more=str(more).lower(), key=f"{'abcdefgh'[page]}.tar",
                                token=f"<NextContinuationToken>{page + 1}</NextContinuationToken>"
                                if more else "").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_https_listing_offers_nothing(tmp_path: Path, scheme: str) -> None:
    """A TLS connection is never offered (LiteS3 closes it as before); the same listing over
    plain http is, and the next request goes out on it."""
    import ssl

    from tests.store.test_h1 import _self_signed

    tls = client = None
    if scheme == "https":
        cert, key = _self_signed(tmp_path)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        client = ssl.create_default_context(cafile=cert)
    with _listing_server(tls=tls) as port:
        lite = LiteS3(f"{scheme}://localhost:{port}", "us-east-1")
        lite.ssl_context = client
        before = handover.stats()
        assert lite.list("b", "", timeout=10) == [("a.tar", 3, None)]
        assert lite.list("b", "", timeout=10) == [("a.tar", 3, None)]  # on the first one's connection
        offered = handover.stats()["offered"] - before["offered"]
        claimed = handover.stats()["claimed"] - before["claimed"]
        assert (offered, claimed, len(handover._offers)) == ((2, 1, 1) if scheme == "http" else (0, 0, 0))


def test_a_listing_that_fails_midway_offers_nothing() -> None:
    """Page 1 read whole, page 2's request cut: the connection is closed, not offered."""
    before = handover.stats()
    for stall, timeout in ((0.0, 10), (1.0, 0.2)):  # page 2: the connection closed; no answer in time
        with _listing_server(pages=1, advertised=2, stall=stall) as port:
            lite = LiteS3(f"http://127.0.0.1:{port}", "us-east-1")
            with pytest.raises(OSError):
                lite.list("b", "", timeout=timeout)  # page 1 says there is more
            assert handover.stats()["offered"] == before["offered"] and handover._offers == []
    with _listing_server(pages=2) as port:  # the same with a page 2: offered once, at the end
        lite = LiteS3(f"http://127.0.0.1:{port}", "us-east-1")
        assert [k for k, _, _ in lite.list("b", "", timeout=10)] == ["a.tar", "b.tar"]
        assert handover.stats()["offered"] == before["offered"] + 1 and len(handover._offers) == 1


def test_lite_get_answers_and_offers_its_connection(shards) -> None:
    """``LiteS3.get``: a 2xx's bytes; a 404 is ``FileNotFoundError``; either way its read-whole
    connection is offered, and the next GET (or listing) goes out on it."""
    proxy, opts, spec = shards
    bucket = spec.split("/")[2]
    lite = LiteS3.from_options(opts, {})
    assert lite is not None
    before = handover.stats()
    status, body = lite.get(bucket, "h/s-1.tar", timeout=10)
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = {name.split(".")[0] for name in tar.getnames()}
    assert status == 200 and names == {s["__key__"] for s in make_samples(COUNTS)[1]}
    with pytest.raises(FileNotFoundError):
        lite.get(bucket, "h/missing.tar", timeout=10)
    listed = lite.list(bucket, "h/", timeout=10)
    assert [k for k, _, _ in listed] == [f"h/s-{i}.tar" for i in range(len(COUNTS))]
    assert listed[1][1] == len(body)
    after = handover.stats()
    assert (after["offered"] - before["offered"], after["claimed"] - before["claimed"]) == (3, 2)
    assert proxy.connections == 1 and len(handover._offers) == 1
