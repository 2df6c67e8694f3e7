"""Exact epochs wired into the pass (EQUAL-STEPS): every rank the same number of batches, every
sample once (or, with drop_last, full batches and a counted left-out), over simulated ranks x
real DataLoader workers. The real torchrun jobs are in test_ddp.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamdata as sd
from tests.helpers import check_exact_epochs, rank_batches, rank_env

# rows per row group, per file: uneven on purpose (5, 1, 9, 3, 0, 7, 2 and more)
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows


@pytest.fixture
def parquet_files(tmp_path):
    ids = 0
    for i, groups in enumerate(ROW_GROUPS):
        path = tmp_path / f"part-{i}.parquet"
        with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("x", pa.float32())])) as w:
            for n in groups:
                w.write_table(pa.table({"id": np.arange(ids, ids + n), "x": np.ones(n, np.float32)}))
                ids += n
    for i, groups in enumerate(ROW_GROUPS):  # the files really have those row groups
        assert [pq.ParquetFile(tmp_path / f"part-{i}.parquet").metadata.row_group(g).num_rows
                for g in range(len(groups))] == groups
    return str(tmp_path) + "/", ids


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (2, 2), (3, 1), (3, 2), (5, 0)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_parquet_epochs_are_exact_with_equal_steps(parquet_files, world_size, num_workers, drop_last):
    spec, total = parquet_files
    ds = sd.ParquetDataset(spec, batch_size=4, shuffle=True, seed=7, drop_last=drop_last)
    check_exact_epochs(ds, total, world_size, num_workers, drop_last, batch_size=4)


def test_parquet_span_cuts_row_groups_and_reads_each_once(parquet_files):
    """Spans start and end inside row groups: two readers share a row group, each reads its rows."""
    spec, total = parquet_files
    ds = sd.ParquetDataset(spec, batch_size=None)
    per_rank = []
    for rank in range(2):
        with rank_env(rank, 2):
            per_rank.append([int(row["id"]) for row in ds])
    assert per_rank[0] == list(range(total // 2 + total % 2))  # unshuffled: contiguous halves
    assert per_rank[1] == list(range(total // 2 + total % 2, total))


def test_parquet_with_filter_falls_back_to_row_groups(parquet_files):
    """A filter makes row counts unknowable before reading: the pass splits row groups whole."""
    import pyarrow.compute as pc

    spec, total = parquet_files
    ds = sd.ParquetDataset(spec, batch_size=None, filter=pc.field("id") < total // 2)
    assert ds.sample_counts() is None
    ids = []
    for rank in range(2):
        with rank_env(rank, 2):
            ids += [int(row["id"]) for row in ds]
    assert sorted(ids) == list(range(total // 2))


def test_loader_batches_in_workers_with_the_plan(parquet_files, tmp_path):
    """sd.loader's in-worker batching asks the dataset for the plan's batch sizes."""
    from streamdata.feed.loader import _BatchedInWorkers

    calls = []

    class Spy(sd.ParquetDataset):
        def iter_batches(self, batch_size, **kw):
            calls.append(batch_size)
            return super().iter_batches(batch_size, **kw)

    spec, total = parquet_files
    ds = Spy(spec, batch_size=None)
    wrapped = _BatchedInWorkers(ds, 5, False, 2)
    got = [b for b in wrapped]
    assert calls == [5]
    assert sum(len(b["id"]) for b in got) == total


# ---- tar shards with a sample index -------------------------------------------------------

TAR_CASES = {  # three cases: uneven, random 10-200, 17 equal shards (not a multiple of 4)
    "uneven": [5, 1, 9, 3, 0, 7, 2],
    "random": [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77, 61, 42],
    "equal17": [64] * 17,
}


@pytest.fixture(params=sorted(TAR_CASES))
def indexed_tars(request, tmp_path):
    from streamdata.catalog.index import build_index
    from tests.helpers import make_samples, tar_bytes

    keys = []
    for i, samples in enumerate(make_samples(TAR_CASES[request.param], floats=4)):
        (tmp_path / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
        keys += [s["__key__"] for s in samples]
    build_index(str(tmp_path) + "/", progress=False)
    return str(tmp_path) + "/", keys


@pytest.mark.parametrize("world_size,num_workers",
                         [(2, 2), pytest.param(3, 1, marks=pytest.mark.slow), (4, 0)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_tar_epochs_with_an_index_are_exact(indexed_tars, world_size, num_workers, drop_last):
    spec, keys = indexed_tars
    ds = sd.TarDataset(spec, batch_size=8, shuffle=True, seed=3, drop_last=drop_last, decode=False)
    assert ds.sample_counts() is not None and int(ds.sample_counts().sum()) == len(keys)
    for epoch in range(2):
        ds.set_epoch(epoch)
        per_rank = [rank_batches(ds, r, world_size, num_workers, "__key__") for r in range(world_size)]
        steps = [len(b) for b in per_rank]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        got = [k for batches in per_rank for b in batches for k in b]
        assert len(got) == len(set(got)), "a sample delivered twice"
        if drop_last:
            assert all(len(b) == 8 for batches in per_rank for b in batches)
            assert len(keys) - len(got) < world_size * max(num_workers, 1) * 8
        else:
            assert sorted(got) == sorted(keys)


def test_tar_spans_read_only_their_bytes(indexed_tars):
    """Readers fetch byte ranges from the index's offsets: over all readers of an epoch, the
    bytes requested are the dataset's bytes once (no shard fetched whole by two readers)."""
    spec, keys = indexed_tars
    ds = sd.TarDataset(spec, batch_size=8, shuffle=True, decode=False)
    total = sum(s.size for s in ds.shards)
    requested = 0
    for rank in range(3):
        with rank_env(rank, 3):
            p = ds.reader_pass(8)
        for unit, part in p.reads:
            item = ds.fetch_item(unit) if part is None else ds.fetch_segment(unit, *part)
            requested += sum((end if end is not None else item.size) - start
                             for start, end in item.ranges or ((0, item.size),))
    # every shard's bytes once; the tar headers of empty shards and end markers included
    assert requested <= total


