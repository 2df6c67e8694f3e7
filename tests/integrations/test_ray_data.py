"""Ray Data (streamdata.integrations.ray), on a local Ray (2 CPUs) and the S3 test server: a
Dataset of images (uint8 arrays) and labels written as tar shards with one sample index (each
write task its own shards, the index written once after them), read back through streamdata
and through the datasource (split across read tasks, exactly), identical; the same as Parquet;
and Ray's own read_webdataset over the folder as it is (no file filter), the index beside the
shards. Slow suite: Ray starts a cluster of processes."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

import streamdata as sd
from tests.helpers import doc_blocks

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "frameworks.md"
ROWS = 61  # over 4 blocks, shards of at most 8 samples: uneven everywhere


def _image(i: int) -> np.ndarray:
    return (np.arange(4 * 5 * 3, dtype=np.uint16).reshape(4, 5, 3) * (i + 1) % 256).astype(np.uint8)


@pytest.fixture
def ray_local():  # started and shut down per test: its worker processes go with it
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _doc_block() -> str:
    return doc_blocks(DOC, "## Ray Data: preparing shards on a cluster, reading them back")[0]


def test_a_dataset_written_as_shards_reads_back_the_same_through_streamdata_and_ray(ray_local, s3_bucket):
    """docs/frameworks.md's Ray Data block, run with its bucket pointed at the test server."""
    ray = ray_local
    from streamdata.integrations.ray import ShardsDatasource

    server, bucket = s3_bucket
    options = server.storage_options
    code = _doc_block().replace("s3://bkt/train", f"s3://{bucket}/images")
    recipe = {"image": _image, "label": lambda i: i % 7, "n": ROWS, "options": options}
    exec(compile(code, "docs/frameworks.md (Ray Data)", "exec"), recipe)
    rows = [{"__key__": f"img{i:06d}", "npy": _image(i), "cls": i % 7} for i in range(ROWS)]

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/images"))
    tasks = {n.split("-")[1] for n in names if n.endswith(".tar")}
    assert len(tasks) == 4 and names[0] == "_streamdata.sdx"  # each block its own shards; one index
    assert not [n for n in names if not (n.endswith(".tar") or n == "_streamdata.sdx")]  # nothing partial
    assert sum(1 for n in names if n.endswith(".tar")) > 4  # maxcount=8: several shards per task

    ds = recipe["train"]
    assert ds.sample_counts() is not None and int(ds.sample_counts().sum()) == ROWS  # exact: the index
    expected = {r["__key__"]: r for r in rows}
    read = list(ds)
    assert sorted(s["__key__"] for s in read) == sorted(expected)
    for s in read:
        assert np.array_equal(s["npy"], expected[s["__key__"]]["npy"]) and s["npy"].dtype == np.uint8
        assert s["cls"] == expected[s["__key__"]]["cls"]

    split = ray.data.read_datasource(ShardsDatasource(ds, rows_per_block=5), override_num_blocks=3)
    for back in (recipe["rows"].take_all(), split.take_all()):  # Ray's number of read tasks; 3
        keys = collections.Counter(r["__key__"] for r in back)
        assert max(keys.values()) == 1 and sorted(keys) == sorted(expected)  # every row once
        for r in back:
            want = expected[r["__key__"]]
            assert np.array_equal(r["npy"], want["npy"]) and r["cls"] == want["cls"]
    assert len(ShardsDatasource(ds).get_read_tasks(3)) == 3

    # Ray's own reader over the folder as it is, no file filter: it skips the "_"-named index
    webdataset = ray.data.read_webdataset(f"s3://{bucket}/images/", filesystem=_arrow_s3(server)).take_all()
    assert sorted(r["__key__"] for r in webdataset) == sorted(expected)


def test_a_dataset_written_as_parquet_shards_reads_back_the_same(ray_local, s3_bucket):
    ray = ray_local
    from streamdata.integrations.ray import ShardsDatasink, ShardsDatasource

    server, bucket = s3_bucket
    options = server.storage_options
    rows = [{"id": i, "label": i % 7, "image": _image(i).tobytes()} for i in range(ROWS)]
    sink = ShardsDatasink(f"s3://{bucket}/tables", format="parquet", storage_options=options)
    ray.data.from_items(rows, override_num_blocks=4).write_datasink(sink)
    assert len(sink.urls) == 4 and all(u.endswith(".parquet") for u in sink.urls)
    ds = sd.ParquetDataset(f"s3://{bucket}/tables/", storage_options=options)
    assert ds.num_rows == ROWS
    back = ray.data.read_datasource(ShardsDatasource(ds), override_num_blocks=3).take_all()
    assert sorted((r["id"], r["label"], bytes(r["image"])) for r in back) == \
        sorted((r["id"], r["label"], r["image"]) for r in rows)


def test_the_datasource_refuses_a_batched_dataset(tmp_path):
    pytest.importorskip("ray")
    import fsspec

    from streamdata.integrations.ray import ShardsDatasource
    from tests.helpers import write_shards

    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[3, 2])
    with pytest.raises(sd.SpecError, match="without batch_size"):
        ShardsDatasource(sd.TarDataset(str(tmp_path) + "/", batch_size=2))


def _arrow_s3(server):
    from urllib.parse import urlsplit

    import pyarrow.fs

    endpoint = urlsplit(server.endpoint_url)
    return pyarrow.fs.S3FileSystem(access_key=server.key, secret_key=server.secret, region=server.region,
                                   endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
