"""The local disk cache (streamdata/cache.py): later epochs read cached shards from disk with no
request, the directory stays under its limit, processes share it safely, corrupt entries are
re-fetched and never served, and a cache that cannot be written degrades to streaming.

Requests are counted at a FaultProxy in front of the S3 test server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import s3fs
import torch

import streamdata as sd
from benchmarks.faults import FaultProxy
from streamdata.fetch.cache import SUFFIX, TMP, Cache, Writer, cache_key
from tests.helpers import UNEVEN, make_samples, tar_bytes, write_shards

REPO = Path(__file__).resolve().parents[2]
PART = 64 * 1024  # small parts: a shard is several parts, written to the cache out of order


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.name.endswith(SUFFIX))


def _samples(ds, num_workers: int = 0) -> dict[str, float]:
    """key -> the value of the sample's npy (all equal to its number) and its cls, checked."""
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                         multiprocessing_context="fork" if num_workers else None,
                                         timeout=60 if num_workers else 0)
    out = {}
    for s in loader:
        values = np.unique(np.asarray(s["npy"]))
        assert len(values) == 1 and values[0] == s["cls"] == s["json"]["n"], s["__key__"]
        out[s["__key__"]] = float(values[0])
    return out


@pytest.fixture
def shards(s3_bucket):
    """UNEVEN shards of 4 KiB samples on S3, a FaultProxy in front: (spec, options, proxy, keys)."""
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/c", counts=UNEVEN, floats=1024)
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        yield f"s3://{bucket}/c/shard-{{000..{len(UNEVEN) - 1:03d}}}.tar", options, proxy, keys


def test_epoch_two_reads_cached_shards_with_no_request(shards, tmp_path):
    spec, options, proxy, keys = shards
    ds = sd.TarDataset(spec, storage_options=options, cache_dir=tmp_path / "cache", part_size=PART)
    proxy.reset_counters()
    first = _samples(ds)
    assert proxy.requests.get("get", 0) >= len(UNEVEN)
    assert len(_entries(tmp_path / "cache")) == len(UNEVEN)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(TMP)]
    proxy.reset_counters()
    second = _samples(ds)
    assert proxy.requests == {}, proxy.history  # not one request: every shard from disk
    assert list(second) == list(first) == keys and second == first
    counts = ds.counts
    assert counts["cache.misses"] == counts["cache.hits"] == len(UNEVEN), counts
    assert counts["cache.corrupt"] == counts["cache.errors"] == counts["cache.evictions"] == 0


def test_without_cache_dir_nothing_is_cached(shards, tmp_path):
    spec, options, proxy, keys = shards
    ds = sd.TarDataset(spec, storage_options=options, part_size=PART)
    assert ds.fetch_config.cache_dir is None
    _samples(ds)
    proxy.reset_counters()
    assert list(_samples(ds)) == keys
    assert proxy.requests.get("get", 0) >= len(UNEVEN) - 1  # every shard again
    assert ds.counts["cache.misses"] == ds.counts["cache.hits"] == 0


def test_dataloader_workers_share_the_cache(shards, tmp_path):
    spec, options, proxy, keys = shards
    ds = sd.TarDataset(spec, storage_options=options, cache_dir=str(tmp_path / "cache"), part_size=PART)
    first = _samples(ds, num_workers=2)
    proxy.reset_counters()
    second = _samples(ds, num_workers=2)
    assert proxy.requests == {}, proxy.history
    assert sorted(second) == sorted(first) == sorted(keys) and second == first
    assert ds.counts["cache.hits"] == len(UNEVEN)  # summed over both workers


def test_parquet_row_groups_through_the_cache(s3_bucket, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    for i in range(2):
        n = np.arange(1000 * i, 1000 * i + 1000)
        with fs.open(f"{bucket}/pq/part-{i}.parquet", "wb") as f:
            pq.write_table(pa.table({"n": n, "x": n * 2.0, "y": n * 3.0}), f, row_group_size=250)
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}

        def make():
            return sd.ParquetDataset(f"s3://{bucket}/pq/part-{{0..1}}.parquet", storage_options=options,
                                     columns=["n", "x"], batch_size=100, cache_dir=tmp_path / "cache")

        def rows(ds):
            batches = list(ds)
            return torch.cat([b["n"] for b in batches]).tolist(), torch.cat([b["x"] for b in batches])

        ds = make()
        n1, x1 = rows(ds)
        assert sorted(n1) == list(range(2000)) and torch.equal(x1, torch.tensor(n1) * 2.0)
        proxy.reset_counters()
        n2, x2 = rows(ds)
        assert proxy.requests == {}, proxy.history  # 8 row groups' column ranges from disk
        assert n2 == n1 and torch.equal(x2, x1)
        assert ds.counts["cache.hits"] == 8
        proxy.reset_counters()
        n3, _ = rows(make())  # a new dataset: one listing, footers from the cache too
        assert proxy.requests == {"list": 1}, proxy.history
        assert n3 == n1


