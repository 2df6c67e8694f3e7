"""BLOCK-SHUFFLE (streamdata/blocks.py): the stateless seeded block shuffle of exact epochs.

Pure window arithmetic on positions; every sample once per epoch over simulated ranks x real
DataLoader workers (tar + index, Parquet; with and without drop_last); the order a pure function
of (seed, epoch, world); a resume on the same world gives exactly the rest of the order and reads
again at most the window it stopped in (counted, and measured in bytes at a proxy); another world
gets exactly what is left; torchdata's StatefulDataLoader and sd.loader (in-worker batches,
NEXT-EPOCH-EARLY); a state of the other shuffle refused."""

from __future__ import annotations

import collections
import json
import random
from urllib.parse import urlsplit

import fsspec
import numpy as np
import pyarrow.compute as pc
import pytest

import streamdata as sd
from streamdata.catalog import index as sdx
from streamdata.epoch.blocks import (
    block_reads,
    block_runs,
    block_shuffled,
    delivered_mask,
    windows_of,
)
from streamdata.epoch.plan import Segment, Span, reader_span
from streamdata.epoch.state import merge_states
from streamdata.epoch.world import World
from streamdata.errors import SpecError
from tests.helpers import rank_batches, rank_env, take, write_shards, write_tables

COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 14]  # 72 samples, uneven on purpose
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows
W = 6  # the tests' window, samples


@pytest.fixture
def tar_dir(tmp_path):
    keys = write_shards(fsspec.filesystem("file"), str(tmp_path), counts=COUNTS)
    sdx.build_index(str(tmp_path) + "/", progress=False)
    return str(tmp_path) + "/", [int(k[1:]) for k in keys]


@pytest.fixture
def parquet_dir(tmp_path):
    return str(tmp_path) + "/", write_tables(fsspec.filesystem("file"), str(tmp_path), ROW_GROUPS)


def _make(kind, path, **kw):
    kw = {"shuffle": True, "shuffle_window": W, "seed": 3, **kw}
    if kind == "parquet":
        return sd.ParquetDataset(path, **kw)
    return sd.TarDataset(path, decode=False, **kw)


def _ids(batch):
    return [int(k[1:]) for k in batch["__key__"]] if "__key__" in batch else batch["id"].tolist()


# ---- the arithmetic, on positions ----------------------------------------------------------------


def _span(sizes):
    return Span(tuple(Segment(i, 0, n) for i, n in enumerate(sizes)))


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("pieces", [1, 3])
def test_the_order_is_a_seeded_permutation_by_windows(split, pieces):
    sizes = [7, 3, 12, 1, 9, 4]
    full = _span(sizes)
    reads, plan = block_reads(full, 0, 6, split, [1, 2, 0, 0], tables=False, pieces=pieces)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    positions = [int(starts[s.unit]) + p for s in reads for p in range(s.start, s.stop)]
    out = list(block_shuffled(positions, plan))
    assert sorted(out) == list(range(sum(sizes)))
    assert out != sorted(out)
    spans, groups = windows_of(sizes, 6, split, [1, 2, 0, 0], pieces)
    assert sorted(p for a, b in spans for p in range(a, b)) == list(range(sum(sizes)))  # pieces tile it
    piece = 6 // pieces
    assert all(b - a <= piece for a, b in spans) if split else all(
        b - a <= piece or len(_cut_sizes(sizes, a, b)) == 1 for a, b in spans)
    assert all(sum(spans[k][1] - spans[k][0] for k in g) <= max(6, max(sizes)) for g in groups)
    at = 0
    for size, group in zip(plan.sizes, groups, strict=True):  # a window's samples come out together
        assert sorted(out[at:at + size]) == sorted(p for k in group for p in range(*spans[k]))
        at += size
    if pieces > 1 and split:
        assert any(len(g) > 1 for g in groups)  # pieces from several places of the span
    again, _ = block_reads(full, 0, 6, split, [1, 2, 0, 0], tables=False, pieces=pieces)
    assert again == reads
    other = [int(starts[s.unit]) + p for s in block_reads(full, 0, 6, split, [1, 3, 0, 0], False, pieces)[0]
             for p in range(s.start, s.stop)]
    assert other != positions  # another epoch (or seed): another order of windows


def _cut_sizes(sizes, a, b):
    """The segments (of ``sizes``) that positions [a, b) touch."""
    starts = np.concatenate(([0], np.cumsum(sizes)))
    return [i for i in range(len(sizes)) if starts[i] < b and starts[i + 1] > a]


