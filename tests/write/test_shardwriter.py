"""sd.ShardWriter against the S3 test server: round trips, compression, the index, failures,
and a writer killed mid-shard (no partial object under a final name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

import streamdata as sd
from benchmarks.faults import Fault, FaultProxy, s3_error_xml
from streamdata.formats.compress import decompressed
from streamdata.formats.tar import samples_from_chunks
from tests.helpers import read_keys

ROOT = Path(__file__).resolve().parents[2]


def make_sample(n: int) -> dict:
    return {"__key__": f"k{n:05d}", "npy": np.full((3, 4), n, dtype=np.float32), "cls": n % 7,
            "json": {"n": n, "s": "é"}, "txt": f"text {n}", "pth": torch.arange(3) * n,
            "bin": bytes([n % 256]) * n}


def write_samples(pattern: str, count: int, **options) -> sd.ShardWriter:
    """``make_sample(0 .. count-1)`` through a ShardWriter; returns it, closed."""
    with sd.ShardWriter(pattern, **options) as writer:
        for n in range(count):
            writer.write(make_sample(n))
    return writer


def check_sample(s: dict) -> None:
    n = s["json"]["n"]
    assert s["__key__"] == f"k{n:05d}"
    assert np.array_equal(s["npy"], np.full((3, 4), n, dtype=np.float32))
    assert s["cls"] == n % 7 and s["txt"] == f"text {n}" and s["json"]["s"] == "é"
    assert torch.equal(s["pth"], torch.arange(3) * n) and s["bin"] == bytes([n % 256]) * n


def read_all(spec: str, options: dict | None) -> dict[str, dict]:
    loader = torch.utils.data.DataLoader(sd.TarDataset(spec, storage_options=options), batch_size=None,
                                         num_workers=2, multiprocessing_context="fork", timeout=60)
    out = {}
    for s in loader:
        check_sample(s)
        assert s["__key__"] not in out
        out[s["__key__"]] = s
    return out


def objects(fs, bucket: str) -> dict[str, int]:
    fs.invalidate_cache()
    return {Path(p).name: info["size"] for p, info in fs.find(bucket, detail=True).items()}


@pytest.mark.parametrize("publish", [None, "copy"])
def test_round_trip_over_s3(s3_bucket, publish):
    server, bucket = s3_bucket
    options = server.storage_options
    writer = write_samples(f"s3://{bucket}/train/shard-%04d.tar", 40, maxcount=9, storage_options=options,
                           index=False, publish=publish)
    assert writer.urls == [f"s3://{bucket}/train/shard-{i:04d}.tar" for i in range(5)]
    fs = fsspec.filesystem("s3", **options)
    assert set(objects(fs, bucket)) == {f"shard-{i:04d}.tar" for i in range(5)}  # no temporary key left
    got = read_all(f"s3://{bucket}/train/", options)
    assert sorted(got) == [f"k{n:05d}" for n in range(40)]


def test_members_are_encoded_as_webdatasets_tarwriter_does(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = [make_sample(n) for n in range(6)]
    with wds.ShardWriter(str(tmp_path / "theirs-%03d.tar"), maxcount=4, verbose=0) as theirs:
        for s in samples:
            theirs.write(dict(s))
    with sd.ShardWriter(str(tmp_path / "ours-%03d.tar"), maxcount=4, index=False) as ours:
        for s in samples:
            ours.write(dict(s))
    for i in range(2):
        a = list(samples_from_chunks([(tmp_path / f"theirs-{i:03d}.tar").read_bytes()]))
        b = list(samples_from_chunks([(tmp_path / f"ours-{i:03d}.tar").read_bytes()]))
        strip = lambda rows: [{k: v for k, v in r.items() if k != "__url__"} for r in rows]  # noqa: E731
        assert strip(a) == strip(b) and len(a) == (4, 2)[i]
    # and webdataset reads ours
    keys = [s["__key__"] for s in wds.WebDataset(str(tmp_path / "ours-{000..001}.tar"), shardshuffle=False)]
    assert keys == [s["__key__"] for s in samples]


def test_maxsize_starts_a_new_shard_before_it_would_be_exceeded(tmp_path):
    with sd.ShardWriter(str(tmp_path / "s-%03d.tar"), maxsize=20_000, index=False) as writer:
        for n in range(30):
            writer.write({"__key__": f"k{n:03d}", "bin": bytes(3000)})
        writer.write({"__key__": "big", "bin": bytes(50_000)})  # alone in a shard of its own
        writer.write({"__key__": "after", "bin": b"x"})
    sizes = [os.path.getsize(u) for u in writer.urls]
    counts = [len(list(samples_from_chunks([Path(u).read_bytes()]))) for u in writer.urls]
    assert sum(counts) == 32 and counts[-2:] == [1, 1]
    # 10240-byte tar records: a shard is at most maxsize rounded up to tar's record
    assert all(s <= 20_480 for s in sizes[:-2]) and counts[0] == 5


@pytest.mark.parametrize("compress,pattern", [("gz", "c-%03d.tar.gz"), (None, "c-{shard:03d}.tar.zst")])
def test_compressed_writing_round_trips(s3_bucket, compress, pattern):
    server, bucket = s3_bucket
    options = server.storage_options
    writer = write_samples(f"s3://{bucket}/{pattern}", 20, maxcount=8, compress=compress,
                           storage_options=options)
    fs = fsspec.filesystem("s3", **options)
    first = fs.cat_file(writer.urls[0])
    _, packed = decompressed([first], "u")
    assert packed and first[:2] in (b"\x1f\x8b", b"\x28\xb5")
    assert sorted(read_all(f"s3://{bucket}/", options)) == [f"k{n:05d}" for n in range(20)]
    assert "_streamdata.sdx" not in objects(fs, bucket)  # compressed shards: no offsets index


def test_close_raises_naming_the_url_when_the_bucket_does_not_exist(s3_server):
    writer = sd.ShardWriter("s3://no-such-bucket-sd/x-%03d.tar", storage_options=s3_server.storage_options,
                            index=False, retry_deadline=5)
    writer.write(make_sample(1))
    with pytest.raises(sd.ShardNotFoundError, match="s3://no-such-bucket-sd/x-000.tar"):
        writer.close()


def test_close_raises_on_refused_puts_and_retries_throttled_ones(s3_bucket):
    server, bucket = s3_bucket
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        proxy.add(Fault("status", status=503, match="put", times=3))
        with sd.ShardWriter(f"s3://{bucket}/ok-%03d.tar", maxcount=5, storage_options=options,
                            index=False, backoff=0.01) as writer:
            for n in range(12):
                writer.write(make_sample(n))
        assert writer.retried["throttled"] == 3 and len(writer.urls) == 3
        assert proxy.faults_injected  # the faults were met, and the shards still landed
        assert sorted(read_all(f"s3://{bucket}/", server.storage_options)) == [f"k{n:05d}" for n in range(12)]

        proxy.add(Fault("status", status=403, match="put", times=None,
                        body=s3_error_xml("AccessDenied", "Access Denied")))
        writer = sd.ShardWriter(f"s3://{bucket}/denied-%03d.tar", storage_options=options, index=False,
                                retry_deadline=5)
        writer.write(make_sample(0))
        with pytest.raises(sd.AccessDeniedError, match=f"s3://{bucket}/denied-000.tar"):
            writer.close()
        assert writer.retried["throttled"] == 0 and sum(writer.retried.values()) == 0  # no retry of a 403


CHILD = """
import json, sys, numpy as np, streamdata as sd
spec, options = sys.argv[1], json.loads(sys.argv[2])
rng = np.random.default_rng(0)
with sd.ShardWriter(spec, maxcount=4, storage_options=options, index=False, part_size=5 << 20,
                    concurrency=2, max_pending=2) as w:
    n = 0
    while True:  # until killed
        w.write({"__key__": f"k{n:06d}", "bin": rng.bytes(3 << 20), "cls": n})
        n += 1
