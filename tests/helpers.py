"""Shared test helpers: build WebDataset shards and read datasets through a DataLoader."""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import torch
import webdataset as wds

UNEVEN = [5, 1, 9, 3, 0, 7, 2]  # samples per shard: uneven on purpose, one empty shard


def tar_bytes(samples: list[dict]) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as writer:
        for sample in samples:
            writer.write(sample)
    return buf.getvalue()


def make_samples(counts: list[int], floats: int = 8) -> list[list[dict]]:
    """Per shard, samples with a unique key, an .npy array derived from it, a .cls and a .json."""
    shards, n = [], 0
    for count in counts:
        shard = []
        for _ in range(count):
            shard.append({"__key__": f"s{n:06d}", "npy": np.full(floats, n, dtype=np.float32),
                          "cls": n, "json": {"n": n}})
            n += 1
        shards.append(shard)
    return shards


def write_shards(fs, prefix: str, counts: list[int] = UNEVEN, floats: int = 8) -> list[str]:
    """Write ``prefix/shard-000.tar``... through fsspec ``fs``; returns all keys in order."""
    keys = []
    for i, shard in enumerate(make_samples(counts, floats)):
        fs.pipe_file(f"{prefix}/shard-{i:03d}.tar", tar_bytes(shard))
        keys += [s["__key__"] for s in shard]
    return keys


@contextlib.contextmanager
def rank_env(rank: int | None, world_size: int | None):
    """RANK/WORLD_SIZE set for the block (a simulated DDP rank), restored after."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_keys(ds, num_workers: int, context: str | None = "fork", rank: int | None = None,
              world_size: int | None = None) -> list[str]:
    """All keys one rank reads through a DataLoader (RANK/WORLD_SIZE set for the read)."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=num_workers,
            multiprocessing_context=context if num_workers else None, timeout=60 if num_workers else 0)
        keys = []
        for item in loader:
            keys += item["__key__"] if isinstance(item["__key__"], list) else [item["__key__"]]
        return keys


def in_forked_child(target, timeout: float = 30.0):
    """Run ``target(conn)`` in a forked child; what it ``conn.send``s (None if nothing within
    ``timeout``), once the child has been joined."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, conn = ctx.Pipe()
    proc = ctx.Process(target=target, args=(conn,))
    proc.start()
    try:
        return parent.recv() if parent.poll(timeout) else None
    finally:
        proc.join(timeout)


def rank_batches(ds, rank: int, world_size: int, num_workers: int, field: str = "id") -> list[list]:
    """``field`` of each batch one simulated rank's DataLoader yields, as lists."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                             timeout=60 if num_workers else 0)
        return [list(b[field].tolist() if hasattr(b[field], "tolist") else b[field]) for b in loader]


def check_exact_epochs(ds, total: int, world_size: int, num_workers: int, drop_last: bool,
                       batch_size: int) -> None:
    """Two epochs of ``ds`` (rows ``id`` 0..total-1) over simulated ranks x real workers:
    equal steps per rank, no duplicate, every row once (or, with drop_last, full batches, the
    left-out counted, and a different left-out set each epoch): EQUAL-STEPS."""
    import collections

    left_out_sets = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.counts["planned.left_out"]
        per_rank = [rank_batches(ds, r, world_size, num_workers) for r in range(world_size)]
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
            assert 0 <= left_out < world_size * max(num_workers, 1) * batch_size
            # every rank's worker 0 counts the job's figure (here all ranks share one process)
            assert ds.counts["planned.left_out"] - before == world_size * left_out
            left_out_sets.append(frozenset(range(total)) - frozenset(ids))
    if drop_last and left_out_sets[0]:
        assert left_out_sets[0] != left_out_sets[1], "the same samples left out every epoch"
