"""BUDGET-GROWTH (streamdata/budget.py): the byte budget grows where latency made the reader wait
for a part the budget held back, and nowhere else; never past byte_budget_max."""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

import pytest

import streamdata as sd
from streamdata.config import FetchConfig
from streamdata.errors import SpecError
from streamdata.fetch import budget as budget_module
from streamdata.fetch.budget import Budget
from streamdata.fetch.prefetcher import Prefetcher

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _nothing_learned():
    budget_module._learned.clear()
    yield
    budget_module._learned.clear()


def _consume(b: Budget, rate: float, seconds: float, step: float = 0.01) -> float:
    """Release bytes at ``rate`` for ``seconds`` (a fake clock from 0); the clock after."""
    now = 0.0
    while now < seconds:
        b.released(int(rate * step), now=now)
        now += step
    return now


def test_no_decision_before_any_history():
    b = Budget(64 * MiB, 128 * MiB, 8 * MiB, key="k")
    assert b.rate(0.0) is None
    b.released(MiB, now=0.0)
    assert b.rate(0.05) is None  # under MIN_HISTORY_S
    assert not b.stalled(0.5, now=0.05) and b.limit == 64 * MiB and b.grown == 0


def test_a_latency_bound_stall_grows_a_step_and_the_next_pass_starts_there():
    b = Budget(64 * MiB, 256 * MiB, 8 * MiB, key="k")
    now = _consume(b, 200e6, 1.0)
    assert b.rate(now) == pytest.approx(200e6, rel=0.05)
    assert b.stalled(0.2, now=now)  # 40 MB consumed while the part travelled: over a quarter of 64 MiB
    assert b.limit == 128 * MiB  # a step (the product with its margin, 58 MB, is less)
    assert not b.stalled(0.1, now=now) and b.limit == 128 * MiB  # 20 MB: under a quarter of 128 MiB
    now = _consume(b, 400e6, 1.0)
    assert b.stalled(0.3, now=now) and b.limit == 256 * MiB  # 120 MB: a step again, to the cap
    assert not b.stalled(5.0, now=now) and b.grown == 2  # at the cap
    assert Budget(64 * MiB, 256 * MiB, 8 * MiB, key="k").limit == 256 * MiB  # learned
    assert Budget(64 * MiB, 128 * MiB, 8 * MiB, key="k").limit == 128 * MiB  # within its own cap
    assert Budget(64 * MiB, 256 * MiB, 8 * MiB, key="other").limit == 64 * MiB


def test_a_large_product_grows_to_it_with_a_margin():
    b = Budget(64 * MiB, 1024 * MiB, 8 * MiB)
    now = _consume(b, 1e9, 1.0)
    assert b.stalled(0.2, now=now)
    assert b.limit == pytest.approx(1e9 * 0.2 * budget_module.MARGIN + 8 * MiB, rel=0.05)


def test_a_short_round_trip_never_grows():
    """A part that came in 20 ms: the reader waited on bandwidth, not on the budget."""
    b = Budget(64 * MiB, 128 * MiB, 8 * MiB)
    now = _consume(b, 250e6, 1.0)
    assert not b.stalled(0.02, now=now) and b.limit == 64 * MiB


def test_a_budget_without_room_never_grows():
    b = Budget(64 * MiB, 64 * MiB, 8 * MiB)
    now = _consume(b, 500e6, 1.0)
    assert not b.stalled(1.0, now=now) and b.limit == 64 * MiB


def test_a_far_first_part_takes_one_step_at_once_and_only_once():
    b = Budget(64 * MiB, 256 * MiB, 8 * MiB, key="far")
    assert not b.far(0.05) and b.limit == 64 * MiB  # a near endpoint
    assert b.far(0.1) and b.limit == 128 * MiB and b.grown == 1  # just far: one STEP
    assert not b.far(0.25) and b.limit == 128 * MiB  # once: later growth is the stalls' to decide
    assert not Budget(64 * MiB, 256 * MiB, 8 * MiB, key="far").far(0.25)  # started at the learned 128
    farther = Budget(8 * MiB, 256 * MiB, 8 * MiB, key="farther")  # three times as far: three steps' worth
    assert farther.far(0.3) and farther.limit == 48 * MiB
    assert not Budget(64 * MiB, 64 * MiB, 8 * MiB).far(1.0)  # no room


