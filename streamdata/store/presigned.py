"""S3 GETs as presigned URLs, and HTTP size probes, on a ``session.Session`` (LITE-HTTP's
pool, ``http1``, or aiohttp's, adapted).

What one ranged GET has received is kept in a ``Body`` across its tries (RESUME, see
``client.AsyncClient.get``); a size probe's answer carries the object's size in its
``Content-Range`` (HEAD-START, see ``client.AsyncClient.size``).

Rules for presigned URLs (``PresignedS3``):

- PRESIGN-LIFETIME: a URL is signed for ``lifetime`` seconds (``FetchConfig.presign_lifetime``)
  and reused for the same object only while less than half of that has passed since the
  moment it carries, in whole seconds as the server counts (SigV4's ``X-Amz-Date``; SigV2's
  ``Expires`` less the lifetime: botocore's S3 presigner signs SigV2 unless told
  ``signature_version="s3v4"``), and never past ``CREDENTIALS_MARGIN`` before the expiry of
  the botocore credentials that signed it (temporary credentials: assume-role,
  ``credential_process``, web identity, container or instance metadata). Wall-clock time,
  as the server's check. A URL without a signature (anonymous access) never expires.
- RESIGN-ON-STALE: an answer that says the URL's signature or credentials are no longer good
  (S3's ``AccessDenied`` "Request has expired", ``ExpiredToken``, ``TokenRefreshRequired``,
  ``SignatureDoesNotMatch``; 400 or 403) drops the URL and re-signs once: botocore refreshes
  refreshable credentials when the signer asks for them, and LITE-S3's static keys sign anew
  with a fresh timestamp. Still refused after that, it is an ``AccessDeniedError``, not retried.
  Any other ``AccessDenied`` to a LITE-S3 URL is the object's answer (``_not_the_signature``).
- RESIGN-COUNTED: every re-sign is counted, by why: ``"age"`` (PRESIGN-LIFETIME), ``"expired"``
  (RESIGN-ON-STALE), ``"refused"`` (another refusal of a URL signed earlier, or of the inherited
  signer's URL: once, with the filesystem's own client), in ``PresignedS3.resigned`` and
  ``resigned_by`` and through the ``on_resign`` callback (the client's counters).
"""

from __future__ import annotations

import asyncio
import calendar
import datetime
import math
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from streamdata.store.network import Network
from streamdata.store.retry import parse_retry_after
from streamdata.store.session import AiohttpSession, Session

__all__ = ["Body", "PresignedS3", "answer_error", "content_total", "http_probe"]


class Body:
    """What one ranged GET has received so far, kept across its tries: a retry asks only for
    the bytes after ``size`` (RESUME, see ``AsyncClient.get``). ``first_at``: when its first
    byte arrived (``time.monotonic()``; the request's latency for BUDGET-GROWTH); ``sent_at``:
    when the request went out on its connection, where the session tells (LITE-HTTP's), so the
    latency leaves out waiting for a connection and opening it."""

    __slots__ = ("chunks", "first_at", "sent_at", "size", "wire")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0  # bytes kept in ``chunks``
        self.wire = 0  # body bytes that arrived, kept or not
        self.first_at: float | None = None
        self.sent_at: float | None = None

    def latency(self, tried: float | None = None) -> float | None:
        """Seconds from the request (as it went out on its connection, and not before ``tried``,
        this try's start: a ``sent_at`` left by an earlier try does not count) to the first byte;
        None where both are unknown or the first byte came before (an earlier try)."""
        since = max((t for t in (tried, self.sent_at) if t is not None), default=None)
        if since is None or self.first_at is None or self.first_at < since:
            return None
        return self.first_at - since

    def keep(self, piece: bytes, wire: int | None = None) -> None:
        if piece:
            if self.first_at is None:
                self.first_at = time.monotonic()
            self.chunks.append(piece)
            self.size += len(piece)
        self.wire += len(piece) if wire is None else wire


