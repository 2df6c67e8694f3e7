"""Readers that are neither DDP ranks nor DataLoader workers (a distributed engine's read tasks,
``integrations.ray``) read their share of an epoch under ``epoch.world.pinned``: with the sample
index, n such readers read every sample once, in spans equal within one sample (EXACTLY-ONCE)."""

from __future__ import annotations

import collections

import fsspec

import streamdata as sd
from streamdata.epoch.world import World, pinned
from tests.helpers import write_shards


def test_pinned_readers_share_an_indexed_epoch_exactly(tmp_path):
    keys = write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[5, 1, 9, 3, 0, 7, 2])
    sd.build_index(str(tmp_path) + "/", progress=False)
    ds = sd.TarDataset(str(tmp_path) + "/", decode=False, shuffle=True, seed=3)
    shares = []
    for i in range(3):
        with pinned(World(rank=i, world_size=3)):
            shares.append([s["__key__"] for s in ds])
    got = collections.Counter(k for share in shares for k in share)
    assert max(got.values()) == 1 and sorted(got) == sorted(keys)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # 27 samples: 9 each
