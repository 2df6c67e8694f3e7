"""An async object-store client bound to one reader: a loop thread plus a fresh fsspec filesystem.

Async backends (s3fs, gcsfs, HTTP on aiohttp) run natively on the loop; sync ones (local
files, HDFS through pyarrow) run in a small thread pool so they overlap the same way.
Created lazily in the process that uses it (LOOP-AFTER-FORK, see ``store.loop``); a forked child
drops the sessions it inherited (FORK-RESET, see ``_fork``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamdata._compat import aiohttp_forget, aiohttp_no_hidden_retry, aiohttp_session_of, executor_threads
from streamdata._fork import at_fork_in_child
from streamdata.config import FetchConfig, lite_http
from streamdata.errors import ShortReadError
from streamdata.metrics import Counters
from streamdata.store.backends import (
    close_sessions,
    filesystem,
    inherited_signer,
    lite_path,
    lite_s3,
    translate_error,
)
from streamdata.store.loop import LoopThread, wait_threads_gone
from streamdata.store.network import network_for
from streamdata.store.presigned import Body, PresignedS3, http_probe
from streamdata.store.rate import RateGovernor, governor_for, share_of
from streamdata.store.retry import Throttle, backoff_s, classify, retry_after

if TYPE_CHECKING:
    from streamdata.store.hub import HubFiles

__all__ = ["AsyncClient", "Chunks", "ClientStats", "body_size"]


class Chunks(tuple):
    """A response body as the chunks it arrived in, not joined.

    Joining a part's chunks into one ``bytes`` copies every byte once more, and in a fresh
    DataLoader worker page-faults in a buffer as big as the part. The tar parser reads the
    chunks as they are (``ItemReader.chunks`` hands them on one by one). Measured
    (benchmarks/README.md): py-spy found a fifth of a worker's samples in the join.
    """

    __slots__ = ()


def body_size(data: bytes | Chunks) -> int:
    """Bytes in a body, joined or not."""
    return sum(map(len, data)) if type(data) is Chunks else len(data)


@dataclass
class ClientStats:
    """Request counters (read by benchmarks and tests).

    ``bytes`` counts bytes delivered; ``received`` every body byte that reached this
    client, tries that failed included where the backend hands them over (S3's presigned
    GETs); ``refetched`` the difference: bytes received more than once (or thrown away).
    """

    requests: int = 0
    retries: int = 0
    bytes: int = 0
    received: int = 0
    refetched: int = 0
    waited_as_asked: int = 0  # retries that waited as an answer's Retry-After asked
    resigned: int = 0  # presigned URLs signed again (``presigned``)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


# storage options under which a presigned GET would not be the same request as s3fs's
_S3_SLOW_OPTIONS = ("requester_pays", "version_aware", "s3_additional_kwargs")


class _LitePaths:
    """What the client asks of a filesystem for S3 URLs under LITE-S3 (none is built)."""

    _strip_protocol = staticmethod(lite_path)


class _HubPaths:
    """What the client asks of a filesystem for ``hf://`` URLs (``hub.HubFiles`` takes them whole)."""

    @staticmethod
    def _strip_protocol(url: str) -> str:
        return url


_live_clients: weakref.WeakSet[AsyncClient] = weakref.WeakSet()


def _forget_inherited() -> None:
    """FORK-RESET, stage "sessions": drop every inherited client's sessions and pools."""
    for client in list(_live_clients):
        if client._presigned is not None:
            client._presigned.forget()
        for fs in (client._fs, client._fallback_fs):
            session = aiohttp_session_of(fs)
            if session is not None:
                aiohttp_forget(session)
    _live_clients.clear()


at_fork_in_child("sessions", _forget_inherited)


