"""Arrow IPC files have exact epochs: each record batch's row count read from its message header
in the constructor (after the footer, rank 0 only), spans cut inside batches, equal steps on every
rank; IPC streams (no footer) and ``filter=`` fall back to the record-batch split."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import streamdata as sd
from streamdata.formats.arrow import coalesce as fmt_coalesce
from streamdata.formats.arrow import ipc_batch_meta_ranges, ipc_batch_rows
from tests.helpers import check_exact_epochs, rank_batches, rank_env

# rows per record batch, per file: uneven on purpose, an empty batch too
BATCHES = [[5, 1, 9], [3, 0], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32())])


def _ipc_bytes(batches: list[int], first_id: int, stream: bool = False) -> bytes:
    sink = pa.BufferOutputStream()
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, SCHEMA) as w:
        for n in batches:
            w.write_batch(pa.record_batch([pa.array(np.arange(first_id, first_id + n)),
                                           pa.array(np.ones(n, np.float32))], schema=SCHEMA))
            first_id += n
    return sink.getvalue().to_pybytes()


def _write(directory, batches=BATCHES) -> tuple[str, int]:
    ids = 0
    for i, sizes in enumerate(batches):
        (directory / f"part-{i}.arrow").write_bytes(_ipc_bytes(sizes, ids))
        ids += sum(sizes)
    return str(directory) + "/", ids


@pytest.fixture
def arrow_files(tmp_path):
    return _write(tmp_path)


def _meta_ranges(data: bytes) -> list[tuple[int, int]]:
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    return [r for r, _ in ipc_batch_meta_ranges(data[len(data) - 10 - footer_len:], "x", len(data))]


def test_counts_are_pyarrows_num_rows_per_batch(arrow_files):
    spec, total = arrow_files
    ds = sd.ArrowDataset(spec)
    counts = ds.sample_counts()
    assert counts is not None and counts.dtype == np.int64
    expected = []
    for unit in ds.units():
        with pa.ipc.open_file(unit.url) as f:
            expected.append(f.get_batch(unit.index).num_rows)
    assert counts.tolist() == expected == [n for sizes in BATCHES for n in sizes]
    assert int(counts.sum()) == total


def test_headers_far_apart_and_the_legacy_format_are_counted(tmp_path):
    """Batches of 24-40 KB put their headers in separate ranges of the file's one item; pre-1.0
    messages (no 0xFFFFFFFF marker) are read too."""
    big = [3000, 5000, 7, 4000]
    table = pa.table({"id": np.arange(sum(big)), "x": np.zeros(sum(big))})
    legacy = pa.ipc.IpcWriteOptions(use_legacy_format=True)
    for name, options in (("far.arrow", None), ("legacy.arrow", legacy)):
        with pa.ipc.new_file(tmp_path / name, table.schema, options=options) as w:
            start = 0
            for n in big:
                w.write_table(table.slice(start, n))
                start += n
    far = (tmp_path / "far.arrow").read_bytes()
    from streamdata.catalog.footers import _HEADER_GAP

    # 3 ranges in the file's one item: the 7-row batch's header shares one with the next
    assert len(fmt_coalesce(_meta_ranges(far), _HEADER_GAP)) == 3
    assert (tmp_path / "legacy.arrow").read_bytes()[8:12] != b"\xff\xff\xff\xff"  # no marker
    ds = sd.ArrowDataset(str(tmp_path) + "/", batch_size=1000)
    assert ds.sample_counts().tolist() == big + big
    assert sorted(i for b in ds for i in b["id"].tolist()) == sorted(list(range(sum(big))) * 2)


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (2, 2), (3, 1), (5, 0)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_arrow_epochs_are_exact_with_equal_steps(arrow_files, world_size, num_workers, drop_last):
    spec, total = arrow_files
    ds = sd.ArrowDataset(spec, batch_size=4, shuffle=True, seed=7, drop_last=drop_last)
    check_exact_epochs(ds, total, world_size, num_workers, drop_last, batch_size=4)


def test_spans_cut_record_batches(arrow_files):
    """Unshuffled, two readers get contiguous halves: the cut falls inside a record batch."""
    spec, total = arrow_files
    ds = sd.ArrowDataset(spec)
    per_rank = []
    for rank in range(2):
        with rank_env(rank, 2):
            per_rank.append([int(row["id"]) for row in ds])
    half = total // 2 + total % 2
    assert per_rank == [list(range(half)), list(range(half, total))]


def test_a_stream_object_means_no_counts_and_a_batch_split(tmp_path):
    """One IPC stream (no footer, rows unknown until read) and the whole dataset is split by
    unit, still exactly once; no batch header is fetched."""
    spec, total = _write(tmp_path)
    (tmp_path / "tail.arrows").write_bytes(_ipc_bytes([4, 2], total, stream=True))
    ds = sd.ArrowDataset(spec)
    assert ds.sample_counts() is None and ds._rows == {}
    ids = []
    for rank in range(2):
        with rank_env(rank, 2):
            ids += [int(row["id"]) for row in ds]
    assert sorted(ids) == list(range(total + 6))


def test_a_filter_means_no_counts(arrow_files):
    spec, total = arrow_files
    ds = sd.ArrowDataset(spec, filter=pc.field("id") < 10)
    assert ds.sample_counts() is None and ds._rows == {}  # no header fetched either
    assert sorted(int(r["id"]) for r in ds) == list(range(10))


def test_a_count_past_the_body_is_not_trusted(tmp_path):
    """A batch of null columns claims 100 000 rows in no body bytes: valid, but a corrupt header
    reads the same, so that dataset falls back to the batch split instead of planning on it."""
    nulls = pa.table({"n": pa.nulls(100_000)})
    with pa.ipc.new_file(tmp_path / "n.arrow", nulls.schema) as w:
        w.write_table(nulls)
    ds = sd.ArrowDataset(str(tmp_path / "n.arrow"), batch_size=50_000)
    assert ds.sample_counts() is None
    assert [len(b["n"]) for b in ds] == [50_000, 50_000]


def _corrupt_first_header(path, value: bytes, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    start, _ = _meta_ranges(bytes(data))[0]
    data[start + at:start + at + len(value)] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("what,value,at,match", [
    ("size past the block", struct.pack("<Ii", 0xFFFFFFFF, 1 << 20), 0, "message of 1048576 bytes"),
    ("negative size", struct.pack("<Ii", 0xFFFFFFFF, -8), 0, "message of -8 bytes"),
    ("root offset outside", struct.pack("<I", 1 << 30), 8, "outside"),
])
def test_a_corrupt_batch_header_is_a_format_error_naming_the_url(tmp_path, what, value, at, match):
    spec, _ = _write(tmp_path)
    bad = tmp_path / "part-3.arrow"
    _corrupt_first_header(bad, value, at)
    with pytest.raises(sd.FormatError, match=match) as info:
        sd.ArrowDataset(spec)
    assert info.value.url == str(bad) and "record batch 0 header" in str(info.value)
    ds = sd.ArrowDataset(spec, on_error="skip")  # skipped and counted, the others still exact
    assert ds.skipped["format"] == 1 and sum(ds.skipped.values()) == 1, ds.skipped
    assert all(u.url != str(bad) for u in ds.units())
    assert ds.sample_counts().tolist() == [n for i, s in enumerate(BATCHES) if i != 3 for n in s]


def _message_table(header: bytes) -> tuple[bytes, int]:
    """The Message flatbuffer of an encapsulated header, and its root table's position."""
    buf = header[8:8 + struct.unpack_from("<i", header, 4)[0]]
    return buf, struct.unpack_from("<I", buf, 0)[0]


