"""An async object-store client bound to one reader: a loop thread plus a fresh fsspec filesystem.

Async backends (s3fs, gcsfs, HTTP on aiohttp) run natively on the loop; sync ones (local
files, HDFS through pyarrow) run in a small thread pool so they overlap the same way.
Created lazily in the process that uses it (LOOP-AFTER-FORK, see ``_aio``); a forked child
drops the sessions it inherited (FORK-RESET, see ``_fork``).
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._aio import LoopThread, wait_threads_gone
from ._fork import at_fork_in_child
from .backends import close_sessions, filesystem, inherited_signer, translate_error
from .config import FetchConfig
from .errors import ShardFetchError
from .metrics import Counters
from .retry import Throttle, backoff_s, classify

__all__ = ["AsyncClient", "Chunks", "ClientStats", "body_size", "content_total"]


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


class _Body:
    """What one ranged GET has received so far, kept across its tries: a retry asks only for
    the bytes after ``size`` (RESUME, see ``AsyncClient.get``)."""

    __slots__ = ("chunks", "size", "wire")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0  # bytes kept in ``chunks``
        self.wire = 0  # body bytes that arrived, kept or not

    def keep(self, piece: bytes, wire: int | None = None) -> None:
        if piece:
            self.chunks.append(piece)
            self.size += len(piece)
        self.wire += len(piece) if wire is None else wire


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
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


# storage options under which a presigned GET would not be the same request as s3fs's
_S3_SLOW_OPTIONS = ("requester_pays", "version_aware", "s3_additional_kwargs")


class _PresignedS3:
    """S3 ranged GETs as presigned URLs on a plain aiohttp session.

    botocore's response pipeline costs about 1.6 ms of CPU per MB read on this project's
    2-core test machine (0.27 vs 0.11 ms per 96 KiB sample against local files); a presigned
    GET is the same signed request with none of that. One URL per object, signed by the
    filesystem's own botocore client (same credentials, endpoint and addressing), reused
    until half its lifetime has passed.
    """

    LIFETIME = 3600

    def __init__(self, fs: Any, max_requests: int, signer: Any = None) -> None:
        import aiohttp

        self.fs = fs
        self.signer = signer  # an inherited client (SIGNER-REUSE in backends), else the fs's own
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_requests))
        _no_hidden_retry(self.session)
        self._urls: dict[str, tuple[str, float, bool]] = {}  # path: (url, re-sign after, inherited)
        self._own_client = asyncio.Lock()  # older s3fs builds several clients if raced

    async def _url(self, path: str) -> tuple[str, bool]:
        """A presigned URL for ``path`` and whether the inherited signer made it."""
        loop = asyncio.get_running_loop()
        hit = self._urls.get(path)
        if hit is not None and hit[1] > loop.time():
            return hit[0], hit[2]
        bucket, key, _ = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key}
        url, inherited = None, self.signer is not None
        if self.signer is not None:
            try:
                url = await self.signer.generate_presigned_url("get_object", Params=params,
                                                               ExpiresIn=self.LIFETIME)
            except Exception:  # e.g. refreshable credentials bound to the parent's loop
                self.signer, inherited = None, False
        if url is None:
            async with self._own_client:
                await self.fs.set_session()  # builds the fs's own client on first use, once
            client = await self.fs.get_s3(bucket)
            url = await client.generate_presigned_url("get_object", Params=params,
                                                      ExpiresIn=self.LIFETIME)
        self._urls[path] = (url, loop.time() + self.LIFETIME / 2, inherited)
        return url, inherited

    async def cat_file(self, path: str, start: int, end: int | None, body: _Body, *,
                       probe: bool = False) -> int | None:
        """Append bytes ``[start, end)`` of ``path`` to ``body`` as they arrive: if the
        connection drops, what arrived stays there, in the chunks it arrived in. Returns the
        object's size where the answer says it (``Content-Range``). ``probe``: the request is
        a size probe, and an empty object's 416 is its answer (size 0), not an error."""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        for attempt in range(2):
            cached = path in self._urls
            url, inherited = await self._url(path)
            async with self.session.get(url, headers=headers) as resp:
                status = resp.status
                total = content_total(resp.headers.get("Content-Range"))
                if status == 206 or (status == 200 and not headers):
                    async for piece, _ in resp.content.iter_chunks():
                        body.keep(piece)
                    return total if status == 206 else body.size
                data = await resp.read()
            if probe and status == 416 and total is not None:
                return total
            if attempt == 0 and ((status == 403 and cached) or (
                    inherited and 300 <= status < 500 and status != 429)):
                # temporary credentials may have rotated; or the inherited signer does not
                # fit this process (other credentials, endpoint or region from the
                # environment: a redirect or a 4xx): re-sign once, with the filesystem's own
                # client. 429 and 5xx are the server's trouble, not the signature's
                self._urls.pop(path, None)
                if inherited:
                    self.signer = None
                continue
            break
        if status == 200:  # a server that ignores Range
            body.keep(data[start:end], wire=len(data))
            return len(data)
        detail = data[:300].decode("utf-8", "replace")
        if status == 404:
            raise FileNotFoundError(f"{path}: HTTP 404 {detail}")
        if status == 403:
            raise PermissionError(f"{path}: HTTP 403 {detail}")
        if status == 416:
            raise OSError(f"{path}: HTTP 416: bytes {start}..{end} lie past the object's end; it is "
                          "shorter than listed or changed")
        raise OSError(f"{path}: HTTP {status} {detail}")

    async def close(self) -> None:
        await self.session.close()


