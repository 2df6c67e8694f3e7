"""The last metres to the GPU: pin batches ahead in a thread, copy them on a side stream.

:class:`PinAhead` reads an iterable of batches in a background thread and page-locks
their tensors, so a later ``.to("cuda", non_blocking=True)`` is truly asynchronous.
:class:`CudaPrefetcher` puts batch k+1 on the device while the model runs batch k.
Without CUDA the prefetcher is a pass-through, so the same training script runs on CPU.

NOTE [producer thread lifecycle]
    Each pass over a :class:`PinAhead` owns one thread, named ``streamdata-pin-ahead-<n>``,
    started on the pass's first ``next()``.  It pulls from the source into a queue of
    ``depth`` items.  Every ``put`` and ``get`` waits in slices of ``_POLL`` seconds and
    looks at the stop flag (or at whether the thread still lives) between slices, so
    neither side can block forever.  The pass is a generator whose ``finally`` stops the
    thread: set the flag, drain the queue, join with a timeout.  That ``finally`` runs on
    exhaustion, on an exception, on ``close()``, and when a consumer breaks out of its
    ``for`` loop (the generator is collected and closed).  A thread still inside the
    source's ``__next__`` after the timeout is reported with a warning, never ignored.
    An exception in the thread is carried to the consumer, after the batches produced
    before it, and re-raised there as the same object with a note saying where it happened.

NOTE [side-stream copy]
    1. Batches k+1 .. k+depth are copied on a dedicated side stream with
       ``non_blocking=True`` from pinned memory, so the copy engine works while the
       consumer's stream computes batch k.  The optional transform runs there too.
    2. An event recorded on the side stream after each copy; before a batch is handed
       over, the consumer's current stream waits on it (a wait on the GPU, not the host).
    3. The batch's device memory was allocated on the side stream; ``record_stream`` of
       the consumer stream on every tensor stops the caching allocator from reusing it
       while the consumer's queued work may still read it.
    4. Pinned host blocks come from the caching host allocator, which does not reuse them
       before the copies that read them have finished; the host batch may be dropped at once.
       (A source that yields pinned buffers of its own and rewrites them is outside this: it
       must not rewrite one before the step that used the batch copied from it has synced.)
    5. Before each copy the side stream waits for the work already queued on the consumer's
       stream, so a transform may read tensors the consumer made (normalisation constants).
       The copy of batch k+depth is issued before the step on batch k is launched, so this
       never delays it behind the step that uses it.
    6. A batch may hold CUDA tensors (a source that decodes on the GPU).  The source runs in
       the pin-ahead thread, whose current stream (the default stream, unless the source set
       another) is where that work was queued: right after the source returns a batch, the
       thread records an event there, and the side stream waits on it before the copy.  The
       consumer's stream may be another one, so waiting on it (5) is not enough.  And
       ``record_stream`` of the side stream on those tensors keeps their memory from being
       handed to the producer's next batch while the side stream's transform may still read it.
       With ``thread=False`` the source runs in the consumer's thread and the event is recorded
       there, on its current stream, as each batch is read (the same rule, one thread).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from streamdata.batch.tree import iter_tensors, pin_batch
from streamdata.errors import SpecError
from streamdata.feed.images import finished, has_encoded

__all__ = ["CudaPrefetcher", "PinAhead", "pin_batch"]

T = TypeVar("T")
_POLL = 0.1  # seconds every blocking queue call waits before it looks again
_thread_numbers = itertools.count()
_END = object()  # the producer's "source exhausted" sentinel
_warned_no_cuda = False


def _cuda_available() -> bool:
    return torch.cuda.is_available()


class _Failure:
    """An exception raised in the producer thread, on its way to the consumer."""

    def __init__(self, exc: BaseException, index: int, thread: str) -> None:
        self.exc, self.index, self.thread = exc, index, thread

    def reraise(self) -> None:
        self.exc.add_note(f"streamdata: raised in thread {self.thread!r} "
                            f"while producing batch {self.index} (counting from 0)")
        raise self.exc


class _Producer:
    """One thread pulling a source iterator into a bounded queue (NOTE [producer thread lifecycle])."""

    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any] | None, *,
                 depth: int, role: str, join_timeout: float) -> None:
        self.name = f"streamdata-{role}-{next(_thread_numbers)}"
        self._source = source
        self._fn = fn
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._join_timeout = join_timeout
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        index = 0
        try:
            for item in self._source:
                if self._stop.is_set():
                    return
                if self._fn is not None:
                    item = self._fn(item)
                if not self._put(item):
                    return
                index += 1
            self._put(_END)
        except BaseException as exc:  # carried to the consumer, which re-raises it
            self._put(_Failure(exc, index, self.name))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        """The next item, ``_END`` or a ``_Failure``; waits as long as the thread lives."""
        while True:
            try:
                return self._queue.get(timeout=_POLL)
            except queue.Empty:
                if self._thread.is_alive():
                    continue
            try:  # the thread may have put its last item just before it ended
                return self._queue.get_nowait()
            except queue.Empty:
                raise RuntimeError(f"{self.name} ended without a result") from None

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def stop(self) -> None:
        """Stop and join the thread; then close the source if it is a generator."""
        self._stop.set()
        self._drain()
        self._thread.join(self._join_timeout)
        self._drain()
        if self._thread.is_alive():
            warnings.warn(f"{self.name} did not stop within {self._join_timeout}s: it is blocked "
                          "in the source's __next__ and will end when that returns",
                          RuntimeWarning, stacklevel=3)
            return
        close = getattr(self._source, "close", None)
        if callable(close):
            close()


class _Passes:
    """Keeps weak references to the live passes (generators) of an iterable, to close them."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()

    def track(self, gen: Iterator[T]) -> Iterator[T]:
        self._live.add(gen)
        return gen

    def close(self) -> None:
        for gen in list(self._live):
            gen.close()


