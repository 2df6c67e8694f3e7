"""sd.Mix: weighted sampling from a tar (with an index) and a Parquet source.

Proportions; every source's epoch exactly once over simulated ranks x real workers (the ranks
take equal steps); stop="first" / "all" / samples=N; resume on the same world (the uninterrupted
order) and on another (what each source has left, no duplicate) with torchdata's
StatefulDataLoader and with sd.loader; foreign states and bad arguments refused."""

from __future__ import annotations

import collections
import json
import logging
import time

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamdata as sd
from streamdata.catalog import index as sdx
from streamdata.epoch.mix import choices, counts_before
from streamdata.epoch.state import merge_states
from tests.helpers import rank_env, stop_and_resume, take, write_shards, write_tables

COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11]  # 58 tar samples
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows
TOTAL = [58, 65]


def tar_row(sample):
    return {"src": 0, "id": int(sample["__key__"][1:])}


def pq_row(row):
    return {"src": 1, "id": int(row["id"])}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("mix"))


def make_data(root) -> str:
    """A tar source with an index and a Parquet source under ``root``."""
    (root / "tar").mkdir()
    (root / "pq").mkdir()
    write_shards(fsspec.filesystem("file"), str(root / "tar"), counts=COUNTS)
    sdx.build_index(str(root / "tar") + "/", progress=False)
    write_tables(fsspec.filesystem("file"), str(root / "pq"), ROW_GROUPS)
    return str(root)


def make(root, weights=(1, 1), **kw):
    tar = sd.TarDataset(root + "/tar/", map=tar_row, shuffle=True, seed=1, shuffle_buffer=kw.pop("buffer", 0),
                        index=kw.pop("index", "auto"))
    parquet = sd.ParquetDataset(root + "/pq/", map=pq_row, shuffle=True, seed=2)
    weights = list(weights) if isinstance(weights, (list, tuple)) else weights  # (or a Schedule)
    return sd.Mix([tar, parquet], weights=weights, seed=kw.pop("seed", 7), **kw)


def pairs(item):
    src, ids = item["src"], item["id"]
    if isinstance(src, torch.Tensor) and src.dim():
        return list(zip(src.tolist(), ids.tolist(), strict=True))
    return [(int(src), int(ids))]


def run_rank(mix, rank, world_size, workers):
    """The batches (lists of (source, id)) one simulated rank's DataLoader yields."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(mix, batch_size=None, num_workers=workers,
                                             timeout=60 if workers else 0)
        return [pairs(b) for b in loader]


def check_once(got, mix, stop):
    """Each source's epoch exactly once: no duplicate; with stop="first", what was not delivered
    is counted; with "all", every sample came and the rest are counted cycles."""
    counts = mix.counts
    for k, total in enumerate(TOTAL):
        ids = [i for s, i in got if s == k]
        if stop == "first":
            assert len(ids) == len(set(ids)), f"source {k}: duplicates"
            assert set(ids) <= set(range(total))
            assert len(ids) + counts[f"mix.undelivered.{k}"] == total, f"source {k}: lost samples"
        else:
            assert set(ids) == set(range(total)), f"source {k}: not every sample"
            assert len(ids) == total + counts[f"mix.cycled.{k}"], f"source {k}: uncounted repeats"


# ---- the choices -------------------------------------------------------------------------


@pytest.mark.slow
def test_proportions_within_two_percent_over_10000_samples(data):
    weights = [0.6, 0.3, 0.1]
    tar = sd.TarDataset(data + "/tar/", map=tar_row)
    other = sd.TarDataset(data + "/tar/", map=lambda s: {**tar_row(s), "src": 2})
    mix = sd.Mix([tar, sd.ParquetDataset(data + "/pq/", map=pq_row), other], weights=weights, seed=3,
                 samples=10_000)
    got = collections.Counter(s["src"] for s in mix)
    assert sum(got.values()) == 10_000
    for k, w in enumerate(weights):
        assert abs(got[k] / 10_000 - w) < 0.02, (k, got)
    assert mix.counts["mix.cycled.0"] > 0 and mix.counts["mix.taken.2"] == got[2]


def test_choices_are_seeded_per_epoch_and_worker_and_resumable():
    """MIX-CHOICES: a reader's choices are a function of seed, epoch, stage, worker and position."""
    probs = np.array([0.5, 0.5])
    head = lambda it, n: [next(it) for _ in range(n)]  # noqa: E731
    a = head(choices(probs, 0, 1, 0, 0), 3000)
    assert a == head(choices(probs, 0, 1, 0, 0), 3000)  # no rank in the seed: the same on every rank
    assert a != head(choices(probs, 0, 2, 0, 0), 3000) and a != head(choices(probs, 0, 1, 0, 1), 3000)
    assert head(choices(probs, 0, 1, 0, 0, start=1500), 1500) == a[1500:]  # a position, not a replay
    assert counts_before(probs, 0, 1, 0, 0, 2500) == np.bincount(a[:2500], minlength=2).tolist()


