"""Parquet and Arrow IPC: exactly-once over row groups, projection on the wire, tensors, errors."""

from __future__ import annotations

import collections
import gc
import os
import threading
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from streamdata.batch.tables import TensorOptions, rebatch, shuffle_rows, to_rows, to_tensors
from streamdata.datasets.parquet import ArrowDataset, ParquetDataset
from streamdata.errors import DecodeError, FormatError, SpecError
from streamdata.formats.arrow import coalesce
from streamdata.write.tables import write_arrow, write_parquet
from tests.helpers import rank_env

ROWS = [700, 100, 1300, 0, 450]  # rows per file: 7, 1, 13, 0 and 5 row groups of 100


def _ids_table(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table({"id": ids, "x": ids.astype(np.float32) / 2,
                     "tag": pa.array([f"t{i % 3}" for i in ids]).dictionary_encode()})


def _read_ids(ds, num_workers: int, rank: int, world_size: int) -> list[int]:
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=num_workers, timeout=60 if num_workers else 0,
            multiprocessing_context="fork" if num_workers else None)
        return [i for batch in loader for i in batch["id"].tolist()]


@pytest.fixture(scope="module")
def s3_files(s3_server):
    """Parquet files with different row-group counts, IPC files and streams, in one bucket."""
    server = s3_server
    bucket = f"sd-arrow-{uuid.uuid4().hex[:10]}"
    server.create_bucket(bucket)
    opts = server.storage_options
    start, parquet, ipc = 0, [], []
    for i, n in enumerate(ROWS):
        parquet += write_parquet(_ids_table(start, n), f"s3://{bucket}/pq/part-{i}.parquet",
                                 row_group_size=100, storage_options=opts)
        start += n
    total = start
    for i, n in enumerate([300, 250]):
        ipc += write_arrow(_ids_table(start, n), f"s3://{bucket}/ipc/f-{i}.arrow", batch_size=64,
                           storage_options=opts)
        start += n
    ipc += write_arrow(_ids_table(start, 170), f"s3://{bucket}/ipc/s-0.arrows", batch_size=50,
                       stream=True, storage_options=opts)
    return server, bucket, parquet, list(range(total)), ipc, list(range(total, start + 170))


# ---- splitting ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_parquet(s3_files):
    server, bucket, _, expected, _, _ = s3_files
    ds = ParquetDataset(f"s3://{bucket}/pq/", ["id"], batch_size=64, shuffle=True, seed=3,
                        storage_options=server.storage_options)
    return ds, expected


@pytest.mark.s3
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_parquet_rows_exactly_once_over_row_groups(s3_parquet, world_size, num_workers):
    ds, expected = s3_parquet
    assert len(ds.units()) == 7 + 1 + 13 + 5 and ds.num_rows == len(expected)
    ds.set_epoch(2)
    got = [i for rank in range(world_size) for i in _read_ids(ds, num_workers, rank, world_size)]
    dupes = [i for i, c in collections.Counter(got).items() if c > 1]
    assert not dupes and sorted(got) == expected


@pytest.mark.s3
def test_units_spread_evenly_when_files_are_few(s3_files):
    from streamdata.epoch.sharding import assign
    from streamdata.epoch.world import World

    server, bucket, urls, _, _, _ = s3_files
    ds = ParquetDataset(urls[:3], storage_options=server.storage_options)  # 3 files, 21 row groups
    shares = [len(assign(ds.units(), World(r, 2, w, 4))) for r in range(2) for w in range(4)]
    assert sum(shares) == 21 and max(shares) - min(shares) <= 1


@pytest.mark.s3
def test_arrow_ipc_file_batches_and_streams_exactly_once(s3_files):
    server, bucket, _, _, _, expected = s3_files
    ds = ArrowDataset(f"s3://{bucket}/ipc/", batch_size=40, shuffle=True,
                      storage_options=server.storage_options)
    assert len(ds.units()) == 5 + 4 + 1  # record batches of the two files, the stream whole
    got = [i for rank in range(2) for i in _read_ids(ds, 2, rank, 2)]
    assert sorted(got) == expected


# ---- projection: bytes on the wire ----------------------------------------------------------