class _PassOwner:
    """What PinAhead and CudaPrefetcher share: ``len`` of the source, and passes that
    ``close()`` (or leaving a ``with`` block) ends, joining their threads."""

    iterable: Iterable[Any]
    _passes: _Passes

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def close(self) -> None:
        """End every pass in progress and join its thread (call from the consuming thread)."""
        self._passes.close()

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_Owner = TypeVar("_Owner", bound=_PassOwner)


class PinAhead(_PassOwner, Generic[T]):
    """Read ``iterable`` in a background thread, up to ``depth`` batches ahead, pinning each batch.

    For loaders that did not pin (``DataLoader(pin_memory=False)``, plain iterables): the
    page-locking copy happens off the training thread.  ``pin=None`` pins when CUDA is
    available; otherwise the thread only reads ahead.  Each pass has its own thread, which
    ends with the pass, on ``close()``, or when the consumer breaks out of its loop.
    """

    def __init__(self, iterable: Iterable[T], *, depth: int = 2, pin: bool | None = None,
                 join_timeout: float = 10.0) -> None:
        if depth < 1:
            raise SpecError(f"PinAhead depth must be >= 1, got {depth}")
        self.iterable = iterable
        self.depth = depth
        self.pin = pin
        self.join_timeout = join_timeout
        self._passes = _Passes()

    def __iter__(self) -> Iterator[T]:
        return self._passes.track(self._pass())

    def _pass(self) -> Iterator[T]:
        pin = _cuda_available() if self.pin is None else self.pin
        source = iter(self.iterable)  # here, in the consumer's thread (DataLoader wants the main thread)
        producer = _Producer(source, self._in_thread(pin), depth=self.depth,
                             role="pin-ahead", join_timeout=self.join_timeout)
        try:
            while True:
                item = producer.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    item.reraise()
                yield item
        finally:
            producer.stop()

    def _in_thread(self, pin: bool) -> Callable[[Any], Any] | None:
        """What the thread applies to each batch as the source returns it."""
        return pin_batch if pin else None



class FeedTimes:
    """Host time pinning (written by the thread that reads the source) and issuing copies (the
    consumer's thread): one writer each, per pass (two live passes may lose an addition)."""

    __slots__ = ("copy_ns", "pin_ns")

    def __init__(self) -> None:
        self.pin_ns = self.copy_ns = 0