# ---- exactly once, equal steps -------------------------------------------------------------


@pytest.mark.parametrize("stop", ["first", "all"])
@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2), (3, 1)])
def test_each_source_exactly_once_and_equal_steps(data, stop, world_size, workers):
    for epoch in (0, 1):
        mix = make(data, weights=(2, 1), stop=stop, batch_size=4)
        mix.set_epoch(epoch)
        per_rank = [run_rank(mix, r, world_size, workers) for r in range(world_size)]
        steps = [len(b) for b in per_rank]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        check_once([p for batches in per_rank for b in batches for p in b], mix, stop)


def test_samples_n_divides_over_the_job(data):
    mix = make(data, weights=(1, 3), samples=300, batch_size=8)
    per_rank = [run_rank(mix, r, 3, 2) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    got = [p for batches in per_rank for b in batches for p in b]
    assert len(got) == 300 and mix.counts["mix.left_out"] == 0
    assert mix.counts["mix.cycled.1"] > 0
    odd = make(data, samples=301)
    assert sum(len(b) for r in range(2) for b in run_rank(odd, r, 2, 0)) == 300
    assert odd.counts["mix.left_out"] == 1


def test_epochs_differ_and_repeat(data):
    mix = make(data)
    first = [p for s in mix for p in pairs(s)]
    mix.set_epoch(1)
    second = [p for s in mix for p in pairs(s)]
    mix.set_epoch(0)
    assert first != second and [p for s in mix for p in pairs(s)] == first


# ---- resume ----------------------------------------------------------------------------------

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def _stateful(ds, workers):
    return torchdata.StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                        timeout=60 if workers else 0,
                                        multiprocessing_context="fork" if workers else None)