def test_config_default_max_env_and_errors(monkeypatch):
    assert FetchConfig().budget_max() == 128 * MiB
    assert FetchConfig(byte_budget=MiB).budget_max() == 2 * MiB
    assert FetchConfig(byte_budget=MiB, byte_budget_max=MiB).budget_max() == MiB
    monkeypatch.setenv("STREAMDATA_BYTE_BUDGET_MAX", str(300 * MiB))
    assert FetchConfig.from_env().budget_max() == 300 * MiB
    with pytest.raises(SpecError, match="byte_budget_max"):
        FetchConfig(byte_budget=2 * MiB, byte_budget_max=MiB)
    with pytest.raises(SpecError, match="byte_budget_max"):
        FetchConfig(byte_budget_max=True)


def _objects(s3_bucket, count: int, size: int) -> tuple[object, list[bytes], str]:
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    blobs = [os.urandom(size) for _ in range(count)]
    for i, blob in enumerate(blobs):
        s3.put_object(Bucket=bucket, Key=f"budget/o-{i}", Body=blob)
    return server, blobs, f"s3://{bucket}/budget/o-{{0..{count - 1}}}"


@pytest.mark.parametrize("room", [True, False])
def test_a_fast_reader_behind_a_slow_link_grows_its_budget_within_the_cap(s3_bucket, room: bool):
    """30 ms one-way, a 1 MiB budget of 256 KiB parts, a reader that never waits on itself:
    the budget held it back and the link's latency made it wait, so the budget grows (never past
    its cap, and the fetcher never holds more than it plus a part); with no room, it stays."""
    from benchmarks.proxy import LatencyProxy

    server, blobs, spec = _objects(s3_bucket, 24, 512 * 1024)
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.03) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        config = FetchConfig(part_size=256 * 1024, window=24, byte_budget=MiB,
                             byte_budget_max=4 * MiB if room else MiB)
        with Prefetcher(sd.expand_spec(spec, server.storage_options), options, config) as fetcher:
            got = [b"".join(reader.chunks()) for reader in fetcher]
    assert got == blobs
    b = fetcher.budget
    if room:
        assert b.grown >= 1 and MiB < b.limit <= 4 * MiB
    else:
        assert b.grown == 0 and b.limit == MiB
    assert fetcher.peak_reserved <= b.limit + config.part_size


@pytest.mark.parametrize("delay_s, pause_s, grown", [
    (0.005, 0.1, 0),  # a near endpoint: no step, and no stall
    (0.06, 0.3, 1),  # a far one (its first part took over FAR_S): one step at once, then no stall
])
def test_a_reader_slower_than_its_link_grows_only_for_a_far_endpoint(s3_bucket, delay_s, pause_s, grown):
    """A reader slower than the link finds every part there: no stall, so no growth from
    stalls; the far-endpoint step is the only one, once."""
    from benchmarks.proxy import LatencyProxy

    server, blobs, spec = _objects(s3_bucket, 4, 256 * 1024)
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=delay_s) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        config = FetchConfig(part_size=128 * 1024, window=4, byte_budget=512 * 1024)
        shards = sd.expand_spec(spec, server.storage_options)
        # the test server's first answer in a fresh process can take 0.1 s and more (its own
        # start, not the endpoint's distance): one GET through the proxy first
        with Prefetcher(shards[:1], options, config) as warm:
            for reader in warm:
                b"".join(reader.chunks())
        with Prefetcher(shards, options, config) as fetcher:
            got = []
            for reader in fetcher:
                time.sleep(pause_s)  # parsing and training take longer than a part's round trip
                got.append(b"".join(reader.chunks()))
    assert got == blobs
    # the far step is taken once, by whichever prefetcher met the endpoint first; the budget it
    # reached is where the next prefetcher of the process starts
    assert (warm.budget.grown + fetcher.budget.grown, fetcher.budget.limit) == (grown, 512 * 1024 << grown)