class _StreamOps:
    """Every CUDA call the prefetcher makes, in one place (NOTE [side-stream copy])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times = FeedTimes()
        self.stream = torch.cuda.Stream(device=device)
        self._made: dict[int, list[torch.cuda.Event]] = {}  # id(batch): where its CUDA tensors are ready

    def produced(self, batch: Any) -> None:
        """In the producer thread, as the source returns ``batch``: mark its CUDA tensors ready (6)."""
        events = []
        for device in {t.device for t in iter_tensors(batch) if t.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        if events:
            self._made[id(batch)] = events  # the batch lives (in the queue) until copy() pops this

    def copy(self, batch: Any, transform: Callable[[Any], Any] | None) -> tuple[Any, Any]:
        start = time.perf_counter_ns()
        try:
            return self._copy(batch, transform)
        finally:
            self.times.copy_ns += time.perf_counter_ns() - start

    def _copy(self, batch: Any, transform: Callable[[Any], Any] | None) -> tuple[Any, Any]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        made = self._made.pop(id(batch), ())
        for event in made:
            self.stream.wait_event(event)
        if made:
            for tensor in iter_tensors(batch):
                if tensor.device == self.device:
                    tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            # asynchronous only from pinned memory: from pageable (or recycled shared) memory
            # nothing guarantees the source was read when the call returns, and the worker
            # may overwrite a released slot
            # images still encoded (decode_on="device") are decoded here, on this stream (feed/images.py)
            out = finished(batch, self.device, self._to_device)
            if transform is not None:
                out = transform(out)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=tensor.is_cuda or tensor.is_pinned())

    def hand_over(self, batch: Any, done: Any) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        for tensor in iter_tensors(batch):
            if tensor.device.type == "cuda":
                tensor.record_stream(consumer)


class _ReadyAhead(PinAhead[Any]):
    """The prefetcher's PinAhead: its thread also tells ``ops`` where each batch's CUDA tensors
    were made (``ops.produced``, NOTE [side-stream copy] 6)."""

    def __init__(self, iterable: Iterable[Any], ops: Any, **kwargs: Any) -> None:
        super().__init__(iterable, **kwargs)
        self.ops = ops

    def _in_thread(self, pin: bool) -> Callable[[Any], Any]:
        return _marked(self.ops, super()._in_thread(pin))


def _marked(ops: Any, pin_fn: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """What the thread that reads the source does to each batch: pin it (when ``pin_fn``), then
    mark where its CUDA tensors were made (``ops.produced``, NOTE [side-stream copy] 6)."""

    def prepare(batch: Any) -> Any:
        if pin_fn is not None:
            start = time.perf_counter_ns()
            batch = pin_fn(batch)
            ops.times.pin_ns += time.perf_counter_ns() - start
        ops.produced(batch)
        return batch

    return prepare


def _copy_ahead(source: Iterator[Any], ops: Any, depth: int,
                transform: Callable[[Any], Any] | None) -> Iterator[Any]:
    """Yield device batches, the copies of the next ``depth`` already queued (NOTE [side-stream copy]).

    A failure in the source or in a copy is raised after the batches before it.
    """
    pending: deque[tuple[Any, Any]] = deque()
    failure: Exception | None = None
    done = False
    index = 0
    while True:
        while not done and len(pending) <= depth:
            try:
                host = next(source)
            except StopIteration:
                done = True
                break
            except Exception as exc:
                failure, done = exc, True
                break
            try:
                pending.append(ops.copy(host, transform))
            except Exception as exc:
                exc.add_note(f"streamdata: raised while copying batch {index} to {ops.device}")
                failure, done = exc, True
                break
            index += 1
        if not pending:
            if failure is not None:
                raise failure
            return
        batch, event = pending.popleft()
        ops.hand_over(batch, event)
        yield batch


class CudaPrefetcher(_PassOwner, Generic[T]):
    """Iterate ``iterable`` with every batch already on ``device``, copied ``depth`` batches ahead.

    Batches (tensors in any nesting of dict, list, tuple, namedtuple and dataclass; other
    leaves pass through) are pinned in a :class:`PinAhead` thread and copied on a side
    stream while the consumer uses the previous one.  ``transform`` runs on the device
    batch, on the side stream (normalise, cast).  ``depth`` 1 or 2 is plenty; each step
    holds ``depth + 1`` batches on the device.  ``thread=False``: the source is read in the
    consumer's thread, with no thread of ours (for a source that pins in a thread of its own,
    such as a DataLoader with ``pin_memory=True``: a second thread between it and the training
    loop only adds a hand-over and contention for the interpreter; ``sd.loader`` chooses so).
    Without CUDA, a pass-through (with a one-time warning when ``device`` asked for CUDA);
    for other devices, plain ``.to()``.
    """

    def __init__(self, iterable: Iterable[T], device: str | torch.device = "cuda", depth: int = 1,
                 transform: Callable[[Any], Any] | None = None, *, pin: bool | None = None,
                 join_timeout: float = 10.0, thread: bool = True) -> None:
        if depth < 1:
            raise SpecError(f"CudaPrefetcher depth must be >= 1, got {depth}")
        self.iterable = iterable
        self.device = torch.device(device)
        self.depth = depth
        self.transform = transform
        self.pin = pin
        self.join_timeout = join_timeout
        self.thread = thread
        self._passes = _Passes()
        self._times = FeedTimes()  # every pass's pinning and copies (``times``)

    def times(self) -> dict[str, float]:
        """Host seconds spent pinning batches (``pin_s``, in the pin-ahead thread or, with
        ``thread=False``, the consumer's) and issuing their copies to the device (``copy_s``;
        the copies themselves run on the side stream, unseen here): ``loader.metrics()``."""
        return {"pin_s": self._times.pin_ns * 1e-9, "copy_s": self._times.copy_ns * 1e-9}

    def __iter__(self) -> Iterator[Any]:
        kind = self.device.type
        if kind == "cuda" and _cuda_available():
            return self._passes.track(self._on_side_stream())
        if kind == "cuda":
            _warn_no_cuda()
        if kind in ("cuda", "cpu"):  # images still encoded are decoded on the CPU (feed/images.py)
            return self._passes.track(self._transformed())
        return self._passes.track(self._synchronous())

    def _on_side_stream(self) -> Iterator[Any]:
        device = self.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        ops = _StreamOps(device)
        ops.times = self._times  # every pass's, together
        if self.thread:
            host = iter(_ReadyAhead(self.iterable, ops, depth=self.depth, pin=self.pin,
                                    join_timeout=self.join_timeout))
        else:
            host = _here(self.iterable, ops, True if self.pin is None else self.pin)
        try:
            yield from _copy_ahead(host, ops, self.depth, self.transform)
        finally:
            host.close()  # type: ignore[attr-defined]  # a generator: stops the thread

    def _transformed(self) -> Iterator[Any]:
        cpu = torch.device("cpu")
        for batch in self.iterable:
            if has_encoded(batch):
                batch = finished(batch, cpu)
            yield batch if self.transform is None else self.transform(batch)

    def _synchronous(self) -> Iterator[Any]:
        for batch in self.iterable:
            out = finished(batch, self.device, lambda t: t.to(self.device))
            yield out if self.transform is None else self.transform(out)



def _here(iterable: Iterable[Any], ops: _StreamOps, pin: bool) -> Iterator[Any]:
    """``thread=False``: the source's batches, read, pinned (a no-op for pinned ones) and marked
    (NOTE [side-stream copy] 6: the consumer's current stream is where they were made) in the
    consumer's thread."""
    source, prepare = iter(iterable), _marked(ops, pin_batch if pin else None)
    try:
        for batch in source:
            yield prepare(batch)
    finally:
        close = getattr(source, "close", None)
        if close is not None:  # as the pin-ahead thread's producer closes it when it stops
            close()


def _warn_no_cuda() -> None:
    global _warned_no_cuda
    if not _warned_no_cuda:
        _warned_no_cuda = True
        warnings.warn("streamdata.CudaPrefetcher: CUDA is not available; batches pass through "
                      "unchanged on the CPU (said once per process)", RuntimeWarning, stacklevel=3)