def test_a_header_that_is_not_a_record_batch_or_points_before_its_start_is_refused():
    from streamdata.formats.arrow import _fb_field

    data = _ipc_bytes([5], 0)
    (a, b), = _meta_ranges(data)
    header = data[a:b]
    buf, table = _message_table(header)
    kind = 8 + _fb_field(buf, table, 1)  # header_type: 3, RecordBatch
    assert header[kind] == 3 and ipc_batch_rows(header, "u", 0) == 5
    dictionary = header[:kind] + b"\x02" + header[kind + 1:]
    with pytest.raises(sd.FormatError, match="not a record batch") as info:
        ipc_batch_rows(dictionary, "u", 0)
    assert info.value.url == "u"
    # a vtable offset that points 2 bytes before the buffer (struct would read from its end)
    before = header[:8 + table] + struct.pack("<i", table + 2) + header[8 + table + 4:]
    with pytest.raises(sd.FormatError, match="offset -2 is outside"):
        ipc_batch_rows(before, "u", 0)


def test_ipc_batch_rows_reads_every_header_and_rejects_each_mutation_with_our_error():
    """Every single-byte change and every truncation of a real header: an int or a FormatError."""
    data = _ipc_bytes([5, 1, 9], 0)
    ranges = _meta_ranges(data)
    assert [ipc_batch_rows(data[a:b], "u", k) for k, (a, b) in enumerate(ranges)] == [5, 1, 9]
    a, b = ranges[2]
    header = data[a:b]
    errors = 0
    for i in range(len(header)):
        for value in (0, 1, 0x7F, 0xFF, header[i] ^ 0x10):
            mutated = header[:i] + bytes([value]) + header[i + 1:]
            try:
                assert isinstance(ipc_batch_rows(mutated, "u", 2), int)
            except sd.FormatError as exc:
                assert exc.url == "u"
                errors += 1
    for cut in range(len(header)):
        try:
            ipc_batch_rows(header[:cut], "u", 2)
        except sd.FormatError:
            errors += 1
    assert errors > len(header)


@pytest.mark.s3
def test_over_s3_the_constructor_makes_one_footer_and_one_header_read_per_file(s3_bucket):
    import s3fs

    from benchmarks.faults import FaultProxy

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    ids = 0
    for i, sizes in enumerate(BATCHES):
        fs.pipe_file(f"{bucket}/ipc/part-{i}.arrow", _ipc_bytes(sizes, ids))
        ids += sum(sizes)
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        ds = sd.ArrowDataset(f"s3://{bucket}/ipc/", storage_options=options, batch_size=4,
                             shuffle=True)
        made = dict(proxy.requests)
        assert made.get("get") == 2 * len(BATCHES), made  # a tail, then the batch headers
        assert set(made) <= {"list", "get"} and made.get("list", 0) <= 1, made
        assert ds.sample_counts().tolist() == [n for sizes in BATCHES for n in sizes]
        per_rank = [rank_batches(ds, r, 2, 0) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(ids))
