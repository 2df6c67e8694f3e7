"""Exact epochs wired into the pass (EQUAL-STEPS): every rank the same number of batches, every
sample once (or, with drop_last, full batches and a counted left-out), over simulated ranks x
real DataLoader workers. The real torchrun jobs are in test_ddp.py."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamdata as sd
from tests.helpers import rank_env

# rows per row group, per file: uneven on purpose (the 5, 1, 9, 3, 0, 7, 2 and more)
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


def _rank_batches(ds, rank: int, world_size: int, num_workers: int) -> list[list[int]]:
    """The ids of each batch one rank's DataLoader yields."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                             timeout=60 if num_workers else 0)
        return [b["id"].tolist() for b in loader]


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (2, 2), (3, 1), (3, 2), (5, 0)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_parquet_epochs_are_exact_with_equal_steps(parquet_files, world_size, num_workers, drop_last):
    spec, total = parquet_files
    batch_size = 4
    ds = sd.ParquetDataset(spec, batch_size=batch_size, shuffle=True, seed=7, drop_last=drop_last)
    left_out_sets = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.counts["planned.left_out"]
        per_rank = [_rank_batches(ds, r, world_size, num_workers) for r in range(world_size)]
        steps = [len(b) for b in per_rank]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        ids = [i for batches in per_rank for b in batches for i in b]
        dupes = [k for k, n in collections.Counter(ids).items() if n > 1]
        assert not dupes, f"duplicates {dupes}"
        if not drop_last:
            assert sorted(ids) == list(range(total))
            assert ds.counts["planned.left_out"] == 0
        else:
            assert all(len(b) == batch_size for batches in per_rank for b in batches)
            left_out = total - len(ids)
            slots = world_size * max(num_workers, 1)
            assert 0 <= left_out < slots * batch_size
            # every rank's worker 0 counts the job's figure (here all ranks share one process)
            assert ds.counts["planned.left_out"] - before == world_size * left_out
            left_out_sets.append(frozenset(range(total)) - frozenset(ids))
    if drop_last and left_out_sets[0]:
        assert left_out_sets[0] != left_out_sets[1], "the same samples left out every epoch"


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
    from streamdata.presets import _BatchedInWorkers

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