class AsyncClient:
    """Ranged GETs with time-outs and retries for URLs of one protocol, on a private loop."""

    def __init__(self, protocol: str, storage_options: dict | None = None,
                 config: FetchConfig | None = None, *, name: str = "io", url: str | None = None,
                 fast_s3: bool = True, counters: Counters | None = None, readers: int = 1) -> None:
        self.protocol = protocol
        self.counters = counters  # the dataset's, shared with the main process (retried.*)
        self.url = url  # an example URL: carries an HDFS name node's host and port
        self.config = config or FetchConfig()
        self.stats = ClientStats()
        self._options = dict(storage_options or {})
        self._executor: ThreadPoolExecutor | None = None
        self._fs: Any = None
        self._fallback_fs: Any = None  # LITE-S3's s3fs, built only to re-sign
        self._presigned: PresignedS3 | HubFiles | None = None  # the signed (or the Hub's) GET path
        self.throttle = Throttle(self.config.max_requests)  # READER-THROTTLE (``retry``)
        # RATE-SHARE (``rate``): this process's share of the job's requests per second, or None
        self.readers = readers
        share = share_of(self._rate(), readers)
        where = f"{protocol}:{self._options.get('endpoint') or self._options.get('endpoint_url') or ''}"
        self.governor: RateGovernor | None = governor_for(where, share) if share is not None else None
        self.fast_s3 = fast_s3
        self._opened: asyncio.Future | None = None
        # HEAD-START: the first bytes of objects sized by a probe (``size``), kept for the
        # ``get`` of their start that follows: {url: (body, size)}
        self._heads: dict[str, tuple[Body, int | None]] = {}
        self._probed = False
        self.io = LoopThread(name)
        _live_clients.add(self)

    # ---- lifecycle --------------------------------------------------------------------

    async def _open(self) -> Any:
        """The filesystem, created on first use on the loop (concurrent callers share it)."""
        if self._opened is None:
            self._opened = asyncio.ensure_future(self._create())
        return await asyncio.shield(self._opened)

    def _lite(self) -> Any:
        """LITE-S3's signer where it serves these options, else ``None``."""
        fast = (self.protocol in ("s3", "s3a") and self.fast_s3
                and not set(_S3_SLOW_OPTIONS) & set(self._options))
        return lite_s3(self.protocol, self._options) if fast else None

    @property
    def endpoint(self) -> tuple[str, str, int] | None:
        """Where LITE-S3's GETs go on LITE-HTTP's pool, ``(scheme, host, port)`` (the tuner's key
        for what it learned of the endpoint); ``None`` on any other path."""
        lite = self._lite() if lite_http() else None
        return None if lite is None else lite.conn_key

    def _rate(self) -> float | None:
        """The job's requests per second to this store (``FetchConfig.max_requests_per_s``, else
        the store's default), or ``None``."""
        rate = self.config.max_requests_per_s
        if rate is None and self.protocol == "hf":
            from streamdata.store.hub import HUB_REQUESTS_PER_S

            rate = HUB_REQUESTS_PER_S
        return rate

    async def _create(self) -> Any:
        if self.protocol == "hf":  # the Hub: its resolve endpoint's ranged GETs (``hub``)
            from streamdata.store.hub import HubFiles

            self._presigned = HubFiles(self._options, self.config.max_requests, timeout=self.config.timeout,
                                       network=network_for(self._options, "https"))
            self._fs = _HubPaths()
            return self._fs
        lite = self._lite()
        if lite is not None:  # LITE-S3: signed here; s3fs is imported only if a GET needs re-signing
            self._presigned = PresignedS3(None, self.config.max_requests, lite, lite=True,
                                           make_fs=self._full_fs, timeout=self.config.timeout,
                                           lifetime=self.config.presign_lifetime, on_resign=self._resigned,
                                           network=network_for(self._options, self.protocol))
            self._fs = _LitePaths()
            return self._fs
        return await self._full_fs()

    def _resigned(self, why: str) -> None:
        """A presigned URL signed again (``metrics.RESIGN_REASONS``); on the loop's thread, which
        also writes ``retried.*`` (ONE-WRITER-PER-ROW holds)."""
        self.stats.add(resigned=1)
        if self.counters is not None:
            self.counters.add(f"resigned.{why}")

    async def _full_fs(self) -> Any:
        import fsspec

        try:
            cls = fsspec.get_filesystem_class(self.protocol)
            is_async = bool(getattr(cls, "async_impl", False))
        except (ImportError, ValueError):
            is_async = False  # filesystem() below raises our error for these
        extra = {"asynchronous": True, "loop": self.io.loop} if is_async else {}
        options = dict(self._options)
        if self.protocol in ("s3", "s3a"):
            # botocore pools 10 connections by default: fewer than the requests we keep in flight
            config = dict(options.get("config_kwargs") or {})
            config["max_pool_connections"] = max(config.get("max_pool_connections", 10),
                                                 self.config.max_requests)
            options["config_kwargs"] = config
        # the backend's own request time-outs and retries bounded, so ours are the only ones
        fs = filesystem(self.protocol, options, url=self.url, timeout=self.config.timeout, **extra)
        fast = self.protocol in ("s3", "s3a") and self.fast_s3 and not set(_S3_SLOW_OPTIONS) & set(options)
        signer = inherited_signer(self.protocol, self._options) if fast else None
        if is_async and signer is None:  # with a signer, s3fs builds its client only if needed
            setter = getattr(fs, "set_session", None) or getattr(fs, "_set_session", None)
            if setter is not None:
                await setter()
            session = aiohttp_session_of(fs)  # HTTP's and gcsfs's
            if session is not None:
                aiohttp_no_hidden_retry(session)
        elif not is_async:
            self._executor = ThreadPoolExecutor(self.config.max_requests,
                                                thread_name_prefix="streamdata-fileio")
        if fast and self._presigned is None:
            self._presigned = PresignedS3(fs, self.config.max_requests, signer,
                                           lifetime=self.config.presign_lifetime, on_resign=self._resigned,
                                           network=network_for(self._options, self.protocol))
        if self._fs is None:
            self._fs = fs
        else:  # LITE-S3's fallback: closed with the client
            self._fallback_fs = fs
        return fs

    async def _close_fs(self) -> None:
        self._heads.clear()
        presigned, self._presigned = self._presigned, None
        if presigned is not None:
            await presigned.close()
        fallback, self._fallback_fs = self._fallback_fs, None
        fs, self._fs = self._fs, None
        for each in (fs, fallback):
            if each is not None and self._executor is None:
                await close_sessions(each)

    def close(self) -> None:
        """Cancel requests, close connections, join the loop thread and the file-I/O pool."""
        self.io.close(cleanup=self._close_fs, timeout=5.0)
        if self._executor is not None:
            threads = executor_threads(self._executor)
            self._executor.shutdown(wait=True, cancel_futures=True)
            wait_threads_gone(threads)
            self._executor = None

    # ---- requests (coroutines, run on the loop) ----------------------------------------

    async def _call(self, async_name: str, sync_name: str, url: str, **kwargs: Any) -> Any:
        # keywords, always: s3fs's _cat_file takes version_id before start and end
        fs = await self._open()
        path = fs._strip_protocol(url)  # HTTP keeps the whole URL, object stores drop "s3://"
        if self._executor is None:
            return await getattr(fs, async_name)(path, **kwargs)
        loop = asyncio.get_running_loop()
        call = functools.partial(getattr(fs, sync_name), path, **kwargs)
        return await loop.run_in_executor(self._executor, call)

    async def size(self, url: str, first_byte: list[float] | None = None) -> int | None:
        """The object's size, for objects a listing did not size, retried like a part.
        ``first_byte``, where the probe is a GET on LITE-HTTP's pool, gets its first byte's
        latency as ``get`` does (the far step reads the reader's first probe).

        HEAD-START: on S3's presigned GETs and HTTP(S) the size comes from a ranged GET's
        ``Content-Range``, not a HEAD, and the client's first such probe asks for the object's
        first ``first_part`` bytes, kept for the ``get`` of the object's start that follows
        (the prefetcher sizes an unsized shard just before it requests its parts): the
        reader's first shard then costs one round trip before its first bytes, not two.
        Later probes ask for one byte (as cheap as a HEAD). Other backends: one HEAD / stat.
        """
        fs = await self._open()
        if self._presigned is None and self.protocol not in ("http", "https"):
            info = await self._retrying(lambda: self._call("_info", "info", url), url, "size")
            return info.get("size")
        head = 1 if self._probed else max(1, self.config.first_part)
        self._probed = True

        async def once() -> tuple[int | None, Body]:
            body = Body()
            if self._presigned is not None:
                total = await self._presigned.cat_file(fs._strip_protocol(url), 0, head, body, probe=True)
            else:
                total = await http_probe(fs, url, head, body)
            return total, body

        total, body = await self._retrying(once, url, "size")
        latency = body.latency()  # on LITE-HTTP's pool only: the probe's try is not timed
        if first_byte is not None and latency is not None:
            first_byte.append(latency)
        if head > 1 and body.size:
            self._heads[url] = (body, total)
        else:
            self.stats.add(received=body.wire)
        return total

    async def get(self, url: str, start: int = 0, end: int | None = None, *,
                  chunks: bool = False, first_byte: list[float] | None = None) -> bytes | Chunks:
        """Bytes ``[start, end)`` of ``url``, retried until ``retry_deadline`` (``_retrying``).

        ``chunks=True`` lets the body come back unjoined (``Chunks``) where the backend can
        (S3's presigned GETs); other backends return ``bytes`` either way. ``first_byte``, where
        the backend streams the body here (S3's presigned GETs), gets the seconds from the
        successful try's request (as it went out on its connection, where the session tells)
        to its first byte: the latency, without the transfer, the waits of earlier tries, or
        waiting for and opening a connection (BUDGET-GROWTH, the far step).

        RESUME: on S3's presigned GETs a retry asks only for the bytes after those already
        received (a connection reset after k bytes re-requests ``[start + k, end)``), and the
        part is delivered once, whole. Other backends' ``_cat_file`` returns whole bytes or
        raises: their retry asks for the whole range again, and the bytes a failed try had
        received never reach this client (``stats.refetched`` cannot count them). A retry
        never re-requests ranges already delivered.
        """
        start = start or 0
        body = Body()
        head, total = self._heads.pop(url, (None, None)) if start == 0 else (None, None)
        if head is not None:  # HEAD-START: the bytes the size probe brought, as the start
            want = (end if end is not None else total if total is not None else head.size + 1) - start
            _keep_prefix(body, head.chunks, want)
            if body.size >= want:  # all there: no request
                self.stats.add(received=body.wire, bytes=body.size)
                return Chunks(body.chunks) if chunks else b"".join(body.chunks)
        cached = body.size

        async def once() -> bytes | Chunks:
            fs = await self._open()
            if self._presigned is not None:
                begin, tried = start + body.size, time.monotonic()
                await self._presigned.cat_file(fs._strip_protocol(url), begin, end, body)
                latency = body.latency(tried)
                if first_byte is not None and latency is not None:
                    first_byte.append(latency)
                size = body.size
            else:
                data = await self._call("_cat_file", "cat_file", url, start=start + cached, end=end)
                body.wire += len(data)
                if cached:
                    data = b"".join(body.chunks) + data
                size = len(data)
            if end is not None and size != end - start:
                raise ShortReadError(
                    f"short read of {url}: {size} of {end - start} bytes at offset "
                    f"{start}; the object is shorter than listed or changed", url=url)
            if self._presigned is None:
                return data
            return Chunks(body.chunks) if chunks else b"".join(body.chunks)

        try:
            data = await self._retrying(once, url, f"bytes {start}..{end}")
        finally:
            self.stats.add(received=body.wire)
        size = body_size(data)
        self.stats.add(bytes=size, refetched=body.wire - size)
        return data

    async def _retrying(self, once: Any, url: str, what: str) -> Any:
        """``await once()`` until it succeeds, a permanent error, or the deadline.

        Each try holds a READER-THROTTLE slot and lasts at most ``timeout``; a failure that
        a retry can fix (``retry.classify``) sleeps ``retry.backoff_s`` and tries again until
        ``retry_deadline`` seconds of tries and sleeps have passed (time spent waiting for a
        slot does not count), or ``retries`` retries if set. Missing objects, refused
        credentials and bad requests fail at once. Every retry is counted per reason.
        """
        cfg, loop = self.config, asyncio.get_running_loop()
        first = loop.time()
        queued = 0.0  # seconds waiting for a slot: not counted against the deadline
        attempt = shorts = 0
        while True:
            asked = loop.time()
            sent = await self.throttle.acquire(first)
            if self.governor is not None and await self.governor.wait():  # RATE-SHARE
                sent = loop.time()
                if self.counters is not None:
                    self.counters.add("paced.requests")
            queued += sent - asked
            outcome, reason, last = "failed", None, None
            try:
                self.stats.add(requests=1)
                result = await asyncio.wait_for(once(), cfg.timeout)
                outcome = "ok"
                return result
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                last, reason = exc, classify(exc)
                if reason == "throttled":
                    outcome = "throttled"
            finally:
                self.throttle.release(sent, outcome)
            spent = loop.time() - first - queued
            shorts += isinstance(last, ShortReadError)  # complete, but shorter than asked
            if reason is None or shorts > _SHORT_RETRIES or spent >= cfg.retry_deadline or (
                    cfg.retries is not None and attempt >= cfg.retries):
                err = translate_error(last, url)
                err.message += (f" ({what}; not retried: a retry cannot fix this)" if reason is None else
                                f" ({what}, after {attempt + 1} attempts over {spent:.1f} s; "
                                f"retry_deadline={cfg.retry_deadline:g} s)")
                raise err from None
            self.stats.add(retries=1)
            if self.counters is not None:
                self.counters.add(f"retried.{reason}")
            pause = backoff_s(attempt, cfg.backoff, cfg.backoff_cap)
            asked_for = retry_after(last) if reason in ("throttled", "server") else None
            if asked_for is not None:  # the answer's Retry-After, within the deadline
                pause = max(pause, asked_for)
                self.stats.add(waited_as_asked=1)
                if self.governor is not None and reason == "throttled":  # the process's readers wait too
                    self.governor.hold(min(asked_for, cfg.retry_deadline - spent))
            await asyncio.sleep(min(pause, cfg.retry_deadline - spent))
            attempt += 1


def _keep_prefix(body: Body, chunks: list[bytes], n: int) -> None:
    """Keep the first ``n`` bytes of ``chunks`` in ``body``."""
    for piece in chunks:
        if body.size >= n:
            break
        body.keep(piece[: n - body.size])


# a body shorter than asked twice more is an object shorter than listed, not a blip
_SHORT_RETRIES = 2
