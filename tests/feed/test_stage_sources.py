"""Stage timings for the datasets that are not one sharded pass: ObjectDataset (a batch's wait
for its objects, decoding, map) and Mix (its sources' readers, row by row), in loader.metrics()."""

from __future__ import annotations

import time
from pathlib import Path

import fsspec
import numpy as np
import torch

import streamdata as sd
from tests.helpers import write_shards


def _slow_map(sample):
    time.sleep(0.002)
    return sample


def test_an_object_datasets_batches_are_timed(tmp_path: Path):
    for i in range(24):
        np.save(tmp_path / f"{i:03d}.npy", np.full(16, i, dtype=np.float32))
    ds = sd.ObjectDataset(str(tmp_path) + "/", decode=True, map=_slow_map)
    loader = sd.timed(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0,
                                                  collate_fn=lambda b: [s["__key__"] for s in b]))
    keys = [k for batch in loader for k in batch]
    ds.close()
    m = loader.metrics()
    assert sorted(keys) == [f"{i:03d}" for i in range(24)]
    assert m["readers"] == 1 and m["samples"] == 24 and m["batches"] == 6
    assert m["requests"] == 24 and m["bytes"] == 24 * (128 + 64)  # each .npy: header and 16 floats
    assert m["stage.map_s"] >= 24 * 0.002 and m["stage.decode_s"] > 0 and m["stage.wait_bytes_s"] > 0
    stages = sum(m[f"stage.{s}_s"] for s in ("wait_bytes", "parse", "decode", "map", "collate"))
    assert stages <= m["readers.busy_s"] * 1.001 and m["readers.busy_s"] <= m["readers.wall_s"] * 1.001


def test_a_mix_sums_its_sources_readers(tmp_path: Path):
    specs = []
    for name, counts in (("a", [10] * 2), ("b", [10] * 3)):
        (tmp_path / name).mkdir()
        write_shards(fsspec.filesystem("file"), str(tmp_path / name), counts=counts, floats=8)
        specs.append(f"file://{tmp_path}/{name}/shard-{{000..{len(counts) - 1:03d}}}.tar")
    mix = sd.Mix([sd.TarDataset(spec, index=None) for spec in specs], weights=[1, 1], seed=1, stop="all")
    loader = sd.loader(mix, batch_size=5, num_workers=0)
    n = sum(len(batch["__key__"]) for batch in loader)
    m = loader.metrics()
    assert m["readers"] == 1 and m["stage.parse_s"] > 0
    assert m["samples"] >= 50 and n >= 50  # every source's samples, each read once (cycled ones more)
    per_source = [row for source in mix.sources for row in source.reader_stats()]
    assert m["samples"] == sum(row["samples"] for row in per_source)
    assert round(m["readers.wall_s"] * 1e9) == max(row["wall_ns"] for row in per_source)
