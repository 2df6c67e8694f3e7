"""NEXT-EPOCH-EARLY: a persistent worker queues its next pass behind the current one in the same
prefetcher; the next epoch adopts it. Same samples, same order, no request made twice, no new
connection per epoch, none left behind when the loop stops."""

from __future__ import annotations

import time

import pytest

import streamdata as sd
from benchmarks.faults import FaultProxy
from tests.helpers import write_shards

pytestmark = pytest.mark.s3

COUNTS = [6, 9, 3, 12, 7, 5, 8, 4]


@pytest.fixture
def proxied(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/ep", counts=COUNTS)
    with FaultProxy(server.endpoint_url) as proxy:
        yield f"s3://{bucket}/ep/", {**server.storage_options, "endpoint_url": proxy.url}, proxy


def _epochs(spec, options, *, early: bool, epochs: int = 3) -> list[list[str]]:
    ds = sd.TarDataset(spec, storage_options=options, shuffle=True, seed=1, decode=False, index=None)
    loader = sd.loader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    ds.early_next_epoch = early  # sd.loader turned it on for its persistent workers
    with loader:
        out = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out.append([k for b in loader for k in b["__key__"]])
    return out


def test_early_next_epoch_reads_the_same_samples_in_the_same_order(proxied):
    spec, options, proxy = proxied
    early = _epochs(spec, options, early=True)
    late = _epochs(spec, options, early=False)
    assert early == late
    assert all(sorted(e) == sorted(early[0]) and len(e) == sum(COUNTS) for e in early)
    assert early[0] != early[1]  # a different shuffle each epoch


def test_the_next_epochs_requests_go_out_before_its_iter_and_none_twice(proxied):
    spec, options, proxy = proxied
    ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None)
    proxy.reset_counters()
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:  # persistent: early on
        assert ds.early_next_epoch
        first = [k for b in loader for k in b["__key__"]]
        time.sleep(1.0)  # no iter() yet: the workers have asked for the next epoch's shards
        before_iter = proxy.requests.get("get", 0)
        second = [k for b in loader for k in b["__key__"]]
        after = proxy.requests.get("get", 0)
    assert sorted(first) == sorted(second) and len(first) == sum(COUNTS)
    assert before_iter > len(COUNTS), proxy.requests  # epoch 1's GETs and some of epoch 2's
    # each shard once per epoch (small shards: one GET each), and epoch 3's queued pass went out
    # only as far as epoch 2 had got when the loader closed
    assert 2 * len(COUNTS) <= after <= 3 * len(COUNTS), proxy.requests


def test_a_token_dataset_s_next_epoch_goes_out_before_its_iter(s3_bucket):
    """The same for ``sd.TokenDataset`` (its pass is the one every dataset runs): flat .bin
    files read in byte ranges, the next epoch's ranges asked for before its ``iter()``."""
    import numpy as np
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    for i, n in enumerate(COUNTS):
        with fs.open(f"{bucket}/tok/part-{i}.bin", "wb") as f:
            f.write(np.arange(n * 100, dtype=np.uint16).tobytes())
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        ds = sd.TokenDataset(f"s3://{bucket}/tok/", seq_len=64, dtype="uint16", storage_options=options)
        proxy.reset_counters()
        with sd.loader(ds, batch_size=4, num_workers=2, persistent_workers=False) as loader:
            assert sum(1 for _ in loader)  # one epoch without the next queued: its GETs
        one = proxy.requests.get("get", 0)
        proxy.reset_counters()
        with sd.loader(ds, batch_size=4, num_workers=2) as loader:
            first = [row.tolist() for b in loader for row in b["input_ids"]]
            time.sleep(1.0)
            before_iter = proxy.requests.get("get", 0)
            second = [row.tolist() for b in loader for row in b["input_ids"]]
            after = proxy.requests.get("get", 0)
    assert first == second and len(first) == sum(COUNTS) * 100 // 64
    assert before_iter > one, (one, proxy.requests)  # epoch 1's ranges and some of epoch 2's
    assert 2 * one <= after <= 3 * one, (one, proxy.requests)  # none twice


