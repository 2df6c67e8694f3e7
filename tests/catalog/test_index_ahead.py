"""INDEX-AHEAD: TarDataset's index GET goes out while the spec is listed (one listing and one
GET, as before), is used only when the listed shards' index URL is the one fetched, and falls
back to a serial read when it is not; against the S3 test server behind the counting proxy."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import streamdata as sd
from streamdata.catalog.index_ahead import early_index_url

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.faults import Fault, FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [4, 3, 5]


def _put(server, bucket: str, prefix: str) -> str:
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"{prefix}s-{i}.tar", Body=tar_bytes(shard))
    return f"s3://{bucket}/{prefix}s-{{0..{len(COUNTS) - 1}}}.tar"


def _gets(proxy: FaultProxy) -> list[str]:
    return [target.split("?")[0] for kind, _, target, outcome in proxy.history
            if kind == "get" and outcome != "hang"]


@pytest.mark.parametrize("spec, index, url", [
    ("s3://b/d/s-{0..2}.tar", "auto", "s3://b/d/_streamdata.sdx"),
    (["s3://b/d/x/a.tar", "s3://b/d/y/b.tar"], "auto", "s3://b/d/_streamdata.sdx"),
    ("s3://b/d/", "auto", "s3://b/d/_streamdata.sdx"),
    ("s3://b/d/*.tar", "auto", "s3://b/d/_streamdata.sdx"),
    ("s3://b/d/s-0.tar", "auto", "s3://b/d/_streamdata.sdx"),
    ("/data/d/s-{0..1}.tar", "auto", "/data/d/_streamdata.sdx"),
    ("s3://b/d/s-{0..2}.tar", "s3://b/other.sdx", "s3://b/other.sdx"),
    ("s3://b/d", "auto", None),  # a directory or the start of names: the listing tells
    ("s3://b/d/s-", "auto", None),
    ("s3://b/*/x.tar", "auto", None),  # shards in any directory
    (["s3://b/d/a.tar", "s3://c/d/b.tar"], "auto", None),  # two buckets: no default location
    (["https://h/a.tar?X-Amz-Signature=1"], "auto", None),  # signed URLs: none either
    ("s3://b/d/s-{0..2}.tar", None, None),
])
def test_early_index_url(spec, index, url) -> None:
    assert early_index_url(spec, index, (".tar",)) == url


def test_index_get_overlaps_the_listing(s3_bucket) -> None:
    """The index's GET reaches the server while the listing is held there; still one listing
    and one GET, and the index is used."""
    server, bucket = s3_bucket
    spec = _put(server, bucket, "d/")
    sd.build_index(spec, server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.5, times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert proxy.requests == {"list": 1, "get": 1}
        events = [(kind, outcome) for kind, _, _, outcome in proxy.history]
        # the index answered while the listing was held (3 s), then the listing answered (which
        # of the two requests reached the proxy first is a race: the GET may be answered before
        # the listing's request even arrives)
        assert sorted(events) == [("get", "200"), ("list", "200 hang"), ("list", "hang")], proxy.history
        assert events[-1] == ("list", "200 hang"), proxy.history
        assert list(ds.sample_counts()) == COUNTS
        assert sorted(s["__key__"] for s in ds) == sorted(
            s["__key__"] for shard in make_samples(COUNTS) for s in shard)


def test_under_lite_s3_the_early_get_needs_no_event_loop(s3_bucket) -> None:
    """Under LITE-S3 the early GET is one request on a plain thread: while the listing is held
    at the proxy, that thread runs and no event-loop thread of ours exists (its start-up would
    compete with the listing's CPU); the index is used."""
    import threading
    import time

    server, bucket = s3_bucket
    spec = _put(server, bucket, "d/")
    sd.build_index(spec, server.storage_options)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(t.name for t in threading.enumerate() if t.name.startswith("streamdata"))
            time.sleep(0.005)

    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.0, times=1))
        proxy.add(Fault("hang", match="get", seconds=0.5, times=1))  # its thread lives a while
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            ds = sd.TarDataset(spec, storage_options=options, decode=False)
        finally:
            stop.set()
            watcher.join(5)
        assert proxy.requests == {"list": 1, "get": 1}
    assert seen == {"streamdata-index-ahead"}, seen
    assert list(ds.sample_counts()) == COUNTS