class PresignedS3:
    """S3 ranged GETs as presigned URLs on a plain HTTP client.

    botocore's response pipeline costs CPU per byte read (benchmarks/README.md, "The HTTP/1.1
    GET path"); a presigned GET is the same signed request with none of that. One URL per
    object, signed by the filesystem's own botocore client (same credentials, endpoint and
    addressing), reused until half its lifetime has passed.

    LITE-HTTP: with LITE-S3's signer (``lite``) the GETs go over ``http1.Pool`` (standard
    library only: no aiohttp import, 0.3 s), unless ``config.lite_http()`` says otherwise; with
    a botocore signer aiohttp is imported already (aiobotocore needs it) and is used, through
    ``session.AiohttpSession``. Either way the same contract, the same error types.

    URLs expire and are re-signed, and every re-sign is counted: PRESIGN-LIFETIME,
    RESIGN-ON-STALE and RESIGN-COUNTED in the module's docstring. ``lifetime``: seconds a URL
    is signed for (``None``: ``FetchConfig``'s default); ``on_resign(why)`` is called on every
    re-sign, on the loop's thread.
    """

    def __init__(self, fs: Any, max_requests: int, signer: Any = None, *, make_fs: Any = None,
                 lite: bool = False, timeout: float = 60.0, lifetime: int | None = None,
                 on_resign: Callable[[str], None] | None = None, network: Network | None = None) -> None:
        from streamdata.config import PRESIGN_LIFETIME_MAX, FetchConfig, lite_http
        from streamdata.errors import SpecError

        if lifetime is None:
            lifetime = FetchConfig.presign_lifetime
        if isinstance(lifetime, bool) or not isinstance(lifetime, int) \
                or not 1 <= lifetime <= PRESIGN_LIFETIME_MAX:
            raise SpecError(f"FetchConfig.presign_lifetime must be whole seconds from 1 to "
                            f"{PRESIGN_LIFETIME_MAX}, got {lifetime!r}")
        self.lifetime = lifetime
        self.on_resign = on_resign
        self.resigned = 0  # RESIGN-COUNTED: every re-sign
        self.resigned_by: dict[str, int] = {}  # ... by why: "age", "expired", "refused"
        self.fs = fs  # None with a LITE-S3 signer: ``make_fs()`` builds it if ever needed
        self._make_fs = make_fs
        self.signer = signer  # an inherited client (SIGNER-REUSE in backends), else the fs's own
        self.lite = lite  # signer is LITE-S3's (s3lite): a 404 or 416 is the object's, not the signature's
        self.timeout = timeout
        self.session: Session
        if lite and lite_http():
            from streamdata.store.http1 import Pool

            self.session = Pool(max_requests, timeout, network=network)
        else:
            self.session = AiohttpSession.new(max_requests, network)
        # path: (url, re-sign once time.time() reaches this, inherited signer made it)
        self._urls: dict[str, tuple[str, float, bool]] = {}
        self._own_client = asyncio.Lock()  # older s3fs builds several clients if raced

    def _count(self, why: str) -> None:
        """RESIGN-COUNTED."""
        self.resigned += 1
        self.resigned_by[why] = self.resigned_by.get(why, 0) + 1
        if self.on_resign is not None:
            self.on_resign(why)

    async def _url(self, path: str) -> tuple[str, bool, bool]:
        """A presigned URL for ``path``, whether the inherited signer made it, and whether it
        was signed before (reused, not signed for this request)."""
        hit = self._urls.get(path)
        if hit is not None:
            # wall clock, not the loop's: the server checks the URL's X-Amz-Date against its own
            if time.time() < hit[1]:
                return hit[0], hit[2], True
            self._count("age")  # PRESIGN-LIFETIME
        signed_at = time.time()
        if self.fs is None:
            bucket, _, key = path.partition("/")
        else:
            bucket, key, _ = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key}
        url, inherited, client = None, self.signer is not None, self.signer
        if self.signer is not None:
            try:
                url = await self.signer.generate_presigned_url("get_object", Params=params,
                                                               ExpiresIn=self.lifetime)
            except Exception:  # e.g. refreshable credentials bound to the parent's loop
                self.signer, inherited = None, False
        if url is None:
            async with self._own_client:
                if self.fs is None:
                    self.fs = await self._make_fs()
                await self.fs.set_session()  # builds the fs's own client on first use, once
            client = await self.fs.get_s3(bucket)
            url = await client.generate_presigned_url("get_object", Params=params,
                                                      ExpiresIn=self.lifetime)
        self._urls[path] = (url, self._reuse_until(url, client, signed_at), inherited)
        return url, inherited, False

    def _reuse_until(self, url: str, signer: Any, signed_at: float) -> float:
        """The wall-clock time from which ``url`` is no longer reused (PRESIGN-LIFETIME)."""
        if "Signature=" not in url:  # anonymous: nothing in it expires
            return math.inf
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        born = _signed_at(query, self.lifetime)
        # the URL's life counts from the moment it carries, whole seconds: up to 1 s before
        # signed_at, so that is where half of it is counted from, not from signed_at
        until = (math.floor(signed_at) if born is None else born) + self.lifetime / 2
        expiry = _credentials_expiry(signer, query)
        if expiry is not None:
            until = min(until, expiry - CREDENTIALS_MARGIN)
        return until

    async def cat_file(self, path: str, start: int, end: int | None, body: Body, *,
                       probe: bool = False) -> int | None:
        """Append bytes ``[start, end)`` of ``path`` to ``body`` as they arrive: if the
        connection drops, what arrived stays there, in the chunks it arrived in. Returns the
        object's size where the answer says it (``Content-Range``). ``probe``: the request is
        a size probe, and an empty object's 416 is its answer (size 0), not an error."""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        stale: str | None = None
        for attempt in range(2):
            url, inherited, reused = await self._url(path)
            async with self.session.get(url, headers, self.timeout) as resp:
                body.sent_at = getattr(resp, "sent_at", None)
                status = resp.status
                total = content_total(resp.headers.get("Content-Range"))
                wait = resp.headers.get("Retry-After")
                if status == 206 or (status == 200 and not headers):
                    async for piece in resp.chunks():
                        body.keep(piece)
                    return total if status == 206 else body.size
                data = await resp.read()
            if probe and status == 416 and total is not None:
                return total
            stale = stale_answer(status, data)
            if attempt == 0 and stale is not None:
                # RESIGN-ON-STALE: a fresh signature (and credentials, where they refresh)
                # fixes this. LITE-S3 signs again itself: its keys are the options' own and a
                # new timestamp is what helps; but a URL of its own that never worked may be
                # signed wrong (a region it guessed), so that one goes to botocore, as below.
                # An inherited botocore signer is dropped: the filesystem's own client
                # resolves the credentials anew
                self._urls.pop(path, None)
                if inherited and not (self.lite and (reused or stale != "SignatureDoesNotMatch")):
                    self.signer = None
                self._count("expired")
                continue
            if attempt == 0 and ((status == 403 and reused) or (
                    inherited and 300 <= status < 500 and status != 429
                    and not (self.lite and _not_the_signature(status, data)))):
                # temporary credentials may have rotated (an answer that does not say so); or
                # the inherited signer does not fit this process (other credentials, endpoint
                # or region from the environment: a redirect or a 4xx): re-sign once, with the
                # filesystem's own client. 429 and 5xx are the server's trouble, not the
                # signature's
                self._urls.pop(path, None)
                if inherited:
                    self.signer = None
                self._count("refused")
                continue
            break
        if status == 200:  # a server that ignores Range
            body.keep(data[start:end], wire=len(data))
            return len(data)
        detail = data[:300].decode("utf-8", "replace")
        denied = status == 403 or stale is not None  # S3 says ExpiredToken with a 400
        raise answer_error(path, status, detail, start, end, wait, denied=denied)

    async def close(self) -> None:
        await self.session.close()

    def forget(self) -> None:
        """FORK-RESET in a child: drop the inherited connections without closing them."""
        self.session.forget()


