"""Worker-side collation into shared memory, nested structures, and the /dev/shm check."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from streamdata.batch import collate as C
from streamdata.batch.tree import iter_tensors, map_kinds, map_tensors
from streamdata.errors import DecodeError, SharedMemoryError, StreamDataError

REPO = Path(__file__).resolve().parents[2]


class Pair(NamedTuple):
    left: object
    right: object


@dataclasses.dataclass(frozen=True)
class Sample:
    image: object
    label: object
    name: str = "x"


def nested(t: torch.Tensor) -> dict:
    return {
        "plain": t,
        "ordered": collections.OrderedDict(a=t + 1, b="text"),
        "default": collections.defaultdict(list, {"c": t * 2}),
        "list": [t, 3, None],
        "tuple": (t, b"raw"),
        "pair": Pair(t, 1.5),
        "sample": Sample(image=t, label=7),
        "deep": [{"x": (t,)}],
    }


def test_map_tensors_rebuilds_every_container_type_and_passes_other_leaves():
    t = torch.arange(6.0).reshape(2, 3)
    batch = nested(t)
    out = map_tensors(lambda x: x * 10, batch)

    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["default"]) is collections.defaultdict and out["default"].default_factory is list
    assert type(out["pair"]) is Pair and type(out["sample"]) is Sample
    assert type(out["tuple"]) is tuple and type(out["list"]) is list
    assert torch.equal(out["plain"], t * 10)
    assert torch.equal(out["ordered"]["a"], (t + 1) * 10) and out["ordered"]["b"] == "text"
    assert out["list"][1:] == [3, None] and out["tuple"][1] == b"raw"
    assert out["pair"].right == 1.5 and out["sample"].label == 7 and out["sample"].name == "x"
    assert torch.equal(out["deep"][0]["x"][0], t * 10)
    assert batch["plain"] is t and batch["sample"].image is t  # input untouched


def test_map_kinds_copies_plain_columns_whole_and_maps_what_is_inside_the_rest():
    """A walk for some kinds of leaf copies lists, tuples and dicts of plain values (keys, URLs,
    counts) without calling ``fn``; a container with anything else inside is walked."""
    t = torch.ones(2)
    keys = [f"k{i}" for i in range(64)]
    batch = {"__key__": keys, "counts": {"a": 1, "b": None}, "mixed": ["a", t], "x": t}
    calls = []
    out = map_kinds(lambda x: calls.append(x) or x * 2, batch, (torch.Tensor,))
    assert out["__key__"] == keys and out["__key__"] is not keys  # a copy: the input untouched
    assert out["counts"] == {"a": 1, "b": None} and out["counts"] is not batch["counts"]
    assert torch.equal(out["mixed"][1], t * 2) and torch.equal(out["x"], t * 2) and len(calls) == 2


def test_iter_tensors_finds_every_tensor_depth_first():
    t = torch.zeros(1)
    found = list(iter_tensors(nested(t)))
    assert len(found) == 8
    assert all(isinstance(x, torch.Tensor) for x in found)


def test_collate_stacks_per_sample_numpy_arrays_into_one_tensor():
    samples = [np.random.default_rng(i).random((10, 15)) for i in range(4)]
    batch = C.collate(samples)
    assert isinstance(batch, torch.Tensor)
    assert batch.dtype == torch.float64 and batch.shape == (4, 10, 15)
    np.testing.assert_array_equal(batch.numpy(), np.stack(samples))
    assert not batch.is_shared()  # main process: no shared memory needed


def test_collate_handles_nested_fields_scalars_and_strings():
    samples = [
        {
            "image": np.full((2, 2), i, dtype=np.uint8),
            "depth": torch.full((3,), float(i)),
            "label": i,
            "weight": i / 2,
            "flag": bool(i % 2),
            "npscalar": np.float32(i),
            "key": f"k{i}",
            "none": None,
            "pair": Pair(np.int64(i), [i, i + 1]),
            "meta": Sample(image=torch.ones(1) * i, label=i),
        }
        for i in range(3)
    ]
    batch = C.collate(samples)
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (3, 2, 2)
    assert torch.equal(batch["depth"][:, 0], torch.tensor([0.0, 1.0, 2.0]))
    assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [0, 1, 2]
    assert batch["weight"].dtype == torch.float64 and batch["weight"].tolist() == [0.0, 0.5, 1.0]
    assert batch["flag"].dtype == torch.bool and batch["flag"].tolist() == [False, True, False]
    assert batch["npscalar"].dtype == torch.float32
    assert batch["key"] == ["k0", "k1", "k2"] and batch["none"] == [None, None, None]
    assert type(batch["pair"]) is Pair and batch["pair"].left.tolist() == [0, 1, 2]
    assert [x.tolist() for x in batch["pair"].right] == [[0, 1, 2], [1, 2, 3]]
    assert type(batch["meta"]) is Sample and batch["meta"].image.shape == (3, 1)
    assert batch["meta"].name == ["x", "x", "x"]  # every field is collated


def test_collate_promotes_mixed_tensor_dtypes():
    batch = C.collate([torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.float32)])
    assert batch.dtype == torch.float32 and batch.tolist() == [[0, 0], [1, 1]]


@pytest.mark.parametrize(
    ("samples", "words"),
    [
        ([{"a": np.zeros((2, 3))}, {"a": np.zeros((2, 4))}], ["batch['a']", "(2, 3)", "(2, 4)"]),
        ([{"a": torch.zeros(2)}, {"a": torch.zeros(3)}], ["batch['a']", "shape"]),
        ([{"a": 1, "b": 2}, {"a": 1}], ["no key 'b'", "sample 1"]),
        ([(1, 2), (1, 2, 3)], ["2 items", "3 items"]),
        ([torch.zeros(1), np.zeros(1)], ["mix of tensors"]),
    ],
)
def test_collate_errors_name_the_field_and_the_difference(samples, words):
    with pytest.raises(DecodeError) as info:
        C.collate(samples)
    for word in words:
        assert word in str(info.value)


def test_collate_rejects_an_empty_list():
    with pytest.raises(ValueError):
        C.collate([])


@pytest.fixture
def in_worker(monkeypatch):
    """Make collate believe it runs in DataLoader worker 0 of 2; record the shm checks."""
    checks: list[tuple[int, int]] = []
    monkeypatch.setattr(C, "_worker", lambda: ("DataLoader worker 0/2", 2))
    real = C.check_shared_memory

    def spy(nbytes, *, in_flight=1, new_bytes=None, where=None):
        same = new_bytes in (None, nbytes)
        checks.append((nbytes, in_flight) if same else (nbytes, in_flight, new_bytes))
        real(nbytes, in_flight=in_flight, new_bytes=new_bytes, where=where)

    monkeypatch.setattr(C, "check_shared_memory", spy)
    return checks


def test_collate_in_a_worker_builds_shared_memory_tensors_after_checking_space(in_worker):
    samples = [{"x": np.ones((4, 5)), "y": torch.ones(3, dtype=torch.int16), "n": i} for i in range(8)]
    batch = C.collate(samples)
    assert batch["x"].is_shared() and batch["y"].is_shared()
    assert torch.equal(batch["x"], torch.ones(8, 4, 5, dtype=torch.float64))
    assert in_worker == [(8 * (4 * 5 * 8 + 3 * 2), 4)]  # data bytes, 2 workers x default prefetch 2


def test_collate_uses_the_in_flight_count_it_is_given(in_worker):
    C.collate([np.zeros(3)], in_flight=12)
    assert in_worker == [(24, 12)]


def fake_space(free, total):
    return lambda path=C.SHM_PATH: (free, total)


def test_check_shared_memory_names_the_bytes_and_the_fixes(monkeypatch):
    monkeypatch.setattr(C, "shared_memory_space", fake_space(60_000_000, 64_000_000))
    with pytest.raises(SharedMemoryError) as info:
        C.check_shared_memory(153_600_000, in_flight=8, where="DataLoader worker 1/2")
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, StreamDataError)
    text = str(err)
    for word in ("153.6 MB", "60.0 MB free of 64.0 MB", "1.2 GB", "prefetch_factor",
                 "--shm-size=2g", 'set_sharing_strategy("file_system")', "worker 1/2"):
        assert word in text


def test_check_shared_memory_refuses_more_in_flight_than_the_filesystem_holds(monkeypatch):
    monkeypatch.setattr(C, "shared_memory_space", fake_space(60_000_000, 64_000_000))
    C.check_shared_memory(10_000_000, in_flight=6)  # 60 MB in flight: fits
    with pytest.raises(SharedMemoryError, match="7 batches in flight"):
        C.check_shared_memory(10_000_000, in_flight=7)


def test_check_shared_memory_is_silent_where_there_is_no_dev_shm(monkeypatch):
    monkeypatch.setattr(C, "shared_memory_space", lambda path=C.SHM_PATH: None)
    C.check_shared_memory(1 << 40, in_flight=100)


def test_shared_memory_space_reads_the_filesystem(tmp_path):
    free, total = C.shared_memory_space(str(tmp_path))
    assert 0 <= free <= total
    assert C.shared_memory_space(str(tmp_path / "missing")) is None


def test_collate_in_a_worker_raises_before_allocating_when_shm_is_too_small(in_worker, monkeypatch):
    monkeypatch.setattr(C, "shared_memory_space", fake_space(1000, 1000))
    monkeypatch.setattr(C, "empty_tensor", lambda *a: pytest.fail("allocated despite the failed check"))
    with pytest.raises(SharedMemoryError, match="does not fit"):
        C.collate([np.zeros(1000)])


def test_to_tensors_counts_only_new_bytes_against_free_space(in_worker, monkeypatch):
    already = torch.ones(1000).share_memory_()  # a batch the dataset collated into shm itself
    out = C.to_tensors({"x": already, "y": np.zeros(10)})
    assert out["x"] is already and out["y"].is_shared()
    assert in_worker == [(4000 + 80, 4, 80)]
    monkeypatch.setattr(C, "shared_memory_space", fake_space(100, 1_000_000))
    C.to_tensors({"x": already})  # nothing new to allocate: fits in 100 free bytes
    with pytest.raises(SharedMemoryError):
        C.to_tensors({"x": torch.ones(1000)})


def test_to_tensors_in_the_main_process_wraps_arrays_without_copying():
    arrays = {"x": np.arange(6.0).reshape(2, 3), "s": ["a", "b"], "n": np.int32(3), "k": 4}
    out = C.to_tensors(arrays)
    assert isinstance(out["x"], torch.Tensor) and np.shares_memory(out["x"].numpy(), arrays["x"])
    assert out["n"].dtype == torch.int32 and out["s"] == ["a", "b"] and out["k"] == 4
    readonly = np.zeros(3)
    readonly.setflags(write=False)
    assert torch.equal(C.to_tensors(readonly), torch.zeros(3, dtype=torch.float64))


def test_to_tensors_in_a_worker_copies_arrays_and_tensors_into_shared_memory(in_worker):
    batch = Pair(np.ones((3, 2), dtype=np.float32), torch.arange(4))
    out = C.to_tensors(batch)
    assert type(out) is Pair and out.left.is_shared() and out.right.is_shared()
    assert torch.equal(out.left, torch.ones(3, 2)) and torch.equal(out.right, torch.arange(4))
    assert in_worker == [(3 * 2 * 4 + 4 * 8, 4)]


class ArraySamples(IterableDataset):
    """Per-sample NumPy arrays, like the seed report (smaller)."""

    def __init__(self, n: int, shape=(20, 15)):
        self.n, self.shape = n, shape

    def __iter__(self):
        for i in range(self.n):
            yield {"x": np.full(self.shape, float(i)), "i": i}


def fork_loader(dataset, **kwargs) -> DataLoader:
    return DataLoader(dataset, num_workers=1, multiprocessing_context="fork", **kwargs)


def test_batches_collated_in_a_real_worker_arrive_as_tensors():
    collate = functools.partial(C.collate, in_flight=2)
    dl = fork_loader(ArraySamples(10), batch_size=4, collate_fn=collate)
    batches = list(dl)
    assert [b["i"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[0]["x"].shape == (4, 20, 15) and batches[0]["x"].is_shared()
    assert torch.equal(batches[2]["x"][1], torch.full((20, 15), 9.0, dtype=torch.float64))


def test_shared_memory_error_reaches_the_main_process_with_its_type(monkeypatch):
    monkeypatch.setattr(C, "shared_memory_space", fake_space(100, 100))  # inherited by the fork
    batches = iter(fork_loader(ArraySamples(4), batch_size=2, collate_fn=C.collate))
    try:
        with pytest.raises(SharedMemoryError, match=r"does not fit in shared memory"):
            next(batches)
    finally:
        batches._shutdown_workers()  # the failed iterator would keep its worker until collected


SMALL_SHM_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    from torch.utils.data import DataLoader, IterableDataset
    from streamdata.batch import collate as C
    from streamdata.errors import SharedMemoryError

    class Big(IterableDataset):
        def __iter__(self):
            while True:
                yield np.zeros((1000, 150))

    dl = DataLoader(Big(), batch_size=128, num_workers=1, collate_fn=C.collate)
    try:
        next(iter(dl))
    except SharedMemoryError as exc:
        print("LOADER", str(exc).splitlines()[-1])
    C.shared_memory_space = lambda path=C.SHM_PATH: None  # skip the check: torch's ENOSPC path
    try:
        C.empty_tensor((64, 1 << 20), torch.uint8, True)
    except SharedMemoryError as exc:
        print("ALLOC", type(exc.__cause__).__name__, exc)
    """
)