def test_eviction_keeps_the_directory_under_the_limit(shards, tmp_path):
    spec, options, proxy, keys = shards
    sizes = {}
    probe = sd.TarDataset(spec, storage_options=options)
    for shard in probe.shards:
        sizes[shard.url] = shard.size
    limit = sum(sorted(sizes.values())[-3:]) + 3 * 4096  # about three of the seven shards
    cache_dir = tmp_path / "cache"
    ds = sd.TarDataset(spec, storage_options=options, cache_dir=cache_dir, cache_limit=limit, part_size=PART)
    for _ in range(2):
        assert list(_samples(ds)) == keys
        held = sum(p.stat().st_size for p in cache_dir.iterdir() if not p.name.startswith("."))
        assert 0 < held <= limit, (held, limit)
    assert ds.counts["cache.evictions"] > 0 and 0 < len(_entries(cache_dir)) < len(UNEVEN)
    # an item larger than the whole limit is not cached at all (and no file is left behind)
    tiny = tmp_path / "tiny"
    small = sd.TarDataset(spec, storage_options=options, cache_dir=tiny, cache_limit=min(sizes.values()) + 1)
    assert list(_samples(small)) == keys
    assert len(list(tiny.iterdir())) <= 2  # at most the empty shard's entry and the lock file


def _put(cache: Cache, name: str, data: bytes) -> None:
    writer = cache.writer(cache_key(name, ((0, len(data)),), len(data), None), len(data))
    assert writer is not None
    writer.write(0, data)  # publishes (then evicts)
    assert not writer.active


def _has(cache: Cache, name: str, size: int) -> bool:
    entry = cache.lookup(cache_key(name, ((0, size),), size, None), size)  # a hit touches it
    if entry is not None:
        entry.close()
    return entry is not None


def test_eviction_removes_the_least_recently_used_entry(tmp_path):
    import time

    cache = Cache(str(tmp_path), limit=3 * (10_000 + 8 + 32))  # three entries of 10,000 bytes
    for name in "abc":
        _put(cache, name, name.encode() * 10_000)
        time.sleep(0.02)
    assert _has(cache, "a", 10_000)  # a is now the most recently used; b the least
    time.sleep(0.02)
    _put(cache, "d", b"d" * 10_000)
    assert [_has(cache, n, 10_000) for n in "acd"] == [True, True, True] and not _has(cache, "b", 10_000)
    assert cache.stats["evictions"] == 1
    held = sum(p.stat().st_size for p in _entries(tmp_path))
    assert held <= cache.limit


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flip one byte of the data: "early" in the first segment, "late" in the last
        at = 700 if how == "early" else len(data) - 2 * 1024
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))


def test_a_corrupt_entry_is_refetched_and_never_served(s3_bucket, tmp_path):
    """CACHE-VERIFY: entries corrupt early, late (after a MiB was served) and truncated are
    deleted and fetched again, counted, and the samples are the first epoch's."""
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    counts = [40, 40, 40, 3]  # 40 samples of 32 KiB: shards of about 1.3 MiB (two segments)
    keys = write_shards(fs, f"{bucket}/k", counts=counts, floats=8192)
    cache_dir = tmp_path / "cache"
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        ds = sd.TarDataset(f"s3://{bucket}/k/shard-{{000..003}}.tar", storage_options=options,
                           cache_dir=cache_dir, part_size=256 * 1024)
        first = _samples(ds)
        entries = {s.url: cache_dir / (cache_key(s.url, ((0, s.size),), s.size, s.etag) + SUFFIX)
                   for s in ds.shards}
        urls = [s.url for s in ds.shards]
        _corrupt(entries[urls[0]], "early")
        _corrupt(entries[urls[1]], "late")  # found after a MiB has been served: the rest re-fetched
        _corrupt(entries[urls[2]], "truncate")
        proxy.reset_counters()
        second = _samples(ds)
        assert second == first and list(second) == keys
        got = [target for kind, _, target, _ in proxy.history if kind == "get"]
        assert {t.split("?")[0].rsplit("/", 1)[-1] for t in got} == {"shard-000.tar", "shard-001.tar",
                                                                      "shard-002.tar"}, got
        c = ds.counts
        assert c["cache.corrupt"] == 3, c
        assert c["cache.hits"] == 3 and c["cache.misses"] == 4 + 1, c  # the truncated one: a miss
        # the truncated entry was fetched whole and cached again; the two found mid-read are gone
        assert entries[urls[2]].exists() and not entries[urls[0]].exists() and not entries[urls[1]].exists()
        _samples(ds)  # they are cached again
        proxy.reset_counters()
        assert _samples(ds) == first and proxy.requests == {}