def _chunk_ranges(path_in_s3: str, fs) -> dict[str, list[tuple[int, int]]]:
    """Independently computed byte ranges of each column's chunks, by column name."""
    meta = pq.ParquetFile(fs.open(path_in_s3)).metadata
    out = collections.defaultdict(list)
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            cc = meta.row_group(g).column(c)
            start = min(o for o in (cc.dictionary_page_offset, cc.data_page_offset) if o)
            out[cc.path_in_schema].append((start, start + cc.total_compressed_size))
    return out


@pytest.mark.s3
def test_projection_requests_only_the_asked_column_chunks(s3_bucket, monkeypatch):
    from urllib.parse import urlsplit

    import s3fs

    from benchmarks.proxy import LatencyProxy
    from streamdata.store.client import AsyncClient

    s3_server, bucket = s3_bucket
    n = 4000
    rng = np.random.default_rng(0)
    table = pa.table({f"c{i}": rng.random(n) for i in range(8)})
    url, = write_parquet(table, f"s3://{bucket}/p.parquet", row_group_size=1000, compression=None,
                         storage_options=s3_server.storage_options)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    chunks = _chunk_ranges(f"{bucket}/p.parquet", fs)

    requested: list[tuple[int, int]] = []
    real_get = AsyncClient.get

    async def spy(self, url, start=0, end=None, **kw):
        requested.append((start, end))
        return await real_get(self, url, start, end, **kw)

    monkeypatch.setattr(AsyncClient, "get", spy)
    ds = ParquetDataset(url, ["c2", "c3"], batch_size=1000, storage_options=s3_server.storage_options)
    requested.clear()  # footers are read in __init__; count the epoch alone
    batches = list(ds)
    assert torch.equal(torch.cat([b["c3"] for b in batches]), torch.from_numpy(table["c3"].to_numpy()))
    assert set(batches[0]) == {"c2", "c3"}
    # each row group's two adjacent chunks arrive as one coalesced range, nothing else is asked for
    wanted = sorted(coalesce(chunks["c2"] + chunks["c3"]))
    assert sorted(requested) == wanted and len(wanted) == 4
    for name, ranges in chunks.items():
        if name not in ("c2", "c3"):
            assert not any(s < re and rs < e for s, e in requested for rs, re in ranges), name

    # and at a counting proxy: 2 of 8 columns move about a quarter of the bytes
    monkeypatch.setattr(AsyncClient, "get", real_get)
    up = urlsplit(s3_server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.0) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url_for(s3_server.endpoint_url)}
        moved = {}
        for cols in (None, ["c2", "c3"]):
            ds = ParquetDataset(url, cols, batch_size=1000, storage_options=options)
            proxy.reset_counters()
            assert sum(len(b["c2"]) for b in ds) == n
            moved[cols is None] = proxy.bytes_down
    assert moved[False] <= 0.35 * moved[True]


@pytest.mark.s3
def test_filter_fetches_its_column_and_drops_it(s3_files):
    server, bucket, urls, _, _, _ = s3_files
    ds = ParquetDataset(urls[:2], ["x"], batch_size=1000, filter=pc.field("id") >= 650,
                        storage_options=server.storage_options)
    batch, = list(ds)
    assert set(batch) == {"x"}
    assert batch["x"].tolist() == [i / 2 for i in range(650, 800)]
    with pytest.raises(SpecError, match="nope"):
        ParquetDataset(urls[0], filter=pc.field("nope") > 0, storage_options=server.storage_options)


# ---- tensors --------------------------------------------------------------------------------


