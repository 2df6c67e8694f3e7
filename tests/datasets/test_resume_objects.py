"""ObjectDataset under the state protocol: a map-style dataset has no position of its own (the
sampler's order and place are saved by torchdata's StatefulDataLoader); its state ties a
checkpoint to its objects, so another dataset's state is refused, and a resumed loader delivers
the rest of the epoch exactly once."""

from __future__ import annotations

import json
import pickle

import pytest

import streamdata as sd
from streamdata.errors import SpecError

torchdata = pytest.importorskip("torchdata.stateful_dataloader")

N = 23


@pytest.fixture
def objects(tmp_path):
    for i in range(N):
        (tmp_path / f"o{i:03d}.txt").write_text(str(i))
    return str(tmp_path) + "/"


def _ids(batch):
    return [int(k[1:]) for k in batch["__key__"]]


def _loader(ds, workers):
    return torchdata.StatefulDataLoader(ds, batch_size=4, shuffle=True, num_workers=workers,
                                        collate_fn=lambda b: {"__key__": [s["__key__"] for s in b]},
                                        timeout=60 if workers else 0,
                                        multiprocessing_context="fork" if workers else None)


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_loader_delivers_the_rest_exactly_once(objects, workers):
    import torch

    torch.manual_seed(7)
    first, second = sd.ObjectDataset(objects, decode=False), sd.ObjectDataset(objects, decode=False)
    loader = _loader(first, workers)
    before, it = [], iter(loader)
    for _ in range(3):
        before += _ids(next(it))
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # the sampler's part holds a tensor
    del it
    resumed = _loader(second, workers)
    resumed.load_state_dict(state)
    after = [i for batch in resumed for i in _ids(batch)]
    first.close(), second.close()  # workers=0: the main process's I/O threads
    assert len(before) == 12 and len(after) == N - 12
    assert sorted(before + after) == list(range(N))


def test_state_names_its_dataset_and_refuses_another(objects, tmp_path_factory):
    ds = sd.ObjectDataset(objects, decode=False)
    state = ds.state_dict()
    assert state["format"] == "streamdata-state" and state["split"] == "objects"
    json.dumps(state)
    ds.load_state_dict(state)  # its own: accepted
    other_dir = tmp_path_factory.mktemp("other")
    (other_dir / "x.txt").write_text("x")
    other = sd.ObjectDataset(str(other_dir) + "/", decode=False)
    with pytest.raises(SpecError, match="another dataset"):
        other.load_state_dict(state)
    tar = {**state, "split": "samples"}
    with pytest.raises(SpecError):
        ds.load_state_dict(tar)


def test_a_loader_state_of_another_dataset_is_refused(objects, tmp_path_factory):
    other_dir = tmp_path_factory.mktemp("other")
    for i in range(5):
        (other_dir / f"x{i}.txt").write_text("x")
    ds, other = sd.ObjectDataset(objects, decode=False), sd.ObjectDataset(str(other_dir) + "/", decode=False)
    loader = _loader(ds, 0)
    next(iter(loader))
    wrong = _loader(other, 0)
    with pytest.raises(SpecError, match="another dataset"):
        wrong.load_state_dict(loader.state_dict())
        next(iter(wrong))
    ds.close(), other.close()
