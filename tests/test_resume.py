"""Mid-epoch resume of a dataset (state_dict / load_state_dict): tar with and without a sample
index, Parquet; the same world continues in the same order (shuffle buffer included:
RESUME-BUFFER), another world gets what is left in equal spans (EQUAL-STEPS); a foreign state is
refused. Simulated ranks (RANK/WORLD_SIZE) over direct iteration; real DataLoader workers and
torchdata's StatefulDataLoader are in test_resume_loaders.py."""

from __future__ import annotations

import collections
import json

import fsspec
import numpy as np
import pyarrow as pa
import pytest

import streamdata as sd
from streamdata.catalog import index as sdx
from streamdata.epoch.state import merge_states
from streamdata.errors import SpecError
from tests.helpers import rank_env, take, write_shards, write_tables

COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11]  # 58 samples, uneven on purpose
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows


@pytest.fixture
def tar_dir(tmp_path):
    keys = write_shards(fsspec.filesystem("file"), str(tmp_path), counts=COUNTS)
    return str(tmp_path) + "/", keys


@pytest.fixture
def parquet_dir(tmp_path):
    return str(tmp_path) + "/", write_tables(fsspec.filesystem("file"), str(tmp_path), ROW_GROUPS)


def _ids(batch):
    return list(batch["__key__"]) if "__key__" in batch else batch["id"].tolist()


def _make(kind, path, **kw):
    if kind == "parquet":
        return sd.ParquetDataset(path, **kw)
    return sd.TarDataset(path, decode=False, index="auto" if kind == "indexed" else None, **kw)


@pytest.mark.parametrize("kind", ["indexed", "unindexed", "parquet"])
@pytest.mark.parametrize("shuffle,buffer", [(False, 0), (True, 0), (True, 5), (True, 40)])
def test_the_same_world_continues_in_the_same_order(tar_dir, parquet_dir, kind, shuffle, buffer):
    path, everything = parquet_dir if kind == "parquet" else tar_dir
    if kind == "indexed":
        sdx.build_index(path, progress=False)
    if kind == "unindexed" and buffer:
        pytest.skip("a shard-level split behind a shuffle buffer resumes by position only (docs/resume.md)")
    kw = dict(batch_size=3, shuffle=shuffle, shuffle_buffer=buffer, seed=3)
    full = [i for b in _make(kind, path, **kw) for i in _ids(b)]
    assert sorted(full) == sorted(everything)
    for stop in (0, 1, 4, 9, 30):
        ds = _make(kind, path, **kw)
        it = iter(ds)
        before = [i for b in take(it, stop) for i in _ids(b)]
        state = json.loads(json.dumps(ds.state_dict()))  # plain data
        it.close()
        assert state["format"] == "streamdata-state" and state["version"] == 1
        resumed = _make(kind, path, **kw)
        resumed.load_state_dict(state)
        after = [i for b in resumed for i in _ids(b)]
        assert before + after == full, f"stop {stop}: not the uninterrupted pass"


def test_a_state_saved_twice_resumes_again(tar_dir):
    path, _ = tar_dir
    sdx.build_index(path, progress=False)
    kw = dict(batch_size=2, shuffle=True, shuffle_buffer=7, seed=1)
    full = [i for b in _make("indexed", path, **kw) for i in _ids(b)]
    got, state = [], None
    for leg in (3, 4, 5, 100):
        ds = _make("indexed", path, **kw)
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        got += [i for b in take(it, leg) for i in _ids(b)]
        state = ds.state_dict()
        it.close()
    assert got == full


@pytest.mark.parametrize("kind,buffer", [("indexed", 0), ("indexed", 6), ("unindexed", 0), ("parquet", 0),
                                         ("parquet", 10)])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (2, 2), (1, 4)])
