"""The shared counters: each reader writes only its own row (ONE-WRITER-PER-ROW)."""

from __future__ import annotations

import collections

import torch

import streamdata as sd
from tests.helpers import make_samples, tar_bytes


def _tag_worker(sample: dict) -> dict:
    info = torch.utils.data.get_worker_info()
    return {"__key__": sample["__key__"], "worker": -1 if info is None else info.id}


def test_each_reader_counts_in_its_own_row(tmp_path):
    """ONE-WRITER-PER-ROW: two workers' samples and skips are counted in two rows (worker k in row
    k + 1), each row exactly what that worker read; the main process reading later adds row 0,
    and the totals are the rows' sums."""
    shards = make_samples([6, 5, 4, 3])
    for i, samples in enumerate(shards):
        samples[0]["npy"] = b"not an npy file"  # one skipped sample per shard
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(samples))
    ds = sd.TarDataset(str(tmp_path / "s-{0..3}.tar"), index=None, map=_tag_worker, on_error="skip")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    by_worker = collections.Counter(sample["worker"] for sample in loader)
    assert sorted(by_worker) == [0, 1] and sum(by_worker.values()) == 18 - 4
    rows = ds.reader_stats()
    assert [row["samples"] for row in rows] == [by_worker[0], by_worker[1]], rows
    assert ds.skipped["decode"] == 4

    main = collections.Counter(sample["worker"] for sample in ds)  # num_workers=0: row 0
    assert main == {-1: 14}
    rows = ds.reader_stats()
    assert [row["samples"] for row in rows] == [14, by_worker[0], by_worker[1]], rows
    assert ds.skipped["decode"] == 8