CAN_MOUNT = sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("unshare")


@pytest.mark.slow
@pytest.mark.skipif(not CAN_MOUNT, reason="needs root and unshare(1) to mount a small /dev/shm")
def test_a_real_small_dev_shm_gives_shared_memory_error_not_a_crash(tmp_path):
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM_SCRIPT)
    command = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    result = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    if "mount" in result.stderr and result.returncode != 0 and "LOADER" not in result.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert "LOADER" in result.stdout, result.stderr
    assert "a batch of 153.6 MB does not fit in shared memory" in result.stdout
    assert "ALLOC RuntimeError" in result.stdout and "67.1 MB" in result.stdout


def test_to_tensors_leaves_a_finished_batch_alone(in_worker):
    """streamdata's own batches (shared tensors, lists of keys) need no conversion and no
    /dev/shm check; one NumPy leaf anywhere, or an unshared tensor, still converts."""
    done = {"x": torch.zeros(2, 3).share_memory_(), "__key__": ["a", "b"], "n": [None, None]}
    assert C.to_tensors(done) is done and in_worker == []
    for leaf in (np.zeros(2), np.float32(1.0), torch.zeros(2)):
        batch = {**done, "extra": [leaf]}
        out = C.to_tensors(batch)
        assert out is not batch and isinstance(out["extra"][0], torch.Tensor)
        assert out["extra"][0].is_shared() or out["extra"][0].dim() == 0  # scalars stay small
