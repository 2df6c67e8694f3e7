"""Exact ``len()`` (docs/distributed.md, "Lengths"): a streamdata dataset and ``sd.loader`` over it
report the batches each rank yields this epoch, from the plan alone, for tar with an index, Parquet
and ``sd.TokenDataset`` (``.bin`` and tar of ``.npy``), whether the dataset batches (a plain
DataLoader, or ``sd.loader``) or ``sd.loader`` batches, with and without ``drop_last``, over
simulated ranks x real DataLoader workers; the same after a resume on the same world and on
another; a dataset whose plan does not know (tar without an index) says what to do. Real
``torchrun`` and Lightning's progress-bar total: ``tests/test_frameworks.py``."""

from __future__ import annotations

import pytest
import torch

import streamdata as sd
from tests.datasets.test_mix import make, make_data
from tests.helpers import rank_env, stopped_state
from tests.test_static_shapes import WORLDS, B, _dataset, make_corpora

KINDS = ["tar", "parquet", "tokens", "tokens-tar"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return make_corpora(tmp_path_factory.mktemp("lengths"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("mix-lengths"))


def _loader(ds, via: str, workers: int, drop_last: bool):
    if via == "dataset":  # a plain DataLoader over a dataset that batches itself
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                           timeout=60 if workers else 0)
    if via == "sd.loader":  # sd.loader over the same dataset (its batch size)
        return sd.loader(ds, num_workers=workers, persistent_workers=False)
    return sd.loader(ds, batch_size=B, drop_last=drop_last, num_workers=workers, persistent_workers=False)


@pytest.mark.parametrize("world_size,workers", WORLDS)
@pytest.mark.parametrize("via", ["dataset", "sd.loader", "loader batches"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_len_is_the_batches_every_rank_yields(corpora, kind, drop_last, via, world_size, workers):
    per_sample = via == "loader batches"
    ds = _dataset(kind, corpora[kind], None if per_sample else B, drop_last and not per_sample)
    for epoch in range(2):
        ds.set_epoch(epoch)
        for rank in range(world_size):
            with rank_env(rank, world_size):
                loader = _loader(ds, via, workers, drop_last)
                expected = len(loader)
                got = sum(1 for _ in loader)
                assert got == expected, (rank, epoch, got, expected)
                if via != "dataset":
                    loader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_dataset_yielding_samples_has_the_rank_s_samples(corpora, kind):
    """``batch_size=None``: ``len()`` is the samples a rank yields, whatever the workers."""
    ds = _dataset(kind, corpora[kind], None)
    for world_size, workers in WORLDS:
        for rank in range(world_size):
            with rank_env(rank, world_size):
                loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                                     timeout=60 if workers else 0)
                assert len(loader) == sum(1 for _ in loader) == ds.steps(num_workers=workers)


def _stopped(corpora, kind: str, world_size: int, workers: int, steps: int) -> dict:
    """Every simulated rank's sd.loader stopped after ``steps`` batches of epoch 0: the job's state."""
    from streamdata.epoch.state import merge_states

    states = []
    for rank in range(world_size):
        with rank_env(rank, world_size):
            loader = sd.loader(_dataset(kind, corpora[kind], B), num_workers=workers,
                               persistent_workers=False)
            it = iter(loader)
            for _ in range(steps):
                next(it)
            states.append(loader.state_dict())
            loader.close()
    return merge_states(states)


@pytest.mark.parametrize("before,after", [((2, 2), (2, 2)), ((2, 2), (1, 0)), ((1, 0), (3, 2)),
                                          ((3, 1), (2, 2))])
@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_epoch_counts_the_steps_before_with_those_left(corpora, kind, before, after):
    """A state taken after ``k`` steps, loaded on another world (or the same): every rank delivers
    the same number ``r`` of batches, and ``len()`` is ``k + r`` where that is at least a whole
    epoch's on the new world, else the whole epoch's (a framework counting its trained steps from
    ``len()`` then meets the loader's end, never stops before it); on the same world ``k + r`` is
    exactly the whole epoch's."""
    k = 2
    state = _stopped(corpora, kind, *before, k)
    world_size, workers = after
    left = []
    for rank in range(world_size):
        with rank_env(rank, world_size):
            whole = len(sd.loader(_dataset(kind, corpora[kind], B), num_workers=workers))
            loader = sd.loader(_dataset(kind, corpora[kind], B), num_workers=workers,
                               persistent_workers=False)
            loader.load_state_dict(state)
            n = len(loader)
            r = sum(1 for _ in loader)
            loader.close()
            assert n == max(whole, k + r), (rank, n, whole, k, r)
            if before == after:
                assert k + r == whole
            left.append(r)
    assert len(set(left)) == 1, left


def test_without_counts_len_says_what_to_do(corpora):
    ds = _dataset("tar-unindexed", corpora["tar-unindexed"], B)
    with pytest.raises(TypeError, match=r"has no length.*streamdata index"):
        len(ds)
    with pytest.raises(TypeError, match=r"has no length.*streamdata index"):
        len(sd.loader(ds, num_workers=0))


# ---- a Mix: its choices and its sources' counts -----------------------------------------------


MIX_ENDS = [{"stop": "first"}, {"stop": "all"}, {"samples": 241}]


@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2), (3, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("end", MIX_ENDS, ids=["first", "all", "samples"])
def test_a_mix_s_len_is_the_batches_every_rank_yields(data, end, drop_last, world_size, workers):
    for epoch in range(2):
        for rank in range(world_size):
            mix = make(data, weights=(2, 1), **end)
            mix.set_epoch(epoch)
            with rank_env(rank, world_size):
                loader = sd.loader(mix, batch_size=3, drop_last=drop_last, num_workers=workers,
                                   persistent_workers=False)
                with loader:
                    expected = len(loader)
                    assert sum(1 for _ in loader) == expected, (epoch, rank)


@pytest.mark.parametrize("end", MIX_ENDS, ids=["first", "all", "samples"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (2, 2)])
def test_a_resumed_mix_counts_the_steps_before_with_those_left(data, end, old, new):
    """Simulated ranks stopped after 4 batches, resumed on ``new`` ranks: ``len()`` there is the
    steps before plus those each rank then delivers, where that is at least a whole epoch's."""
    kw = dict(weights=(3, 1), batch_size=3, **end)
    state = stopped_state(lambda: make(data, **kw), old, 4)
    for rank in range(new):
        with rank_env(rank, new):
            whole = len(make(data, **kw))
            mix = make(data, **kw)
            mix.load_state_dict(state)
            n = len(mix)
            r = sum(1 for _ in mix)
            assert n == max(whole, 4 + r), (rank, n, whole, r)
            if old == new:
                assert n == whole == 4 + r


def test_a_mix_without_counts_says_what_to_do(data):
    mix = make(data, index=None)
    with pytest.raises(TypeError, match=r"Mix has no length.*sources \[0\]"):
        len(mix)
    assert len(make(data, index=None, samples=100)) == 100
