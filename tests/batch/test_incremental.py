"""Collation as samples arrive (streamdata/incremental.py): the same batches as collate()."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import namedtuple

import numpy as np
import pytest
import torch

from streamdata.batch import collate as C
from streamdata.batch.batches import BatchBuilder, batches
from streamdata.errors import DecodeError


def same(a, b) -> bool:
    """Structural equality of two collated batches: containers, tensor values and dtypes."""
    if isinstance(a, torch.Tensor):
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense() if isinstance(b, torch.Tensor) and b.is_sparse else None
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and same(dataclasses.asdict(a), dataclasses.asdict(b))
    return a == b


def build(samples, capacity=None):
    builder = BatchBuilder(capacity or len(samples))
    for s in samples:
        builder.add(s)
    return builder.finish()


Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Rec:
    x: np.ndarray
    name: str


CASES = {
    "dict of arrays, ints, floats, strings": [
        {"x": np.full((2, 3), i, dtype=np.float32), "cls": i, "w": i / 2, "__key__": f"k{i}"}
        for i in range(5)],
    "nested tuple and list": [
        (np.arange(4) + i, [torch.full((2,), float(i)), f"s{i}"]) for i in range(3)],
    "bare arrays": [np.arange(6, dtype=np.int16).reshape(2, 3) * i for i in range(4)],
    "tensors": [torch.arange(3, dtype=torch.float64) + i for i in range(4)],
    "dtype changes mid-batch (promoted as collate does)": [
        {"x": np.ones(3, dtype=np.float32 if i < 2 else np.float64) * i} for i in range(4)],
    "big-endian arrays": [{"x": np.arange(3, dtype=">f4") + i} for i in range(3)],
    "numpy scalars and bools": [{"s": np.float32(i), "b": i % 2 == 0} for i in range(3)],
    "namedtuple (collate() rebuilds it)": [Pair(np.ones(2) * i, i) for i in range(3)],
    "dataclass (collate() rebuilds it)": [Rec(np.ones(2) * i, f"r{i}") for i in range(3)],
    "a list field, later an array": [{"a": [1, 2]}, {"a": np.array([3, 4])}],
    "a tuple field, later a tensor": [((1.0, 2.0),), (torch.tensor([3.0, 4.0]),)],
    "sparse tensors (collate() stacks them)": [torch.eye(2).to_sparse() * i for i in range(3)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_batch_equals_collate_of_the_samples(name):
    samples = CASES[name]
    assert same(build(samples), C.collate(samples))


def test_a_short_batch_in_a_bigger_builder_is_the_first_rows_only():
    samples = [{"x": np.arange(3) + i, "i": i} for i in range(3)]
    batch = build(samples, capacity=8)
    assert batch["x"].shape == (3, 3) and same(batch, C.collate(samples))


@pytest.mark.parametrize("bad, words", [
    ([{"x": np.zeros(3)}, {"x": np.zeros(4)}], ["batch['x']", "shape"]),
    ([{"x": np.zeros(3)}, {"y": np.zeros(3)}], ["no key 'x'"]),
    ([(np.zeros(2), 1), (np.zeros(2),)], ["2 items"]),
])
def test_mismatched_samples_raise_decode_error_naming_the_field(bad, words):
    with pytest.raises(DecodeError) as info:
        build(bad)
    assert all(w in str(info.value) for w in words)


def test_each_sample_can_be_freed_once_added():
    """The builder keeps no reference to a sample's arrays after copying them."""
    builder = BatchBuilder(4)
    refs = []
    for i in range(4):
        sample = {"x": np.full(1000, float(i)), "i": i}
        refs.append(weakref.ref(sample["x"]))
        builder.add(sample)
        del sample
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    assert builder.finish()["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_in_a_worker_the_batch_is_in_shared_memory(monkeypatch):
    monkeypatch.setattr(C, "_worker", lambda: ("DataLoader worker 0/2", 2))
    batch = build([{"x": np.ones(4) * i, "i": i} for i in range(3)])
    assert batch["x"].is_shared() and batch["x"][:, 0].tolist() == [0.0, 1.0, 2.0]


def test_batches_groups_and_keeps_or_drops_the_tail():
    items = [{"i": i, "x": np.full(2, i)} for i in range(7)]
    kept = list(batches(iter(items), 3))
    assert [b["i"].tolist() for b in kept] == [[0, 1, 2], [3, 4, 5], [6]]
    dropped = list(batches(iter(items), 3, drop_last=True))
    assert [b["i"].tolist() for b in dropped] == [[0, 1, 2], [3, 4, 5]]
    assert same(kept[0], C.collate(items[:3]))  # the default collation


def test_batches_with_a_collate_fn_hands_it_lists_of_samples():
    seen = []

    def mine(samples):
        seen.append(list(samples))
        return len(samples)

    assert list(batches(iter(range(7)), 3, collate_fn=mine)) == [3, 3, 1]
    assert seen == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(batches(iter(range(7)), 3, collate_fn=mine, drop_last=True)) == [3, 3]
    assert list(batches(iter([]), 3, collate_fn=mine)) == [] == list(batches(iter([]), 3))


def test_a_full_builder_refuses_more():
    builder = BatchBuilder(1)
    builder.add(1)
    with pytest.raises(ValueError, match="full"):
        builder.add(2)


def test_tensors_that_require_grad_are_collated_as_collate_does():
    """Not copied row by row (that would record an autograd graph): collate() decides."""
    samples = [torch.ones(2, requires_grad=True) for _ in range(3)]
    assert same(build(samples), C.collate(samples))


def test_a_refused_sample_leaves_the_batch_as_it_was():
    builder = BatchBuilder(4)
    builder.add({"a": np.zeros(2), "b": 0})
    with pytest.raises(DecodeError):
        builder.add({"a": np.ones(2)})  # no "b": nothing of it is written
    builder.add({"a": np.full(2, 2.0), "b": 2})
    batch = builder.finish()
    assert batch["a"][:, 0].tolist() == [0.0, 2.0] and batch["b"].tolist() == [0, 2]


def test_a_short_batch_gets_storage_of_its_own_size():
    batch = build([{"x": np.zeros(1000)}], capacity=64)
    assert batch["x"].untyped_storage().nbytes() == 1000 * 8