@pytest.mark.parametrize("stop,at", [("first", 9), ("all", 9), ("all", 25)])  # 25: a source cycled
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_in_the_same_order(data, stop, at, workers, caplog):
    kw = dict(weights=(1, 2), stop=stop, batch_size=5, buffer=6)
    full = [p for b in _stateful(make(data, **kw), workers) for p in pairs(b)]
    loader = _stateful(make(data, **kw), workers)
    it = iter(loader)
    before = [p for b in take(it, at) for p in pairs(b)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    mix = make(data, **kw)
    resumed = _stateful(mix, workers)
    resumed.load_state_dict(state)
    with caplog.at_level(logging.WARNING):
        after = [p for b in resumed for p in pairs(b)]
    assert "fast-forwarding" not in caplog.text, "torchdata replayed the epoch"
    assert before + after == full
    assert sum(mix.counts[f"mix.taken.{k}"] for k in (0, 1)) == len(after), "samples taken again"


def legs(data, kw, worlds, at):
    """Runs of simulated ranks (direct iteration), each leg's ranks stopping after ``at`` batches
    and their states merged for the next leg; the last leg runs to the end. Returns every
    (source, id) delivered, every Mix made, and the last leg's steps per rank."""
    got, mixes, state = [], [], None
    for leg, ranks in enumerate(worlds):
        states, steps = [], []
        for rank in range(ranks):
            with rank_env(rank, ranks):
                mixes.append(make(data, **kw))
                if state is not None:
                    mixes[-1].load_state_dict(state)
                it = iter(mixes[-1])
                batches = [pairs(b) for b in (take(it, at) if leg < len(worlds) - 1 else it)]
                steps.append(len(batches))
                got += [p for b in batches for p in b]
                states.append(mixes[-1].state_dict())
                it.close()
        assert len(set(steps)) == 1, f"leg {leg}: unequal steps {steps}"
        state = json.loads(json.dumps(merge_states(states)))
    return got, mixes, steps


def check_sources(got, mixes, kw):
    for k, total in enumerate(TOTAL):
        ids = collections.Counter(i for s, i in got if s == k)
        if kw.get("stop") == "first":
            assert max(ids.values()) == 1, f"source {k} duplicates"
            lost = sum(m.counts[f"mix.undelivered.{k}"] for m in mixes)
            assert sum(ids.values()) + lost == total, f"source {k}: lost or counted twice"
        elif kw.get("stop") == "all":
            assert set(ids) == set(range(total))
            cycled = sum(m.counts[f"mix.cycled.{k}"] for m in mixes)
            assert sum(ids.values()) == total + cycled, f"source {k}: uncounted repeats"
    if kw.get("samples"):
        assert len(got) + sum(m.counts["mix.left_out"] for m in mixes) == kw["samples"]


ENDS = [{"stop": "first"}, {"stop": "all"}, {"samples": 241}]  # (241: what ranks cannot share, counted)


@pytest.mark.parametrize("at", [6, 20])  # at 20 the tar source ran out on every old reader
@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (1, 2)])
def test_another_world_gets_what_each_source_has_left(data, end, at, old, new):
    kw = dict(weights=(3, 1), batch_size=3, buffer=5, **end)
    got, mixes, _ = legs(data, kw, [old, new], at)
    check_sources(got, mixes, kw)


@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
def test_three_worlds_in_one_epoch(data, end):
    kw = dict(weights=(1, 2), batch_size=2, buffer=3, **end)
    got, mixes, _ = legs(data, kw, [2, 3, 3, 1], 5)  # (3 then 3: the same shape continues)
    check_sources(got, mixes, kw)


@pytest.mark.parametrize("weights,old,new,at", [((2, 1), 2, 3, 15), ((1, 1), 2, 1, 20)])
def test_a_reader_that_ends_at_its_first_choice_counts_what_it_holds(data, weights, old, new, at):
    """stop="first" on another world: a new reader whose first choice falls on a source whose
    re-divided quota is 0 yields nothing; what it holds of the others is counted undelivered."""
    kw = dict(weights=weights, batch_size=3, stop="first")
    got, mixes, _ = legs(data, kw, [old, new], at)
    check_sources(got, mixes, kw)


def _dataset_states(loader_state):
    """The dataset states in a StatefulDataLoader's state (torchdata 0.11's layout)."""
    if "_snapshot" not in loader_state:
        return [loader_state["dataset_state"]]
    return [w["dataset_state"] for w in loader_state["_snapshot"]["_worker_snapshots"].values()]


