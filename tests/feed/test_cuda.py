"""The pin-ahead thread and the CUDA prefetcher.

On CPU: structure handling, thread lifecycle, exception carrying, the scheduling of
side-stream copies (against a recording stand-in for the CUDA calls) and the pass-through.
Tests marked ``cuda`` run the real side stream where a device exists.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch

from streamdata.batch import tree
from streamdata.batch.tree import iter_tensors, map_tensors
from streamdata.errors import SpecError
from streamdata.feed import cuda as K


class Pair(NamedTuple):
    image: torch.Tensor
    label: object


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    tags: list


def make_batch(i: int) -> dict:
    return {
        "x": torch.full((2, 3), float(i)),
        "ids": torch.arange(4, dtype=torch.int64) + i,
        "half": torch.ones(2, dtype=torch.float16) * i,
        "pair": Pair(torch.tensor([i], dtype=torch.uint8), f"label{i}"),
        "record": Record(x=torch.zeros(1) + i, tags=["a", i]),
        "nested": [(torch.eye(2) * i, None)],
        "array": np.full(2, i),
        "name": f"b{i}",
    }


def assert_same_batch(got, want) -> None:
    """Same structure, types, non-tensor leaves; tensors equal in value, dtype and shape."""
    got_t, want_t = list(iter_tensors(got)), list(iter_tensors(want))
    assert len(got_t) == len(want_t)
    for g, w in zip(got_t, want_t, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu())
    strip = lambda b: map_tensors(lambda t: "T", b)  # noqa: E731
    g, w = strip(got), strip(want)
    np.testing.assert_array_equal(g.pop("array"), w.pop("array"))
    assert g == w
    assert type(got["pair"]) is Pair and type(got["record"]) is Record


def streamdata_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("streamdata")]


class Failing(ValueError):
    pass


def source(n: int, fail_at: int | None = None, log: list | None = None):
    for i in range(n):
        if i == fail_at:
            raise Failing(f"bad batch {i}")
        if log is not None:
            log.append(i)
        yield make_batch(i)


# --- pin_batch / PinAhead ------------------------------------------------------------------------

def test_pin_batch_pins_every_tensor_and_passes_other_leaves(monkeypatch):
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(tree, "_pin_tensor", lambda t: pinned.append(t) or t.clone())
    batch = make_batch(3)
    out = K.pin_batch(batch)
    assert len(pinned) == 6
    assert all(any(p is t for p in pinned) for t in iter_tensors(batch))
    assert_same_batch(out, batch)
    assert out["x"] is not batch["x"] and out["name"] == "b3" and out["pair"].label == "label3"


def test_pin_ahead_yields_the_source_batches_in_order_from_a_named_thread():
    seen_threads = []

    def watched():
        for batch in source(5):
            seen_threads.append(threading.current_thread().name)
            yield batch

    out = list(K.PinAhead(watched(), depth=2, pin=False))
    assert len(out) == 5
    for i, batch in enumerate(out):
        assert_same_batch(batch, make_batch(i))
    assert len(set(seen_threads)) == 1 and seen_threads[0].startswith("streamdata-pin-ahead-")
    assert streamdata_threads() == []


def test_pin_ahead_pins_in_the_thread_when_asked(monkeypatch):
    pinned_in: list[str] = []

    def fake_pin(t):
        pinned_in.append(threading.current_thread().name)
        return t

    monkeypatch.setattr(tree, "_pin_tensor", fake_pin)
    assert len(list(K.PinAhead(source(2), pin=True))) == 2
    assert len(pinned_in) == 12 and all(name.startswith("streamdata-pin-ahead") for name in pinned_in)


def test_pin_ahead_does_not_pin_without_cuda(monkeypatch):
    monkeypatch.setattr(K, "_cuda_available", lambda: False)
    monkeypatch.setattr(tree, "_pin_tensor", lambda t: pytest.fail("pinned without CUDA"))
    assert len(list(K.PinAhead(source(3)))) == 3


def test_pin_ahead_carries_the_source_exception_with_its_type_and_where():
    got = []
    with pytest.raises(Failing, match="bad batch 3") as info:
        for batch in K.PinAhead(source(6, fail_at=3), pin=False):
            got.append(batch)
    assert len(got) == 3  # the batches before the failure arrive first
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "batch 3" in notes and "streamdata-pin-ahead-" in notes
    assert any(entry.name == "source" for entry in info.traceback)  # the producer's frames are kept
    assert streamdata_threads() == []


def test_pin_ahead_thread_is_gone_after_an_early_break():
    for i, _ in enumerate(K.PinAhead(source(100), pin=False)):
        assert streamdata_threads() != []
        if i == 2:
            break
    gc.collect()
    assert streamdata_threads() == []


def test_pin_ahead_close_stops_a_pass_in_progress():
    feed = K.PinAhead(source(100), pin=False)
    batches = iter(feed)
    next(batches)
    assert len(streamdata_threads()) == 1
    feed.close()
    assert streamdata_threads() == []
    with pytest.raises(StopIteration):
        next(batches)


def test_pin_ahead_as_context_manager_and_two_passes():
    with K.PinAhead([1, 2, 3], pin=False) as feed:
        first, second = iter(feed), iter(feed)
        assert next(first) == 1 and next(second) == 1
        assert len(streamdata_threads()) == 2
    assert streamdata_threads() == []
    assert list(feed) == [1, 2, 3] and len(feed) == 3


def test_pin_ahead_reads_at_most_depth_plus_one_ahead():
    log: list[int] = []
    batches = iter(K.PinAhead(source(50, log=log), depth=2, pin=False))
    next(batches)
    time.sleep(0.3)  # room for a producer that ignored its bound to run on
    # consumed 1; the queue holds 2; the thread holds 1 more, waiting to put it
    assert len(log) <= 1 + 2 + 1
    batches.close()


def test_pin_ahead_warns_when_the_source_will_not_let_its_thread_stop():
    release = threading.Event()

    def stuck():
        yield 0
        release.wait(30)
        yield 1

    batches = iter(K.PinAhead(stuck(), pin=False, join_timeout=0.2))
    assert next(batches) == 0
    with pytest.warns(RuntimeWarning, match="blocked in the source"):
        batches.close()
    release.set()  # let the thread finish, so nothing is left behind
    deadline = time.monotonic() + 10
    while streamdata_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streamdata_threads() == []


def test_depth_must_be_positive():
    with pytest.raises(SpecError):
        K.PinAhead([], depth=0)
    with pytest.raises(SpecError):
        K.CudaPrefetcher([], depth=0)


# --- the copy schedule, against a recording stand-in for the CUDA calls --------------------------

class RecordingOps:
    """Stands in for _StreamOps: 'copies' by cloning, and logs every call."""

    def __init__(self, device: torch.device | None = None, fail_copy_at: int | None = None):
        self.device = torch.device("cuda", 0) if device is None else device
        self.log: list[tuple[str, int]] = []
        self.fail_copy_at = fail_copy_at

    def produced(self, batch):
        self.log.append(("produced", int(batch["ids"][0]), threading.current_thread().name))

    def copy(self, batch, transform):
        i = int(batch["ids"][0])
        if i == self.fail_copy_at:
            raise RuntimeError("copy failed")
        self.log.append(("copy", i))
        out = map_tensors(torch.clone, batch)
        out = transform(out) if transform is not None else out
        return out, ("event", i)

    def hand_over(self, batch, event):
        self.log.append(("hand_over", event[1]))


@pytest.mark.parametrize("depth", [1, 2])
def test_copies_run_depth_batches_ahead_of_the_one_handed_over(depth):
    ops = RecordingOps()
    for k, batch in enumerate(K._copy_ahead(source(6), ops, depth, None)):
        assert_same_batch(batch, make_batch(k))
        copied = [i for what, i in ops.log if what == "copy"]
        assert copied[-1] == min(k + depth, 5)  # batch k+depth already queued while k is used
    assert [i for what, i in ops.log if what == "hand_over"] == list(range(6))
    assert [i for what, i in ops.log if what == "copy"] == list(range(6))


def test_the_consumer_waits_for_each_copy_before_using_it():
    ops = RecordingOps()
    for k, _batch in enumerate(K._copy_ahead(source(4), ops, 1, None)):
        assert [i for what, i in ops.log if what == "hand_over"][-1] == k
        assert ops.log.index(("copy", k)) < ops.log.index(("hand_over", k))


def test_a_source_failure_comes_after_the_batches_before_it():
    got = []
    with pytest.raises(Failing):
        for batch in K._copy_ahead(source(6, fail_at=4), RecordingOps(), 2, None):
            got.append(int(batch["ids"][0]))
    assert got == [0, 1, 2, 3]


def test_a_copy_failure_is_noted_with_the_batch_and_device():
    got = []
    with pytest.raises(RuntimeError, match="copy failed") as info:
        for batch in K._copy_ahead(source(6), RecordingOps(fail_copy_at=2), 1, None):
            got.append(int(batch["ids"][0]))
    assert got == [0, 1]
    assert any("copying batch 2 to cuda:0" in note for note in info.value.__notes__)


def test_the_transform_is_applied_to_each_device_batch():
    def transform(batch):
        return {**batch, "x": batch["x"] * 2}

    out = list(K._copy_ahead(source(3), RecordingOps(), 1, transform))
    assert [float(b["x"][0, 0]) for b in out] == [0.0, 2.0, 4.0]


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available', with RecordingOps in place of the stream calls."""
    made: list[RecordingOps] = []

    def ops(device):
        made.append(RecordingOps(device))
        return made[-1]

    monkeypatch.setattr(K, "_cuda_available", lambda: True)
    monkeypatch.setattr(K, "_StreamOps", ops)
    monkeypatch.setattr(tree, "_pin_tensor", lambda t: t)
    return made