def test_an_early_get_that_failed_is_read_again(s3_bucket) -> None:
    """A 503 to the early GET: the lookup reads the index again (retried as ``read_index``
    is) and uses it."""
    server, bucket = s3_bucket
    spec = _put(server, bucket, "d/")
    sd.build_index(spec, server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("status", status=503, match="get", times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert proxy.requests == {"list": 1, "get": 2}
    assert list(ds.sample_counts()) == COUNTS


def test_no_index_is_one_404_during_the_listing(s3_bucket) -> None:
    server, bucket = s3_bucket
    spec = _put(server, bucket, "d/")
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.5, times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert proxy.requests == {"list": 1, "get": 1}
        assert [(k, o) for k, _, _, o in proxy.history] == [("list", "hang"), ("get", "404"),
                                                           ("list", "200 hang")], proxy.history
    assert ds.sample_counts() is None


def test_a_wrong_guess_falls_back_to_the_listed_location(s3_bucket) -> None:
    """``d/`` whose shards all lie in ``d/sub/``: the early GET asks for ``d/_streamdata.sdx``
    (404), the listing says ``d/sub/``, whose index is then read and used."""
    server, bucket = s3_bucket
    sd.build_index(_put(server, bucket, "d/sub/"), server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        # the listing held a moment: the early GET's answer is in before the second GET goes out
        # (the proxy logs answers, not requests)
        proxy.add(Fault("hang", match="list", seconds=1.0, times=1))
        ds = sd.TarDataset(f"s3://{bucket}/d/", storage_options=options, decode=False)
        assert proxy.requests == {"list": 1, "get": 2}
        assert _gets(proxy) == [f"/{bucket}/d/_streamdata.sdx", f"/{bucket}/d/sub/_streamdata.sdx"]
    assert list(ds.sample_counts()) == COUNTS


def test_ambiguous_spec_reads_the_index_after_the_listing(s3_bucket) -> None:
    server, bucket = s3_bucket
    sd.build_index(_put(server, bucket, "d/"), server.storage_options)
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.0, times=1))
        ds = sd.TarDataset(f"s3://{bucket}/d", storage_options=options, decode=False)
        assert [(k, o) for k, _, _, o in proxy.history] == [("list", "hang"), ("list", "200 hang"),
                                                           ("get", "200")], proxy.history
    assert list(ds.sample_counts()) == COUNTS


def test_a_failed_listing_leaves_no_early_request_running(s3_bucket) -> None:
    """A missing shard is still the constructor's error; the early GET's thread is closed
    (the leak guard fails a test that leaves a streamdata thread)."""
    server, bucket = s3_bucket
    _put(server, bucket, "d/")
    with pytest.raises(sd.ShardNotFoundError, match="first: .*s-3.tar"):
        sd.TarDataset(f"s3://{bucket}/d/s-{{0..9}}.tar", storage_options=server.storage_options)


# ---------------------------------------------------------------------------- the index's two names

LEGACY = "streamdata.sdx"  # the name before _streamdata.sdx: read where only it exists, never written


def _forms(bucket: str) -> dict[str, tuple[str, bool]]:
    """Spec forms of ``d/``'s shards, and whether their listing covers ``d/`` whole (LISTED-NAMES:
    it then tells which index name exists; else both GETs go ahead together)."""
    return {"brace": (f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar", True),
            "directory": (f"s3://{bucket}/d/", True),
            "glob": (f"s3://{bucket}/d/*.tar", False)}


def _answers(proxy: FaultProxy) -> list[tuple[str, str, str]]:
    """``(kind, object, outcome)`` in the order the proxy answered them."""
    return [(kind, target.split("?")[0].rsplit("/", 1)[-1], outcome)
            for kind, _, target, outcome in proxy.history]


@pytest.mark.parametrize("form", ["brace", pytest.param("directory", marks=pytest.mark.slow),
                                  pytest.param("glob", marks=pytest.mark.slow)])
def test_an_index_under_the_old_name_is_still_read(s3_bucket, form) -> None:
    """A dataset indexed before the rename keeps its exact epochs. Where the listing covers the
    directory, the old name is read after it (one GET more, for such datasets only); else both
    names were asked for beside the listing."""
    server, bucket = s3_bucket
    sd.build_index(_put(server, bucket, "d/"), server.storage_options, output=f"s3://{bucket}/d/{LEGACY}")
    spec, told = _forms(bucket)[form]
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.0, times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert proxy.requests == {"list": 1, "get": 2}, proxy.history
        answers = _answers(proxy)
        gets = [(name, outcome) for kind, name, outcome in answers if kind == "get"]
        assert sorted(gets) == [("_streamdata.sdx", "404"), (LEGACY, "200")], proxy.history
        last = answers[-1] if told else [a for a in answers if a[0] == "list"][-1]
        assert last[0] == ("get" if told else "list"), proxy.history
        assert ds._index is not None and ds._index.url == f"s3://{bucket}/d/{LEGACY}"
        assert list(ds.sample_counts()) == COUNTS  # exact epochs, from the old index
        assert sorted(s["__key__"] for s in ds) == sorted(s["__key__"] for shard in make_samples(COUNTS)
                                                          for s in shard)


@pytest.mark.parametrize("form", ["brace", "directory", "glob"])
def test_where_both_names_exist_the_new_one_is_read(s3_bucket, form) -> None:
    """The old index (one shard's entry only here: read, it would warn and leave no index) is not
    used."""
    from streamdata.catalog.index import read_index, write_index

    server, bucket = s3_bucket
    new = sd.build_index(_put(server, bucket, "d/"), server.storage_options)
    assert new == f"s3://{bucket}/d/_streamdata.sdx"
    write_index(f"s3://{bucket}/d/{LEGACY}", read_index(new, server.storage_options)[:1],
                server.storage_options)
    spec, told = _forms(bucket)[form]
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ds = sd.TarDataset(spec, storage_options=options, decode=False)
        gets = sorted(name for kind, name, _ in _answers(proxy) if kind == "get")
        assert gets == (["_streamdata.sdx"] if told else ["_streamdata.sdx", LEGACY]), proxy.history
    assert ds._index is not None and ds._index.url == new
    assert list(ds.sample_counts()) == COUNTS


@pytest.mark.parametrize("form", ["directory", "glob"])
def test_no_index_costs_the_same_requests_as_before_the_rename(s3_bucket, form) -> None:
    """Without an index: where the listing covers the directory, one 404 beside the listing and
    nothing after it, as with one name; a glob's listing does not say, so both names' GETs go
    out beside it (two 404s, still none after the listing)."""
    server, bucket = s3_bucket
    _put(server, bucket, "d/")
    spec, told = _forms(bucket)[form]
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=1.5, times=1))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        answers = _answers(proxy)
        assert (answers[-1][0], answers[-1][2]) == ("list", "200 hang"), proxy.history  # none after it
        gets = sorted((name, outcome) for kind, name, outcome in answers if kind == "get")
        assert gets == [("_streamdata.sdx", "404")] + ([] if told else [(LEGACY, "404")]), proxy.history
    assert ds.sample_counts() is None