@pytest.mark.parametrize("split", [True, False])
def test_any_position_restores_the_rest_and_says_what_was_delivered(split):
    rng = random.Random(0)
    sizes = [7, 3, 12, 1, 9, 4]
    full, material = _span(sizes), [4, 1, 1, 0]
    starts = np.concatenate(([0], np.cumsum(sizes)))

    def order(d):
        reads, plan = block_reads(full, d, 5, split, material, tables=False)
        return list(block_shuffled([int(starts[s.unit]) + p for s in reads for p in range(s.start, s.stop)],
                                   plan)), plan

    whole, _ = order(0)
    for d in sorted(rng.sample(range(1, sum(sizes)), 12)):
        rest, plan = order(d)
        assert rest == whole[d:], d
        assert plan.skip < max(5, max(sizes))  # one window, at most
        mask = delivered_mask(sizes, d, 5, split, material)
        assert sorted(np.flatnonzero(mask).tolist()) == sorted(whole[:d])
        runs = block_runs(5, split, seed=4, epoch=1)(World(1, 2, 0, 1), sizes, d)
        assert sorted(p for a, b in runs for p in range(a, b)) == sorted(whole[d:])


@pytest.mark.parametrize("d", [0, 13, 40])
def test_the_next_window_is_read_evenly_while_one_is_put_out(d):
    """READ-SPREAD: after the first window, each sample put out costs at most a window's share of
    reading (not a whole window at each window's start), nothing is held past about one window,
    and the order is each window's permutation, as read whole would give it."""
    sizes = [40, 40, 40, 40, 40, 17]
    full = _span(sizes)
    reads, plan = block_reads(full, d, 40, True, [5, 1, 0, 0], tables=False)
    positions = [sum(sizes[:s.unit]) + p for s in reads for p in range(s.start, s.stop)]
    read = 0

    def counted():
        nonlocal read
        for p in positions:
            read += 1
            yield p

    out, between, ahead = [], [], []
    last = None
    for sample in block_shuffled(counted(), plan):
        if last is not None:
            between.append(read - last)
        last = read
        out.append(sample)
        ahead.append(read - len(out) - plan.skip)  # read but not yet put out (or dropped)
    whole, at = [], 0
    for size, key in zip(plan.sizes, plan.keys, strict=True):  # each window read whole, then permuted
        held = positions[at:at + size]
        whole += [held[i] for i in np.random.default_rng([*plan.material, 0xB10C, key + 1]).permutation(size)]
        at += size
    assert out == whole[plan.skip:]
    assert max(between) <= 2, between  # windows of 40 and 40: one read per sample put out
    assert max(ahead) <= 40 + 1  # about one window held


def test_the_plans_pad_comes_last_unshuffled():
    span = reader_span([3], World(1, 2, 0, 1), batch_size=1)  # 3 samples, 2 ranks, batch 1: pad
    assert span.pad == 1
    reads, plan = block_reads(span, 0, 2, True, [0, 0, 1, 0], tables=False)
    out = list(block_shuffled([p for s in reads for p in range(s.start, s.stop)], plan))
    assert sorted(out) == sorted(p for s in span.segments for p in range(s.start, s.stop))
    assert out[-1] == span.segments[-1].start  # the repeated sample: after the windows


# ---- exact epochs over ranks x workers --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["indexed", "parquet"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch_over_ranks_and_workers(tar_dir, parquet_dir, kind, drop_last):
    path, everything = parquet_dir if kind == "parquet" else tar_dir
    ds = _make(kind, path, batch_size=3, drop_last=drop_last)
    assert ds.block_window() == W
    field = "id" if kind == "parquet" else "__key__"
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        per_rank = [rank_batches(ds, r, 2, 2, field=field) for r in range(2)]
        assert len({len(b) for b in per_rank}) == 1, "unequal steps per rank"
        ids = [int(str(i).lstrip("s")) for batches in per_rank for b in batches for i in b]
        assert len(ids) == len(set(ids)), "a duplicate"
        if drop_last:
            assert all(len(b) == 3 for batches in per_rank for b in batches)
            assert len(everything) - len(ids) < 2 * 2 * 3
        else:
            assert sorted(ids) == everything
        orders.append(ids)
    assert orders[0] != orders[1]
    unshuffled = [int(str(i).lstrip("s")) for r in range(2) for b in rank_batches(
        _make(kind, path, batch_size=3, drop_last=drop_last, shuffle=False), r, 2, 2, field=field) for i in b]
    assert orders[0] != unshuffled


def test_the_order_is_a_function_of_seed_and_epoch(tar_dir):
    path, _ = tar_dir

    def order(seed, epoch):
        ds = _make("indexed", path, seed=seed)
        ds.set_epoch(epoch)
        return [int(s["__key__"][1:]) for s in ds]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0) and order(1, 0) != order(1, 1)