def test_prefetcher_feeds_from_the_pin_thread_and_leaves_nothing_behind(fake_cuda):
    feed = K.CudaPrefetcher(source(10), device="cuda:0", depth=2)
    for k, batch in enumerate(feed):
        assert_same_batch(batch, make_batch(k))
        assert len(streamdata_threads()) == 1
        if k == 4:
            break
    gc.collect()
    assert streamdata_threads() == []
    assert fake_cuda[0].device == torch.device("cuda", 0)


def test_the_pin_thread_marks_each_batch_produced_before_its_copy(fake_cuda):
    """NOTE [side-stream copy] 6: ``produced`` runs in the thread that ran the source (where a
    source's GPU work was queued), after pinning, and before the batch's copy is issued."""
    assert len(list(K.CudaPrefetcher(source(4), device="cuda:0", depth=2))) == 4
    log = fake_cuda[0].log
    produced = [entry for entry in log if entry[0] == "produced"]
    assert [i for _, i, _ in produced] == [0, 1, 2, 3]
    assert all(thread.startswith("streamdata-pin-ahead-") for _, _, thread in produced)
    for i in range(4):
        assert log.index(produced[i]) < log.index(("copy", i))


def test_without_a_thread_the_consumer_reads_marks_and_copies_in_order(fake_cuda):
    """``thread=False``: no thread of ours; each batch is marked produced in the consumer's
    thread before its copy, ``depth`` ahead as with the thread."""
    feed = K.CudaPrefetcher(source(6), device="cuda:0", depth=2, thread=False)
    for k, batch in enumerate(feed):
        assert_same_batch(batch, make_batch(k))
        assert streamdata_threads() == []
    log = fake_cuda[0].log
    produced = [entry for entry in log if entry[0] == "produced"]
    assert [i for _, i, _ in produced] == list(range(6))
    assert {thread for _, _, thread in produced} == {threading.current_thread().name}
    for i in range(6):
        assert log.index(produced[i]) < log.index(("copy", i)) < log.index(("hand_over", i))


