"""sd.Mix with an ``sd.Schedule`` of weights: the realised proportions follow the schedule per
tenth of the epoch over every reader (on one world and across an elastic restart); the pass draws
exactly the choices the schedule says; resume on the same world continues the uninterrupted run,
on another every source's epoch once; ``len()`` exact; functions picklable (spawn workers); bad
schedules refused; docs/mix.md's "Schedules" recipe runs."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import streamdata as sd
from streamdata.epoch.mix import Scheduled, choices, counts_before, split_budget, taken_in_stage
from tests.datasets.test_mix import (
    ENDS,
    _stateful,
    check_sources,
    legs,
    make,
    make_data,
    pairs,
    pq_row,
    tar_row,
)
from tests.helpers import doc_blocks, rank_env, stop_and_resume, stopped_state

ROOT = Path(__file__).resolve().parents[2]
ANNEAL = [(0.0, [0.9, 0.1]), (1.0, [0.5, 0.5])]  # source 1's share from 10% to 50% over the epoch


def anneal(x: float) -> list[float]:
    """ANNEAL as a function (module level: picklable)."""
    return [0.9 - 0.4 * x, 0.1 + 0.4 * x]


def scaled(x: float, top: float) -> list[float]:
    return [1.0, top * x + 0.1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("mix-schedule"))


# ---- the schedule and the choices -------------------------------------------------------------


def test_a_schedule_interpolates_between_points_and_holds_outside():
    s = sd.Schedule([(0.2, [1.0, 3.0]), (0.6, [3.0, 1.0])])
    assert s(0.0) == [1.0, 3.0] and s(0.2) == [1.0, 3.0] and s(0.4) == [2.0, 2.0]
    assert s(0.6) == [3.0, 1.0] and s(1.0) == [3.0, 1.0]
    assert sd.Schedule(anneal)(0.5) == pytest.approx([0.7, 0.3])
    assert s.describe() == {"by": "fraction", "points": [[0.2, [1.0, 3.0]], [0.6, [3.0, 1.0]]]}
    described = sd.Schedule(anneal, by="samples").describe()
    assert described["by"] == "samples" and described["function"].endswith("test_mix_schedule.anneal")


def _shares(streams: list[tuple[list[int], int, int]], total: int, windows: int = 10) -> list[float]:
    """Source 1's share of every tenth of the epoch: ``streams`` of (choices, the epoch's samples
    taken before the stage, the stage's readers); a choice at position t is at ``before + t *
    readers`` of ``total``."""
    got, of = np.zeros(windows), np.zeros(windows)
    for chosen, before, readers in streams:
        x = (before + np.arange(len(chosen)) * readers) * windows // total
        np.add.at(of, np.minimum(x, windows - 1), 1)
        np.add.at(got, np.minimum(x, windows - 1), np.asarray(chosen) == 1)
    return (got / of).tolist()


def _expected(windows: int = 10) -> list[float]:
    return [0.1 + 0.4 * (i + 0.5) / windows for i in range(windows)]  # ANNEAL's mean in each tenth


def _stage(schedule, total, shape, start, stage, take_t=None):
    """Every reader's choices in a stage of ``shape`` (ranks x workers) of a ``samples=total`` epoch
    that began after ``start`` samples: (choices, start, readers) per reader."""
    ranks, workers = shape
    probs = Scheduled(schedule, start, ranks * workers, total)
    out = []
    for _rank, worker in itertools.product(range(ranks), range(workers)):
        budget = split_budget(total - start, shape, worker)[0] if take_t is None else take_t
        chosen = list(itertools.islice(choices(probs, 3, 0, stage, worker), budget))
        out.append((chosen, start, ranks * workers))
    return out


def test_the_realised_proportions_follow_the_schedule_in_every_tenth_of_the_epoch():
    """samples=N over 2 ranks x 4 workers: source 1's share of each tenth of the epoch, over every
    reader, is within 2% of the schedule's."""
    total = 400_000
    streams = _stage(sd.Schedule(ANNEAL), total, (2, 4), 0, 0)
    assert sum(len(c) for c, _, _ in streams) == total
    for got, want in zip(_shares(streams, total), _expected(), strict=True):
        assert abs(got - want) < 0.02, (got, want)


def test_the_proportions_follow_the_schedule_across_an_elastic_restart():
    """2 x 2 readers stop at 37% of the epoch; 3 x 2 readers take the rest: the new stage's readers
    start the schedule where the job stood (the samples the state says were taken)."""
    total, schedule = 400_000, sd.Schedule(ANNEAL)
    first = _stage(schedule, total, (2, 2), 0, 0, take_t=37_000)
    done = sum(len(c) for c, _, _ in first)
    second = _stage(schedule, total, (3, 2), done, 1)
    assert done + sum(len(c) for c, _, _ in second) == total
    for got, want in zip(_shares(first + second, total), _expected(), strict=True):
        assert abs(got - want) < 0.02, (got, want)


