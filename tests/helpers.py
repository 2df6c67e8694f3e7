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
