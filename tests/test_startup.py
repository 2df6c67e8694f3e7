"""Start-up: sizes from the first ranged GET (HEAD-START), no HEAD and no second request for a
small first shard, against the real HTTP and S3 test servers."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamdata as sd
from streamdata.config import FetchConfig
from streamdata.store.client import AsyncClient
from streamdata.store.presigned import content_total

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.faults import FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [4, 3, 5]


def _keys(counts: list[int]) -> list[str]:
    return [s["__key__"] for shard in make_samples(counts) for s in shard]


@contextlib.contextmanager
def _shards_behind_a_proxy(server, bucket: str) -> Iterator[tuple[FaultProxy, dict]]:
    """COUNTS shards at ``d/s-{i}.tar``; a counting proxy in front of the S3 server, and the
    storage options that go through it."""
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"d/s-{i}.tar", Body=tar_bytes(shard))
    with FaultProxy(server.endpoint_url) as proxy:
        yield proxy, dict(server.storage_options, endpoint_url=proxy.url)


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
    ds = sd.TarDataset(urls, decode=False, index=None)
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
    with _shards_behind_a_proxy(server, bucket) as (proxy, options):
        shards = [sd.Shard(f"s3://{bucket}/d/s-{i}.tar") for i in range(len(COUNTS))]
        ds = sd.TarDataset(shards, storage_options=options, decode=False, index=None)
        assert proxy.requests == {}  # Shard items are taken as given: no listing
        assert [s["__key__"] for s in ds] == _keys(COUNTS)
        # no HEAD: shard 0 is one GET (size and bytes), the others a 1-byte probe and a GET
        assert proxy.requests == {"get": 1 + 2 * (len(COUNTS) - 1)}


def test_lite_signatures_match_botocore() -> None:
    """LITE-S3 signs exactly as botocore does (SigV4 query auth), for the same instant."""
    import datetime
    import urllib.parse

    import boto3
    from botocore.config import Config

    from streamdata.store.s3lite import LiteS3

    def query(url: str) -> dict[str, str]:
        return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))

    for endpoint, region, token in [("http://127.0.0.1:9000", "us-east-1", None),
                                    ("https://s3.example.com:443/", "eu-west-3", "TOK/en+=")]:
        boto = boto3.client("s3", endpoint_url=endpoint, region_name=region, aws_access_key_id="AKID",
                            aws_secret_access_key="se/cr+et", aws_session_token=token,
                            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
        lite = LiteS3(endpoint, region, "AKID", "se/cr+et", token)
        cases = [("get_object", {"Bucket": "bkt", "Key": "dir/a b+c~(1).tar"}, "dir/a b+c~(1).tar", {}),
                 ("list_objects_v2", {"Bucket": "bkt", "Prefix": "d ir/", "Delimiter": "/"}, "",
                  {"list-type": "2", "prefix": "d ir/", "delimiter": "/", "encoding-type": "url"})]
        for operation, params, key, extra in cases:
            theirs = boto.generate_presigned_url(operation, Params=params, ExpiresIn=3600)
            when = datetime.datetime.strptime(query(theirs)["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
            mine = lite.url("bkt", key, extra, now=when.replace(tzinfo=datetime.UTC))
            assert query(mine) == query(theirs), (theirs, mine)
            assert urllib.parse.urlsplit(mine).path == urllib.parse.urlsplit(theirs).path
        boto.close()
    assert "se/cr+et" not in repr(lite)


_CHILD = """
import json, sys
import streamdata as sd
opts, spec = json.loads(sys.argv[1])
ds = sd.TarDataset(spec, storage_options=opts, decode=False, index=None)
heavy = ("s3fs", "aiobotocore", "botocore")
seen = [m for m in sys.modules if m.split(".")[0] in heavy]
def mark(sample):
    sample["heavy"] = [m for m in sys.modules if m.split(".")[0] in heavy]
    return sample
ds.map = mark
keys, worker_heavy = [], set()
for batch in sd.loader(ds, batch_size=None, num_workers=2, pin_memory=False, persistent_workers=False):
    keys.append(batch["__key__"])
    worker_heavy.update(batch["heavy"])