def test_a_schedule_s_choices_are_positions_and_counts_as_the_pass_draws():
    """MIX-CHOICES with a schedule: a position, not a replay; counts and ends from the same draws."""
    probs = Scheduled(sd.Schedule(ANNEAL), 0, 4, 10_000)
    head = list(itertools.islice(choices(probs, 0, 1, 0, 0), 3000))
    assert list(itertools.islice(choices(probs, 0, 1, 0, 0, start=1700), 1300)) == head[1700:]
    assert counts_before(probs, 0, 1, 0, 0, 2500) == np.bincount(head[:2500], minlength=2).tolist()
    ends = taken_in_stage(probs, 0, 1, 0, 0, [10_000, 200], "first")
    assert ends == [i for i, k in enumerate(head) if k == 1][200]  # the 201st choice of source 1
    later = Scheduled(sd.Schedule(ANNEAL), 5_000, 4, 10_000)  # the same stage, later in the job
    assert list(itertools.islice(choices(later, 0, 1, 0, 0), 3000)) != head


def _worker_row(row):
    info = torch.utils.data.get_worker_info()
    return {**row, "w": info.id if info is not None else 0}


BY_SAMPLES = sd.Schedule([(0, [1, 1]), (300, [1, 9])], by="samples")


@pytest.mark.parametrize("schedule", [sd.Schedule(ANNEAL), BY_SAMPLES], ids=["fraction", "samples"])
def test_each_reader_takes_the_choices_the_schedule_draws(data, schedule):
    """2 simulated ranks x 2 real workers, samples=1000: every reader's sources, in its order, are
    the choices drawn for its worker index from the schedule."""
    total, shape = 1000, (2, 2)
    for rank in range(2):
        with rank_env(rank, 2):
            mix = sd.Mix([sd.TarDataset(data + "/tar/", map=lambda s: _worker_row(tar_row(s))),
                          sd.ParquetDataset(data + "/pq/", map=lambda r: _worker_row(pq_row(r)))],
                         weights=schedule, samples=total, seed=11)
            loader = torch.utils.data.DataLoader(mix, batch_size=None, num_workers=2, timeout=60,
                                                 multiprocessing_context="fork")
            got = collections.defaultdict(list)
            for s in loader:
                got[int(s["w"])].append(int(s["src"]))
        probs = Scheduled(schedule, 0, 4, total)
        for w in range(2):
            budget = split_budget(total, shape, w)[0]
            assert got[w] == list(itertools.islice(choices(probs, 11, 0, 0, w), budget)), (rank, w)


# ---- resume -----------------------------------------------------------------------------------

SCHEDULES = {"fraction": sd.Schedule(ANNEAL),
             "samples": sd.Schedule([(0, [0.9, 0.1]), (60, [0.2, 0.8])], by="samples")}


@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
@pytest.mark.parametrize("by", sorted(SCHEDULES))
def test_stateful_dataloader_resumes_mid_schedule_in_the_same_order(data, end, by):
    kw = dict(weights=SCHEDULES[by], batch_size=5, buffer=6, **end)
    full = [p for b in _stateful(make(data, **kw), 2) for p in pairs(b)]
    assert stop_and_resume(lambda: _stateful(make(data, **kw), 2), 9, pairs) == full


@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1)])
def test_another_world_mid_schedule_gets_what_each_source_has_left(data, end, old, new):
    kw = dict(weights=sd.Schedule(ANNEAL), batch_size=3, buffer=5, **end)
    got, mixes, _ = legs(data, kw, [old, new], 7)
    check_sources(got, mixes, kw)


# ---- lengths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
@pytest.mark.parametrize("world_size,workers", [(2, 2), (3, 1)])
def test_a_scheduled_mix_s_len_is_the_batches_every_rank_yields(data, end, world_size, workers):
    for rank in range(world_size):
        with rank_env(rank, world_size):
            mix = make(data, weights=sd.Schedule(ANNEAL), **end)
            with sd.loader(mix, batch_size=3, num_workers=workers, persistent_workers=False) as loader:
                expected = len(loader)
                assert sum(1 for _ in loader) == expected, rank


@pytest.mark.parametrize("end", ENDS, ids=["first", "all", "samples"])
def test_a_resumed_scheduled_mix_counts_the_steps_before_with_those_left(data, end):
    kw = dict(weights=sd.Schedule(ANNEAL), batch_size=3, **end)
    state = stopped_state(lambda: make(data, **kw), 2, 4)
    for rank in range(3):
        with rank_env(rank, 3):
            whole = len(make(data, **kw))
            mix = make(data, **kw)
            mix.load_state_dict(state)
            n, r = len(mix), sum(1 for _ in mix)
            assert n == max(whole, 4 + r), (rank, n, whole, r)