def _rich_table(n: int = 23) -> tuple[pa.Table, dict]:
    """A table of every mapped type, and the tensors/lists it must become."""
    i = np.arange(n)
    ragged = [list(range(k % 4)) for k in i]
    pairs = [[[k, -k]] * (k % 3) for k in i]
    floats = [None if k % 5 == 0 else k / 4 for k in i]
    table = pa.table({
        "i32": pa.array(i, pa.int32()),
        "u8": pa.array(i % 250, pa.uint8()),
        "f16": pa.array(i / 8, pa.float16()),
        "flag": pa.array(i % 2 == 0),
        "f": pa.array(floats, pa.float64()),
        "when": pa.array(i * 1000, pa.timestamp("ms")),
        "word": pa.array([f"w{k % 4}" for k in i]).dictionary_encode(),
        "code": pa.array((i % 3).astype(np.int64)).dictionary_encode(),
        "blob": pa.array([bytes([k]) * (k % 3) for k in i], pa.binary()),
        "vec": pa.FixedSizeListArray.from_arrays(
            pa.array((i[:, None] * [1, 10, 100]).ravel(), pa.int64()), 3),
        "seq": pa.array(ragged, pa.list_(pa.int16())),
        "pts": pa.array(pairs, pa.list_(pa.list_(pa.float32(), 2))),
        "deep": pa.array([[[k]] * (k % 2) for k in i], pa.list_(pa.list_(pa.int64()))),
        "rec": pa.array([{"a": int(k), "b": f"b{k}"} for k in i]),
    })
    longest = 3
    seq = np.zeros((n, longest), np.int16)
    for k, row in enumerate(ragged):
        seq[k, :len(row)] = row
    pts = np.zeros((n, 2, 2), np.float32)
    for k, row in enumerate(pairs):
        pts[k, :len(row)] = np.array(row, np.float32).reshape(-1, 2)
    expected = {
        "i32": torch.arange(n, dtype=torch.int32), "u8": torch.arange(n, dtype=torch.uint8),
        "f16": torch.from_numpy((i / 8).astype(np.float16)), "flag": torch.from_numpy(i % 2 == 0),
        "f": torch.tensor([float("nan") if v is None else v for v in floats], dtype=torch.float64),
        "when": torch.from_numpy(i * 1000), "word": [f"w{k % 4}" for k in i],
        "code": torch.from_numpy(i % 3), "blob": [bytes([k]) * (k % 3) for k in i],
        "vec": torch.from_numpy(i[:, None] * np.array([1, 10, 100])),
        "seq": torch.from_numpy(seq), "seq_lengths": torch.from_numpy(i % 4),
        "pts": torch.from_numpy(pts), "pts_lengths": torch.from_numpy(i % 3),
        "deep": [[[k]] * (k % 2) for k in i],
        "rec.a": torch.from_numpy(i), "rec.b": [f"b{k}" for k in i],
    }
    return table, expected


def _assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert isinstance(got[key], torch.Tensor) and got[key].dtype == want.dtype, key
            assert torch.equal(got[key].nan_to_num(-1), want.nan_to_num(-1)), key
        else:
            assert got[key] == want, key


def test_tensor_mapping_of_every_type():
    table, expected = _rich_table()
    _assert_same(to_tensors(table), expected)
    offsets = to_tensors(table, TensorOptions(lists="offsets"))
    assert offsets["seq"].tolist() == [v for k in range(23) for v in range(k % 4)]
    assert offsets["seq_offsets"].tolist() == np.concatenate([[0], np.cumsum(np.arange(23) % 4)]).tolist()
    row = list(to_rows(table))[7]
    assert row["seq"].tolist() == [0, 1, 2] and row["word"] == "w3" and row["vec"].tolist() == [7, 70, 700]


def test_numeric_columns_are_zero_copy():
    values = np.arange(1000, dtype=np.float32)
    table = pa.table({"x": values})
    got = to_tensors(table.slice(10, 100))["x"]
    assert got.data_ptr() == table["x"].chunk(0).buffers()[1].address + 10 * 4


def test_integer_nulls_need_a_fill_value():
    table = pa.table({"n": pa.array([1, None, 3], pa.int64())})
    with pytest.raises(DecodeError, match="fill_null"):
        to_tensors(table)
    assert to_tensors(table, TensorOptions(fill_null={"n": -1}))["n"].tolist() == [1, -1, 3]


def test_unconvertible_batches_follow_on_error(tmp_path):
    table = pa.table({"n": pa.array([1, 2, None, 4, 5, 6], pa.int64())})
    url, = write_parquet(table, str(tmp_path / "n.parquet"), row_group_size=3)
    with pytest.raises(DecodeError, match="'n' has 1 nulls"):
        list(ParquetDataset(url, batch_size=3))
    assert [b["n"].tolist() for b in ParquetDataset(url, batch_size=3, on_error="skip")] == [[4, 5, 6]]
    assert [b["n"].tolist() for b in ParquetDataset(url, batch_size=3, fill_null=0)] == [[1, 2, 0], [4, 5, 6]]