def test_without_a_thread_a_source_failure_comes_after_the_batches_before_it(fake_cuda):
    got = []
    with pytest.raises(Failing):
        for batch in K.CudaPrefetcher(source(5, fail_at=3), device="cuda:0", thread=False):
            got.append(int(batch["ids"][0]))
    assert got == [0, 1, 2]


def test_prefetcher_surfaces_source_errors_with_type_and_where(fake_cuda):
    got = []
    with pytest.raises(Failing) as info:
        for batch in K.CudaPrefetcher(source(5, fail_at=3), device="cuda:0"):
            got.append(batch)
    assert len(got) == 3
    assert any("while producing batch 3" in note for note in info.value.__notes__)
    assert streamdata_threads() == []


def test_prefetcher_close_joins_the_thread(fake_cuda):
    with K.CudaPrefetcher(source(10), device="cuda:0") as feed:
        batches = iter(feed)
        next(batches)
        assert len(streamdata_threads()) == 1
    assert streamdata_threads() == []


# --- without CUDA ----------------------------------------------------------------------------------

@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(K, "_cuda_available", lambda: False)
    monkeypatch.setattr(K, "_warned_no_cuda", False)


def test_without_cuda_the_prefetcher_passes_the_same_batches_through(no_cuda):
    batches = [make_batch(i) for i in range(4)]
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        out = list(K.CudaPrefetcher(batches, device="cuda", depth=2))
    assert len(out) == 4 and all(o is b for o, b in zip(out, batches, strict=True))
    assert streamdata_threads() == []