"""


@pytest.mark.parametrize("where", [pytest.param("local", marks=pytest.mark.slow), "s3"])
def test_a_writer_killed_mid_shard_leaves_no_partial_shard(tmp_path, request, s3_server, where):
    """PUBLISH-WHOLE: a writer killed mid-upload leaves only whole shards under final names
    (the rest are temporary keys)."""
    if where == "s3":
        server, bucket = request.getfixturevalue("s3_bucket")
        options, spec = server.storage_options, f"s3://{bucket}/k/shard-%05d.tar"
        fs, root = fsspec.filesystem("s3", **options), f"{bucket}/k"
    else:
        options, spec = {}, str(tmp_path / "k" / "shard-%05d.tar")
        fs, root = fsspec.filesystem("file"), str(tmp_path / "k")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, spec, json.dumps(options)], env=env,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until 2 shards are in place, then mid-way into later ones
            if child.poll() is not None:
                pytest.fail(f"the writer exited: {child.stderr.read().decode()[-2000:]}")
            if fs.exists(root) and sum(n.endswith(".tar") for n in objects(fs, root)) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no shard published within 120 s")
        time.sleep(0.7)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stderr.close()
    names = objects(fs, root)
    final = sorted(n for n in names if n.endswith(".tar"))
    assert len(final) >= 2 and final == [f"shard-{i:05d}.tar" for i in range(len(final))]
    for name in final:  # every shard under a final name is whole: 4 samples and the end marker
        data = fs.cat_file(f"{root}/{name}")
        assert [s["cls"] for s in samples_from_chunks([data], name)] == [b"%d" % i for i in range(
            int(name[6:11]) * 4, int(name[6:11]) * 4 + 4)]
    assert all(n.endswith(".tmp") for n in names if n not in final), names


def test_read_keys_helper_sees_written_local_shards(tmp_path):
    write_samples(str(tmp_path / "w-%02d.tar"), 10, maxcount=3, index=False)
    assert sorted(read_keys(sd.TarDataset(str(tmp_path) + "/"), num_workers=2)) == [
        f"k{n:05d}" for n in range(10)]


def test_the_writers_index_equals_build_index(s3_bucket):
    from streamdata.catalog.index import build_index, read_index

    server, bucket = s3_bucket
    options = server.storage_options
    long_key = "d/" + "x" * 120  # a ustar name split into prefix and name
    with sd.ShardWriter(f"s3://{bucket}/idx/part-%03d.tar", maxcount=7, storage_options=options) as writer:
        for n in range(20):
            writer.write({**make_sample(n), "__key__": f"{long_key}{n:03d}" if n % 5 == 0 else f"k{n:05d}"})
    # without an index of its own, a writer still has its entries (one index for several writers)
    with sd.ShardWriter(f"s3://{bucket}/noidx/part-%03d.tar", maxcount=7, storage_options=options,
                        index=False) as silent:
        for n in range(20):
            silent.write({**make_sample(n), "__key__": f"{long_key}{n:03d}" if n % 5 == 0 else f"k{n:05d}"})
    assert read_index(f"s3://{bucket}/noidx/_streamdata.sdx", options) is None
    assert [e.samples for e in silent.entries] == [7, 7, 6]
    # a second writer into the same directory: its shards join the index
    with sd.ShardWriter(f"s3://{bucket}/idx/part-%03d.tar", maxcount=7, start_shard=3,
                        storage_options=options) as second:
        for n in range(20, 25):
            second.write(make_sample(n))
    ours = read_index(f"s3://{bucket}/idx/_streamdata.sdx", options)
    built = build_index(f"s3://{bucket}/idx/", options, output=f"s3://{bucket}/built.sdx", progress=False)
    theirs = read_index(built, options)
    assert [e.name for e in ours] == [f"part-{i:03d}.tar" for i in range(4)]
    assert [e.samples for e in ours] == [7, 7, 6, 5]
    for mine, silent_entry in zip(ours[:3], silent.entries, strict=True):  # the same offsets
        assert silent_entry.name.endswith(mine.name) and np.array_equal(mine.offsets, silent_entry.offsets)
    by_name = {e.name: e for e in theirs}
    for entry in ours:
        other = by_name[f"idx/{entry.name}"]  # the built index sits one directory up
        assert (entry.size, entry.etag, entry.samples) == (other.size, other.etag, other.samples)
        assert entry.etag and np.array_equal(entry.offsets, other.offsets), entry.name
    # the dataset finds the writer's index by itself and reads exact spans
    ds = sd.TarDataset(f"s3://{bucket}/idx/", storage_options=options, decode=False)
    assert ds.sample_counts().tolist() == [7, 7, 6, 5]
    assert len(read_keys(ds, num_workers=2)) == 25


@pytest.mark.slow
def test_write_blocks_while_max_pending_shards_wait(s3_bucket, capsys):
    """Bounded spool: with uploads slowed down (200 ms one-way), write() waits for a slot, so
    the spool never holds more than max_pending finished shards and the one being written."""
    from urllib.parse import urlsplit

    from benchmarks.proxy import LatencyProxy

    server, bucket = s3_bucket
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.2) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        writer = sd.ShardWriter(f"s3://{bucket}/slow-%03d.tar", maxcount=2, storage_options=options,
                                index=False, concurrency=1, max_pending=1, progress=True)
        spool, most = writer._uploader._spool, 0
        with writer:
            for n in range(12):
                writer.write(make_sample(n))
                most = max(most, len(os.listdir(spool)))
    assert len(writer.urls) == 6 and most == 2
    assert "shards uploaded" in capsys.readouterr().err  # the progress bar, asked for
    assert not os.path.exists(spool)  # removed at close


def test_table_writers_upload_in_the_background_and_name_a_missing_bucket(s3_server, tmp_path):
    import pyarrow as pa

    table = pa.table({"x": list(range(100))})
    # the first shard to fail (uploads run concurrently)
    with pytest.raises(sd.ShardNotFoundError, match=r"s3://no-such-bucket-sd/t-0000[0-2]\.parquet"):
        sd.write_parquet(table, "s3://no-such-bucket-sd/t-{shard:05d}.parquet", rows_per_shard=40,
                         storage_options=s3_server.storage_options)
    urls = sd.write_arrow(table, str(tmp_path / "a-{shard:02d}.arrow"), rows_per_shard=40)
    assert sorted(os.listdir(tmp_path)) == ["a-00.arrow", "a-01.arrow", "a-02.arrow"]  # no spool left
    assert len(urls) == 3


@pytest.mark.parametrize("publish", [None, "copy"])
def test_round_trip_over_gcs_with_the_index(gcs_bucket, publish):
    server, bucket = gcs_bucket
    options = server.storage_options
    write_samples(f"gs://{bucket}/g/part-%03d.tar", 10, maxcount=4, storage_options=options, publish=publish)
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    assert sorted(objects(fs, f"{bucket}/g")) == ["_streamdata.sdx", "part-000.tar", "part-001.tar",
                                                  "part-002.tar"]
    ds = sd.TarDataset(f"gs://{bucket}/g/", storage_options=options)
    assert ds.sample_counts().tolist() == [4, 4, 2]  # the writer's index, found and not stale
    assert sorted(read_all(f"gs://{bucket}/g/", options)) == [f"k{n:05d}" for n in range(10)]
