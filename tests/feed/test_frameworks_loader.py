"""What training frameworks do to ``sd.loader``, without the frameworks: a probing ``iter()``
before ``load_state_dict`` (Lightning's data set-up), a fetcher that takes batches ahead of the
step (``held_ahead``, CONSUMED-POSITION), a ``set_epoch`` after the first batch, the state at an
epoch's end, and accelerate's re-splitting wrappers (SELF-SPLIT). Local shards with an index:
exact epochs, and a resume that must give back exactly the rest."""

from __future__ import annotations

import collections

import fsspec
import pytest
import torch

import streamdata as sd
from streamdata._compat import dataloader_iterator
from tests.helpers import rank_env, write_shards

COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 6, 4, 13, 8]  # 89 samples, 13 uneven shards


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks")
    write_shards(fsspec.filesystem("file"), str(root), counts=COUNTS)
    sd.build_index(str(root) + "/", progress=False)
    return str(root) + "/"


@pytest.fixture(scope="module")
def raw_spec(tmp_path_factory):
    """The same shards without an index: split by shard, no ``len()``."""
    root = tmp_path_factory.mktemp("frameworks-raw")
    write_shards(fsspec.filesystem("file"), str(root), counts=COUNTS)
    return str(root) + "/"


def _loader(spec: str, workers: int = 2, shuffle: bool = True, **kw) -> sd.Loader:
    ds = sd.TarDataset(spec, shuffle=shuffle, seed=5, decode=False)
    return sd.loader(ds, batch_size=4, num_workers=workers, **kw)


def _keys(batches) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def _epoch(spec: str, epoch: int, workers: int = 2, shuffle: bool = True) -> list[str]:
    """The epoch as an uninterrupted loader delivers it."""
    with _loader(spec, workers, shuffle) as loader:
        loader.set_epoch(epoch)
        return _keys(loader)


def _exact(before: list[str], after: list[str], everything: list[str]) -> None:
    got = collections.Counter(before + after)
    assert max(got.values()) == 1, [k for k, n in got.items() if n > 1]
    assert sorted(got) == sorted(everything)


def test_a_probing_iter_starts_nothing_and_leaves_the_epoch_as_it_was(spec):
    """LAZY-START: Lightning's set-up calls iter() once to check the loader is iterable."""
    with _loader(spec) as loader:
        iter(loader)  # the probe, dropped
        assert dataloader_iterator(loader.dataloader) is None  # no worker started
        assert _keys(loader) == _epoch(spec, 0)  # epoch 0's order, not epoch 1's


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_after_a_probe_takes_effect(spec, workers):
    everything = _epoch(spec, 0)
    with _loader(spec) as first:
        it = iter(first)
        before = _keys(next(it) for _ in range(5))
        state = first.state_dict()
    with _loader(spec, workers) as loader:
        iter(loader)  # the probe
        loader.load_state_dict(state)
        after = _keys(loader)
    assert before == everything[:len(before)]
    _exact(before, after, everything)


def test_workers_started_without_a_delivered_batch_are_restarted_by_a_load(spec):
    """An iteration that started workers but delivered nothing: they read the old position, so
    load_state_dict ends them and the next iteration starts new ones."""
    everything = _epoch(spec, 0)
    with _loader(spec) as first:
        it = iter(first)
        before = _keys(next(it) for _ in range(3))
        state = first.state_dict()
    with _loader(spec) as loader:
        iter(loader.dataloader)  # persistent workers started, no batch delivered
        assert dataloader_iterator(loader.dataloader) is not None
        loader.load_state_dict(state)
        assert dataloader_iterator(loader.dataloader) is None
        after = _keys(loader)
        with pytest.raises(sd.SpecError, match="before the loader's first iteration delivers"):
            loader.load_state_dict(state)
    _exact(before, after, everything)


def _ahead(loader, steps: int, held: int = 1):
    """A fetcher that takes ``held`` batches ahead of its step (Lightning's: 1): the batches
    the step consumed after ``steps`` steps, and the iterator."""
    it = iter(loader)
    taken = [next(it) for _ in range(held)]
    consumed = []
    for _ in range(steps):
        consumed.append(taken.pop(0))
        taken.append(next(it))
    return consumed, it