print(json.dumps({"seen": seen, "workers": sorted(worker_heavy), "keys": sorted(keys)}))
"""


def test_lite_s3_lists_once_and_imports_no_botocore(s3_bucket) -> None:
    """LITE-S3: a brace pattern costs one listing request, and neither the constructing process
    nor its DataLoader workers import s3fs, aiobotocore or botocore."""
    import json
    import subprocess

    server, bucket = s3_bucket
    with _shards_behind_a_proxy(server, bucket) as (proxy, options):
        spec = f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar"
        ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None)
        assert proxy.requests == {"list": 1}  # no HEAD, no region probe: one ListObjectsV2
        assert [s.size for s in ds.shards] == [len(tar_bytes(s)) for s in make_samples(COUNTS)]
        proxy.reset_counters()
        root = str(Path(__file__).resolve().parents[1])
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([options, spec])], cwd=root,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"seen": [], "workers": [], "keys": sorted(_keys(COUNTS))}
        assert proxy.requests == {"list": 1, "get": len(COUNTS)}


@pytest.mark.parametrize("spec", ["s3://{b}/d/", "s3://{b}/d", "s3://{b}/d/s-1.tar", "s3://{b}/d/s-",
                                  "s3://{b}/d/sub", "s3://{b}", "s3://{b}/d/s-{{0..2}}.tar",
                                  ["s3://{b}/d/s-0.tar", "s3://{b}/d/s-2.tar"], "s3://{b}/nothing"])
def test_lite_expansion_means_what_s3fs_means(s3_bucket, spec) -> None:
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for key in ["d/s-0.tar", "d/s-1.tar", "d/s-2.tar", "d/sub/x.tar", "d/sub/y.txt", "d/s-x/z.tar",
                "other.tar"]:
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode() * 10)
    spec = [s.format(b=bucket) for s in spec] if isinstance(spec, list) else spec.format(b=bucket)
    lite = server.storage_options
    botocore = dict(server.storage_options, use_ssl=False)  # an option LITE-S3 leaves to s3fs
    from streamdata.store.backends import lite_s3

    assert lite_s3("s3", lite) is not None and lite_s3("s3", botocore) is None

    def expand(options):
        try:
            return sd.expand_spec(spec, options, suffixes=(".tar",))
        except sd.StreamDataError as exc:
            return type(exc)

    assert expand(lite) == expand(botocore)


def test_lite_s3_falls_back_to_botocore_when_refused(s3_bucket) -> None:
    """A listing LITE-S3 may have signed wrong (a 4xx other than 404) is made again by s3fs."""
    from benchmarks.faults import Fault

    server, bucket = s3_bucket
    server.boto3_client().put_object(Bucket=bucket, Key="d/s-0.tar", Body=tar_bytes(make_samples([2])[0]))
    with FaultProxy(server.endpoint_url) as proxy:
        proxy.add(Fault("status", status=403, match="list", times=1))
        options = dict(server.storage_options, endpoint_url=proxy.url)
        ds = sd.TarDataset(f"s3://{bucket}/d/s-{{0..0}}.tar", storage_options=options, decode=False,
                           index=None)
        assert ds.shards[0].size is not None and proxy.requests == {"list": 2}
        missing = sd.TarDataset  # a missing bucket is a clear error, not a fallback
        with pytest.raises(sd.ShardNotFoundError):
            missing(f"s3://{bucket}-nope/d/s-{{0..0}}.tar", storage_options=options)


def test_no_listing_names_shards_without_a_request(s3_bucket) -> None:
    """expand_spec(listing=False): no request at construction, sizes from the readers' first
    GETs; a missing shard fails when read, naming it; the default still fails at once."""
    server, bucket = s3_bucket
    with _shards_behind_a_proxy(server, bucket) as (proxy, options):
        spec = f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar"
        shards = sd.expand_spec(spec, options, listing=False)
        assert shards == [sd.Shard(f"s3://{bucket}/d/s-{i}.tar") for i in range(len(COUNTS))]
        ds = sd.TarDataset(shards, storage_options=options, decode=False, index=None)
        assert proxy.requests == {}
        assert [s["__key__"] for s in ds] == _keys(COUNTS)
        assert proxy.requests == {"get": 1 + 2 * (len(COUNTS) - 1)}  # no list, no HEAD

        missing = f"s3://{bucket}/d/s-{{0..{len(COUNTS)}}}.tar"  # one shard too many
        with pytest.raises(sd.ShardNotFoundError, match=f"s-{len(COUNTS)}.tar"):
            sd.TarDataset(missing, storage_options=options)
        ds = sd.TarDataset(sd.expand_spec(missing, options, listing=False), storage_options=options,
                           index=None)
        with pytest.raises(sd.ShardNotFoundError, match=f"s-{len(COUNTS)}.tar"):
            list(ds)


def test_a_bad_decode_spec_is_refused_before_any_request(s3_bucket) -> None:
    server, bucket = s3_bucket
    with _shards_behind_a_proxy(server, bucket) as (proxy, options):
        spec = f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar"
        with pytest.raises(sd.SpecError, match="unknown image spec"):
            sd.TarDataset(spec, storage_options=options, decode="no-such-spec")
        assert proxy.requests == {}  # neither the listing nor the index GET went out
        ds = sd.TarDataset(spec, storage_options=options, index=None)
        assert sorted(int(s["cls"]) for s in ds) == list(range(sum(COUNTS)))  # decoded


@pytest.mark.parametrize("spec, match", [("s3://b/d/*.tar", "glob or a directory"),
                                         ("s3://b/d/", "glob or a directory"),
                                         ("nope://b/x.tar", "unknown protocol"),
                                         (["s3://b/x.tar", "s3://b/x.tar"], "more than once")])
def test_no_listing_refuses_what_needs_a_listing(spec, match: str) -> None:
    with pytest.raises(sd.SpecError, match=match):
        sd.expand_spec(spec, listing=False)


def test_lite_listing_follows_every_page(s3_bucket) -> None:
    """LITE-S3's listing reads all pages (continuation tokens), keys with odd characters
    included (encoding-type=url), over one connection."""
    from streamdata.store.backends import lite_s3

    server, bucket = s3_bucket
    s3 = server.boto3_client()
    keys = [f"p/k-{i} +%~é.tar" for i in range(5)] + ["p/sub/deeper.tar", "q/other.tar"]
    for key in keys:
        s3.put_object(Bucket=bucket, Key=key, Body=b"x" * len(key))
    with FaultProxy(server.endpoint_url) as proxy:
        lite = lite_s3("s3", dict(server.storage_options, endpoint_url=proxy.url))
        found = lite.list(bucket, "p/", timeout=10, page_size=2)
        assert proxy.requests == {"list": 3}
        assert sorted((k, n) for k, n, _ in found) == sorted((k, len(k)) for k in keys if k.startswith("p/"))
        flat = lite.list(bucket, "p/", timeout=10, delimiter="/")  # one level, as s3fs's ls
        assert sorted(k for k, _, _ in flat) == sorted(k for k in keys[:5])


def test_the_first_shard_starts_with_small_parts(s3_bucket) -> None:
    """FIRST-BYTES-FIRST: a reader's first shard's parts start at 256 KiB and double (the first
    batch waits for the first of them only)."""
    import os

    server, bucket = s3_bucket
    blob = [{"__key__": f"k{i}", "bin": os.urandom(1 << 20)} for i in range(6)]  # 6 MiB and headers
    server.boto3_client().put_object(Bucket=bucket, Key="w/s-0.tar", Body=tar_bytes(blob))
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        ds = sd.TarDataset(f"s3://{bucket}/w/s-{{0..0}}.tar", storage_options=options, decode=False,
                           index=None)
        assert [s["__key__"] for s in ds] == [b["__key__"] for b in blob]
        gets = [t for kind, _, t, _ in proxy.history if kind == "get" and "/w/s-0.tar" in t]
    assert len(gets) == 5, gets  # 256 KiB, 512 KiB, 1 MiB, 2 MiB, the rest