def answer_error(where: str, status: int, detail: str, start: int, end: int | None, wait: str | None, *,
                 denied: bool, hint: str = "", what: str = "object") -> OSError:
    """The typed error of a ranged GET of bytes ``[start, end)`` of ``where`` answered with
    ``status`` (no 2xx), ``detail`` the start of its body: 404 a ``FileNotFoundError``;
    ``denied`` (the caller's reading of the answer: 403, an expired signature) a
    ``PermissionError``, ``hint`` after it; 416 the range past the ``what``'s end; any other
    status an ``OSError`` carrying it and its ``Retry-After`` ``wait`` (``_status_error``)."""
    if status == 404:
        return FileNotFoundError(f"{where}: HTTP 404 {detail}")
    if denied:
        return PermissionError(f"{where}: HTTP {status} {detail}{hint}")
    if status == 416:
        return _status_error(f"{where}: HTTP 416: bytes {start}..{end} lie past the {what}'s end; it is "
                             "shorter than listed or changed", status, None)
    return _status_error(f"{where}: HTTP {status} {detail}", status, wait)


def _status_error(text: str, status: int, wait: str | None) -> OSError:
    """An answer no 2xx: ``status`` and the wait its ``Retry-After`` asked for (a 503's, a
    429's) as attributes, read by ``retry.classify`` and ``retry.retry_after``."""
    err = OSError(text)
    err.status = status  # type: ignore[attr-defined]
    err.retry_after = parse_retry_after(wait)  # type: ignore[attr-defined]
    return err


