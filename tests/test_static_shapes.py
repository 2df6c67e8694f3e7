"""Static shapes (docs/distributed.md, "Static shapes"): with ``drop_last=True`` every batch on
every rank has the full shape ``[B, ...]`` and every rank takes the same number of steps, for
tar with an index, Parquet and ``sd.TokenDataset`` (``.bin`` and tar of ``.npy``), whether the
batch size is the dataset's or ``sd.loader``'s, over simulated ranks x real DataLoader workers;
what is left out is counted (``planned.left_out``) and equals the total less what was delivered.
Without counts (tar without an index) every batch is full too and the short batches left out
are counted (``batched.left_out``); equal steps there come from END-TOGETHER, under real
``torchrun`` below."""

from __future__ import annotations

import contextlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamdata as sd
from tests.helpers import make_samples, rank_env, tar_bytes, torchrun

B = 4
SHARDS = [5, 1, 9, 3, 0, 7, 2, 13, 4, 11]  # samples per tar shard: 55, uneven, one empty
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows
BINS = [300, 17, 555, 90]  # tokens per .bin: 962
DOCS = [[30, 0, 75, 12], [160], [9, 14, 3, 40, 21], [55, 66]]  # tokens per .npy sample, per tar
SEQ = 16
WORLDS = [(1, 0), (1, 2), (2, 1), (3, 0), (3, 2)]  # ranks, workers
JOB = Path(__file__).parent / "jobs" / "ddp_uneven.py"


