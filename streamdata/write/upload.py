"""Background uploads of finished local files to any fsspec URL (the shard and table writers).

A writer fills a local spool file, then hands it to :class:`Uploader` and goes on with the
next shard while up to ``concurrency`` uploads run in threads. ``submit`` blocks while
``max_pending`` files are queued or uploading, so the spool (disk) and the memory of uploads
in flight stay bounded: at most ``concurrency x part_concurrency x part_size`` bytes of parts
in memory (a file of at least twice ``part_size`` goes up as a multipart upload, s3fs's
``put_file``; smaller ones in one PUT).

Invariant (PUBLISH-WHOLE): an object appears under its final name only whole. On S3 and GCS
a PUT, a completed multipart upload and a finalized resumable upload each publish all the bytes
at once (an unfinished one is invisible), so objects are uploaded to their final name
(``publish="put"``). Elsewhere, and with ``publish="copy"`` anywhere, a file is uploaded to a
temporary key next to it (``.<name>.<random>.tmp``, which no listing of shard suffixes picks
up) and then copied into place and the temporary key deleted (what the copy costs:
benchmarks/README.md, "Compressed shards and the shard writer"); a local file is spooled
next to its final name and renamed (atomic on one file system). A writer killed at any point leaves at most a
temporary key or spool file (and, on S3, an unfinished multipart upload, which a bucket
lifecycle rule for incomplete multipart uploads removes), never a partial object under a
final name.

Failures are retried under the readers' policy (``retry.classify``, ``retry.backoff_s``):
transient ones (5xx, throttling, resets, timeouts) until ``retry_deadline`` after the first
try, each counted per reason in :attr:`Uploader.retried`; permanent ones (no such bucket,
access denied) at once. The first failure is raised by the next ``submit`` and by ``close``,
as our error naming the object's URL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamdata.config import FetchConfig
from streamdata.errors import FetchTimeoutError, StreamDataError
from streamdata.metrics import RETRY_REASONS
from streamdata.progress import progress as progress_bar
from streamdata.store.backends import close_filesystem, filesystem, translate_error
from streamdata.store.retry import backoff_s, classify
from streamdata.store.urls import etag_of, split_url

__all__ = ["DEFAULT_PART_SIZE", "Uploaded", "Uploader"]

log = logging.getLogger("streamdata")
DEFAULT_PART_SIZE = 32 << 20  # bytes per multipart part (S3: 5 MiB .. 5 GiB; 10,000 parts at most)
_POLL = 0.1  # seconds: blocking waits are taken in slices this long
_ATOMIC_PUT = ("s3", "s3a", "gs", "gcs")  # stores whose uploads appear whole or not at all


@dataclass(frozen=True)
class Uploaded:
    """A published object: its URL, size in bytes and ETag (``None`` where the store has none)."""

    url: str
    size: int
    etag: str | None


class Uploader:
    """Uploads local files to their URLs in background threads (see the module docstring)."""

    def __init__(self, protocol: str, storage_options: Mapping[str, Any] | None = None, *,
                 config: FetchConfig | None = None, concurrency: int = 4, max_pending: int = 8,
                 part_size: int = DEFAULT_PART_SIZE, part_concurrency: int = 2,
                 tmpdir: str | None = None, progress: bool | None = None, desc: str = "uploaded",
                 publish: str | None = None) -> None:
        if concurrency < 1 or max_pending < 1 or part_size < 5 << 20 or part_concurrency < 1:
            from streamdata.errors import SpecError

            raise SpecError("upload: concurrency, max_pending and part_concurrency must be >= 1 and "
                            f"part_size >= 5 MiB (got {concurrency}, {max_pending}, {part_concurrency}, "
                            f"{part_size})")
        if publish not in (None, "put", "copy"):
            from streamdata.errors import SpecError

            raise SpecError(f"upload: publish must be None, 'put' or 'copy', got {publish!r}")
        self.protocol = protocol
        self.publish = publish or ("put" if protocol in _ATOMIC_PUT else "copy")
        self.config = config or FetchConfig()
        self.max_pending = max_pending
        self.part_size, self.part_concurrency = part_size, part_concurrency
        self.fs = filesystem(protocol, storage_options, timeout=self.config.timeout)
        self.retried = dict.fromkeys(RETRY_REASONS, 0)
        self.uploaded: list[Uploaded] = []  # in the order they finished
        self._spool = None if protocol == "file" else tempfile.mkdtemp(prefix="streamdata-spool-",
                                                                      dir=tmpdir)
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency,
                                                           thread_name_prefix="streamdata-upload")
        self._lock = threading.Condition()
        self._pending = 0
        self._error: StreamDataError | None = None
        self._stop = threading.Event()
        self._bar = progress_bar(None, desc=desc, unit="shard", enabled=progress)
        self._closed = False

    # ---- the writer's side ---------------------------------------------------------------

    def spool_path(self, url: str) -> str:
        """Where to write the file that will be published at ``url``: next to it for a local
        destination (published by a rename), else in the spool directory."""
        if self.protocol == "file":
            path = split_url(url)[1]
            folder, name = posixpath.split(path)
            os.makedirs(folder or ".", exist_ok=True)
            return posixpath.join(folder, _temporary_name(name))
        assert self._spool is not None
        return os.path.join(self._spool, f"{uuid.uuid4().hex[:12]}-{posixpath.basename(url)}")

    def submit(self, spool: str, url: str, done: Callable[[Uploaded], None] | None = None) -> None:
        """Publish ``spool`` at ``url`` in the background (the spool file is removed after);
        blocks while ``max_pending`` uploads are unfinished. Raises the first upload failure."""
        self._check()
        start = time.monotonic()
        with self._lock:
            while self._pending >= self.max_pending:  # bounded: each upload ends by its deadline
                self._lock.wait(_POLL)
                self._check()
                if time.monotonic() - start > self.config.wait_limit():
                    raise FetchTimeoutError(f"upload of {url}: no upload slot freed within "
                                            f"{self.config.wait_limit():.0f} s", url=url)
            self._pending += 1
        self._pool.submit(self._run, spool, url, done)

    def wait(self) -> list[Uploaded]:
        """Wait for every submitted upload; raises the first failure. Bounded by ``wait_limit``
        after the last upload's progress."""
        start = time.monotonic()
        with self._lock:
            while self._pending:
                self._lock.wait(_POLL)
                if self._error is not None:
                    break
                if time.monotonic() - start > self.config.wait_limit():
                    raise FetchTimeoutError(f"uploads: {self._pending} not finished within "
                                            f"{self.config.wait_limit():.0f} s")
        self._check()
        return list(self.uploaded)

    def close(self, *, cancel: bool = False) -> None:
        """Stop the threads (after the running uploads; ``cancel`` skips queued ones and ends
        retries' sleeps), close connections and remove the spool directory."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        self._bar.close()
        close_filesystem(self.fs)
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- the upload threads ----------------------------------------------------------------

    def _run(self, spool: str, url: str, done: Callable[[Uploaded], None] | None) -> None:
        try:
            if self._error is None and not self._stop.is_set():
                result = self._publish(spool, url)
                if done is not None:
                    done(result)
                with self._lock:
                    self.uploaded.append(result)
                self._bar.update(1)
        except BaseException as exc:  # noqa: BLE001 - carried to the writer's thread
            err = exc if isinstance(exc, StreamDataError) else translate_error(exc, url, "upload")
            with self._lock:
                self._error = self._error or err
        finally:
            with contextlib.suppress(OSError):
                os.remove(spool)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _publish(self, spool: str, url: str) -> Uploaded:
        fs, path = self.fs, self.fs._strip_protocol(split_url(url)[1])
        if self.protocol == "file":  # spooled next to it (PUBLISH-WHOLE): a rename
            os.replace(spool, path)
            return Uploaded(url, os.path.getsize(path), None)
        if self.publish == "put":  # the store publishes an upload whole (PUBLISH-WHOLE)
            self._retrying(lambda: self._put(spool, path), url, "upload")
            return self._published(spool, url, path)
        folder, name = posixpath.split(path)
        temporary = posixpath.join(folder, _temporary_name(name))
        try:
            self._retrying(lambda: self._put(spool, temporary), url, "upload")
            self._retrying(lambda: fs.cp_file(temporary, path), url, "publish (copy into place)")
            try:
                self._retrying(lambda: fs.rm_file(temporary), url, "remove the temporary copy of")
            except StreamDataError as exc:  # the shard is in place: only a stray temporary key is left
                log.warning("streamdata: %s", exc)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(temporary)  # best effort: a failed try may have left it
            raise
        return self._published(spool, url, path)

    def _published(self, spool: str, url: str, path: str) -> Uploaded:
        info = self._retrying(lambda: self.fs.info(path), url, "check")
        return Uploaded(url, int(info.get("size") or os.path.getsize(spool)), etag_of(info))

    def _put(self, spool: str, path: str) -> None:
        if self.protocol in ("s3", "s3a"):  # bounded memory: part_size x part_concurrency
            self.fs.put_file(spool, path, chunksize=self.part_size, max_concurrency=self.part_concurrency)
        else:
            self.fs.put_file(spool, path)

    def _retrying(self, fn: Callable[[], Any], url: str, what: str) -> Any:
        """``fn()``, retried on transient failures until ``retry_deadline`` (and ``retries``)."""
        cfg, start = self.config, time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                reason = classify(exc)
                pause = backoff_s(attempt, cfg.backoff, cfg.backoff_cap)
                if reason is None or (cfg.retries is not None and attempt >= cfg.retries) \
                        or time.monotonic() - start + pause > cfg.retry_deadline or self._stop.is_set():
                    err = translate_error(exc, url, what)
                    if attempt:
                        err.message += f" (after {attempt + 1} attempts in {time.monotonic() - start:.1f} s)"
                    raise err from exc
            with self._lock:
                self.retried[reason] += 1
            if self._stop.wait(pause):
                raise StreamDataError(f"upload of {url} cancelled", url=url)
            attempt += 1


def _temporary_name(name: str) -> str:
    """A hidden name that no shard-suffix listing includes."""
    return f".{name}.{uuid.uuid4().hex[:10]}.tmp"