def test_without_counts_a_samples_schedule_has_no_length_and_a_fraction_is_refused(data):
    mix = make(data, weights=sd.Schedule(ANNEAL, by="samples"), index=None)
    with pytest.raises(TypeError, match=r"Mix has no length.*sources \[0\]"):
        len(mix)
    with pytest.raises(sd.SpecError, match=r"by fraction needs the epoch's length.*samples=N"):
        make(data, weights=sd.Schedule(ANNEAL), index=None)
    assert len(make(data, weights=sd.Schedule(ANNEAL), index=None, samples=100)) == 100


# ---- functions ----------------------------------------------------------------------------------


@pytest.mark.slow  # (a spawned worker imports torch: ~20 s on a loaded machine)
def test_a_function_schedule_reads_in_a_spawned_worker_as_its_points_do(data):
    """A function travels to a spawned worker pickled (a partial too) and draws the choices its
    points do (one worker of one reads as the main process)."""
    kw = dict(batch_size=4, samples=200)
    points = [p for b in make(data, weights=sd.Schedule(ANNEAL), **kw) for p in pairs(b)]
    loader = torch.utils.data.DataLoader(make(data, weights=anneal, **kw), batch_size=None, num_workers=1,
                                         timeout=120, multiprocessing_context="spawn")
    assert [p for b in loader for p in pairs(b)] == points
    partial = sd.Schedule(functools.partial(scaled, top=2.0))
    assert pickle.loads(pickle.dumps(partial.fn))(0.5) == [1.0, 1.1]
    assert partial.describe()["function"].endswith("test_mix_schedule.scaled")


def test_bad_schedules_are_refused(data):
    with pytest.raises(sd.SpecError, match="cannot be pickled.*top level"):
        sd.Schedule(lambda x: [1, x])
    with pytest.raises(sd.SpecError, match="increasing"):
        sd.Schedule([(0.5, [1, 1]), (0.5, [1, 2])])
    with pytest.raises(sd.SpecError, match="positive sum"):
        sd.Schedule([(0, [0, 0])])
    with pytest.raises(sd.SpecError, match="different numbers of weights"):
        sd.Schedule([(0, [1, 1]), (1, [1, 1, 1])])
    with pytest.raises(sd.SpecError, match="'fraction' or 'samples'"):
        sd.Schedule(ANNEAL, by="steps")
    with pytest.raises(sd.SpecError, match="3 weights for 2 sources"):
        make(data, weights=sd.Schedule([(0, [1, 1, 1])]))
    with pytest.raises(sd.SpecError, match="stop='all' every source needs a weight > 0"):
        make(data, weights=sd.Schedule([(0, [1, 1]), (1, [1, 0])]), stop="all")
    with pytest.raises(sd.SpecError, match="no end"):
        make(data, weights=sd.Schedule(anneal, by="samples"), stop="all")
    make(data, weights=sd.Schedule([(0, [0, 1]), (1, [1, 1])]), stop="all")  # (a source left out at first)


def test_a_state_of_another_schedule_is_refused(data):
    state = make(data, weights=sd.Schedule(ANNEAL)).state_dict()
    with pytest.raises(sd.SpecError, match="weights"):
        make(data, weights=sd.Schedule([(0.0, [0.9, 0.1]), (1.0, [0.6, 0.4])])).load_state_dict(state)
    with pytest.raises(sd.SpecError, match="weights"):
        make(data, weights=(0.9, 0.1)).load_state_dict(state)
    make(data, weights=sd.Schedule(ANNEAL)).load_state_dict(json.loads(json.dumps(state)))


# ---- docs/mix.md --------------------------------------------------------------------------------


def test_the_docs_schedule_recipe_runs(data):
    (code,) = doc_blocks("docs/mix.md", "## Schedules")
    for url, path in (("s3://bkt/web/", "/tar/"), ("s3://bkt/books/", "/pq/")):
        code = code.replace(repr(url).replace("'", '"'), repr(data + path))
    seen: list[list[int]] = []
    ns: dict = {"__name__": "__docs__", "to_common": lambda s: {"src": 0 if "__key__" in s else 1},
                "train_step": lambda batch: seen.append(batch["src"].tolist())}
    exec(compile(code, "docs/mix.md", "exec"), ns)  # noqa: S102
    assert len(seen) == ns["steps"] and sum(map(len, seen)) == 4000
    books = np.asarray([s for batch in seen for s in batch])
    assert 0.07 < books[:3200].mean() < 0.13  # the first 80%: 90/10
    assert 0.22 < books[3200:].mean() < 0.38  # then annealing to 50/50: 30% on average
