"""Retry mechanics: by deadline, permanent errors at once, resume from the bytes received,
one AIMD limit per reader (READER-THROTTLE), every retry counted per reason.

The S3 tests read moto's server through ``benchmarks.faults.FaultProxy`` with DEFAULT
fetch options unless a test says otherwise (whole-dataset scenarios live in
``test_fault_scenarios.py``).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import streamdata as sd
from benchmarks.faults import Fault, FaultProxy, s3_error_xml
from streamdata.config import FetchConfig
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.metrics import COUNTERS, RETRY_REASONS, Counters
from streamdata.store.retry import Throttle, backoff_s, classify, parse_retry_after, retry_after
from tests.helpers import make_samples, read_keys, tar_bytes, write_shards

MiB = 1 << 20


@pytest.fixture
def proxied(s3_bucket, monkeypatch):
    """(bucket, s3fs filesystem straight to the server, the proxy, storage options through it).

    The signer cache starts empty: a proxy may get the port an earlier test's proxy had, and
    with it the same storage options, so this process would sign with that test's client
    (SIGNER-REUSE), whose URLs re-sign once on a 404 and make the request counts differ."""
    import s3fs

    from streamdata.store import backends

    monkeypatch.setattr(backends, "_SIGNERS", {})
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        yield bucket, fs, proxy, {**server.storage_options, "endpoint_url": proxy.url}


def _read_all(items, options, config=None, counters=None):
    with Prefetcher(items, options, config, counters=counters) as fetcher:
        data = [reader.read() for reader in fetcher]
    return data, fetcher


def _caused(exc, cause):
    exc.__cause__ = cause
    return exc


# ---- the pieces, without a network --------------------------------------------------------

def test_throttle_halves_once_per_round_grows_by_one_per_round_and_keeps_floor_and_ceiling():
    async def scenario():
        t = Throttle(8)
        sent = [await t.acquire(0) for _ in range(8)]
        assert t.active == 8 and t.allowed == 8
        for s in sent:  # a burst of 503s to 8 concurrent requests: one decrease, not eight
            t.release(s, "throttled")
        assert (t.allowed, t.decreases, t.lowest) == (4, 1, 4)
        for _ in range(5):  # each round of throttling (requests sent after the decrease) halves
            t.release(await t.acquire(0), "throttled")
        assert t.allowed == 1 and t.lowest == 1  # floor
        for _ in range(3):
            t.release(await t.acquire(0), "ok")  # +1/limit each: one slot per round of successes
        assert t.allowed == 2
        for _ in range(500):
            t.release(await t.acquire(0), "ok")
        assert t.allowed == 8 and t.limit == 8.0  # ceiling
        return t

    asyncio.run(scenario())


def test_throttle_blocks_past_the_limit_and_hands_slots_out_oldest_first():
    async def scenario():
        t = Throttle(4)
        held = [await t.acquire(0) for _ in range(4)]
        t.release(held.pop(), "throttled")  # limit 2, 3 still active
        order = []

        async def one(priority):
            sent = await t.acquire(priority)
            order.append(priority)
            await asyncio.sleep(0)
            t.release(sent, "other")

        tasks = [asyncio.ensure_future(one(p)) for p in (3.0, 1.0, 2.0)]
        await asyncio.sleep(0.01)
        assert order == [] and t.active == 3  # over the limit: nobody gets through
        t.release(held.pop(), "other")
        await asyncio.sleep(0.01)
        assert order == []  # 2 active, limit 2
        t.release(held.pop(), "other")
        await asyncio.gather(*tasks)
        assert order == [1.0, 2.0, 3.0]
        t.release(held.pop(), "other")
        assert t.active == 0
        # a waiter cancelled before or after its slot was granted leaves no slot taken
        t.limit = 1.0
        first = await t.acquire(0)
        queued = [asyncio.ensure_future(t.acquire(p)) for p in (1.0, 2.0)]
        await asyncio.sleep(0.01)
        queued[1].cancel()
        t.release(first, "other")  # granted to queued[0]...
        queued[0].cancel()  # ...which is cancelled before it runs
        await asyncio.gather(*queued, return_exceptions=True)
        assert t.active == 0 and not t._waiters
        t.release(await t.acquire(0), "other")

    asyncio.run(scenario())


@pytest.mark.parametrize(("exc", "reason"), [
    (OSError("b/k: HTTP 503 <Code>SlowDown</Code>"), "throttled"),
    (OSError("b/k: HTTP 429 "), "throttled"),
    (OSError("b/k: HTTP 500 <Code>InternalError</Code>"), "server"),
    (TimeoutError(), "timeout"),
    (ConnectionResetError("reset by peer"), "connection"),
    (ConnectionRefusedError(111, "Connection refused"), "connection"),
    (_caused(FileNotFoundError("http://h/x"), ConnectionRefusedError()), "connection"),
    (OSError("b/k: HTTP 404 <Code>NoSuchKey</Code>"), None),
    (OSError("b/k: HTTP 500 <Code>NoSuchKey</Code>"), None),  # the body says it is gone
    (OSError("b/k: HTTP 400 <Code>InvalidArgument</Code>"), None),
    (OSError("<Code>InvalidAccessKeyId</Code>"), None),
    (FileNotFoundError("x"), None),
    (PermissionError("x"), None),
    (ValueError("something else"), "other"),
])
def test_failures_are_classified_permanent_or_by_retry_reason(exc, reason):
    assert classify(exc) == reason
    assert reason is None or reason in RETRY_REASONS


def _aiohttp_errors():
    """aiohttp's exceptions as aiohttp raises them (its payload errors' texts included), each
    with the reason its type stands for."""
    import ssl

    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    key = ConnectionKey("h", 443, True, True, None, None, None)
    cert = ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate")
    return [
        (aiohttp.ClientPayloadError("Response payload is not completed: <ContentLengthError: 400, "
                                    "message='Not enough data to satisfy content length header.'>"), "short"),
        (aiohttp.ClientPayloadError("Response payload is not completed: <ContentLengthError: 400, "
                                    "message='Not enough data to satisfy content length header.'>. "
                                    "ConnectionResetError(104, 'Connection reset by peer')"), "connection"),
        (aiohttp.ServerDisconnectedError(), "connection"),
        (aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connection refused")), "connection"),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), "connection"),
        (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), "timeout"),
        (aiohttp.ClientConnectorCertificateError(key, cert), None),
    ]


def test_aiohttp_errors_are_classified_by_their_type():
    from streamdata.errors import TransportError
    from streamdata.store.session import transport_error

    for exc, reason in _aiohttp_errors():
        assert classify(exc) == reason, exc
        typed = transport_error(exc, "https://h/o")
        assert isinstance(typed, TransportError) and typed.__cause__ is exc


@pytest.mark.parametrize(("exc", "reason"), [
    # a type no retry can fix, whatever its message says
    (lambda e: e.CertificateError("connection reset, timeout: ConnectionResetError"), None),
    (lambda e: PermissionError("timed out: Connection reset by peer"), None),
    (lambda e: e.AccessDeniedError("TimeoutError: ClientPayloadError"), None),
    # a transport type, whatever its message says
    (lambda e: e.ShortBodyError("timeout; ConnectionResetError; HTTP 404 NoSuchKey"), "short"),
    (lambda e: e.TransportTimeoutError("Connection reset by peer"), "timeout"),
    (lambda e: e.ConnectionLostError("IncompleteRead, ContentLengthError, timeout"), "connection"),
    # names of transport errors in the text of something else make it none of them
    (lambda e: ValueError("ConnectionResetError: timeout, ServerDisconnectedError"), "other"),
    (lambda e: OSError("ClientPayloadError: <ContentLengthError: 400, message='Not enough data'>"), "other"),
    (lambda e: RuntimeError("Response payload is not completed. ConnectionResetError(104)"), "other"),
])
def test_transport_failures_are_classified_by_type_not_by_message(exc, reason):
    from streamdata import errors

    assert classify(exc(errors)) == reason


def test_backoff_is_full_jitter_below_a_cap():
    sleeps = [backoff_s(n, 0.1, 10.0) for n in range(40) for _ in range(20)]
    assert all(0 <= s <= 10.0 for s in sleeps)
    assert all(backoff_s(2, 0.1, 10.0) <= 0.4 for _ in range(100))
    assert max(backoff_s(30, 0.1, 10.0) for _ in range(200)) > 5.0  # capped, not 0.1 * 2**30


def test_retry_after_is_read_as_seconds_or_an_http_date_from_our_errors_and_aiohttps():
    import email.utils
    from types import SimpleNamespace

    assert parse_retry_after("3") == 3.0 and parse_retry_after(" 0 ") == 0.0
    now = 1_700_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 7, usegmt=True), now=now) == pytest.approx(7.0)
    assert parse_retry_after(email.utils.formatdate(now - 60, usegmt=True), now=now) == 0.0  # past
    assert [parse_retry_after(v) for v in (None, "", "soon", "-1", "1.5")] == [None] * 5
    ours = OSError("b/k: HTTP 503 SlowDown")
    ours.retry_after = 2.0
    assert retry_after(ours) == 2.0
    theirs = OSError("503")  # aiohttp's ClientResponseError keeps the answer's headers
    theirs.headers = {"Retry-After": "4"}
    assert retry_after(_caused(FileNotFoundError("x"), theirs)) == 4.0
    assert retry_after(OSError("b/k: HTTP 503")) is None
    assert retry_after(SimpleNamespace(retry_after=True, headers=None, __cause__=None)) is None


def test_defaults_retry_by_deadline_and_waits_outlast_it():
    cfg = FetchConfig()
    assert (cfg.retry_deadline, cfg.retries, cfg.backoff, cfg.backoff_cap) == (300.0, None, 0.1, 10.0)
    assert cfg.wait_limit() > cfg.retry_deadline + cfg.timeout
    with pytest.raises(sd.SpecError):
        FetchConfig(retry_deadline=-1)


def test_a_file_shorter_than_listed_fails_fast_not_at_the_deadline(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([20])[0]))
    ds = sd.TarDataset(str(tmp_path / "a.tar"))
    (tmp_path / "a.tar").write_bytes(b"x" * 1000)
    began = time.monotonic()
    with pytest.raises(sd.ShardFetchError, match="short read.*after 3 attempts"):
        list(ds)
    assert time.monotonic() - began < 20
    assert ds.retried["short"] == 2


# ---- S3 through the fault proxy --------------------------------------------------------------

@pytest.mark.parametrize("header", ["1", "http-date"])
def test_a_throttled_answer_is_retried_no_sooner_than_its_retry_after(proxied, header):
    """A 503 with ``Retry-After`` is tried again after at least that wait, even where the
    back-off alone would have retried within milliseconds; the retry is counted as throttled."""
    import email.utils

    bucket, fs, proxy, options = proxied
    blob = os.urandom(50_000)
    fs.pipe_file(f"{bucket}/ra", blob)
    items = [FetchItem(f"s3://{bucket}/ra", len(blob))]
    wait = "1" if header == "1" else email.utils.formatdate(time.time() + 2, usegmt=True)
    proxy.add(Fault("status", status=503, body=s3_error_xml("SlowDown", "Reduce your request rate"),
                    match="get", times=1, headers={"Retry-After": wait}))
    counters = Counters(COUNTERS)
    began = time.monotonic()
    data, fetcher = _read_all(items, options, FetchConfig(backoff=0.001, backoff_cap=0.002), counters)
    took = time.monotonic() - began
    assert data == [blob]
    assert took >= 0.95  # an HTTP date is read to the second: at least 1 s of its 2 remain
    assert fetcher.stats.waited_as_asked == 1 and fetcher.stats.retries == 1
    retried = counters.snapshot("retried.")
    assert retried["throttled"] == 1 and sum(retried.values()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reset", "503"])
def test_a_3s_outage_of_every_request_is_survived_exactly_once(proxied, mode):
    bucket, fs, proxy, options = proxied
    keys = write_shards(fs, f"{bucket}/d")
    ds = sd.TarDataset(f"s3://{bucket}/d/shard-{{000..006}}.tar", storage_options=options, decode=False)
    proxy.outage(3.0, mode=mode)
    assert [s["__key__"] for s in ds] == keys
    retried = ds.retried
    assert retried["throttled" if mode == "503" else "connection"] >= 1
    assert sum(retried.values()) == retried["throttled" if mode == "503" else "connection"]


@pytest.mark.slow
def test_a_30s_outage_is_survived_exactly_once(proxied):
    bucket, fs, proxy, options = proxied
    keys = write_shards(fs, f"{bucket}/d")
    ds = sd.TarDataset(f"s3://{bucket}/d/shard-{{000..006}}.tar", storage_options=options, decode=False)
    proxy.outage(30.0, mode="refuse")
    assert [s["__key__"] for s in ds] == keys
    assert ds.retried["connection"] >= 5


def test_503_slowdown_lowers_the_whole_readers_concurrency_and_is_survived(proxied):
    bucket, fs, proxy, options = proxied
    blobs = [os.urandom(MiB) for _ in range(12)]
    for i, blob in enumerate(blobs):
        fs.pipe_file(f"{bucket}/b/{i:02d}", blob)
    items = [FetchItem(f"s3://{bucket}/b/{i:02d}", MiB) for i in range(12)]
    proxy.add(Fault("status", status=503, match="get", times=12))  # S3's SlowDown body
    counters = Counters(COUNTERS)
    data, fetcher = _read_all(items, options, counters=counters)
    assert data == blobs
    assert fetcher.throttle.decreases >= 1
    assert fetcher.throttle.lowest <= FetchConfig().max_requests // 2
    assert counters.snapshot("retried.")["throttled"] == 12 == fetcher.stats.retries


@pytest.mark.parametrize(("status", "code", "error"), [
    (404, "NoSuchKey", sd.ShardNotFoundError),
    (403, "AccessDenied", sd.AccessDeniedError),
    (400, "InvalidArgument", sd.ShardFetchError),
    (500, "NoSuchKey", sd.ShardNotFoundError),  # a permanent code in the body of a 5xx
    (503, "InvalidAccessKeyId", sd.AccessDeniedError),
])
def test_permanent_errors_fail_at_once(proxied, status, code, error):
    bucket, fs, proxy, options = proxied
    fs.pipe_file(f"{bucket}/a.bin", b"x" * 1000)
    proxy.add(Fault("status", status=status, body=s3_error_xml(code, "no"), match="get", times=None))
    began = time.monotonic()
    counters = Counters(COUNTERS)
    with pytest.raises(error, match="a.bin"):
        _read_all([FetchItem(f"s3://{bucket}/a.bin", 1000)], options, counters=counters)
    assert time.monotonic() - began < 10
    assert sum(counters.snapshot("retried.").values()) == 0  # not retried
    # one GET; two at most where the URL came from a signer this process inherited, which
    # re-signs once on an error answer (SIGNER-REUSE); CI saw 2 once, not reproduced since
    assert 1 <= proxy.requests.get("get", 0) <= 2, proxy.history


def test_403_after_the_url_was_signed_is_re_signed_once_then_fails(proxied):
    bucket, fs, proxy, options = proxied
    fs.pipe_file(f"{bucket}/a.bin", b"x" * 1000)
    item = FetchItem(f"s3://{bucket}/a.bin", 1000, ((0, 10), (10, 20)))
    seen = []

    def after_the_first(method, path, query):  # the first GET signs the URL; later ones reuse it
        seen.append(path)
        return len(seen) > 1

    proxy.add(Fault("status", status=403, body=s3_error_xml("AccessDenied", "no"), match=after_the_first,
                    times=None))
    with pytest.raises(sd.AccessDeniedError):
        _read_all([item], options, FetchConfig(max_requests=1))
    assert proxy.requests["get"] == 3  # the first part; the second, once re-signed; no retries


def test_a_reset_mid_part_resumes_from_the_bytes_received(proxied):
    bucket, fs, proxy, options = proxied
    blob = os.urandom(3 * MiB)
    fs.pipe_file(f"{bucket}/big", blob)
    proxy.add(Fault("reset", after_bytes=200_000, match="get", times=1))
    counters = Counters(COUNTERS)
    [data], fetcher = _read_all([FetchItem(f"s3://{bucket}/big", len(blob))], options, counters=counters)
    assert data == blob
    assert proxy.faults_injected.get("reset") == 1 and fetcher.stats.retries == 1
    assert counters.snapshot("retried.")["connection"] == 1
    # the retry asked only for the rest: nothing came twice (without resume, 200 000 bytes would)
    assert fetcher.stats.received == len(blob) and fetcher.stats.refetched == 0


def test_a_stalled_part_times_out_and_resumes(proxied):
    bucket, fs, proxy, options = proxied
    blob = os.urandom(MiB)
    fs.pipe_file(f"{bucket}/big", blob)
    proxy.add(Fault("stall", after_bytes=100_000, match="get", times=1))
    counters = Counters(COUNTERS)
    [data], fetcher = _read_all([FetchItem(f"s3://{bucket}/big", len(blob))], options,
                                FetchConfig(timeout=3.0), counters=counters)
    assert data == blob
    assert counters.snapshot("retried.")["timeout"] == 1
    assert fetcher.stats.refetched == 0 and fetcher.stats.received == len(blob)


def test_retries_are_counted_per_reason_over_dataloader_workers(proxied):
    bucket, fs, proxy, options = proxied
    keys = write_shards(fs, f"{bucket}/d", [3] * 8, floats=20_000)
    ds = sd.TarDataset(f"s3://{bucket}/d/shard-{{000..007}}.tar", storage_options=options, decode=False)
    proxy.add(Fault("reset", after_bytes=1000, match="get", times=4))
    proxy.add(Fault("status", status=500, match="get", times=2))
    assert sorted(read_keys(ds, num_workers=2)) == sorted(keys)
    assert ds.retried == {**dict.fromkeys(RETRY_REASONS, 0), "connection": 4, "server": 2}


@pytest.mark.slow  # twelve throttled answers, each waited out (~20 s)
def test_the_scheduler_keeps_no_more_parts_in_flight_than_the_throttle_allows(proxied):
    bucket, fs, proxy, options = proxied
    blobs = [os.urandom(MiB // 4) for _ in range(16)]
    for i, blob in enumerate(blobs):
        fs.pipe_file(f"{bucket}/b/{i:02d}", blob)
    # the first object is sized by a ranged GET (HEAD-START, client.py), the only request until
    # it is answered: throttled again and again, it brings the limit from 32 to 1 before the
    # scheduler plans a part
    items = [FetchItem(f"s3://{bucket}/b/00")] + [FetchItem(f"s3://{bucket}/b/{i:02d}", MiB // 4)
                                                  for i in range(1, 16)]
    options = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    proxy.add(Fault("status", status=503, match="get", times=12))
    data, fetcher = _read_all(items, options)
    assert data == blobs
    assert fetcher.throttle.lowest == 1 and fetcher.throttle.decreases >= 5
    # one slot more per round of successes from there: far below the 16 parts the window holds
    assert fetcher.peak_inflight <= 8


def test_http_backend_retries_a_whole_part_and_fails_a_404_at_once(tmp_path, http_server):
    # fsspec's HTTP _cat_file returns a part whole or raises: its retry asks for the whole part
    blob = os.urandom(600_000)
    (tmp_path / "blob").write_bytes(blob)
    server = http_server(tmp_path)
    with FaultProxy(server.endpoint_url) as proxy:
        url = f"{proxy.url}/blob"
        proxy.add(Fault("reset", after_bytes=100_000, match="get", times=1))
        proxy.add(Fault("status", status=503, match="get", times=1))
        counters = Counters(COUNTERS)
        [data], fetcher = _read_all([FetchItem(url, len(blob))], None, counters=counters)
        assert data == blob
        assert counters.snapshot("retried.") == {**dict.fromkeys(RETRY_REASONS, 0), "connection": 1,
                                                 "throttled": 1}
        assert fetcher.throttle.decreases == 1
        began = time.monotonic()
        with pytest.raises(sd.ShardNotFoundError, match="missing"):
            _read_all([FetchItem(f"{proxy.url}/missing", 10)], None)
        assert time.monotonic() - began < 10


def test_a_part_fails_at_its_deadline_not_before_and_the_reader_does_not_hang(proxied):
    bucket, fs, proxy, options = proxied
    fs.pipe_file(f"{bucket}/a.bin", b"x" * 1000)
    proxy.outage(120.0, mode="reset")
    counters = Counters(COUNTERS)
    began = time.monotonic()
    with pytest.raises(sd.ShardFetchError, match=r"after \d+ attempts over .* retry_deadline=3 s"):
        _read_all([FetchItem(f"s3://{bucket}/a.bin", 1000)], options,
                  FetchConfig(retry_deadline=3.0, timeout=2.0), counters=counters)
    assert 3.0 <= time.monotonic() - began < 30
    assert counters.snapshot("retried.")["connection"] >= 2
    proxy.clear()



def test_object_dataset_counts_its_retries(proxied):
    """ObjectDataset's client adds to the dataset's counters too (one object per sample)."""
    bucket, fs, proxy, options = proxied
    payloads = {f"s3://{bucket}/objs/o{i}.bin": bytes([i]) * (1000 + i) for i in range(4)}
    for url, data in payloads.items():
        fs.pipe_file(url[len("s3://"):], data)
    ds = sd.ObjectDataset(sorted(payloads), storage_options=options, decode=False)
    try:
        proxy.add(Fault("reset", after_bytes=100, match="get", times=2))
        samples = ds.__getitems__(range(len(ds)))
    finally:
        ds.close()
    assert [s["bin"] for s in samples] == [payloads[u] for u in sorted(payloads)]
    assert proxy.faults_injected == {"reset": 2} and ds.retried["connection"] == 2
