"""Slow: many epochs through ``sd.loader`` over the S3 server leak nothing.

"Memory that grows per epoch" is one of the complaints streamdata exists to answer. With
persistent workers, 30 epochs of a shuffled, batched TarDataset over moto's S3: every epoch
reads every sample exactly once, and neither the main process nor a worker grows (RSS and
unique memory), nor do the main process's threads, open files (beyond the pooled batch
storages it keeps mapped, bounded by the pool) or lent-storage records.
"""

from __future__ import annotations

import collections

import psutil
import pytest
import s3fs

import streamdata as sd
from streamdata.batch import recycle
from tests.helpers import write_shards

pytestmark = pytest.mark.slow

MB = 1 << 20
COUNTS = [48, 17, 64, 33, 0, 51, 40, 23]  # uneven on purpose, one empty shard
WARMUP, EPOCHS = 4, 30


def _snapshot(main: psutil.Process, servers: set[int], feed: sd.Loader) -> dict:
    workers = [p for p in main.children() if p.pid not in servers]
    return {
        "main_rss": main.memory_info().rss,
        "worker_uss": [w.memory_full_info().uss for w in workers],
        "workers": sorted(w.pid for w in workers),
        "threads": main.num_threads(),
        # the main process maps each pooled batch storage once and keeps it on the board
        # (MAPPED-ONCE): one descriptor a mapping, as many as the batches in flight need
        "fds": main.num_fds() - len(feed.board.mapped),
        "mapped": len(feed.board.mapped),
        "lent": recycle.lent_count(),
    }


def test_thirty_epochs_read_everything_once_and_grow_nothing(s3_bucket):
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/soak", counts=COUNTS, floats=8192)  # 32 KiB per sample
    spec = f"s3://{bucket}/soak/shard-{{000..{len(COUNTS) - 1:03d}}}.tar"
    ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=16, shuffle=True,
                       byte_budget=4 * MB, part_size=1 * MB)
    main = psutil.Process()
    servers = {p.pid for p in main.children()}  # the S3 server runs as a child of this process
    uss: list[list[float]] = []  # per epoch after the warm-up: each worker's USS, MB
    with sd.loader(ds, num_workers=2, pin_memory=False) as feed:
        for epoch in range(WARMUP + EPOCHS):
            feed.set_epoch(epoch)
            seen = collections.Counter(k for batch in feed for k in batch["__key__"])
            assert sorted(seen) == sorted(keys) and set(seen.values()) == {1}, f"epoch {epoch}"
            if epoch == WARMUP - 1:
                before = _snapshot(main, servers, feed)
            if epoch >= WARMUP - 1:
                uss.append([round(u / MB, 1) for u in _snapshot(main, servers, feed)["worker_uss"]])
        after = _snapshot(main, servers, feed)
    assert after["workers"] == before["workers"]  # the same persistent workers throughout
    half = len(uss) // 2
    grown = {
        "main RSS MB": (after["main_rss"] - before["main_rss"]) / MB,
        # the last 15 epochs: a leak grows every epoch, while a worker's heap and buffer pool
        # settle at a level that load can shift once (a slow spell holds more in flight)
        "worker USS MB, last half": max(b - a for a, b in zip(uss[half], uss[-1], strict=True)),
    }
    # a leak of one batch (16 x 32 KiB = 0.5 MB) per epoch would add 7.5 MB over 15 epochs
    assert grown["main RSS MB"] < 8 and grown["worker USS MB, last half"] < 6, (grown, uss, ds.counts)
    assert after["threads"] == before["threads"]
    assert after["fds"] <= before["fds"] + 2, (before, after)  # descriptors the board does not hold
    assert after["mapped"] <= 2 * recycle.SLOTS_PER_WORKER
    assert after["lent"] <= before["lent"] + 8
