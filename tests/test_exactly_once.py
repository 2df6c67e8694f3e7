"""Every sample exactly once per epoch across simulated ranks x DataLoader workers, on real servers."""

from __future__ import annotations

import collections

import pytest

import streamdata as sd
from tests.helpers import UNEVEN, read_keys, write_shards

WORLDS = [1, 2, 3]
WORKERS = [0, 1, 3]


def _check_exactly_once(spec, options, all_keys, *, batch_size=None):
    for world_size in WORLDS:
        for num_workers in WORKERS:
            ds = sd.TarDataset(spec, storage_options=options, shuffle=True, seed=5,
                               batch_size=batch_size, decode=False)
            ds.set_epoch(1)
            got = []
            for rank in range(world_size):
                got += read_keys(ds, num_workers, rank=rank, world_size=world_size)
            dupes = [k for k, n in collections.Counter(got).items() if n > 1]
            assert not dupes, f"world {world_size} x {num_workers} workers: duplicates {dupes[:5]}"
            assert sorted(got) == sorted(all_keys), f"world {world_size} x {num_workers} workers"


@pytest.fixture
def s3_shards(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/data")
    return f"s3://{bucket}/data/shard-{{000..{len(UNEVEN) - 1:03d}}}.tar", server.storage_options, keys


def test_exactly_once_s3(s3_shards):
    _check_exactly_once(*s3_shards)


def test_exactly_once_s3_batched(s3_shards):
    spec, options, keys = s3_shards
    ds = sd.TarDataset(spec, storage_options=options, batch_size=4, shuffle=True)
    got = read_keys(ds, 2)
    assert sorted(got) == sorted(keys)


def test_exactly_once_gcs(gcs_bucket):
    import gcsfs

    server, bucket = gcs_bucket
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/data")
    _check_exactly_once(f"gs://{bucket}/data/", server.storage_options, keys)


def test_exactly_once_local(tmp_path):
    import fsspec

    keys = write_shards(fsspec.filesystem("file"), str(tmp_path))
    _check_exactly_once(str(tmp_path / "shard-*.tar"), {}, keys)


def test_http_urls(tmp_path, http_server):
    import fsspec

    keys = write_shards(fsspec.filesystem("file"), str(tmp_path))
    server = http_server(tmp_path)
    urls = [server.url(f"shard-{i:03d}.tar") for i in range(len(UNEVEN))]
    ds = sd.TarDataset(urls, part_size=300)
    assert sorted(read_keys(ds, 2)) == sorted(keys)


def test_determinism_per_seed_and_epoch(tmp_path):
    import fsspec

    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[3] * 12)
    spec = str(tmp_path / "shard-{000..011}.tar")

    def order(epoch, seed=0):
        ds = sd.TarDataset(spec, shuffle=True, seed=seed, decode=False)
        ds.set_epoch(epoch)
        return read_keys(ds, 2, rank=1, world_size=2)

    assert order(3) == order(3)
    assert order(3) != order(4)
    assert order(3, seed=1) != order(3, seed=0)
    ds = sd.TarDataset(spec, shuffle=True, decode=False)
    ds.set_epoch(7)
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in ds]  # main process: epoch is as set


def test_epochs_advance_per_pass_with_persistent_workers(tmp_path):
    import fsspec
    import torch

    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[2] * 10)
    spec = str(tmp_path / "shard-{000..009}.tar")
    ds = sd.TarDataset(spec, shuffle=True, decode=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                                         multiprocessing_context="fork")
    passes = [[s["__key__"] for s in loader] for _ in range(2)]
    expected = []
    for epoch in range(2):
        fresh = sd.TarDataset(spec, shuffle=True, decode=False)
        fresh.set_epoch(epoch)
        expected.append(read_keys(fresh, 2))
    assert passes == expected and passes[0] != passes[1]


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_fork_and_spawn_complete_an_epoch_over_s3(s3_shards, context):
    """LOOP-AFTER-FORK: the parent used s3fs and aiohttp first; forked (and spawned) workers
    make their own loops and filesystems and read the epoch whole instead of hanging."""
    spec, options, keys = s3_shards
    ds = sd.TarDataset(spec, storage_options=options, shuffle=True)
    list(sd.TarDataset(spec, storage_options=options))  # use s3fs/aiohttp in the parent first
    assert sorted(read_keys(ds, 2, context=context)) == sorted(keys)