def test_an_unwritable_cache_dir_degrades_to_streaming_with_one_warning(shards, tmp_path):
    spec, options, proxy, keys = shards
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = sd.TarDataset(spec, storage_options=options, cache_dir=blocker / "cache", part_size=PART)
        assert list(_samples(ds)) == keys
        assert list(_samples(ds)) == keys
    mine = [w for w in caught if "streamdata cache" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "reads without caching" in str(mine[0].message)
    assert ds.counts["cache.errors"] == 2 and ds.counts["cache.hits"] == 0  # one per pass


FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys, warnings
    import streamdata as sd
    spec, options, cache_dir = json.loads(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (96 * 1024, resource.RLIM_INFINITY))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = sd.TarDataset(spec, storage_options=options, cache_dir=cache_dir, part_size=64 * 1024)
        epochs = [[s["__key__"] for s in ds if (s["npy"] == s["cls"]).all()] for _ in range(2)]
    print(json.dumps({"epochs": epochs, "counts": ds.counts,
                      "warnings": [str(w.message) for w in caught if "streamdata cache" in str(w.message)]}))
""")


def test_a_full_disk_degrades_to_streaming_with_one_warning(shards, tmp_path):
    """A file-size limit makes the cache's writes fail mid-shard (EFBIG), as a full disk would."""
    spec, options, proxy, keys = shards
    cache_dir = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, json.dumps([spec, options, str(cache_dir)])],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["epochs"] == [keys, keys]
    assert len(got["warnings"]) == 1 and "File too large" in got["warnings"][0], got["warnings"]
    assert got["counts"]["cache.errors"] == 1, got["counts"]
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(TMP)]  # the partial entry is gone
    for entry in _entries(cache_dir):  # what was published before the failure is whole
        assert entry.stat().st_size <= 96 * 1024


READER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import streamdata as sd
    spec, options, cache_dir, go = json.loads(sys.argv[1])
    ds = sd.TarDataset(spec, storage_options=options, cache_dir=cache_dir, part_size=16 * 1024, window=4)
    while not os.path.exists(go):  # both processes start reading at the same moment
        time.sleep(0.005)
    epochs = []
    for _ in range(3):
        epochs.append([[s["__key__"], bool((np.asarray(s["npy"]) == s["cls"]).all())] for s in ds])
    print(json.dumps({"epochs": epochs, "counts": ds.counts}))