_CONTENT_RANGE = re.compile(r"\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$")


def content_total(header: str | None) -> int | None:
    """The object's size from a ``Content-Range`` header (``bytes 0-99/1234``, ``bytes */0``)."""
    m = _CONTENT_RANGE.match(header or "")
    return int(m.group(1)) if m else None


async def http_probe(fs: Any, url: str, head: int, body: Body) -> int | None:
    """One ranged GET of an HTTP object's first ``head`` bytes through the fsspec filesystem's
    own aiohttp session and request options (``kwargs``), adapted to the GET contract: its
    bytes into ``body``, its size from ``Content-Range`` (or ``Content-Length`` where the
    server ignores ``Range``, without reading the body)."""
    options = dict(fs.kwargs or {})
    headers = dict(options.pop("headers", None) or {})
    headers["Range"] = f"bytes=0-{head - 1}"
    session = AiohttpSession(await fs.set_session(), options, owned=False)
    async with session.get(fs.encode_url(url), headers) as resp:
        total = content_total(resp.headers.get("Content-Range"))
        if resp.status == 206:
            async for piece in resp.chunks():
                body.keep(piece)
            return total
        if resp.status == 416 and total is not None:  # an empty object
            return total
        if resp.status == 404:
            raise FileNotFoundError(url)
        if resp.status >= 400:
            raise _status_error(f"{url}: HTTP {resp.status}", resp.status, resp.headers.get("Retry-After"))
        length = resp.headers.get("Content-Length")
        if length is not None and length.strip().isdigit():  # 200: a server that ignores Range
            resp.release(failed=True)  # the body is not wanted: drop the connection rather than read it
            return int(length)
        async for piece in resp.chunks():
            body.keep(piece)
        return body.size


def _not_the_signature(status: int, body: bytes) -> bool:
    """An answer to a LITE-S3 URL that re-signing by botocore cannot change: the endpoint is
    the options' own, so a missing object, a range past its end or a refused access (S3's
    ``AccessDenied``, not ``SignatureDoesNotMatch``) is the object's answer. Not an expired
    URL's ``AccessDenied`` ("Request has expired"): ``stale_answer`` tells that one."""
    return status in (404, 416) or (status == 403 and b"<Code>AccessDenied</Code>" in body
                                    and stale_answer(status, body) is None)


