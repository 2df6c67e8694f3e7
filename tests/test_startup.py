"""Start-up: sizes from the first ranged GET (HEAD-START), no HEAD and no second request for a
small first shard, against the real HTTP and S3 test servers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import streamdata as sd
from streamdata.client import AsyncClient, content_total
from streamdata.config import FetchConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.faults import FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [4, 3, 5]


def _keys(counts: list[int]) -> list[str]:
    return [s["__key__"] for shard in make_samples(counts) for s in shard]


def test_content_total() -> None:
    assert content_total("bytes 0-99/1234") == 1234
    assert content_total("bytes */0") == 0
    assert content_total(None) is None
    assert content_total("bytes 0-99/*") is None


def test_http_sizes_from_the_first_ranged_get(tmp_path: Path, http_server) -> None:
    for i, shard in enumerate(make_samples(COUNTS)):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    (tmp_path / "empty.bin").write_bytes(b"")
    server = http_server(root_dir=tmp_path)
    urls = [server.url(f"s-{i}.tar") for i in range(len(COUNTS))]
    ds = sd.TarDataset(urls, decode=False)
    assert [s.size for s in ds.shards] == [None] * len(COUNTS)  # HTTP: nothing to list
    assert [s["__key__"] for s in ds] == _keys(COUNTS)
    reqs = server.requests
    assert not [r for r in reqs if r[0] == "HEAD"], reqs
    first = [r for r in reqs if r[1].endswith("/s-0.tar")]
    # the reader's first shard: one GET, its size from Content-Range, its bytes kept
    assert first == [("GET", "/s-0.tar", f"bytes=0-{FetchConfig().first_part - 1}")], reqs
    later = [r for r in reqs if r[1].endswith("/s-1.tar")]
    assert later[0] == ("GET", "/s-1.tar", "bytes=0-0") and len(later) == 2, reqs  # probe, then the GET

    client = AsyncClient("http", name="t")
    try:
        assert client.io.run(client.size(server.url("empty.bin")), 30) == 0  # 416 bytes */0
        with pytest.raises(sd.ShardNotFoundError):
            client.io.run(client.size(server.url("missing.tar")), 30)
    finally:
        client.close()


def test_s3_sizes_from_the_first_ranged_get(s3_bucket) -> None:
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"d/s-{i}.tar", Body=tar_bytes(shard))
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        shards = [sd.Shard(f"s3://{bucket}/d/s-{i}.tar") for i in range(len(COUNTS))]
        ds = sd.TarDataset(shards, storage_options=options, decode=False)
        assert proxy.requests == {}  # Shard items are taken as given: no listing
        assert [s["__key__"] for s in ds] == _keys(COUNTS)
        # no HEAD: shard 0 is one GET (size and bytes), the others a 1-byte probe and a GET
        assert proxy.requests == {"get": 1 + 2 * (len(COUNTS) - 1)}
