"""NO-LISTING datasets (``TarDataset(spec, listing=False)``): no listing in the constructor,
sizes from each shard's first ranged GET (``Content-Range``), the window's unsized shards
probed concurrently, and a missing shard reported at its first read, naming it; against the
S3 test server behind the counting proxy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import streamdata as sd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.faults import Fault, FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [4, 3, 5, 2]
KEYS = sorted(s["__key__"] for shard in make_samples(COUNTS) for s in shard)


@pytest.fixture
def shards(s3_bucket):
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"d/s-{i}.tar", Body=tar_bytes(shard))
    return server, bucket, f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar"


def test_listing_false_sizes_from_the_first_ranged_gets(shards) -> None:
    server, bucket, spec = shards
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None, listing=False)
        assert proxy.requests == {}  # no listing, no HEAD
        assert [s.size for s in ds.shards] == [None] * len(COUNTS)
        assert sorted(s["__key__"] for s in ds) == KEYS
        # shard 0: one GET (its size and first bytes); the others a 1-byte probe and a GET
        assert proxy.requests == {"get": 1 + 2 * (len(COUNTS) - 1)}


def test_unsized_shards_are_probed_concurrently(shards) -> None:
    """Shard 1's size probe is held at the proxy: shards 2 and 3 are sized meanwhile (not
    after it, one round trip after another)."""
    server, bucket, spec = shards
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match=lambda m, p, q: p.endswith("/d/s-1.tar"), seconds=2.0, times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None, listing=False)
        assert sorted(s["__key__"] for s in ds) == KEYS
        answered = [target.split("?")[0].rsplit("/", 1)[1] for _, _, target, outcome in proxy.history
                    if outcome != "hang"]
    held = answered.index("s-1.tar")
    assert "s-2.tar" in answered[:held] and "s-3.tar" in answered[:held], answered


def test_listing_false_missing_shard_fails_at_its_first_read(shards) -> None:
    server, bucket, _ = shards
    missing = f"s3://{bucket}/d/s-{{0..{len(COUNTS)}}}.tar"  # one shard too many
    with pytest.raises(sd.ShardNotFoundError, match=f"s-{len(COUNTS)}.tar"):
        sd.TarDataset(missing, storage_options=server.storage_options)  # listing=True: at once
    ds = sd.TarDataset(missing, storage_options=server.storage_options, index=None, listing=False)
    with pytest.raises(sd.ShardNotFoundError, match=f"d/s-{len(COUNTS)}.tar"):
        list(ds)


def test_listing_false_with_an_index(shards) -> None:
    """The index is still read (no listing: its GET, and the older name's beside it, as nothing
    lists the directory) and gives an exact epoch; spans are read by offsets although the
    shards' sizes are unknown."""
    server, bucket, spec = shards
    sd.build_index(spec, server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        ds = sd.TarDataset(spec, storage_options=options, decode=False, listing=False)
        answered = [(t.split("?")[0].rsplit("/", 1)[-1], o) for k, _, t, o in proxy.history if k == "get"]
        # the old name's GET may still be on its way when the constructor is done with the new one
        assert ("_streamdata.sdx", "200") in answered and set(answered) <= {
            ("_streamdata.sdx", "200"), ("streamdata.sdx", "404")}, proxy.history
        assert "list" not in proxy.requests
        assert list(ds.sample_counts()) == COUNTS
        assert sorted(s["__key__"] for s in ds) == KEYS