def test_a_slow_transfer_at_a_short_round_trip_is_not_a_far_endpoint(s3_bucket):
    """The latency is the first byte's: a near endpoint behind a slow link (2 MB/s a
    connection, 0 ms) takes 0.1 s and more to deliver a part's last byte, but its first byte
    comes at once, so the budget stays (measured to the last byte, it doubled)."""
    from benchmarks.proxy import LatencyProxy

    server, blobs, spec = _objects(s3_bucket, 2, 512 * 1024)
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.0, bandwidth=2e6) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        config = FetchConfig(part_size=512 * 1024, first_part=512 * 1024, window=2, byte_budget=2 * MiB)
        start = time.monotonic()
        with Prefetcher(sd.expand_spec(spec, server.storage_options), options, config) as fetcher:
            got = [b"".join(reader.chunks()) for reader in fetcher]
        took = time.monotonic() - start
    assert got == blobs and took > 2 * budget_module.FAR_S  # each part's last byte came late
    assert (fetcher.budget.grown, fetcher.budget.limit) == (0, 2 * MiB)


def test_growth_is_counted_on_the_dataset(s3_bucket):
    from benchmarks.proxy import LatencyProxy
    from tests.helpers import make_samples, tar_bytes

    server, bucket = s3_bucket
    s3 = server.boto3_client()
    shards = make_samples([40] * 12, floats=1024)  # 4 KiB arrays: some 190 KiB a shard
    for i, shard in enumerate(shards):
        s3.put_object(Bucket=bucket, Key=f"budget-tar/s-{i}.tar", Body=tar_bytes(shard))
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.03) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        ds = sd.TarDataset(f"s3://{bucket}/budget-tar/s-{{0..11}}.tar", storage_options=options,
                           index=None, decode=False, part_size=64 * 1024, byte_budget=256 * 1024,
                           window=12)
        keys = [s["__key__"] for s in ds]
    assert len(keys) == 480 and len(set(keys)) == 480
    assert ds.counts["budget.grown"] >= 1


def test_the_first_byte_is_timed_from_the_request_on_its_connection(s3_bucket):
    """HTTPS 100 ms one-way from the server: opening the connection costs the TLS handshake's
    round trip before the request goes out, and the first byte's latency (BUDGET-GROWTH, the
    far step) leaves it out: it is the request's own round trip, timed from when it
    went out on its connection, not from the try's start."""
    from benchmarks.proxy import LatencyProxy
    from streamdata.store.client import AsyncClient
    from streamdata.testing import TLSFront

    server, blobs, _ = _objects(s3_bucket, 1, 64 * 1024)
    with TLSFront(server.endpoint_url) as front, \
            LatencyProxy("127.0.0.1", front.port, delay_s=0.1, handshake_rtts=0) as proxy:
        kwargs = {**server.storage_options.get("client_kwargs", {}), "verify": front.ca_file}
        options = {**server.storage_options, "endpoint_url": f"https://127.0.0.1:{proxy.port}",
                   "client_kwargs": kwargs}
        client = AsyncClient("s3", options)
        latency: list[float] = []
        try:
            start = time.monotonic()
            url = f"s3://{s3_bucket[1]}/budget/o-0"
            data = client.io.run(client.get(url, 0, 1024, first_byte=latency), 30)
            took = time.monotonic() - start
        finally:
            client.close()
    assert data == blobs[0][:1024]
    assert took >= 0.38  # the handshake's round trip, then the request's
    assert 0.19 <= latency[0] < took - 0.15, (latency, took)  # the request's alone