def test_another_world_gets_what_is_left_in_equal_steps(tar_dir, parquet_dir, kind, buffer, old, new):
    path, everything = parquet_dir if kind == "parquet" else tar_dir
    if kind == "indexed":
        sdx.build_index(path, progress=False)
    kw = dict(batch_size=4, shuffle=True, shuffle_buffer=buffer, seed=5)
    before, states = [], []
    for rank in range(old):
        with rank_env(rank, old):
            ds = _make(kind, path, **kw)
            it = iter(ds)
            before += [i for b in take(it, 2) for i in _ids(b)]  # DDP ranks stop at one step
            states.append(ds.state_dict())
            it.close()
    state = json.loads(json.dumps(merge_states(states)))
    after, steps = [], []
    for rank in range(new):
        with rank_env(rank, new):
            ds = _make(kind, path, **kw)
            ds.load_state_dict(state)
            batches = list(ds)
            steps.append(len(batches))
            after += [i for b in batches for i in _ids(b)]
    got = collections.Counter(before + after)
    assert sorted(got) == sorted(everything), "a sample lost"
    assert max(got.values()) == 1, f"duplicates: {[k for k, n in got.items() if n > 1]}"
    if kind != "unindexed":  # exact epochs: EQUAL-STEPS on the new ranks
        assert len(set(steps)) == 1, steps


def test_a_state_with_one_readers_position_resumes_only_on_its_world(tar_dir):
    path, _ = tar_dir
    sdx.build_index(path, progress=False)
    with rank_env(0, 2):
        ds = _make("indexed", path, batch_size=2)
        it = iter(ds)
        next(it)
        state = ds.state_dict()
        it.close()
    assert state["stages"][0]["delivered"] == [2, None]
    with rank_env(0, 3):
        other = _make("indexed", path, batch_size=2)
        other.load_state_dict(state)
        with pytest.raises(SpecError, match="same world shape"):
            iter(other)