def test_a_loop_that_stops_leaves_no_requests_behind(proxied):
    spec, options, proxy = proxied
    ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None)
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        for _ in loader:  # a whole epoch: the next one's requests start in the workers
            pass
        for i, _ in enumerate(loader):
            if i == 2:
                break  # stop early in epoch 2
    settled = dict(proxy.requests)
    time.sleep(1.0)
    assert proxy.requests == settled, "requests after the loader closed"


@pytest.fixture
def delayed(s3_bucket):
    import s3fs

    from benchmarks.common import upstream
    from benchmarks.proxy import LatencyProxy

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/ep", counts=COUNTS)
    with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.02) as proxy:
        url = proxy.url_for(server.endpoint_url)
        yield f"s3://{bucket}/ep/", {**server.storage_options, "endpoint_url": url}, proxy


@pytest.mark.parametrize("how", ["sd.loader", "DataLoader"])
def test_later_epochs_read_on_the_connections_of_the_first(delayed, how):
    """The next pass is queued in this pass's prefetcher: its requests go out on the connections
    already open (no handshake per epoch), where a prefetcher of its own opened new ones. A
    plain DataLoader with persistent workers gets it with ``early_next_epoch`` set."""
    from torch.utils.data import DataLoader

    spec, options, proxy = delayed
    ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None, batch_size=4)
    if how == "sd.loader":
        loader = sd.loader(ds, num_workers=2)  # persistent: early on
    else:
        ds.early_next_epoch = True
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    opened = []
    for _ in range(4):
        keys = [k for b in loader for k in b["__key__"]]
        assert len(keys) == sum(COUNTS) == len(set(keys))
        opened.append(proxy.connections)
    getattr(loader, "close", lambda: loader._iterator._shutdown_workers())()
    assert opened[0] > 0
    # epochs 2-4 opened no set of their own: at most one or two more, where the next epoch's first
    # requests overlap the last of the one before
    assert opened[-1] - opened[0] <= 2 < opened[0], opened


def test_a_loop_that_stops_early_then_goes_on_reads_every_sample_once(proxied):
    """A pass that stops before its end does not hand its prefetcher on: the next ``iter()``
    starts a pass of its own, with every sample once, in the order a fresh loader reads."""
    spec, options, proxy = proxied
    ds = sd.TarDataset(spec, storage_options=options, shuffle=True, seed=3, decode=False, index=None)
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        loader.set_epoch(0)
        first = [k for b in loader for k in b["__key__"]]
        loader.set_epoch(1)
        for i, _ in enumerate(loader):
            if i == 1:
                break
        loader.set_epoch(2)
        again = [k for b in loader for k in b["__key__"]]
    fresh = sd.TarDataset(spec, storage_options=options, shuffle=True, seed=3, decode=False, index=None)
    with sd.loader(fresh, batch_size=4, num_workers=2) as loader:
        loader.set_epoch(2)
        expected = [k for b in loader for k in b["__key__"]]
    assert sorted(first) == sorted(again) and len(again) == sum(COUNTS)
    assert again == expected


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_the_next_pass_is_queued_as_the_second_read_is_taken_or_at_the_end_of_a_shorter_pass(n):
    """Planning the next pass (0.2 s for a million shuffled shards) waits until the first read
    is under way, so it never delays an epoch's first batch."""
    from streamdata.datasets.sharded import ShardedDataset

    calls = []
    opened = ShardedDataset._opened(list(range(n)), iter(range(n)), lambda: calls.append(len(taken)))
    taken = []
    for pair in opened:  # queued just before the second read is handed out (the first taken)
        taken.append(pair)
        assert calls == ([1] if len(taken) >= 2 else [])
    assert calls == [min(n, 1)] and len(taken) == n  # a shorter pass: once it is all taken