# ---- resume ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["indexed", "parquet"])
@pytest.mark.parametrize("world", [1, 2])
def test_the_same_world_resumes_exactly_and_reads_one_window_again(tar_dir, parquet_dir, kind, world):
    path, _ = parquet_dir if kind == "parquet" else tar_dir
    rng = random.Random(kind + str(world))
    biggest = max(max(g) for g in ROW_GROUPS) if kind == "parquet" else W  # a window's most samples
    rereads = []
    for rank in range(world):
        with rank_env(rank, world):
            full = [i for b in _make(kind, path, batch_size=2) for i in _ids(b)]
            for stop in rng.sample(range(1, len(full) // 2), 4):
                ds = _make(kind, path, batch_size=2)
                it = iter(ds)
                before = [i for b in take(it, stop) for i in _ids(b)]
                state = json.loads(json.dumps(ds.state_dict()))
                it.close()
                assert state["shuffle"] == f"block:{W}"
                resumed = _make(kind, path, batch_size=2)
                resumed.load_state_dict(state)
                after = [i for b in resumed for i in _ids(b)]
                assert before + after == full, f"rank {rank}, stop {stop}: not the uninterrupted order"
                rereads.append(resumed.counts["resumed.reread"])
                assert rereads[-1] < biggest
    assert any(rereads), "no stop inside a window: the count is not checked"


@pytest.mark.parametrize("kind", ["indexed", "parquet"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (2, 2)])
def test_another_world_gets_exactly_what_is_left(tar_dir, parquet_dir, kind, old, new):
    path, everything = parquet_dir if kind == "parquet" else tar_dir
    before, states = [], []
    for rank in range(old):
        with rank_env(rank, old):
            ds = _make(kind, path, batch_size=4)
            it = iter(ds)
            before += [i for b in take(it, 3) for i in _ids(b)]  # DDP ranks stop at one step
            states.append(ds.state_dict())
            it.close()
    state = json.loads(json.dumps(merge_states(states)))
    after, steps = [], []
    for rank in range(new):
        with rank_env(rank, new):
            ds = _make(kind, path, batch_size=4)
            ds.load_state_dict(state)
            batches = list(ds)
            steps.append(len(batches))
            after += [i for b in batches for i in _ids(b)]
    got = collections.Counter(before + after)
    assert sorted(got) == everything, "a sample lost"
    assert max(got.values()) == 1, f"duplicates: {[k for k, n in got.items() if n > 1]}"
    assert len(set(steps)) == 1, steps


def test_a_state_of_the_other_shuffle_is_refused(tar_dir):
    path, _ = tar_dir
    block = _make("indexed", path, batch_size=2)
    buffer = _make("indexed", path, batch_size=2, shuffle="buffer")
    assert block.block_window() == W and buffer.block_window() is None
    it = iter(block)
    take(it, 3)
    state = block.state_dict()
    it.close()
    with pytest.raises(SpecError, match="block shuffle, window 6"):
        buffer.load_state_dict(state)
    with pytest.raises(SpecError, match="window 6.*window 9"):
        _make("indexed", path, batch_size=2, shuffle_window=9).load_state_dict(state)
    with pytest.raises(SpecError, match="shuffle buffer or none"):
        block.load_state_dict(buffer.state_dict())
    with pytest.raises(SpecError, match="shuffle="):
        merge_states([state, {**state, "shuffle": None}])
    _make("indexed", path, batch_size=2).load_state_dict(state)  # the same shuffle: taken


def test_which_shuffle_a_dataset_takes(tar_dir, parquet_dir, tmp_path):
    path, _ = tar_dir
    assert sd.TarDataset(path, shuffle=True).block_window() is not None  # counts and offsets: block
    assert sd.TarDataset(path, shuffle=True, shuffle_buffer=16).block_window() is None  # asked for one
    assert sd.TarDataset(path, shuffle=False).block_window() is None
    assert sd.TarDataset(path, shuffle=True, index=None).block_window() is None  # no counts: buffer
    assert sd.ParquetDataset(parquet_dir[0], shuffle=True).block_window() is not None
    default = sd.TarDataset(path, shuffle=True).block_window()
    assert 64 <= default <= 65536  # ORDER-NOT-IO: the fetch settings do not size it
    assert sd.TarDataset(path, shuffle=True, byte_budget=2 ** 20, autotune=False).block_window() == default
    with pytest.raises(SpecError, match="sample count"):
        sd.TarDataset(path, shuffle="block", index=None)  # in the constructing process
    with pytest.raises(SpecError, match="sample count"):
        sd.ParquetDataset(parquet_dir[0], shuffle="block", filter=pc.field("id") > 3)
    with pytest.raises(SpecError, match="shuffle must be"):
        sd.TarDataset(path, shuffle="blocks")
    with pytest.raises(SpecError, match="shuffle_window"):
        sd.TarDataset(path, shuffle=True, shuffle_window=0)


# ---- real loaders over the S3 test server ----------------------------------------------------------------


@pytest.fixture
def proxied(s3_bucket):
    import s3fs

    from benchmarks.faults import FaultProxy
    from benchmarks.proxy import LatencyProxy

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/tar", counts=COUNTS, floats=256)
    sdx.build_index(f"s3://{bucket}/tar/", server.storage_options, progress=False)
    with FaultProxy(server.endpoint_url) as faults:
        up = urlsplit(faults.url)
        with LatencyProxy(up.hostname, up.port, delay_s=0.0) as latency:
            options = {**server.storage_options, "endpoint_url": f"http://127.0.0.1:{latency.port}"}
            yield f"s3://{bucket}/tar/", options, faults, latency


def _s3(spec, options, **kw):
    return sd.TarDataset(spec, storage_options=options, decode=False, shuffle=True, shuffle_window=W,
                         seed=5, **kw)


@pytest.mark.s3
def test_a_resume_fetches_the_rest_and_one_window_measured_at_a_proxy(proxied):
    spec, options, faults, latency = proxied
    full = [int(s["__key__"][1:]) for s in _s3(spec, options)]
    ds = _s3(spec, options)
    offsets = ds._index.offsets
    size = {}  # each sample's bytes, from the index
    n = 0
    for off in offsets:
        for i in range(len(off) - 1):
            size[n] = int(off[i + 1] - off[i])
            n += 1
    for stop in (5, 23, 40):
        ds = _s3(spec, options)
        it = iter(ds)
        before = [int(s["__key__"][1:]) for s in take(it, stop)]
        state = ds.state_dict()
        it.close()
        resumed = _s3(spec, options)
        resumed.load_state_dict(state)
        latency.reset_counters()
        faults.reset_counters()
        after = [int(s["__key__"][1:]) for s in resumed]
        assert before + after == full
        reread = resumed.counts["resumed.reread"]
        assert reread < W
        gets = faults.requests.get("get", 0)
        payload = sum(size[i] for i in after) + reread * max(size.values())
        # headers, and the end-of-archive marker and padding (to 10 KiB) of a range that ends a shard
        assert latency.bytes_down <= payload + gets * (2048 + 10240), (latency.bytes_down, payload, gets)
        piece = -(-W // min(W, 16))
        assert gets <= 2 * (-(-(len(after) + W) // piece))  # a piece: one ranged GET, two across a shard


@pytest.mark.s3
def test_stateful_dataloader_with_two_workers_resumes_in_order(proxied):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    spec, options, _, _ = proxied

    def loader(ds):
        return torchdata.StatefulDataLoader(ds, batch_size=None, num_workers=2, timeout=60,
                                            multiprocessing_context="fork")

    full = [i for b in loader(_s3(spec, options, batch_size=3)) for i in _ids(b)]
    assert sorted(full) == list(range(sum(COUNTS)))
    first = loader(_s3(spec, options, batch_size=3))
    it = iter(first)
    before = [i for _ in range(7) for i in _ids(next(it))]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = loader(_s3(spec, options, batch_size=3))
    resumed.load_state_dict(state)
    after = [i for b in resumed for i in _ids(b)]
    assert before + after == full


@pytest.mark.s3
def test_sd_loader_batches_in_workers_resumes_elsewhere_and_starts_the_next_epoch_early(proxied):
    spec, options, faults, _ = proxied
    ds = _s3(spec, options)
    epochs = []
    with sd.loader(ds, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        assert ds.early_next_epoch
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([i for b in loader for i in _ids(b)])
    late = _s3(spec, options)
    with sd.loader(late, batch_size=4, num_workers=2, persistent_workers=False) as loader:
        loader.set_epoch(1)
        assert [i for b in loader for i in _ids(b)] == epochs[1]  # adopted early: the same order
    assert all(sorted(e) == list(range(sum(COUNTS))) for e in epochs) and epochs[0] != epochs[1]
    with rank_env(1, 2):  # the early pass is adopted only if it equals the pass iter() plans
        assert late._plan_pass(1, 4, False) == late._plan_pass(1, 4, False)
        assert late._plan_pass(1, 4, False).windows is not None
    with sd.loader(_s3(spec, options), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        before = [i for _ in range(5) for i in _ids(next(it))]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
    assert state["shuffle"] == f"block:{W}"
    with sd.loader(_s3(spec, options), batch_size=4, num_workers=0) as loader:  # another world
        loader.load_state_dict(state)
        after = [i for b in loader for i in _ids(b)]
    assert sorted(before + after) == list(range(sum(COUNTS))) and len(before + after) == sum(COUNTS)


def test_the_quality_benchmark_runs_small(capsys):
    from benchmarks import shuffle_quality

    shuffle_quality.main(["--samples", "2000", "--shards", "10", "--classes", "10", "--memory", "64",
                          "--epochs", "1", "--resumes", "2"])
    out = capsys.readouterr().out
    assert "block/16" in out and "buffer" in out and "uniform" in out
