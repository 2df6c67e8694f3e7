"""The README's first command: a local S3 server, a small shard set, one epoch, the numbers."""

from __future__ import annotations

import io
import time

__all__ = ["run_demo", "write_demo_shards"]


def write_demo_shards(fs, prefix: str, *, shards: int, per_shard: int, floats: int) -> int:
    """Write ``shards`` WebDataset tars of ``per_shard`` samples (an .npy array and a .cls int)."""
    import numpy as np
    import webdataset as wds

    rng = np.random.default_rng(0)
    n = 0
    for s in range(shards):
        buf = io.BytesIO()
        with wds.TarWriter(buf) as writer:
            for _ in range(per_shard):
                writer.write({"__key__": f"sample{n:07d}",
                              "npy": rng.standard_normal(floats, dtype=np.float32), "cls": n % 10})
                n += 1
        fs.pipe_file(f"{prefix}/train-{s:06d}.tar", buf.getvalue())
    return n


def run_demo(*, shards: int = 32, per_shard: int = 64, floats: int = 4096, batch_size: int = 32,
             num_workers: int = 2) -> dict:
    """Start a loopback S3 server, write shards, stream one epoch; print and return the numbers."""
    import s3fs
    import torch

    import streamdata as sd
    from streamdata.testing import S3Server

    with S3Server() as server:
        server.create_bucket("demo")
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
        total = write_demo_shards(fs, "demo/train", shards=shards, per_shard=per_shard, floats=floats)
        spec = f"s3://demo/train/train-{{000000..{shards - 1:06d}}}.tar"
        print(f"wrote {total} samples in {shards} shards to {server.endpoint_url} as {spec}")
        ds = sd.TarDataset(spec, storage_options=server.storage_options, shuffle=True, seed=0,
                           batch_size=batch_size)
        ds.set_epoch(0)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
        start = time.perf_counter()
        first = None
        seen = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - start
                print(f"first batch: keys {batch['__key__'][:2]}..., npy {tuple(batch['npy'].shape)} "
                      f"{batch['npy'].dtype}, cls {tuple(batch['cls'].shape)}")
            seen += len(batch["__key__"])
        elapsed = time.perf_counter() - start
    result = {"samples": seen, "expected": total, "seconds": elapsed, "samples_per_s": seen / elapsed,
              "time_to_first_batch_s": first, "mb_per_s": seen * floats * 4 / elapsed / 1e6}
    print(f"streamed {seen}/{total} samples in {elapsed:.2f} s: {result['samples_per_s']:.0f} samples/s, "
          f"{result['mb_per_s']:.1f} MB/s, time to first batch {first:.3f} s "
          f"({num_workers} workers, batch {batch_size})")
    if seen != total:
        raise SystemExit(f"demo failed: {seen} samples read, {total} written")
    return result
