"""When to try a request again, how long to wait, and how many requests a reader may send.

``classify`` tells a failure that another try can fix (and why: one of
``metrics.RETRY_REASONS``) from one it cannot (``None``: a missing object, refused
credentials, a bad request, an untrusted certificate): a failure below HTTP by its type
(``errors.TransportError``'s tree, TYPED-TRANSPORT-ERRORS in ``session``), an answer by its
status and S3/GCS error code; ``backoff_s`` is the sleep before a retry, at least what a
throttled answer's ``Retry-After`` asks (``retry_after``); ``Throttle`` is the reader's shared
limit on concurrent requests.

Invariant (READER-THROTTLE): every request a reader sends (a part's first try and each
retry, every backend, and HEADs) holds one slot of its client's ``Throttle`` while it is
on the wire, and the prefetcher's scheduler starts a new part only while fewer parts are in
flight than the throttle allows. The limit is AIMD, shared by all the reader's parts: an
answer that says "slow down" (503, S3's SlowDown, 429) halves it, once per round (answers to
requests sent before the last decrease do not decrease it again, so one burst of 503s to
32 concurrent requests halves it once, not 32 times); each success adds ``1/limit`` (one
slot per round of successes); floor 1, ceiling ``max_requests``. Slots are handed out
oldest part first, so the part the consumer waits for is not queued behind later ones.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import heapq
import itertools
import random
import re
import time
from collections.abc import Iterator, Mapping

from streamdata.errors import (
    CertificateError,
    ProxyAuthError,
    ShortBodyError,
    ShortReadError,
    StreamDataError,
    TransportError,
    TransportTimeoutError,
)
from streamdata.store.session import transport_error

__all__ = ["Throttle", "backoff_s", "classify", "parse_retry_after", "retry_after"]

# S3 / GCS error codes that no retry can fix, as they appear in an answer body or an
# exception's text (s3fs, botocore, our presigned GETs)
PERMANENT_CODES = ("NoSuchKey", "NoSuchBucket", "NoSuchVersion", "AccessDenied", "AllAccessDisabled",
                   "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidBucketName", "InvalidObjectState",
                   "AccountProblem", "InvalidToken", "ExpiredToken", "InvalidArgument", "InvalidRequest",
                   "MethodNotAllowed", "AuthorizationHeaderMalformed", "UserProjectMissing")
THROTTLE_CODES = ("SlowDown", "Throttl", "TooManyRequests", "RequestLimitExceeded", "rateLimitExceeded",
                  "Reduce your request rate")
# HTTP statuses that no retry can fix (416: the object is shorter than asked: it changed)
PERMANENT_STATUS = frozenset({400, 401, 403, 404, 405, 407, 410, 411, 412, 416})

_STATUS_IN_TEXT = re.compile(r"\b(?:HTTP|status(?: code)?)[ :=]*([1-5]\d\d)\b", re.IGNORECASE)


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status ``exc`` (or its cause: s3fs wraps botocore's errors) carries, if any."""
    for err in _causes(exc):
        for name in ("status", "code", "status_code"):
            value = getattr(err, name, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(err, "response", None)  # botocore ClientError; huggingface_hub's errors
        if isinstance(getattr(response, "status_code", None), int):
            return response.status_code  # type: ignore[union-attr]
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
        match = _STATUS_IN_TEXT.search(str(err))
        if match:
            return int(match.group(1))
    return None


def _causes(exc: BaseException | None, depth: int = 3) -> Iterator[BaseException]:
    """``exc`` and its causes, ``depth`` at most (wrappers wrap the error that tells)."""
    while exc is not None and depth > 0:
        yield exc
        exc, depth = exc.__cause__, depth - 1


def classify(exc: BaseException) -> str | None:
    """Why ``exc`` is worth another try (a ``RETRY_REASONS`` name), or ``None`` if it is not.

    A failure below HTTP is judged by its type alone (an exception from a backend we do not
    wrap, such as gcsfs or fsspec's HTTP, is typed first by ``session.transport_error``):
    whatever its message says, a ``CertificateError`` is permanent, a ``ShortBodyError``
    "short", a ``TransportTimeoutError`` "timeout", any other ``TransportError`` "connection".
    An answer is judged by its status and the S3/GCS error code its body carries.
    """
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        # fsspec's HTTP info() calls any failure "not found": judge by what it was
        return classify(exc.__cause__)
    exc = transport_error(exc)
    if isinstance(exc, TransportError):
        if isinstance(exc, (CertificateError, ProxyAuthError)):
            return None
        if isinstance(exc, ShortBodyError):
            return "short"
        if isinstance(exc, TransportTimeoutError):
            return "timeout"
        return "connection"
    if isinstance(exc, (FileNotFoundError, PermissionError)) or "Credentials" in type(exc).__name__:
        return None
    if isinstance(exc, StreamDataError):
        return "short" if isinstance(exc, ShortReadError) else None
    text = f"{type(exc).__name__} {exc}"
    status = _status(exc)
    if any(code in text for code in PERMANENT_CODES):  # the body says so, whatever the status
        return None
    if status in (429, 503) or any(code in text for code in THROTTLE_CODES):
        return "throttled"
    if status in PERMANENT_STATUS:
        return None
    if isinstance(exc, TimeoutError) or status == 408:
        return "timeout"
    if status is not None and status >= 500:
        return "server"
    return "other"


def backoff_s(attempt: int, base: float, cap: float) -> float:
    """The sleep before retry ``attempt`` (from 0), with full jitter:
    ``uniform(0, min(cap, base * 2**attempt))``."""
    return random.uniform(0.0, min(cap, base * 2.0 ** min(attempt, 60)))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds: delta-seconds, or an HTTP date (the wait
    until then, 0 if past); ``None`` for a missing or unreadable value."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is read as such
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_after(exc: BaseException | None) -> float | None:
    """The wait a failed request's answer asked for (``Retry-After``, on a 503 or 429): our
    presigned GETs set ``exc.retry_after``; aiohttp's status errors carry the answer's headers."""
    for err in _causes(exc):
        value = getattr(err, "retry_after", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
        headers = getattr(err, "headers", None)
        if isinstance(headers, Mapping):  # aiohttp's multidict is one
            found = parse_retry_after(headers.get("Retry-After"))
            if found is not None:
                return found
    return None


class Throttle:
    """The reader's AIMD limit on concurrent requests (READER-THROTTLE). Loop-side only."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.limit = float(ceiling)  # AIMD state; ``allowed`` is what it lets through
        self.lowest = ceiling  # the lowest ``allowed`` so far (read by tests and benchmarks)
        self.decreases = 0
        self.active = 0
        self._waiters: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._decreased_at = float("-inf")

    @property
    def allowed(self) -> int:
        """Requests (and, in the prefetcher, parts) that may be in flight now."""
        return max(1, int(self.limit))

    async def acquire(self, priority: float) -> float:
        """Wait for a slot (lower ``priority`` first: a part's first-try time); returns the
        time the request was let through, to pass back to :meth:`release`."""
        loop = asyncio.get_running_loop()
        if self.active >= self.allowed or self._waiters:
            fut = loop.create_future()
            entry = (priority, next(self._seq), fut)
            heapq.heappush(self._waiters, entry)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():  # granted as we were cancelled: pass it on
                    self.active -= 1
                    self._grant()
                elif entry in self._waiters:  # else ``_grant`` dropped it already
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
                raise
        else:
            self.active += 1
        return loop.time()

    def release(self, sent_at: float, outcome: str) -> None:
        """Give the slot back: ``outcome`` is ``"ok"``, ``"throttled"`` or anything else (no change)."""
        self.active -= 1
        if outcome == "throttled":
            if sent_at >= self._decreased_at:  # once per round
                self.limit = max(1.0, self.limit / 2)
                self.lowest = min(self.lowest, self.allowed)
                self.decreases += 1
                self._decreased_at = asyncio.get_running_loop().time()
        elif outcome == "ok":
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.active < self.allowed:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                self.active += 1
                fut.set_result(None)