def test_a_foreign_state_is_refused(tar_dir, parquet_dir):
    path, _ = tar_dir
    ds = _make("unindexed", path, batch_size=2, seed=1)
    state = ds.state_dict()
    with pytest.raises(SpecError, match="another dataset"):
        _make("unindexed", path, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(SpecError, match="another dataset"):
        _make("parquet", parquet_dir[0], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(SpecError, match="version"):
        ds.load_state_dict({**state, "version": 99})
    with pytest.raises(SpecError, match="not a streamdata state"):
        ds.load_state_dict({"epoch": 1})
    sdx.build_index(path, progress=False)  # the split changes: samples, not shards
    with pytest.raises(SpecError, match="another dataset"):
        _make("indexed", path, batch_size=2, seed=1).load_state_dict(state)
    resumed = _make("unindexed", path, batch_size=3, seed=1, drop_last=True)
    resumed.load_state_dict(state)
    with pytest.raises(SpecError, match="same batching"):
        iter(resumed)


def test_resume_seeks_and_counts_what_it_reads_again(tar_dir):
    """Without an index a partly read shard is read again up to the position (counted); whole
    shards delivered are not read at all."""
    path, _ = tar_dir
    ds = _make("unindexed", path, batch_size=4)
    it = iter(ds)
    before = [i for b in take(it, 4) for i in _ids(b)]  # 16 samples: shards 0-2 (15), 1 of shard 3
    state = ds.state_dict()
    it.close()
    assert state["stages"][0]["delivered"] == [[3, 1]]
    resumed = _make("unindexed", path, batch_size=4)
    resumed.load_state_dict(state)
    after = [i for b in resumed for i in _ids(b)]
    assert len(before) + len(after) == sum(COUNTS) and not set(before) & set(after)
    assert resumed.counts["resumed.reread"] == 1


def test_the_epoch_after_a_resumed_one_is_whole(tar_dir):
    path, everything = tar_dir
    sdx.build_index(path, progress=False)
    ds = _make("indexed", path, batch_size=4, shuffle=True)
    ds.set_epoch(2)
    it = iter(ds)
    take(it, 2)
    state = ds.state_dict()
    it.close()
    assert state["epoch"] == 2
    resumed = _make("indexed", path, batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert len([i for b in resumed for i in _ids(b)]) == len(everything) - 8
    resumed.set_epoch(3)
    assert sorted(i for b in resumed for i in _ids(b)) == sorted(everything)


@pytest.mark.parametrize("stream", [False, True], ids=["files", "with-a-stream"])
def test_arrow_record_batches_resume(tmp_path, stream):
    """ArrowDataset resumes too: IPC files have row counts (a sample-level position); one IPC
    stream object among them splits record batches whole (a unit-level position)."""
    ids = 0
    for i, groups in enumerate(ROW_GROUPS + ([[4, 2]] if stream else [])):
        name = f"part-{i}.arrows" if stream and i == len(ROW_GROUPS) else f"part-{i}.arrow"
        with pa.OSFile(str(tmp_path / name), "wb") as f, \
                (pa.ipc.new_stream if name.endswith("s") else pa.ipc.new_file)(
                    f, pa.schema([("id", pa.int64())])) as w:
            for n in groups:
                w.write_table(pa.table({"id": np.arange(ids, ids + n)}))
                ids += n
    kw = dict(batch_size=4, shuffle=True, shuffle_buffer=0, seed=3)
    full = [i for b in sd.ArrowDataset(str(tmp_path) + "/", **kw) for i in _ids(b)]
    assert sorted(full) == list(range(ids))
    for stop in (1, 5, 9):
        ds = sd.ArrowDataset(str(tmp_path) + "/", **kw)
        it = iter(ds)
        before = [i for b in take(it, stop) for i in _ids(b)]
        state = json.loads(json.dumps(ds.state_dict()))
        it.close()
        assert state["split"] == ("units" if stream else "samples")
        resumed = sd.ArrowDataset(str(tmp_path) + "/", **kw)
        resumed.load_state_dict(state)
        assert before + [i for b in resumed for i in _ids(b)] == full


def test_an_inexact_resume_says_so(tar_dir, caplog):
    """A shard-level split behind a shuffle buffer resumes within a buffer only: a warning."""
    path, _ = tar_dir
    ds = _make("unindexed", path, batch_size=2, shuffle=True, shuffle_buffer=8)
    it = iter(ds)
    take(it, 3)
    state = ds.state_dict()
    it.close()
    with caplog.at_level("WARNING", logger="streamdata"):
        _make("unindexed", path, batch_size=2, shuffle=True, shuffle_buffer=8).load_state_dict(state)
    assert "delivered twice or not at all" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="streamdata"):
        _make("unindexed", path, batch_size=2, shuffle=True, shuffle_buffer=0).load_state_dict(
            _make("unindexed", path, batch_size=2, shuffle=True, shuffle_buffer=0).state_dict())
    assert "delivered twice" not in caplog.text



def test_a_state_resumes_whatever_the_fetch_settings(tmp_path):
    """ORDER-NOT-IO: the default block window follows the shards, not ``byte_budget``; a state saved
    with the default 64 MiB resumes exactly with 16 MiB and without autotune (samples of 40 kB,
    where a window sized from the budget would be about 800 samples against 200: refused)."""
    path = str(tmp_path) + "/"
    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[70, 90, 60, 80], floats=10_000)
    sdx.build_index(path, progress=False)

    def make(**more):
        return _make("indexed", path, batch_size=8, shuffle=True, seed=2, **more)

    full = [i for b in make(byte_budget=64 << 20) for i in _ids(b)]
    ds = make(byte_budget=64 << 20)
    it = iter(ds)
    before = [i for b in take(it, 11) for i in _ids(b)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    resumed = make(byte_budget=16 << 20, autotune=False)
    resumed.load_state_dict(state)
    assert before + [i for b in resumed for i in _ids(b)] == full