@pytest.mark.parametrize("held", [1, 2])
def test_held_ahead_leaves_the_fetched_ahead_batches_out_of_the_state(spec, held):
    """CONSUMED-POSITION: 5 steps consumed, 5 + held handed out: the state counts 5, and the
    resume reads the held batches again."""
    everything = _epoch(spec, 0)
    with _loader(spec, held_ahead=held) as loader:
        consumed, _ = _ahead(loader, 5, held)
        state = loader.state_dict()
    before = _keys(consumed)
    assert sum(state["stages"][-1]["delivered"]) == len(before)
    with _loader(spec) as loader:
        loader.load_state_dict(state)
        after = _keys(loader)
    _exact(before, after, everything)


def test_without_held_ahead_a_fetched_ahead_batch_would_be_lost(spec):
    """What code that takes a batch ahead, and that the loader does not know, does to the state:
    it counts the batch held."""
    with _loader(spec) as loader:
        consumed, _ = _ahead(loader, 5)
        state = loader.state_dict()
        assert loader.held_ahead == 0  # a loop of this module's: nothing known
    assert sum(state["stages"][-1]["delivered"]) == len(_keys(consumed)) + 4  # one batch more


def _lightning(loader):
    """Lightning's fit loop's fetcher over ``loader``, as the loop sets it up, its epoch started
    (an ``iter()`` of the fetcher starts another)."""
    fetchers = pytest.importorskip("lightning.pytorch.loops.fetchers")
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    fetcher = fetchers._PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    return iter(fetcher)


def _steps(fetcher, steps: int | None = None) -> list[str]:
    """The keys of the batches of a started fetcher's ``steps`` steps (None: to the epoch's end)."""
    taken = []
    while steps is None or len(taken) < steps:
        try:
            batch, _, _ = next(fetcher)
        except StopIteration:
            break
        taken.append(batch)
    return _keys(taken)


@pytest.mark.parametrize("indexed", [False, True])
def test_lightnings_fetcher_is_found_and_its_resume_is_exact(spec, raw_spec, indexed):
    """HELD-AHEAD-DETECTED: Lightning's fetcher takes one batch ahead of the step of a loader
    without len() (shards without an index, read in order: an exact resume), none of one with a
    len() (the index); the default finds which, and a state saved after 5 steps resumes exactly."""
    where, shuffle, ahead = (spec, True, 0) if indexed else (raw_spec, False, 1)
    everything = _epoch(where, 0, shuffle=shuffle)
    with _loader(where, shuffle=shuffle) as loader:
        assert loader.held_ahead is None  # known at the first batch
        before = _steps(_lightning(loader), 5)
        assert loader.held_ahead == ahead
        state = loader.state_dict()
    if indexed:  # (without counts a position is [shards done, samples into the next])
        assert sum(state["stages"][-1]["delivered"]) == len(before)
    with _loader(where, shuffle=shuffle) as loader:
        loader.load_state_dict(state)
        after = _steps(_lightning(loader))
        assert loader.held_ahead == ahead
        assert loader.state_dict()["epoch"] == 1  # the epoch ended: every batch consumed
        next_epoch = _keys(loader)  # the next pass: a plain loop
        assert next_epoch == _epoch(where, 1, shuffle=shuffle) and loader.held_ahead == 0
    _exact(before, after, everything)


def test_a_given_held_ahead_wins_over_what_is_found(spec):
    with _loader(spec, held_ahead=1) as loader:  # Lightning takes none ahead of a loader with len()
        consumed = _steps(_lightning(loader), 5)
        assert loader.held_ahead == 1
        state = loader.state_dict()
    assert sum(state["stages"][-1]["delivered"]) == len(consumed) - 4  # the last batch left out