# a second: a URL is taken within microseconds of the check and sent at once; what is left
# covers the trip and a little clock skew. One that still arrives late is answered
# ExpiredToken and re-signed (RESIGN-ON-STALE)
CREDENTIALS_MARGIN = 1.0

# S3's error codes that say the signature or its credentials are no longer good: a re-sign
# fixes them (RESIGN-ON-STALE). SignatureDoesNotMatch: credentials rotated, or a clock moved
_STALE_CODES = ("ExpiredToken", "TokenRefreshRequired", "SignatureDoesNotMatch")
_CODE = re.compile(rb"<Code>\s*([A-Za-z]+)\s*</Code>")
_EXPIRED_MESSAGE = re.compile(rb"<Message>\s*Request has expired", re.IGNORECASE)


def stale_answer(status: int, body: bytes) -> str | None:
    """The S3 error code of an answer that a fresh signature can fix (RESIGN-ON-STALE), or
    ``None``: ``"ExpiredToken"``, ``"TokenRefreshRequired"``, ``"SignatureDoesNotMatch"``, or
    ``"RequestExpired"`` for the ``AccessDenied`` whose message is "Request has expired" (an
    expired URL; any other ``AccessDenied`` is the object's answer). Only a 400 or a 403."""
    if status not in (400, 403):
        return None
    m = _CODE.search(body[:4096])
    code = m.group(1).decode() if m else None
    if code == "AccessDenied" and _EXPIRED_MESSAGE.search(body[:4096]):
        return "RequestExpired"
    return code if code in _STALE_CODES else None


def _signed_at(query: dict[str, list[str]], lifetime: int) -> float | None:
    """When a presigned URL (its ``query``) says it was signed, as a Unix time, or ``None``:
    SigV4's ``X-Amz-Date`` (``20240102T030405Z``; LITE-S3's, and botocore's under
    ``signature_version="s3v4"``), or SigV2's ``Expires`` (the end, a Unix time; what
    botocore's S3 presigner makes by default) less ``lifetime``."""
    stamp = (query.get("X-Amz-Date") or [""])[0]
    end = (query.get("Expires") or [""])[0]
    try:
        if stamp:
            return float(calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ")))
        return float(end) - lifetime if end else None
    except ValueError:
        return None


def _credentials_expiry(signer: Any, query: dict[str, list[str]]) -> float | None:
    """When the botocore credentials that signed a URL (its ``query``) expire, as a Unix time;
    ``None`` where they do not (static keys, LITE-S3) or it cannot be told.

    botocore has no public accessor: ``RefreshableCredentials`` (and aiobotocore's) keep it in
    ``_expiry_time``, and ``get_frozen_credentials()`` returns keys and token only, so the
    signer's credentials are read where every botocore since 1.x keeps them, with ``getattr``.
    They may have been refreshed by another request since this URL was signed: where their
    key or token is not the URL's, the URL's own expiry is unknown, and it is not reused."""
    creds = getattr(getattr(signer, "_request_signer", None), "_credentials", None)
    expiry = getattr(creds, "_expiry_time", None)
    if not isinstance(expiry, datetime.datetime):
        return None
    # SigV4 names them X-Amz-Credential (key/scope) and X-Amz-Security-Token; SigV2
    # AWSAccessKeyId and x-amz-security-token
    key = (query.get("X-Amz-Credential") or query.get("AWSAccessKeyId") or [""])[0].split("/", 1)[0]
    token = (query.get("X-Amz-Security-Token") or query.get("x-amz-security-token") or [""])[0] or None
    if key != getattr(creds, "_access_key", key) or token != getattr(creds, "_token", token):
        return 0.0  # refreshed since: re-sign at the next use
    if expiry.tzinfo is None:  # botocore parses ISO 8601 to an aware time; naive would be UTC
        expiry = expiry.replace(tzinfo=datetime.UTC)
    return expiry.timestamp()