@pytest.mark.parametrize("stop", ["first", "all"])
def test_stateful_dataloader_states_merged_restart_another_world(data, stop):
    """2 simulated ranks x 2 workers under StatefulDataLoader; every worker's state merged
    (docs/resume.md's recipe) restarts on 3 ranks x 1 worker: each source once, equal steps."""
    kw = dict(weights=(2, 1), stop=stop, batch_size=4, buffer=5)
    before, states, olds = [], [], []
    for rank in range(2):
        with rank_env(rank, 2):
            olds.append(make(data, **kw))
            loader = _stateful(olds[-1], 2)
            it = iter(loader)
            before += [p for b in take(it, 7) for p in pairs(b)]
            states += _dataset_states(loader.state_dict())
            del it
    state = json.loads(json.dumps(merge_states(states)))
    resumed = make(data, **kw)
    resumed.load_state_dict(state)
    per_rank = [run_rank(resumed, r, 3, 1) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1, [len(b) for b in per_rank]
    got = before + [p for batches in per_rank for b in batches for p in b]
    for k, total in enumerate(TOTAL):
        ids = collections.Counter(i for s, i in got if s == k)
        if stop == "first":
            assert max(ids.values()) == 1
            lost = sum(m.counts[f"mix.undelivered.{k}"] for m in [resumed, *olds])
            assert sum(ids.values()) + lost == total
        else:
            assert set(ids) == set(range(total))
            assert sum(ids.values()) == total + sum(m.counts[f"mix.cycled.{k}"] for m in [resumed, *olds])


@pytest.mark.parametrize("workers,new_workers", [(2, 2), (2, 0), (0, 3)])
def test_sd_loader_state_restarts_any_number_of_workers(data, workers, new_workers):
    kw = dict(weights=(1, 1), stop="first")
    with sd.loader(make(data, **kw), batch_size=4, num_workers=workers) as loader:
        full = [p for b in loader for p in pairs(b)]
    with sd.loader(make(data, **kw), batch_size=4, num_workers=workers) as loader:
        it = iter(loader)
        before = [p for _ in range(5) for p in pairs(next(it))]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
    assert state["split"] == "mix" and None not in state["stages"][-1]["delivered"]
    assert sum(e["t"] for e in state["stages"][-1]["delivered"]) == len(before)
    mix = make(data, **kw)
    with sd.loader(mix, batch_size=4, num_workers=new_workers) as loader:
        loader.load_state_dict(state)
        after = [p for b in loader for p in pairs(b)]
    got = collections.Counter(before + after)
    assert max(got.values()) == 1
    if workers == new_workers:  # the same readers stop where they would have: the same samples
        assert set(got) == set(full)
    for k, total in enumerate(TOTAL):
        assert sum(1 for s, _ in got if s == k) + mix.counts[f"mix.undelivered.{k}"] == total


MIX_COUNTERS = ("mix.taken.", "mix.cycled.", "mix.undelivered.", "mix.left_out")


def _own(counts):
    return {name: n for name, n in counts.items() if name.startswith(MIX_COUNTERS)}


@pytest.mark.parametrize("end,schedule", [({"stop": "first"}, False), ({"stop": "first"}, True),
                                          ({"stop": "all"}, False), ({"samples": 241}, True)],
                         ids=["first", "first-schedule", "all", "samples-schedule"])
def test_counts_saved_near_the_epoch_s_end_follow_the_batches_received(data, end, schedule):
    """CONSUMED-POSITION for the mix's counters: 2 simulated ranks x 2 workers through sd.loader
    save one step before the epoch's end, once every worker has run its pass to its end (its
    counters say so: they match an uninterrupted run's); restarted on 3 ranks x 1 worker, each
    source once and the counts over both runs exact (what the workers had counted ahead of the
    loop is counted where it was received: not twice)."""
    from tests.datasets.test_mix_schedule import ANNEAL

    kw = dict(weights=sd.Schedule(ANNEAL) if schedule else (2, 1), **end)
    got, mixes, states = [], [], []
    for rank in range(2):
        with rank_env(rank, 2):
            whole = make(data, **kw)
            with sd.loader(whole, batch_size=3, num_workers=2) as loader:
                steps = sum(1 for _ in loader)
            mixes.append(make(data, **kw))
            with sd.loader(mixes[-1], batch_size=3, num_workers=2) as loader:
                it = iter(loader)
                got += [p for b in take(it, steps - 1) for p in pairs(b)]
                deadline = time.monotonic() + 60  # the workers run to their passes' ends
                while _own(mixes[-1]._counters.snapshot()) != _own(whole.counts):
                    assert time.monotonic() < deadline, "the workers did not end their passes"
                    time.sleep(0.02)
                assert _own(mixes[-1].counts) != _own(whole.counts)  # the last step not received
                states.append(loader.state_dict())
                del it
    state = json.loads(json.dumps(merge_states(states)))
    for rank in range(3):
        with rank_env(rank, 3):
            mixes.append(make(data, **kw))
            with sd.loader(mixes[-1], batch_size=3, num_workers=1) as loader:
                loader.load_state_dict(state)
                got += [p for b in loader for p in pairs(b)]
    check_sources(got, mixes, kw)
    for k in range(2):
        taken = sum(m.counts[f"mix.taken.{k}"] for m in mixes)
        assert taken == sum(1 for s, _ in got if s == k), f"source {k}: taken {taken}"


# ---- refused -----------------------------------------------------------------------------------


def test_foreign_states_are_refused_naming_what_differs(data):
    mix = make(data)
    state = mix.state_dict()
    with pytest.raises(sd.SpecError, match="weights"):
        make(data, weights=(1, 2)).load_state_dict(state)
    with pytest.raises(sd.SpecError, match="stop"):
        make(data, stop="all").load_state_dict(state)
    other = sd.Mix([sd.TarDataset(data + "/tar/", map=tar_row, shuffle=True, seed=9),
                    sd.ParquetDataset(data + "/pq/", map=pq_row, shuffle=True, seed=2)], seed=7)
    with pytest.raises(sd.SpecError, match=r"source 0 \(TarDataset\) differs"):
        other.load_state_dict(state)
    plain = sd.TarDataset(data + "/tar/")
    with pytest.raises(sd.SpecError, match="not of a Mix"):
        mix.load_state_dict(plain.state_dict())
    with pytest.raises(sd.SpecError, match="another dataset"):
        plain.load_state_dict(state)
    mix.load_state_dict(json.loads(json.dumps(state)))  # its own: accepted


def test_bad_arguments_are_refused(data):
    tar = lambda **kw: sd.TarDataset(data + "/tar/", **kw)  # noqa: E731
    with pytest.raises(sd.SpecError, match="one weight per source"):
        sd.Mix([tar(), tar()], weights=[1])
    with pytest.raises(sd.SpecError, match="> 0"):
        sd.Mix([tar(), tar()], weights=[1, 0])
    with pytest.raises(sd.SpecError, match="sharded"):
        sd.Mix([tar(), [1, 2, 3]])
    with pytest.raises(sd.SpecError, match="batches itself"):
        sd.Mix([tar(), tar(batch_size=4)])
    with pytest.raises(sd.SpecError, match="not both"):
        sd.Mix([tar()], stop="all", samples=10)
    with pytest.raises(sd.SpecError, match="'first' or 'all'"):
        sd.Mix([tar()], stop="longest")
    t = tar()
    with pytest.raises(sd.SpecError, match="same dataset object"):
        sd.Mix([t, t])


def test_a_state_saved_after_the_last_batch_is_the_next_epochs_start_on_any_world(data):
    """CONSUMED-POSITION (feed/checkpoint.py): once the epoch's iteration has ended (stop="first":
    what the readers left is counted as undelivered), the state is the next epoch's start;
    restarted on another world it reads that epoch as a fresh loader set to it does."""
    kw = dict(weights=(3, 1), stop="first")
    mix = make(data, **kw)
    with sd.loader(mix, batch_size=1, num_workers=2) as loader:  # (every last batch is full)
        got = [p for b in loader for p in pairs(b)]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 1 and state["stages"] == []
    assert mix.counts["mix.undelivered.1"] > 0
    assert len(got) + sum(mix.counts[f"mix.undelivered.{k}"] for k in (0, 1)) == sum(TOTAL)
    for workers in (0, 3):
        with sd.loader(make(data, **kw), batch_size=4, num_workers=workers) as loader:
            loader.load_state_dict(state)
            resumed = [p for b in loader for p in pairs(b)]
        fresh = make(data, **kw)
        fresh.set_epoch(1)
        with sd.loader(fresh, batch_size=4, num_workers=workers) as loader:
            assert resumed == [p for b in loader for p in pairs(b)] and resumed


@pytest.mark.parametrize("stop", ["first", "all"])
def test_a_source_without_counts_ends_when_it_runs_out_and_resumes(data, stop):
    """A tar source without its index (a shard-level split): no quotas; the reader's epoch ends
    when a source runs out on it ("first") or when the last one does ("all"); resume is exact."""
    kw = dict(weights=(1, 1), stop=stop, batch_size=4, index=None)
    mix = make(data, **kw)
    full = [p for b in _stateful(mix, 2) for p in pairs(b)]
    for k, total in enumerate(TOTAL):
        ids = collections.Counter(i for s, i in full if s == k)
        if stop == "first":
            assert max(ids.values()) == 1 and set(ids) <= set(range(total))
        else:
            assert set(ids) == set(range(total))
            assert sum(ids.values()) == total + mix.counts[f"mix.cycled.{k}"]
    assert stop_and_resume(lambda: _stateful(make(data, **kw), 2), 8, pairs) == full


def test_persistent_workers_follow_set_epoch(data):
    kw = dict(weights=(1, 1), stop="first")
    expected = []
    for epoch in (0, 1):
        with sd.loader(make(data, **kw), batch_size=4, num_workers=2, persistent_workers=False) as loader:
            loader.set_epoch(epoch)
            expected.append(sorted(p for b in loader for p in pairs(b)))
    assert expected[0] != expected[1]
    with sd.loader(make(data, **kw), batch_size=4, num_workers=2) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert sorted(p for b in loader for p in pairs(b)) == expected[epoch]


def flaky_row(sample):
    n = int(sample["__key__"][1:])
    if n % 10 == 0:
        raise sd.DecodeError(f"no sample {n}", url=sample["__url__"], key=sample["__key__"])
    return {"src": 0, "id": n}


def test_the_sources_counters_are_the_mixs(data):
    tar = sd.TarDataset(data + "/tar/", map=flaky_row, on_error="skip")
    mix = sd.Mix([tar, sd.ParquetDataset(data + "/pq/", map=pq_row)], weights=[1, 1], stop="all")
    got = [p for s in mix for p in pairs(s)]
    skipped = sum(mix.skipped.values())
    assert skipped == sum(tar.skipped.values()) > 0
    assert mix.counts["skipped.other"] + mix.counts["skipped.decode"] == skipped
    assert not [i for s, i in got if s == 0 and i % 10 == 0]
    assert set(mix.retried) == set(tar.retried)


def test_a_source_that_never_yields_cannot_be_cycled(data, tmp_path):
    write_shards(fsspec.filesystem("file"), str(tmp_path), counts=[0, 0])
    empty = sd.TarDataset(str(tmp_path) + "/", index=None, map=tar_row)
    with pytest.raises(sd.SpecError, match="no samples"):  # counts known: refused at once
        sd.Mix([make(data).sources[0], _empty_parquet(tmp_path)], stop="all")
    mix = sd.Mix([sd.ParquetDataset(data + "/pq/", map=pq_row), empty], samples=50)
    with pytest.raises(sd.StreamDataError, match="no sample in 3 epochs in a row"):
        list(mix)


def _empty_parquet(tmp_path):
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "pq" / "empty.parquet")
    return sd.ParquetDataset(str(tmp_path / "pq") + "/", map=pq_row)