def test_a_filter_that_fails_on_rows_is_a_decode_error_under_the_policy(tmp_path):
    table = pa.table({"n": pa.array([1, 2, 3, 4, 0, 6], pa.int64())})
    url, = write_parquet(table, str(tmp_path / "f.parquet"), row_group_size=3)
    risky = pc.divide(pc.scalar(12), pc.field("n")) > 3  # binds, then divides by zero in group 2
    with pytest.raises(DecodeError, match="filter") as info:
        list(ParquetDataset(url, batch_size=2, filter=risky))
    assert info.value.url == url and info.value.key == "filter"
    ds = ParquetDataset(url, batch_size=2, filter=risky, on_error="skip")
    assert [b["n"].tolist() for b in ds] == [[1, 2], [3]] and ds.skipped["decode"] == 1


@pytest.mark.parametrize("kind", ["parquet", "arrow-file", "arrow-stream"])
def test_objects_round_trip_to_expected_tensors(tmp_path, kind):
    table, expected = _rich_table()
    pattern = str(tmp_path / "t-{shard}")
    if kind == "parquet":
        urls = write_parquet(table, pattern + ".parquet", rows_per_shard=10, row_group_size=4)
        ds = ParquetDataset(urls, batch_size=23)
    else:
        urls = write_arrow(table, pattern + ".arrow", rows_per_shard=10, batch_size=4,
                           stream=kind == "arrow-stream", compression="zstd")
        ds = ArrowDataset(urls, batch_size=23)
    assert len(urls) == 3
    batch, = list(ds)
    _assert_same(batch, expected)


def test_user_decoder_per_value(tmp_path):
    table = pa.table({"img": [np.full(4, k, np.uint8).tobytes() for k in range(6)], "k": range(6)})
    url, = write_parquet(table, str(tmp_path / "d.parquet"))
    ds = ParquetDataset(url, batch_size=6,
                        decoders={"img": lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)})
    batch, = list(ds)
    assert batch["img"].shape == (6, 4) and batch["img"][:, 0].tolist() == list(range(6))


# ---- batching stages ------------------------------------------------------------------------


def test_rebatch_across_boundaries_and_row_shuffle():
    tables = [_ids_table(0, 7), _ids_table(7, 0), _ids_table(7, 12), _ids_table(19, 3)]
    sizes = [t.num_rows for t in rebatch(iter(tables), 5)]
    assert sizes == [5, 5, 5, 5, 2] and [t.num_rows for t in rebatch(iter(tables), 5, True)] == [5] * 4
    ids = [t["id"].to_pylist() for t in rebatch(iter(tables), 5)]
    assert sum(ids, []) == list(range(22))

    def shuffled(seed):
        out = shuffle_rows(iter(tables), 8, np.random.default_rng(seed))
        return sum((t["id"].to_pylist() for t in out), [])

    assert sorted(shuffled(1)) == list(range(22)) and shuffled(1) == shuffled(1) != shuffled(2)
    assert shuffled(1) != list(range(22))


def test_batches_and_shuffle_through_the_dataset(tmp_path):
    urls = write_parquet((_ids_table(k * 37, 37) for k in range(4)), str(tmp_path / "b-{shard}.parquet"),
                         rows_per_shard=50, row_group_size=16)
    ds = ParquetDataset(urls, batch_size=32, shuffle=True, shuffle_buffer=40, drop_last=True)
    ds.set_epoch(1)
    first = [b["id"].tolist() for b in ds]
    assert all(len(b) == 32 for b in first) and len(first) == 148 // 32
    ds.set_epoch(1)
    assert [b["id"].tolist() for b in ds] == first
    ds.set_epoch(2)
    assert [b["id"].tolist() for b in ds] != first


# ---- writers --------------------------------------------------------------------------------


def test_writer_cuts_shards_and_exact_row_groups(tmp_path):
    batches = (_ids_table(k * 33, 33).to_batches()[0] for k in range(10))  # 330 rows, odd chunks
    urls = write_parquet(batches, str(tmp_path / "w-{shard:02d}.parquet"), rows_per_shard=150,
                         row_group_size=40)
    assert [os.path.basename(u) for u in urls] == ["w-00.parquet", "w-01.parquet", "w-02.parquet"]
    groups = [[pq.read_metadata(u).row_group(g).num_rows for g in range(pq.read_metadata(u).num_row_groups)]
              for u in urls]
    assert groups == [[40, 40, 40, 30], [40, 40, 40, 30], [30]]
    with pytest.raises(SpecError, match="shard"):
        write_parquet(_ids_table(0, 5), str(tmp_path / "fixed.parquet"), rows_per_shard=2)