def test_no_listing_sends_both_names_ahead(s3_bucket) -> None:
    """``listing=False`` (NO-LISTING) lists nothing: both GETs go out at once, none after."""
    server, bucket = s3_bucket
    spec = _put(server, bucket, "d/")
    sd.build_index(spec, server.storage_options, output=f"s3://{bucket}/d/{LEGACY}")
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        ds = sd.TarDataset(spec, storage_options=options, decode=False, listing=False)
        assert proxy.requests == {"get": 2}, proxy.history
    assert list(ds.sample_counts()) == COUNTS


def test_other_tools_folder_discovery_skips_the_index(tmp_path) -> None:
    """pyarrow's dataset discovery (as Ray Data's, Spark's: ``_`` and ``.`` prefixes skipped)
    finds the shards and not the index; the old name it would take for a shard."""
    import pyarrow as pa
    import pyarrow.dataset as pads

    for i, shard in enumerate(make_samples(COUNTS)):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    assert sd.build_index(str(tmp_path / "s-{0..2}.tar")) == str(tmp_path / "_streamdata.sdx")
    shards = sorted(str(tmp_path / f"s-{i}.tar") for i in range(len(COUNTS)))
    # a schema given: nothing is read, only discovered (they are not Parquet files)
    assert sorted(pads.dataset(str(tmp_path), format="parquet", schema=pa.schema([])).files) == shards
    (tmp_path / LEGACY).write_bytes((tmp_path / "_streamdata.sdx").read_bytes())
    found = pads.dataset(str(tmp_path), format="parquet", schema=pa.schema([])).files
    assert sorted(found) == sorted([*shards, str(tmp_path / LEGACY)])
    assert [s.url for s in sd.TarDataset(str(tmp_path) + "/").shards] == shards  # neither name a shard