_CONTENT_RANGE = re.compile(r"\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$")


def content_total(header: str | None) -> int | None:
    """The object's size from a ``Content-Range`` header (``bytes 0-99/1234``, ``bytes */0``)."""
    m = _CONTENT_RANGE.match(header or "")
    return int(m.group(1)) if m else None


async def _http_probe(fs: Any, url: str, head: int, body: _Body) -> int | None:
    """One ranged GET of an HTTP object's first ``head`` bytes through the fsspec filesystem's
    own session and request options: its bytes into ``body``, its size from ``Content-Range``
    (or ``Content-Length`` where the server ignores ``Range``, without reading the body)."""
    kw = dict(getattr(fs, "kwargs", {}) or {})
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes=0-{head - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as resp:
        total = content_total(resp.headers.get("Content-Range"))
        if resp.status == 206:
            async for piece, _ in resp.content.iter_chunks():
                body.keep(piece)
            return total
        if resp.status == 416 and total is not None:  # an empty object
            return total
        fs._raise_not_found_for_status(resp, url)  # FileNotFoundError, or aiohttp's status error
        if resp.content_length is not None:  # 200: a server that ignores Range
            resp.close()  # the body is not wanted: drop the connection rather than read it
            return resp.content_length
        async for piece, _ in resp.content.iter_chunks():
            body.keep(piece)
        return body.size


def _no_hidden_retry(session: Any) -> None:
    """aiohttp re-sends a GET at once, unseen, when a reused connection drops before the
    answer; retries are ours (by deadline, throttled, counted). No public switch: the
    attribute, where it exists."""
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False


def _forget_session(session: Any) -> None:
    """Drop an aiohttp session inherited through fork without touching its connections:
    finalising it in the child closes the parent's keep-alive sockets under the parent
    (seen: the parent's next request hung until its time-out)."""
    connector = getattr(session, "_connector", None)
    if connector is not None:
        session._connector = None
        connector._closed = True
        connector._conns.clear()


_live_clients: weakref.WeakSet[AsyncClient] = weakref.WeakSet()


def _forget_inherited() -> None:
    """FORK-RESET, stage "sessions": drop every inherited client's aiohttp sessions."""
    for client in list(_live_clients):
        if client._presigned is not None:
            _forget_session(client._presigned.session)
        _forget_session(getattr(client._fs, "_session", None))
    _live_clients.clear()


at_fork_in_child("sessions", _forget_inherited)


class AsyncClient:
    """Ranged GETs with time-outs and retries for URLs of one protocol, on a private loop."""

    def __init__(self, protocol: str, storage_options: dict | None = None,
                 config: FetchConfig | None = None, *, name: str = "io", url: str | None = None,
                 fast_s3: bool = True, counters: Counters | None = None) -> None:
        self.protocol = protocol
        self.counters = counters  # the dataset's, shared with the main process (retried.*)
        self.url = url  # an example URL: carries an HDFS name node's host and port
        self.config = config or FetchConfig()
        self.stats = ClientStats()
        self._options = dict(storage_options or {})
        self._executor: ThreadPoolExecutor | None = None
        self._fs: Any = None
        self._presigned: _PresignedS3 | None = None
        self.throttle = Throttle(self.config.max_requests)  # READER-THROTTLE (``retry``)
        self.fast_s3 = fast_s3
        self._opened: asyncio.Future | None = None
        # HEAD-START: the first bytes of objects sized by a probe (``size``), kept for the
        # ``get`` of their start that follows: {url: (body, size)}
        self._heads: dict[str, tuple[_Body, int | None]] = {}
        self._probed = False
        self.io = LoopThread(name)
        _live_clients.add(self)

    # ---- lifecycle --------------------------------------------------------------------

    async def _open(self) -> Any:
        """The filesystem, created on first use on the loop (concurrent callers share it)."""
        if self._opened is None:
            self._opened = asyncio.ensure_future(self._create())
        return await asyncio.shield(self._opened)

    async def _create(self) -> Any:
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
            _no_hidden_retry(getattr(fs, "_session", None))  # HTTP's and gcsfs's aiohttp session
        elif not is_async:
            self._executor = ThreadPoolExecutor(self.config.max_requests,
                                                thread_name_prefix="streamdata-fileio")
        if fast:
            self._presigned = _PresignedS3(fs, self.config.max_requests, signer)
        self._fs = fs
        return fs

    async def _close_fs(self) -> None:
        self._heads.clear()
        presigned, self._presigned = self._presigned, None
        if presigned is not None:
            await presigned.close()
        fs, self._fs = self._fs, None
        if fs is not None and self._executor is None:
            await close_sessions(fs)

    def close(self) -> None:
        """Cancel requests, close connections, join the loop thread and the file-I/O pool."""
        self.io.close(cleanup=self._close_fs, timeout=5.0)
        if self._executor is not None:
            threads = list(getattr(self._executor, "_threads", ()))
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

    async def size(self, url: str) -> int | None:
        """The object's size, for objects a listing did not size, retried like a part.

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

        async def once() -> tuple[int | None, _Body]:
            body = _Body()
            if self._presigned is not None:
                total = await self._presigned.cat_file(fs._strip_protocol(url), 0, head, body, probe=True)
            else:
                total = await _http_probe(fs, url, head, body)
            return total, body

        total, body = await self._retrying(once, url, "size")
        if head > 1 and body.size:
            self._heads[url] = (body, total)
        else:
            self.stats.add(received=body.wire)
        return total

    async def get(self, url: str, start: int = 0, end: int | None = None, *,
                  chunks: bool = False) -> bytes | Chunks:
        """Bytes ``[start, end)`` of ``url``, retried until ``retry_deadline`` (``_retrying``).

        ``chunks=True`` lets the body come back unjoined (``Chunks``) where the backend can
        (S3's presigned GETs); other backends return ``bytes`` either way.

        RESUME: on S3's presigned GETs a retry asks only for the bytes after those already
        received (a connection reset after k bytes re-requests ``[start + k, end)``), and the
        part is delivered once, whole. Other backends' ``_cat_file`` returns whole bytes or
        raises: their retry asks for the whole range again, and the bytes a failed try had
        received never reach this client (``stats.refetched`` cannot count them). A retry
        never re-requests ranges already delivered.
        """
        start = start or 0
        body = _Body()
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
                begin = start + body.size
                await self._presigned.cat_file(fs._strip_protocol(url), begin, end, body)
                size = body.size
            else:
                data = await self._call("_cat_file", "cat_file", url, start=start + cached, end=end)
                body.wire += len(data)
                if cached:
                    data = b"".join(body.chunks) + data
                size = len(data)
            if end is not None and size != end - start:
                raise ShardFetchError(
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
            shorts += isinstance(last, ShardFetchError)  # complete, but shorter than asked
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
            await asyncio.sleep(min(backoff_s(attempt, cfg.backoff, cfg.backoff_cap),
                                    cfg.retry_deadline - spent))
            attempt += 1


def _keep_prefix(body: _Body, chunks: list[bytes], n: int) -> None:
    """Keep the first ``n`` bytes of ``chunks`` in ``body``."""
    for piece in chunks:
        if body.size >= n:
            break
        body.keep(piece[: n - body.size])


# a body shorter than asked twice more is an object shorter than listed, not a blip
_SHORT_RETRIES = 2