""")


@pytest.mark.slow
def test_two_processes_fetching_at_once_share_entries_safely(shards, tmp_path):
    spec, options, proxy, keys = shards
    cache_dir, go = tmp_path / "cache", tmp_path / "go"
    arg = json.dumps([spec, options, str(cache_dir), str(go)])
    procs = [subprocess.Popen([sys.executable, "-c", READER, arg], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
    try:
        go.write_text("")
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    for (stdout, stderr), p in zip(results, procs, strict=True):
        assert p.returncode == 0, stderr
        got = json.loads(stdout)
        for epoch in got["epochs"]:
            assert [k for k, _ in epoch] == keys and all(ok for _, ok in epoch)
        assert got["counts"]["cache.corrupt"] == got["counts"]["cache.errors"] == 0, got["counts"]
    # every entry is whole and right: it reads back as the shard's bytes
    cache = Cache(str(cache_dir))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    ds = sd.TarDataset(spec, storage_options=options)
    for s in ds.shards:
        entry = cache.lookup(cache_key(s.url, ((0, s.size),), s.size, s.etag), s.size)
        assert entry is not None
        try:
            assert entry.read() == fs.cat_file(s.url)
        finally:
            entry.close()
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(TMP)]


def test_object_dataset_through_the_cache(s3_bucket, tmp_path):
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    for i in range(6):
        fs.pipe_file(f"{bucket}/o/{i:03d}.txt", f"object {i}".encode())
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        ds = sd.ObjectDataset(f"s3://{bucket}/o/", storage_options=options, cache_dir=tmp_path / "cache")
        try:
            first = [s["txt"] for s in ds.__getitems__(list(range(6)))]
            proxy.reset_counters()
            second = [s["txt"] for s in ds.__getitems__(list(range(6)))]
        finally:
            ds.close()
        assert first == second == [f"object {i}" for i in range(6)]
        assert proxy.requests == {}, proxy.history
        assert ds.counts["cache.hits"] == 6 and ds.counts["cache.misses"] == 6


def test_cache_options_flow_through_fetch_config(monkeypatch, tmp_path):
    cfg = sd.FetchConfig.resolve(None, cache_dir=tmp_path / "c", cache_limit=1 << 30)
    assert cfg.cache_dir == str(tmp_path / "c") and cfg.cache_limit == 1 << 30
    assert sd.FetchConfig().cache_dir is None and sd.FetchConfig(cache_dir="").cache_dir is None
    monkeypatch.setenv("STREAMDATA_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("STREAMDATA_CACHE_LIMIT", "1000000")
    cfg = sd.FetchConfig.resolve(None)
    assert cfg.cache_dir == str(tmp_path / "env") and cfg.cache_limit == 1000000
    assert sd.FetchConfig.resolve(None, cache_dir=str(tmp_path / "kw")).cache_dir == str(tmp_path / "kw")
    for bad in (0, -5, 1.5, "10GB", True):
        with pytest.raises(sd.SpecError, match="cache_limit"):
            sd.FetchConfig(cache_limit=bad)
    with pytest.raises(sd.SpecError, match="cache_dir"):
        sd.FetchConfig(cache_dir=3)


def test_one_writer_per_entry_and_readers_see_only_whole_entries(tmp_path):
    """CACHE-PUBLISH without timing: a second writer of an entry being written gets none (it
    would only stream), a reader never sees the entry before it is whole, an abandoned file is
    taken over, and an entry deleted while open stays readable."""
    cache = Cache(str(tmp_path))
    data = os.urandom(3 * (1 << 20) + 5)
    key = cache_key("s3://b/k.tar", ((0, len(data)),), len(data), "etag-1")
    first = cache.writer(key, len(data))
    assert first is not None
    assert cache.writer(key, len(data)) is None  # flock held by the first (another open file)
    first.write(1 << 20, data[1 << 20:])  # parts out of order
    assert cache.lookup(key, len(data)) is None  # not published yet: a miss, never a torn read
    first.write(0, data[:1 << 20])
    assert not first.active and cache.writer(key, len(data)) is None  # published: nothing to write
    entry = cache.lookup(key, len(data))
    assert entry is not None
    os.unlink(cache.path(key))  # evicted by another process while this reader holds it
    try:
        assert entry.read() == data
    finally:
        entry.close()
    # a writer that died leaves its .tmp, unlocked: the next writer takes it over
    dead = cache.writer(key, len(data))
    dead.write(0, data[:1000])
    os.close(dead._fd)  # the process is gone: its lock with it, the partial file stays
    dead._fd = None
    again = cache.writer(key, len(data))
    assert again is not None
    again.write(0, data)
    entry = cache.lookup(key, len(data))
    try:
        assert entry.read() == data
    finally:
        entry.close()
    # another key, another etag: another entry
    assert cache.lookup(cache_key("s3://b/k.tar", ((0, len(data)),), len(data), "etag-2"), len(data)) is None


def test_byte_ranges_corrupt_mid_entry_are_refetched_from_the_right_offset(tmp_path):
    """A Parquet-like item of several byte ranges: a bad segment found after the first MiB was
    served makes the reader fetch the rest, range by range, from the first byte not delivered."""
    from streamdata.fetch.prefetcher import FetchItem, Prefetcher

    blob = os.urandom(3 << 20)
    src = tmp_path / "obj.bin"
    src.write_bytes(blob)
    ranges = ((100, 700_000), (1 << 20, (2 << 20) + 12345), ((5 << 19), 3 << 20))
    want = [blob[a:b] for a, b in ranges]
    cfg = sd.FetchConfig(cache_dir=str(tmp_path / "cache"), part_size=256 * 1024)

    def read() -> tuple[list[bytes], dict]:
        with Prefetcher([FetchItem(str(src), len(blob), ranges)], config=cfg) as fetcher:
            got = next(iter(fetcher)).read_ranges()
            return got, dict(fetcher.cache.stats), fetcher.stats.requests

    assert read()[0] == want
    (entry,) = _entries(tmp_path / "cache")
    data = bytearray(entry.read_bytes())
    data[(1 << 20) + 5000] ^= 0x01  # in the second segment: the first MiB is served first
    entry.write_bytes(bytes(data))
    got, stats, requests = read()
    assert got == want
    assert stats["hits"] == 1 and stats["corrupt"] == 1 and requests >= 1, stats
    assert not entry.exists()
    got, stats, requests = read()  # a miss, fetched and cached again
    assert got == want and stats["misses"] == 1
    got, stats, requests = read()
    assert got == want and stats["hits"] == 1 and requests == 0


def test_a_shards_etag_is_part_of_its_key(tmp_path):
    """A shard whose listing (or index) gives an ETag is cached under it: another ETag, same URL
    and size (the object was rewritten), is fetched again, never served from the old entry."""
    from typing import NamedTuple

    from streamdata.fetch.prefetcher import Prefetcher

    class Tagged(NamedTuple):  # urls.Shard with the index's etag field
        url: str
        size: int
        etag: str | None = None

    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 5000)
    cfg = sd.FetchConfig(cache_dir=str(tmp_path / "cache"))

    def hits(shard: Tagged) -> int:
        with Prefetcher([shard], config=cfg) as fetcher:
            assert next(iter(fetcher)).read() == src.read_bytes()
            return fetcher.cache.stats["hits"]

    assert [hits(Tagged(str(src), 5000, "v1")), hits(Tagged(str(src), 5000, "v1"))] == [0, 1]
    src.write_bytes(b"y" * 5000)  # rewritten: same size, a new ETag
    assert [hits(Tagged(str(src), 5000, "v2")), hits(Tagged(str(src), 5000, "v2"))] == [0, 1]


def test_persistent_workers_starting_the_next_epoch_early_fetch_each_shard_once(shards, tmp_path):
    """sd.loader's persistent workers start each next epoch's pass before the current one ends
    (NEXT-EPOCH-EARLY): over three epochs every shard is still fetched exactly once (the early
    pass after the last epoch looks its shards up too: hits >= 2 x shards)."""
    spec, options, proxy, keys = shards
    ds = sd.TarDataset(spec, storage_options=options, cache_dir=tmp_path / "cache", batch_size=2)
    with sd.loader(ds, num_workers=2, pin_memory=False) as feed:
        epochs = [sorted(k for batch in feed for k in batch["__key__"]) for _ in range(3)]
    assert epochs == [sorted(keys)] * 3
    c = ds.counts
    assert c["cache.misses"] == len(UNEVEN) and c["cache.hits"] >= 2 * len(UNEVEN), c


def test_the_next_epoch_started_early_waits_for_entries_still_being_written(shards, tmp_path, monkeypatch):
    """A disk slower than the network (each publish held back): the next epoch's pass starts
    (NEXT-EPOCH-EARLY) while the current pass's entries are still being written; it waits for
    this process's writer instead of fetching those shards a second time (CACHE-PUBLISH).
    Without the wait: 13-14 misses, not 7."""
    publish = Writer.publish

    def slow_publish(self):
        time.sleep(0.3)  # the workers fork after this: each writes its entries this slowly
        publish(self)

    monkeypatch.setattr(Writer, "publish", slow_publish)
    test_persistent_workers_starting_the_next_epoch_early_fetch_each_shard_once(shards, tmp_path)


def test_an_object_rewritten_in_place_with_the_same_size_is_read_anew(s3_bucket, tmp_path):
    """The listing's ETag is part of the key: new bytes of the same size are never served old."""
    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    samples = make_samples([4])[0]
    fs.pipe_file(f"{bucket}/r/a.tar", tar_bytes(samples))
    cache_dir = tmp_path / "cache"
    spec = f"s3://{bucket}/r/a.tar"
    old = _samples(sd.TarDataset(spec, storage_options=server.storage_options, cache_dir=cache_dir))
    fs.pipe_file(f"{bucket}/r/a.tar", tar_bytes(samples[::-1]))  # same size, other bytes
    assert fs.size(f"{bucket}/r/a.tar") == len(tar_bytes(samples))
    ds = sd.TarDataset(spec, storage_options=server.storage_options, cache_dir=cache_dir)
    new = _samples(ds)
    assert list(new) == list(old)[::-1] and ds.counts["cache.hits"] == 0