class _Sized(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter({"__key__": [str(i) for i in range(start, start + 4)]} for start in (0, 4, 8))

    def __len__(self) -> int:
        return 3


def test_lightnings_fetcher_takes_no_batch_ahead_of_a_loader_with_a_length():
    """With len() the fetcher knows the last batch without taking one ahead: nothing held."""
    with sd.loader(_Sized(), batch_size=None, num_workers=0) as loader:
        assert len(loader) == 3
        assert len(_steps(_lightning(loader))) == 12
        assert loader.held_ahead == 0


def test_rays_device_wrapper_is_found_and_its_resume_is_exact(spec):
    """HELD-AHEAD-DETECTED: ``prepare_data_loader(loader)``'s wrapper (``move_to_device=True``)
    takes the next batch as it hands one out."""
    utils = pytest.importorskip("ray.train.torch.train_loop_utils")
    everything = _epoch(spec, 0)
    with _loader(spec) as loader:
        batches = iter(utils._WrappedDataLoader(loader, torch.device("cpu"), False))
        before = _keys(next(batches) for _ in range(5))
        assert loader.held_ahead == 1
        state = loader.state_dict()
    with _loader(spec) as loader:
        loader.load_state_dict(state)
        after = _keys(utils._WrappedDataLoader(loader, torch.device("cpu"), False))
    _exact(before, after, everything)


def test_at_an_epochs_end_the_state_is_the_next_epochs_start(spec):
    """A fetcher that met the end while taking ahead holds nothing: every batch is consumed, and a
    checkpoint at the epoch's end resumes with the next epoch (as Lightning's epoch counter does)."""
    with _loader(spec, held_ahead=1) as loader:
        assert sorted(_keys(loader)) == sorted(_epoch(spec, 0))
        state = loader.state_dict()
    assert state["epoch"] == 1 and state["stages"] == []
    with _loader(spec) as loader:
        loader.load_state_dict(state)
        assert _keys(loader) == _epoch(spec, 1)


def test_set_epoch_of_the_epoch_being_read_changes_nothing(spec):
    """Lightning sets the epoch after its fetcher took the first batch: the pass goes on."""
    for workers in (0, 2):
        everything = _epoch(spec, 0, workers)
        with _loader(spec, workers, held_ahead=1) as loader:
            loader.set_epoch(0)
            it = iter(loader)
            first = next(it)
            loader.set_epoch(0)  # the same epoch, mid-pass
            got = _keys([first, *it])
            assert got == everything
            loader.set_epoch(1)
            assert _keys(loader) == _epoch(spec, 1, workers)


def test_held_ahead_is_checked_and_the_loader_has_no_sampler(spec):
    with pytest.raises(sd.SpecError, match="held_ahead"):
        _loader(spec, held_ahead=-1)
    with _loader(spec) as loader:
        assert loader.sampler is None  # frameworks find none to replace with a DistributedSampler


def test_accelerates_resplitting_wrapper_is_refused(spec):
    """SELF-SPLIT: a plain DataLoader that accelerator.prepare() wrapped calls set_epoch from
    IterableDatasetShard (more than one process): refused with what to do instead."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    ds = sd.TarDataset(spec, decode=False, batch_size=4)
    with rank_env(0, 2):
        with pytest.raises(sd.SpecError, match="sd.loader"):
            data_loader.IterableDatasetShard(ds, batch_size=4, num_processes=2, process_index=0).set_epoch(1)
    data_loader.IterableDatasetShard(ds, batch_size=4, num_processes=1, process_index=0).set_epoch(1)
    ds.set_epoch(2)  # called by anyone else: as before
    mix = sd.Mix([sd.TarDataset(spec, decode=False)], weights=[1.0], seed=0, batch_size=4)
    with rank_env(0, 2):
        with pytest.raises(sd.SpecError, match="sd.loader"):
            data_loader.IterableDatasetShard(mix, batch_size=4, num_processes=2, process_index=0).set_epoch(1)



def test_a_prefetcher_made_without_items_takes_no_other_protocols_items():
    """A resumed worker whose span was all delivered makes a prefetcher with nothing to read (a
    client for no protocol); NEXT-EPOCH-EARLY once queued the next epoch's S3 items in it, read
    as local paths (found under Lightning, resuming near an epoch's end). Now refused, and the
    dataset does not queue there."""
    from streamdata.fetch.prefetcher import Prefetcher
    from streamdata.store.urls import Shard

    empty = Prefetcher([])
    try:
        assert empty.protocol is None
        with pytest.raises(sd.SpecError, match="protocol"):
            empty.extend([Shard("s3://bkt/shard-000.tar", 10)])
    finally:
        empty.close()