def _tar_shards(root: Path, indexed: bool) -> str:
    root.mkdir()
    for i, samples in enumerate(make_samples(SHARDS, floats=4)):
        (root / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
    if indexed:
        from streamdata.catalog.index import build_index

        build_index(str(root) + "/", progress=False)
    return str(root) + "/"


def _npy_tars(root: Path) -> str:
    root.mkdir()
    at = 0
    for i, lengths in enumerate(DOCS):
        with tarfile.open(root / f"part-{i}.tar", "w") as tar:
            for k, n in enumerate(lengths):
                npy = io.BytesIO()
                np.save(npy, np.arange(at, at + n, dtype=np.uint32))
                at += n
                info = tarfile.TarInfo(f"doc{k:04d}.npy")
                info.size = len(npy.getvalue())
                tar.addfile(info, io.BytesIO(npy.getvalue()))
    return str(root) + "/"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return make_corpora(tmp_path_factory.mktemp("static-shapes"))


def make_corpora(root: Path) -> dict[str, str]:
    """Tar with and without an index, Parquet, .bin tokens and tar of .npy tokens under ``root``."""
    (root / "pq").mkdir()
    n = 0
    for i, groups in enumerate(ROW_GROUPS):
        with pq.ParquetWriter(root / "pq" / f"part-{i}.parquet", pa.schema([("id", pa.int64())])) as w:
            for g in groups:
                w.write_table(pa.table({"id": np.arange(n, n + g)}))
                n += g
    (root / "bin").mkdir()
    for i, tokens in enumerate(BINS):
        np.arange(tokens, dtype=np.uint16).tofile(root / "bin" / f"part-{i}.bin")
    return {"tar": _tar_shards(root / "tar", indexed=True), "tar-unindexed": _tar_shards(root / "raw", False),
            "parquet": str(root / "pq") + "/", "tokens": str(root / "bin") + "/",
            "tokens-tar": _npy_tars(root / "npy")}


def _dataset(kind: str, spec: str, batch_size: int | None, drop_last: bool = False):
    common = {"batch_size": batch_size, "drop_last": drop_last, "shuffle": True, "seed": 3}
    if kind in ("tar", "tar-unindexed"):
        return sd.TarDataset(spec, index="auto" if kind == "tar" else None, **common)
    if kind == "parquet":
        return sd.ParquetDataset(spec, **common)
    if kind == "tokens":
        return sd.TokenDataset(spec, seq_len=SEQ, dtype="uint16", targets=True, **common)
    return sd.TokenDataset(spec, seq_len=SEQ, field="npy", eos_id=60000, **common)


def _full_shape(kind: str) -> dict[str, tuple]:
    """Every tensor field of a full batch, and its shape."""
    if kind.startswith("tar"):
        return {"npy": (B, 4), "cls": (B,)}
    if kind == "parquet":
        return {"id": (B,)}
    return {"input_ids": (B, SEQ + 1 if kind == "tokens" else SEQ)}


def _total(ds, kind: str) -> int:
    return ds.num_sequences if kind.startswith("tokens") else sum(SHARDS) if kind.startswith("tar") else 65


def _rank_epoch(ds, via: str, rank: int, world_size: int, workers: int) -> list[dict]:
    """One simulated rank's batches of one epoch: per batch, each tensor's shape (and ``n``: how
    many keys it holds, where it has keys)."""
    with rank_env(rank, world_size):
        if via == "dataset":  # a plain DataLoader over a dataset that batches (drop_last=True on it)
            loader = contextlib.nullcontext(torch.utils.data.DataLoader(
                ds, batch_size=None, num_workers=workers, timeout=60 if workers else 0))
        elif via == "sd.loader":  # sd.loader over the same dataset (its batch size, its drop_last)
            loader = sd.loader(ds, num_workers=workers, persistent_workers=False, drop_last=True)
        else:  # sd.loader batches a per-sample dataset: batch_size= and drop_last= given to the loader
            loader = sd.loader(ds, batch_size=B, drop_last=True, num_workers=workers,
                               persistent_workers=False)
        with loader as batches:
            return [{name: tuple(value.shape) for name, value in batch.items()
                     if isinstance(value, torch.Tensor)}
                    | {"n": len(batch["__key__"]) if "__key__" in batch else None} for batch in batches]


@pytest.mark.parametrize("world_size,workers", WORLDS)
@pytest.mark.parametrize("via", ["dataset", "sd.loader", "loader batches"])
@pytest.mark.parametrize("kind", ["tar", "parquet", "tokens", "tokens-tar"])
def test_every_batch_full_on_every_rank_with_equal_steps(corpora, kind, via, world_size, workers):
    """Two epochs: every batch's every tensor has the full shape on every rank, every rank takes
    the same steps, and ``planned.left_out`` (each rank's reader 0 adds the job's figure: here the
    simulated ranks share one process) is the total less what was delivered."""
    spec = corpora[kind]
    per_sample = via == "loader batches"
    ds = _dataset(kind, spec, None if per_sample else B, not per_sample)
    total = _total(ds, kind)
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.counts
        per_rank = [_rank_epoch(ds, via, r, world_size, workers) for r in range(world_size)]
        steps = [len(batches) for batches in per_rank]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        assert steps[0] == total // (world_size * max(workers, 1) * B) * max(workers, 1)
        full = _full_shape(kind)
        for batches in per_rank:
            for batch in batches:
                assert {k: batch[k] for k in full} == full, batch
                assert batch["n"] in (None, B)
        delivered = B * sum(steps)
        after = ds.counts
        assert after["planned.left_out"] - before["planned.left_out"] == world_size * (total - delivered)
        assert after["batched.left_out"] == before["batched.left_out"] == 0


@pytest.mark.parametrize("world_size,workers", WORLDS)
@pytest.mark.parametrize("via", ["dataset", "loader batches"])
def test_without_counts_every_batch_is_full_and_the_rest_counted(corpora, via, world_size, workers):
    """Tar shards without an index (shards split whole): every batch full on every rank; the
    short batch each reader left out counted in ``batched.left_out`` (this rank's readers: the
    simulated ranks' summed here) == total - delivered. Equal steps need END-TOGETHER, a real
    process group: the torchrun test below."""
    per_sample = via == "loader batches"
    ds = _dataset("tar-unindexed", corpora["tar-unindexed"], None if per_sample else B, not per_sample)
    assert ds.sample_counts() is None
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.counts["batched.left_out"]
        per_rank = [_rank_epoch(ds, via, r, world_size, workers) for r in range(world_size)]
        assert all(batch["npy"] == (B, 4) and batch["n"] == B for batches in per_rank for batch in batches)
        delivered = B * sum(len(batches) for batches in per_rank)
        assert ds.counts["batched.left_out"] - before == sum(SHARDS) - delivered
        assert ds.counts["planned.left_out"] == 0


def test_a_loader_drop_last_that_the_batching_dataset_would_not_keep_is_refused(corpora):
    ds = _dataset("tar", corpora["tar"], B)  # batches itself, drop_last=False
    with pytest.raises(sd.SpecError, match="batches itself.*give drop_last to it"):
        sd.loader(ds, num_workers=0, drop_last=True)


@pytest.mark.slow  # (a torchrun job: the slow suite, run in CI too)
def test_torchrun_without_an_index_full_batches_and_equal_steps(tmp_path):
    """Real ranks (2 x 2 workers, gloo) over tar shards without an index, sd.loader with
    drop_last=True: END-TOGETHER ends every rank's epoch at the same step, every batch is full,
    and delivered + undelivered (END-TOGETHER) + batched.left_out (drop_last) == the dataset."""
    cases = {}
    for name, counts in {"uneven": SHARDS, "random": [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77],
                         "equal9": [64] * 9}.items():
        root = tmp_path / name
        root.mkdir()
        for i, samples in enumerate(make_samples(counts)):
            (root / f"shard-{i:03d}.tar").write_bytes(tar_bytes(samples))
        cases[name] = {"spec": str(root) + "/", "storage_options": {}, "index": None, "drop_last": True,
                       "loader": "sd", "total": sum(counts)}
    ranks = torchrun(JOB, tmp_path, 2, {"tag": "static", "cases": cases}, 240)
    for name, case in cases.items():
        left_before = [0, 0]
        for epoch in range(2):
            r0, r1 = (ranks[r][name][epoch] for r in (0, 1))
            assert r0["steps"] == r1["steps"] > 0 and r0["all_steps"] == [r0["steps"]] * 2, (name, epoch)
            assert set(r0["sizes"] + r1["sizes"]) == {8}, (name, epoch)  # the job's batch size
            delivered = r0["keys"] + r1["keys"]
            assert len(delivered) == len(set(delivered)), (name, epoch)
            left = [r["counts"]["batched.left_out"] for r in (r0, r1)]
            assert (len(delivered) + r0["undelivered"] + r1["undelivered"]
                    + sum(left) - sum(left_before)) == case["total"], (name, epoch)
            left_before = left