def test_a_stale_index_is_refused_at_construction(tmp_path):
    from streamdata.catalog.index import build_index
    from tests.helpers import make_samples, tar_bytes

    shards = make_samples([3, 4], floats=4)
    for i, samples in enumerate(shards):
        (tmp_path / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
    build_index(str(tmp_path) + "/", progress=False)
    (tmp_path / "shard-001.tar").write_bytes(tar_bytes(shards[1][:2]))  # rewritten: smaller
    with pytest.raises(sd.SpecError, match="shard-001.tar") as info:
        sd.TarDataset(str(tmp_path) + "/")
    assert "streamdata index" in str(info.value)
    assert sd.TarDataset(str(tmp_path) + "/", index=None).sample_counts() is None


def test_without_an_index_a_multi_rank_job_is_told_how_to_get_exact_epochs(tmp_path, caplog):
    from tests.helpers import make_samples, tar_bytes

    for i, samples in enumerate(make_samples([3, 4], floats=4)):
        (tmp_path / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
    with rank_env(0, 2), caplog.at_level("WARNING", logger="streamdata"):
        ds = sd.TarDataset(str(tmp_path) + "/")
    assert ds.sample_counts() is None
    assert any("streamdata index" in r.getMessage() for r in caplog.records)


def _wids(tmp_path, counts, claimed=None):
    import json

    from tests.helpers import make_samples, tar_bytes

    keys, shardlist = [], []
    for i, samples in enumerate(make_samples(counts, floats=4)):
        (tmp_path / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
        keys += [s["__key__"] for s in samples]
        shardlist.append({"url": f"shard-{i:03d}.tar", "nsamples": (claimed or counts)[i]})
    (tmp_path / "wids.json").write_text(json.dumps({"__kind__": "wids-shard-index-v1",
                                                    "shardlist": shardlist}))
    return str(tmp_path / "wids.json"), keys


def test_a_wids_shard_list_gives_exact_epochs_without_offsets(tmp_path):
    """Counts without offsets: spans that start inside a shard read it from its start and
    skip to the span; equal steps and exactly once all the same."""
    counts = [5, 1, 9, 3, 0, 7, 2]
    wids, keys = _wids(tmp_path, counts)
    ds = sd.TarDataset(str(tmp_path) + "/", index=wids, batch_size=4, shuffle=True, seed=2, decode=False)
    assert ds.sample_counts().tolist() == counts
    per_rank = [rank_batches(ds, r, 2, 2, "__key__") for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    got = [k for batches in per_rank for b in batches for k in b]
    assert sorted(got) == sorted(keys)


@pytest.mark.parametrize("claimed", [[3, 6], [3, 2]])
def test_a_count_that_misstates_a_shard_is_an_error_naming_it(tmp_path, claimed):
    """More or fewer samples than the count says: never a silent change of the epoch's steps."""
    wids, _ = _wids(tmp_path, [3, 4], claimed=claimed)
    ds = sd.TarDataset(str(tmp_path) + "/", index=wids, decode=False)
    with pytest.raises(sd.FormatError, match="shard-001.tar.*streamdata index"):
        list(ds)