def test_without_cuda_it_warns_once_per_process(no_cuda):
    with pytest.warns(RuntimeWarning):
        list(K.CudaPrefetcher([1], device="cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(K.CudaPrefetcher([1, 2], device="cuda")) == [1, 2]


def test_cpu_device_is_a_silent_pass_through_and_applies_the_transform(no_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feed = K.CudaPrefetcher([torch.ones(2), torch.zeros(2)], device="cpu",
                                transform=lambda t: t + 1)
        out = list(feed)
    assert [t.tolist() for t in out] == [[2.0, 2.0], [1.0, 1.0]]
    assert len(feed) == 2


def test_the_pass_through_propagates_source_errors_unchanged(no_cuda):
    with pytest.raises(Failing):
        list(K.CudaPrefetcher(source(3, fail_at=1), device="cpu"))


# --- on a CUDA device ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_nested_batches_arrive_on_the_device_unchanged(depth):
    out = list(K.CudaPrefetcher(source(5), device="cuda", depth=depth))
    for i, batch in enumerate(out):
        assert all(t.is_cuda for t in iter_tensors(batch))
        assert_same_batch(batch, make_batch(i))
    assert streamdata_threads() == []


@pytest.mark.cuda
def test_cuda_transform_runs_on_the_device_and_pinned_loader_batches_work():
    loader = torch.utils.data.DataLoader(torch.arange(64.0).reshape(16, 4), batch_size=4,
                                         pin_memory=True)
    feed = K.CudaPrefetcher(loader, device="cuda", transform=lambda t: t.half() * 2)
    out = list(feed)
    assert all(t.is_cuda and t.dtype == torch.float16 for t in out)
    assert torch.equal(torch.cat(out).float().cpu(), torch.arange(64.0).reshape(16, 4) * 2)


@pytest.mark.cuda
def test_cuda_results_are_right_under_a_busy_consumer_stream():
    """Data races show as wrong values: the consumer's stream runs long kernels meanwhile."""
    big = [torch.full((1 << 20,), float(i)) for i in range(8)]
    total = 0.0
    for i, t in enumerate(K.CudaPrefetcher(big, device="cuda", depth=2)):
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(5):
            busy = busy @ busy / 2048
        total += float(t.sum())
        assert float(t[0]) == float(i)
    assert total == sum(float(i) * (1 << 20) for i in range(8))


@pytest.mark.cuda
def test_cuda_early_break_and_errors_leave_no_thread():
    for i, _ in enumerate(K.CudaPrefetcher(source(50), device="cuda")):
        if i == 1:
            break
    gc.collect()
    with pytest.raises(Failing):
        list(K.CudaPrefetcher(source(5, fail_at=2), device="cuda"))
    assert streamdata_threads() == []


# --- on a CUDA device: ordering, overlap and host buffers, measured with CUDA events ---------------

def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


@functools.cache
def sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s clock cycles per millisecond, calibrated once (as gpu_feed does)."""
    from benchmarks.gpu_feed import cycles_per_second

    return cycles_per_second() / 1000


def busy(ms: float) -> None:
    torch.cuda._sleep(int(ms * sleep_cycles_per_ms()))


def all_true(flags: list[torch.Tensor]) -> bool:
    return bool(torch.stack(flags).all())  # one sync, after the loop


@pytest.mark.cuda
def test_cuda_the_copy_of_the_next_batch_runs_while_the_consumer_computes(monkeypatch):
    """NOTE [side-stream copy] 1 and 5: while step k runs on the consumer's stream, batch k+1 is
    copied on the side stream.  Events on both streams: each copy's span lies inside the step
    before the one that uses it, and the consumer's stream has no gaps between steps.  The
    control (the same copies on the consumer's stream) shows that the gaps are seen."""
    n, numel = 8, 16 << 20  # 64 MB batches
    host = [torch.full((numel,), float(i)).pin_memory() for i in range(n)]
    sleep_cycles_per_ms()
    scratch = torch.empty(numel, device="cuda")
    scratch.copy_(host[0], non_blocking=True)  # warm up
    start, end = timing_event(), timing_event()
    start.record()
    scratch.copy_(host[0], non_blocking=True)
    end.record()
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    step_ms = max(3 * copy_ms, 2.0)

    copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    class TimedOps(K._StreamOps):
        def copy(self, batch, transform):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # as copy() does first
            begin = timing_event()
            begin.record(self.stream)
            out, done = super().copy(batch, transform)
            finish = timing_event()
            finish.record(self.stream)
            copies.append((begin, finish))
            return out, done

    monkeypatch.setattr(K, "_StreamOps", TimedOps)

    def run(feed, copy_here: bool):
        steps, sums = [], []
        torch.cuda.synchronize()
        base = timing_event()
        base.record()
        for t in feed:
            if copy_here:
                t = t.to("cuda", non_blocking=True)  # on the consumer's stream
            begin, finish = timing_event(), timing_event()
            begin.record()
            busy(step_ms)
            sums.append(t[:: 1 << 16].sum())  # the step reads its batch
            finish.record()
            steps.append((begin, finish))
        torch.cuda.synchronize()
        at = base.elapsed_time
        gaps = at(steps[-1][1]) - at(steps[0][0]) - sum(b.elapsed_time(f) for b, f in steps)
        assert [float(x) for x in sums] == [256.0 * i for i in range(n)]
        return steps, gaps, at

    steps, gaps, at = run(K.CudaPrefetcher(host, device="cuda", depth=1), copy_here=False)
    assert len(copies) == n
    inside = []
    for k in range(1, n - 1):
        (cb, cf), (sb, sf) = copies[k + 1], steps[k]
        span = at(cf) - at(cb)
        inside.append((min(at(cf), at(sf)) - max(at(cb), at(sb))) / span)
    _, control_gaps, _ = run(host, copy_here=True)
    detail = (f"copy {copy_ms:.2f} ms, step {step_ms:.2f} ms; share of copy k+1 inside step k: "
              f"{[round(x, 2) for x in inside]}; gaps between steps {gaps:.2f} ms "
              f"(control, copies on the consumer's stream: {control_gaps:.2f} ms)")
    print(detail)
    assert control_gaps > 0.5 * (n - 1) * copy_ms, detail  # the method sees exposed copies
    assert min(inside) > 0.5, detail
    assert gaps < 0.5 * (n - 1) * copy_ms, detail


@pytest.mark.cuda
def test_cuda_pinned_blocks_are_not_reused_while_their_copy_waits():
    """NOTE [side-stream copy] 4: the pin thread makes a fresh pinned copy of every batch and
    drops it once its copy is queued; the copies wait behind a busy consumer that never syncs,
    so a pinned block handed to the next batch before its copy ran would show wrong values."""
    n, numel = 16, 4 << 20
    sleep_cycles_per_ms()
    oks = []

    def fresh():
        for i in range(n):
            yield torch.full((numel,), float(i))  # pageable: the pin thread copies it to a pinned block

    for i, t in enumerate(K.CudaPrefetcher(fresh(), device="cuda", depth=2)):
        busy(20)  # the GPU is the slow side: copies queue up behind the steps
        oks.append((t == float(i)).all())
    assert all_true(oks)


class Stamped(torch.utils.data.IterableDataset):
    """Samples whose every value is the sample's index, split between the workers."""

    def __init__(self, n: int, width: int = 1 << 16) -> None:
        self.n, self.width = n, width

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield {"x": np.full(self.width, float(i)), "i": i}


@pytest.mark.cuda
@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_loader_batches_are_right_when_their_shared_memory_is_recycled(pin_memory):
    """Workers reuse a batch's shared memory once the main process drops it (recycle.py); the
    pinned copy (the DataLoader's pin thread, or the pin-ahead thread) is what the side stream
    reads.  A busy consumer that never syncs keeps the copies waiting while workers go on."""
    import streamdata as sd

    sleep_cycles_per_ms()
    oks, seen = [], []
    with sd.loader(Stamped(8 * 40), batch_size=8, num_workers=2, device="cuda", depth=2,
                   pin_memory=pin_memory) as feed:
        for batch in feed:
            assert batch["x"].is_cuda
            busy(5)  # the GPU is the slow side: copies queue up behind the steps
            oks.append((batch["x"] == batch["i"].to(batch["x"].dtype)[:, None]).all())
            seen.append(batch["i"])
    assert all_true(oks)
    assert torch.cat(seen).sort().values.tolist() == list(range(8 * 40))


@pytest.mark.cuda
@pytest.mark.parametrize(("fill_ms", "step_ms", "keep_source"), [
    (5.0, 0.5, True),  # ordering: each batch is filled late on the producer's stream
    (0.2, 3.0, False),  # keep-alive: the side stream lags behind a busy consumer
], ids=["filled-late", "side-stream-lags"])
def test_cuda_batches_made_on_the_gpu_by_the_source_are_ordered_and_kept(fill_ms, step_ms, keep_source):
    """NOTE [side-stream copy] 6: the source makes its batches on the GPU in the pin-ahead thread
    (its default stream); the consumer runs on a stream of its own.  filled-late: the transform
    and the consumer must see the filled batch (the side stream waits for the producer's
    stream, not only the consumer's).  side-stream-lags: a source tensor the transform drops
    must not be handed to the producer's next batch while the transform may still read it."""
    n, numel = 12, 1 << 20
    sleep_cycles_per_ms()

    def made_on_gpu():
        for i in range(n):
            x = torch.empty(numel, device="cuda")  # this thread's current stream: the default one
            busy(fill_ms)
            x.fill_(float(i))
            yield {"x": x, "i": i}

    def transform(batch):
        out = {"y": batch["x"] * 2, "i": batch["i"]}
        return {**out, "x": batch["x"]} if keep_source else out

    consumer = torch.cuda.Stream()
    oks = []
    with torch.cuda.stream(consumer):
        for batch in K.CudaPrefetcher(made_on_gpu(), device="cuda", depth=2, transform=transform):
            busy(step_ms)
            oks.append((batch["y"] == 2.0 * batch["i"]).all())
            if keep_source:
                oks.append((batch["x"] == float(batch["i"])).all())
    consumer.synchronize()
    assert all_true(oks)


class Slow(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(1000):
            time.sleep(0.05)
            yield {"x": np.full(1024, float(i))}


@pytest.mark.cuda
def test_cuda_loader_close_while_the_pin_thread_waits_for_a_worker():
    """Loader.close() mid-epoch, the pin-ahead thread blocked in the DataLoader's next(): the
    thread is joined first (no warning), then the workers end (the leak guard checks them)."""
    import streamdata as sd

    feed = sd.loader(Slow(), batch_size=4, num_workers=2, device="cuda", pin_memory=False)
    batches = iter(feed)
    next(batches)
    next(batches)
    assert len(streamdata_threads()) == 1
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed.close()
    assert time.monotonic() - began < 5
    assert not [w for w in caught if "did not stop" in str(w.message)]
    assert streamdata_threads() == [] and feed.dataloader._iterator is None


@pytest.mark.cuda
def test_cuda_loader_that_pins_feeds_the_device_without_a_thread_of_ours_and_closes_mid_epoch():
    """sd.loader(device=...) with the DataLoader pinning (the default with CUDA): the batches
    arrive right, on the device, with no streamdata thread; close() mid-epoch ends the workers."""
    import streamdata as sd

    feed = sd.loader(Slow(), batch_size=4, num_workers=2, device="cuda")
    batches = iter(feed)
    for _ in range(3):
        batch = next(batches)
        assert batch["x"].is_cuda and streamdata_threads() == []
        assert sorted(batch["x"][:, 0].tolist()) == batch["x"][:, 0].tolist()
    began = time.monotonic()
    feed.close()
    assert time.monotonic() - began < 5
    assert feed.dataloader._iterator is None