# ---- corrupt and truncated objects ----------------------------------------------------------


def _corrupt_row_group(path: str, group: int) -> None:
    meta = pq.read_metadata(path)
    cc = meta.row_group(group).column(0)
    data = bytearray(open(path, "rb").read())
    at = cc.data_page_offset + cc.total_compressed_size - 8  # inside the page's compressed data
    data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    open(path, "wb").write(bytes(data))


def test_corrupt_row_group_names_url_and_group_or_is_skipped(tmp_path):
    url, = write_parquet(_ids_table(0, 300), str(tmp_path / "bad.parquet"), row_group_size=100)
    _corrupt_row_group(url, 1)
    with pytest.raises(FormatError) as info:
        list(ParquetDataset(url, batch_size=50))
    assert url in str(info.value) and "row group 1" in str(info.value) and info.value.key == "row group 1"
    ids = [i for b in ParquetDataset(url, batch_size=50, on_error="skip") for i in b["id"].tolist()]
    assert ids == list(range(100)) + list(range(200, 300))


@pytest.mark.slow
def test_error_crosses_a_worker_with_its_url(tmp_path):
    url, = write_parquet(_ids_table(0, 200), str(tmp_path / "bad.parquet"), row_group_size=100)
    _corrupt_row_group(url, 0)
    loader = torch.utils.data.DataLoader(ParquetDataset(url, batch_size=50), batch_size=None,
                                         num_workers=1, multiprocessing_context="fork", timeout=60)
    caught = None
    try:
        list(loader)
    except Exception as exc:  # keep only type and text: the traceback would pin the worker
        caught = (type(exc), str(exc))
    gc.collect()  # the dropped iterator shuts its worker down
    assert caught is not None and caught[0] is FormatError
    assert url in caught[1] and "row group 0" in caught[1] and "worker 0/1" in caught[1]


def test_truncated_objects_raise_format_error_naming_the_url(tmp_path):
    url, = write_parquet(_ids_table(0, 300), str(tmp_path / "cut.parquet"), row_group_size=100)
    data = open(url, "rb").read()
    open(url, "wb").write(data[:-20])
    with pytest.raises(FormatError, match="cut.parquet"):
        ParquetDataset(url)
    good, = write_parquet(_ids_table(0, 10), str(tmp_path / "good.parquet"))
    assert ParquetDataset([url, good], on_error="skip").num_rows == 10

    stream, = write_arrow(_ids_table(0, 300), str(tmp_path / "cut.arrows"), batch_size=100, stream=True)
    data = open(stream, "rb").read()
    open(stream, "wb").write(data[: len(data) // 2])
    with pytest.raises(FormatError, match="cut.arrows"):
        list(ArrowDataset(stream, batch_size=100))

    file, = write_arrow(_ids_table(0, 300), str(tmp_path / "cut.arrow"), batch_size=100)
    data = open(file, "rb").read()
    open(file, "wb").write(data[:-100])
    with pytest.raises(FormatError, match="cut.arrow .*truncated"):
        list(ArrowDataset(file, batch_size=100))


def test_unknown_column_is_a_spec_error_at_construction(tmp_path):
    url, = write_parquet(_ids_table(0, 10), str(tmp_path / "c.parquet"))
    with pytest.raises(SpecError, match="'nope'.*id, tag, x"):
        ParquetDataset(url, ["nope"])


def test_no_thread_left_behind(tmp_path):
    url, = write_parquet(_ids_table(0, 100), str(tmp_path / "t.parquet"), row_group_size=10)
    it = iter(ParquetDataset(url, batch_size=7))
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("streamdata")]


def test_a_truncated_ipc_file_is_named_whatever_the_first_piece_size():
    """S3 parts reach the reader as the chunks they arrived in, which can be a few bytes:
    an IPC *file* without its footer is still recognised from its first bytes."""
    from streamdata.errors import FormatError
    from streamdata.formats.arrow import ipc_stream_batches

    sink = pa.BufferOutputStream()
    table = pa.table({"x": list(range(10))})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    truncated = sink.getvalue().to_pybytes()[:-40]
    for split in (1, 2, 5, len(truncated)):
        pieces = [truncated[i:i + split] for i in range(0, len(truncated), split)]
        with pytest.raises(FormatError, match="starts as an Arrow IPC file"):
            list(ipc_stream_batches(pieces, "s3://b/t.arrow"))
