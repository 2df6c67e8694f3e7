"""Real ``torchrun`` jobs (2 ranks, gloo on CPU, 2 workers each) over uneven data: no hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import UNEVEN, torchrun, write_shards

JOB = Path(__file__).parent / "jobs" / "ddp_uneven.py"
LIST_JOB = Path(__file__).parent / "jobs" / "list_once.py"
TIME_LIMIT_S = 240  # a hang shows as this time limit, not as a hung suite

CASES = {  # three uneven cases: uneven, random 10-200, equal shards not a multiple of 4
    "uneven": UNEVEN,
    "random": [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77, 61, 42],
    "equal17": [64] * 17,
}


def _torchrun(tmp_path: Path, cases: dict, job: Path = JOB) -> list[dict]:
    return torchrun(job, tmp_path, 2, {"tag": job.stem, "cases": cases}, TIME_LIMIT_S)


def test_ddp_over_uneven_shards_ends_every_epoch_together(s3_bucket, tmp_path):
    """END-TOGETHER: without sample counts both ranks end each epoch at the same step, and what
    a rank did not hand on is counted as undelivered."""
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    cases, keys = {}, {}
    for name, counts in CASES.items():
        keys[name] = write_shards(fs, f"{bucket}/{name}", counts=counts)
        cases[name] = {"spec": f"s3://{bucket}/{name}/shard-{{000..{len(counts) - 1:03d}}}.tar",
                       "storage_options": server.storage_options}
    ranks = _torchrun(tmp_path, cases)
    for name in CASES:
        for epoch in range(2):
            r0, r1 = (ranks[r][name][epoch] for r in (0, 1))
            assert r0["steps"] == r1["steps"] > 0 and r0["all_steps"] == [r0["steps"]] * 2, (name, epoch)
            assert r0["len"] is r1["len"] is None  # no counts: no len()
            delivered = r0["keys"] + r1["keys"]
            assert len(delivered) == len(set(delivered)) and set(delivered) <= set(keys[name])
            assert len(delivered) + r0["undelivered"] + r1["undelivered"] == len(keys[name]), (name, epoch)


@pytest.mark.slow
def test_a_job_lists_once_and_reads_footers_once_whatever_its_ranks(s3_bucket, tmp_path):
    """LIST-ONCE: rank 0 expands the spec (and reads the sample index or Parquet footers) for
    every rank; the storage sees one job's worth of requests, not one per rank; rank 0's error
    reaches all."""
    import pyarrow as pa
    import s3fs

    import streamdata as sd
    from benchmarks.faults import FaultProxy

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/tar", counts=UNEVEN)
    write_shards(fs, f"{bucket}/indexed", counts=UNEVEN)
    from streamdata.catalog.index import build_index

    build_index(f"s3://{bucket}/indexed/", storage_options=server.storage_options, progress=False)
    for i in range(3):
        with fs.open(f"{bucket}/pq/part-{i}.parquet", "wb") as f:
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"n": list(range(10 * i, 10 * i + 10))}), f, row_group_size=4)
        with fs.open(f"{bucket}/ipc/part-{i}.arrow", "wb") as f:  # record batches of 4, 4, 2 rows
            with pa.ipc.new_file(f, pa.schema([("n", pa.int64())])) as w:
                for start in (0, 4, 8):
                    w.write_table(pa.table({"n": list(range(10 * i + start, 10 * i + min(start + 4, 10)))}))
    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        indexed = {"spec": f"s3://{bucket}/indexed/", "storage_options": options}
        sd.TarDataset(indexed["spec"], storage_options=options)
        assert dict(proxy.requests) == {"list": 1, "get": 1}, proxy.requests  # the index: one GET
        proxy.reset_counters()
        cases = {"indexed": indexed, "tar": {"spec": f"s3://{bucket}/tar/", "storage_options": options},
                 "parquet": {"spec": f"s3://{bucket}/pq/part-{{0..2}}.parquet", "storage_options": options},
                 "arrow": {"spec": f"s3://{bucket}/ipc/part-{{0..2}}.arrow", "storage_options": options},
                 "objects": {"spec": f"s3://{bucket}/tar/", "storage_options": options, "kind": "objects"},
                 "missing": {"spec": f"s3://{bucket}/tar/shard-{{000..009}}.tar", "storage_options": options}}
        for case in cases.values():  # one process: the requests one job should make
            try:
                (sd.ObjectDataset if case.get("kind") == "objects" else
                 sd.ParquetDataset if case["spec"].endswith(".parquet") else
                 sd.ArrowDataset if case["spec"].endswith(".arrow") else sd.TarDataset)(
                    case["spec"], storage_options=options)
            except sd.ShardNotFoundError:
                pass
        alone = dict(proxy.requests)
        proxy.reset_counters()
        ranks = _torchrun(tmp_path, cases, LIST_JOB)
        job = dict(proxy.requests)
    assert alone.get("list", 0) >= 3 and alone.get("get", 0) >= 3  # listings, footers
    assert job == alone, (job, alone)  # two ranks, one job's worth of requests
    assert ranks[0] == ranks[1]
    assert len(ranks[0]["tar"]["shards"]) == len(UNEVEN) and ranks[0]["parquet"]["rows"] == 30
    assert ranks[0]["indexed"]["samples"] == sum(UNEVEN) and ranks[0]["tar"]["samples"] is None
    assert ranks[0]["arrow"]["samples"] == 30  # row counts from the batches' headers, read on rank 0
    assert ranks[0]["missing"]["error"] == "ShardNotFoundError"
    assert len(ranks[0]["objects"]["shards"]) == len(UNEVEN)  # ObjectDataset lists once too


ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1], [40, 17]]  # 122 rows


def _write_parquet(fs, prefix: str) -> list[int]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = 0
    for i, groups in enumerate(ROW_GROUPS):
        with fs.open(f"{prefix}/part-{i}.parquet", "wb") as f, pq.ParquetWriter(
                f, pa.schema([("id", pa.int64()), ("x", pa.float32())])) as w:
            for n in groups:
                w.write_table(pa.table({"id": np.arange(ids, ids + n), "x": np.ones(n, np.float32)}))
                ids += n
    return list(range(ids))


def _check_exact(name: str, case: dict, ranks: dict, everything: list, batch_size: int = 8) -> None:
    """EQUAL-STEPS and exactly-once (or full batches and the documented left-out) per epoch."""
    left_out_so_far = 0
    for epoch in range(2):
        r0, r1 = (ranks[r][name][epoch] for r in (0, 1))
        assert r0["steps"] == r1["steps"] and r0["all_steps"] == [r0["steps"]] * 2, (name, epoch)
        assert r0["len"] == r1["len"] == r0["steps"], (name, epoch)  # len(): the plan's steps
        assert r0["steps"] > 0 or case.get("drop_last") and len(everything) < 2 * 2 * batch_size
        assert r0["undelivered"] == r1["undelivered"] == 0, (name, epoch)
        delivered = r0["keys"] + r1["keys"]
        assert len(delivered) == len(set(delivered)) and set(delivered) <= set(everything), (name, epoch)
        if case.get("drop_last"):
            assert set(r0["sizes"] + r1["sizes"]) <= {batch_size}, (name, epoch, r0["sizes"], r1["sizes"])
            left_out = len(everything) - len(delivered)
            assert 0 <= left_out < 2 * 2 * batch_size, (name, epoch)  # ranks x workers x batch
            # each rank counts the job's left-out figure (the same on both), summed over epochs
            left_out_so_far += left_out
            assert r0["counts"]["planned.left_out"] == r1["counts"]["planned.left_out"] \
                == left_out_so_far, (name, epoch)
        else:
            assert sorted(map(str, delivered)) == sorted(map(str, everything)), (name, epoch)


@pytest.mark.slow
def test_ddp_parquet_uneven_row_groups_exact_epochs(s3_bucket, tmp_path):
    """Parquet row counts come from footers: exact epochs, equal steps, through a plain
    DataLoader (no end-of-epoch help) and through sd.loader, with and without drop_last."""
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    ids = _write_parquet(fs, f"{bucket}/pq")
    cases = {f"pq-{loader}-{drop}": {"kind": "parquet", "spec": f"s3://{bucket}/pq/",
                                     "storage_options": server.storage_options,
                                     "loader": loader, "drop_last": drop}
             for loader in ("plain", "sd") for drop in (False, True)}
    ranks = _torchrun(tmp_path, cases)
    for name, case in cases.items():
        _check_exact(name, case, ranks, ids)


@pytest.mark.slow
def test_ddp_tar_with_an_index_exact_epochs(s3_bucket, tmp_path):
    """Three uneven cases with a sample index: exact epochs and equal steps on both
    ranks through a plain DataLoader (no end-of-epoch help), and full batches with drop_last
    through sd.loader; two epochs each."""
    import s3fs

    from streamdata.catalog.index import build_index

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    cases, keys = {}, {}
    for name, counts in CASES.items():
        keys[name] = write_shards(fs, f"{bucket}/{name}", counts=counts)
        build_index(f"s3://{bucket}/{name}/", storage_options=server.storage_options, progress=False)
        for loader, drop in (("plain", False), ("sd", True)):
            cases[f"{name}-{loader}-{drop}"] = {
                "spec": f"s3://{bucket}/{name}/shard-{{000..{len(counts) - 1:03d}}}.tar",
                "storage_options": server.storage_options, "loader": loader, "drop_last": drop}
    ranks = _torchrun(tmp_path, cases)
    for case_name, case in cases.items():
        _check_exact(case_name, case, ranks, keys[case_name.split("-")[0]])
