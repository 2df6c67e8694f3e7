"""NEXT-EPOCH-EARLY: persistent workers start the next epoch's requests once their pass has
asked for its last shard; the next epoch adopts them. Same samples, same order, no request
made twice, none left behind when the loop stops."""

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
    # each shard once per epoch (small shards: one GET each), and epoch 3's early start began
    # only if epoch 2 asked for its last shard before the loader closed
    assert 2 * len(COUNTS) <= after <= 3 * len(COUNTS), proxy.requests


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
