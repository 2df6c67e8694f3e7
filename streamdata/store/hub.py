"""The Hugging Face Hub as a store: ``hf://datasets/OWNER/NAME[@REVISION]/path`` URLs.

Listing goes through huggingface_hub's own fsspec filesystem (``HfFileSystem``, made by
``backends.filesystem``: the tree API, its pagination, its token resolution); data goes
through the reader's prefetcher as ranged GETs of the Hub's resolve endpoint
(``{endpoint}/datasets/OWNER/NAME/resolve/{revision}/{path}``, as huggingface_hub's
``hf_hub_url`` writes it), with the Hub's headers (``build_hf_headers``: the ``Authorization:
Bearer`` token from ``token=`` in the storage options, else ``HF_TOKEN`` or the saved login,
and the user agent), on the one GET contract (``session``): LITE-HTTP's pool, or aiohttp's.
So a Hub part is retried, resumed, timed and throttled as an S3 part is, and the Hub's
answer (a redirect to its CDN or Xet bridge, followed; a 429 with ``Retry-After``) reaches
``client``'s retry loop as any other. A redirect to another host does not carry the token
(``http1``; aiohttp does the same).

``@~parquet`` names the Hub's Parquet conversion (the ``refs/convert/parquet`` revision):
:func:`canonical_path` writes it the way huggingface_hub reads it.

The Hub counts requests: ``FetchConfig.max_requests_per_s`` (default :data:`HUB_REQUESTS_PER_S`
for ``hf://``) paces the job's requests (RATE-SHARE, ``rate``).
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Mapping
from typing import Any

from streamdata.errors import SpecError
from streamdata.redact import redact
from streamdata.store.network import Network
from streamdata.store.presigned import Body, answer_error, content_total
from streamdata.store.session import AiohttpSession, Session

__all__ = ["HUB_REQUESTS_PER_S", "PARQUET_REVISION", "HubFiles", "canonical_path", "hub_filesystem_class",
           "hub_headers", "resolve_url"]

# The job's requests per second to the Hub where FetchConfig.max_requests_per_s is not set:
# under the Hub's published limits for a free account's resolve requests (thousands per five
# minutes), with room for the listing and for other jobs of the same account
HUB_REQUESTS_PER_S = 10.0

PARQUET_ALIAS = "~parquet"  # hf://datasets/OWNER/NAME@~parquet/...: the Hub's Parquet conversion
PARQUET_REVISION = "refs/convert/parquet"
_QUOTED_PARQUET = "refs%2Fconvert%2Fparquet"


def canonical_path(path: str) -> str:
    """``path`` (after ``hf://``) with ``@~parquet`` written as the revision it names, quoted as
    huggingface_hub reads a revision with slashes: ``datasets/o/n@refs%2Fconvert%2Fparquet/...``."""
    head, at, rest = path.partition("@")
    if not at:
        return path
    revision, slash, tail = rest.partition("/")
    if revision == PARQUET_ALIAS:
        return f"{head}@{_QUOTED_PARQUET}{slash}{tail}"
    return path


def _parse(url: str) -> Any:
    """huggingface_hub's reading of an ``hf://`` URL (type, id, revision, path in the repo)."""
    from huggingface_hub.utils import parse_hf_uri

    path = url.split("://", 1)[-1]
    try:
        parsed = parse_hf_uri("hf://" + canonical_path(path))
    except ValueError as exc:
        raise SpecError(f"malformed Hub URL {redact(url)!r}: write hf://datasets/OWNER/NAME[@REVISION]/path "
                        f"({exc})", url=url) from None
    if parsed.type == "bucket" or not parsed.path_in_repo:
        raise SpecError(f"{redact(url)!r} names no file of a repository: write "
                        "hf://datasets/OWNER/NAME[@REVISION]/path", url=url)
    return parsed


def resolve_url(url: str, endpoint: str | None = None) -> str:
    """The Hub's resolve URL of an ``hf://`` file URL, as huggingface_hub's ``hf_hub_url`` writes
    it (the revision quoted whole, the path by segment), at ``endpoint`` (else huggingface_hub's)."""
    parsed = _parse(url)
    prefix = "" if parsed.type == "model" else f"{parsed.type}s/"
    revision = urllib.parse.quote(parsed.revision or "main", safe="")
    return (f"{_endpoint({'endpoint': endpoint})}/{prefix}{parsed.id}/resolve/{revision}/"
            f"{urllib.parse.quote(parsed.path_in_repo)}")


def _endpoint(storage_options: Mapping[str, Any] | None) -> str:
    from huggingface_hub import constants

    return str((storage_options or {}).get("endpoint") or constants.ENDPOINT).rstrip("/")


def hub_headers(storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """The headers of a GET to the Hub (huggingface_hub's ``build_hf_headers``): the token of
    ``storage_options["token"]`` (``False``: none), else huggingface_hub's own resolution
    (``HF_TOKEN``, the saved login; not sent under ``HF_HUB_DISABLE_IMPLICIT_TOKEN``)."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=(storage_options or {}).get("token"), library_name="streamdata")


class HubFiles:
    """Ranged GETs of ``hf://`` files through the resolve endpoint, on a ``session.Session``.

    The interface ``client.AsyncClient`` asks of a signed-GET path (``PresignedS3``'s):
    ``cat_file`` appends what arrives to a ``Body`` (RESUME), ``close``, ``forget``.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None, max_requests: int, *,
                 timeout: float = 60.0, network: Network | None = None) -> None:
        from streamdata.config import lite_http

        self.endpoint = _endpoint(storage_options)
        self._headers = hub_headers(storage_options)
        self.timeout = timeout
        self._urls: dict[str, str] = {}  # hf:// URL -> its resolve URL
        self.session: Session
        if lite_http():
            from streamdata.store.http1 import Pool

            self.session = Pool(max_requests, timeout, network=network)
        else:
            self.session = AiohttpSession.new(max_requests, network)

    def __repr__(self) -> str:  # the headers hold the token: never shown
        return f"HubFiles(endpoint={self.endpoint!r})"

    def _url(self, url: str) -> str:
        found = self._urls.get(url)
        if found is None:
            found = self._urls[url] = resolve_url(url, self.endpoint)
        return found

    async def cat_file(self, url: str, start: int, end: int | None, body: Body, *,
                       probe: bool = False) -> int | None:
        """Append bytes ``[start, end)`` of the ``hf://`` file ``url`` to ``body`` as they arrive;
        returns its size where the answer says it (``Content-Range``). ``probe``: a size probe
        (an empty file's 416 is its answer, size 0)."""
        headers = dict(self._headers)
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        async with self.session.get(self._url(url), headers, self.timeout) as resp:
            status = resp.status
            total = content_total(resp.headers.get("Content-Range"))
            wait = resp.headers.get("Retry-After")
            if status == 206 or (status == 200 and "Range" not in headers):
                async for piece in resp.chunks():
                    body.keep(piece)
                return total if status == 206 else body.size
            data = await resp.read()
        if probe and status == 416 and total is not None:
            return total
        if status == 200:  # a server that ignores Range
            body.keep(data[start:end], wire=len(data))
            return len(data)
        detail = redact(data[:300].decode("utf-8", "replace"))
        raise answer_error(url, status, detail, start, end, wait, denied=status in (401, 403), what="file",
                           hint=" (a gated or private repository needs a token: HF_TOKEN, "
                                "`hf auth login`, or storage_options={'token': ...})")

    async def close(self) -> None:
        await self.session.close()

    def forget(self) -> None:
        """FORK-RESET in a child: drop the inherited connections without closing them."""
        self.session.forget()


@functools.cache
def hub_filesystem_class() -> Any:
    """huggingface_hub's ``HfFileSystem``, reading ``@~parquet`` as the Parquet conversion's
    revision (:func:`canonical_path`) wherever it strips a path's protocol."""
    from huggingface_hub import HfFileSystem

    class HubFileSystem(HfFileSystem):
        @classmethod
        def _strip_protocol(cls, path: Any) -> Any:
            stripped = super()._strip_protocol(path)
            return canonical_path(stripped) if isinstance(stripped, str) else stripped

    HubFileSystem.__name__ = HubFileSystem.__qualname__ = "HfFileSystem"
    return HubFileSystem
