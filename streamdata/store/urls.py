"""What a URL names: one object to read (:class:`Shard`), and a URL split into protocol and path.

The store's own vocabulary, below the spec grammar (:mod:`streamdata.catalog.specs`), so the
prefetcher and the writers read URLs without the listing code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from streamdata.errors import SpecError
from streamdata.redact import redact_url

__all__ = ["Shard", "etag_of", "known_size", "split_url"]


class Shard(NamedTuple):
    """One object to read: its full URL (with protocol), its size in bytes and its ETag
    (S3 ``ETag``, GCS ``md5Hash`` or ``etag``, quotes stripped), where the listing gives them."""

    url: str
    size: int | None = None
    etag: str | None = None


def known_size(shard: Shard) -> int:
    """``shard``'s size in bytes, which a reader of its end (footers, index files) or of byte
    ranges needs: a SpecError naming the object where the listing left it unknown."""
    if shard.size is None:
        raise SpecError(f"the size of {redact_url(shard.url)} is unknown: it is read by byte ranges or "
                        "from its end; list it (listing=True), or give its size")
    return shard.size


def etag_of(details: Mapping[str, Any]) -> str | None:
    """An object's content tag from fsspec listing details (S3 ``ETag``; GCS ``md5Hash``, else
    ``etag``), without quotes; ``None`` where the backend gives none (local files, HTTP)."""
    for name in ("ETag", "md5Hash", "etag"):
        value = details.get(name)
        if isinstance(value, str) and value.strip('"'):
            return value.strip('"')
    return None


def split_url(url: str) -> tuple[str, str]:
    """``"s3://bkt/key"`` -> ``("s3", "bkt/key")``; a plain path -> ``("file", "/abs/path")``."""
    if "://" in url:
        protocol, path = url.split("://", 1)
        protocol = protocol.lower()
        if protocol == "file":
            return "file", path
        return protocol, path
    if url.startswith(("s3:", "gs:", "gcs:", "hdfs:")):
        raise SpecError(f"malformed URL {url!r}: write the protocol as PROTOCOL://bucket/key")
    return "file", os.path.abspath(url)
