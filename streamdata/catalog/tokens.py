"""Token files' counts before any reader starts, once per job on rank 0 (LIST-ONCE): each
``.bin``'s Megatron ``.idx``, read whole and checked against its ``.bin``'s listed size; a flat
``.bin``'s dtype from the ``tokens.json`` beside it; a tar shard's tokens per sample, from a
counting pass that reads each shard once (its ``.npy`` headers)."""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections.abc import Sequence

import numpy as np

from streamdata.catalog.footers import read_footers, with_sizes
from streamdata.catalog.specs import listing_deadline
from streamdata.config import FetchConfig
from streamdata.errors import FormatError, ShardNotFoundError, SpecError
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.formats.tokens import MegatronIndex, parse_idx, tar_token_counts, token_dtype
from streamdata.policy import ErrorPolicy
from streamdata.progress import progress
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["SIDECAR", "count_tar_tokens", "idx_url", "read_indexes", "sidecar_dtype"]

SIDECAR = "tokens.json"  # beside flat .bin files: {"dtype": "uint16"}


def idx_url(bin_url: str) -> str:
    """Where a ``.bin``'s Megatron index lies: beside it, ``.idx`` for ``.bin``."""
    return bin_url[:-4] + ".idx" if bin_url.endswith(".bin") else bin_url + ".idx"


def _size(shard: Shard) -> int:
    if shard.size is None:
        raise SpecError(f"{redact_url(shard.url)}: size unknown")
    return shard.size


def read_indexes(shards: Sequence[Shard], storage_options: dict, config: FetchConfig) -> list[MegatronIndex]:
    """The ``.idx`` of each of ``shards`` (``.bin`` files of known size), in order: one GET each,
    all at once, on rank 0; a missing, malformed or mismatched index raises, naming it."""
    def read() -> dict[str, bytes]:
        idx = with_sizes([Shard(idx_url(s.url)) for s in shards], storage_options, config)
        most = max(_size(s) for s in idx)
        return read_footers(idx, storage_options, config, tail_bytes=max(most, 16),
                            footer_length=lambda tail, s: _size(s), policy=ErrorPolicy("raise"))

    data = from_rank0(read)
    return [parse_idx(data[idx_url(s.url)], idx_url(s.url), s.url, _size(s)) for s in shards]


def _read_small(url: str, storage_options: dict, config: FetchConfig) -> bytes | None:
    """A small object's bytes (one GET, no HEAD first), ``None`` when there is none."""
    config = config.replace(retry_deadline=listing_deadline(config), cache_dir=None)
    try:
        with Prefetcher([FetchItem(url, None, ((0, None),))], dict(storage_options), config) as fetcher:
            return next(iter(fetcher)).read()
    except ShardNotFoundError as exc:
        exc.with_traceback(None)
        return None


def sidecar_dtype(shards: Sequence[Shard], storage_options: dict, config: FetchConfig) -> np.dtype | None:
    """The token dtype that the ``tokens.json`` in the directory of each of ``shards`` (``.bin``
    files) names, ``{"dtype": "uint16"}``; ``None`` when no directory has one. Directories
    that disagree, or where some have one and some not, are a SpecError."""
    def read() -> dict[str, bytes | None]:
        dirs = sorted({posixpath.dirname(s.url) for s in shards})
        return {d: _read_small(f"{d}/{SIDECAR}", storage_options, config) for d in dirs}

    found = from_rank0(read)
    dtypes: dict[str, np.dtype] = {}
    for d, data in found.items():
        if data is None:
            continue
        url = f"{d}/{SIDECAR}"
        try:
            doc = json.loads(data)
            value = doc["dtype"]
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{redact_url(url)} is not {{\"dtype\": \"uint16\"}}-style JSON "
                              f"({type(exc).__name__}: {exc}): fix it, or pass dtype=", url=url) from None
        dtypes[d] = token_dtype(value, where=redact_url(url) or SIDECAR)
    if not dtypes:
        return None
    missing = [d for d, data in found.items() if data is None]
    if missing or len(set(dtypes.values())) > 1:
        said = ", ".join(f"{redact_url(d)}: {dt}" for d, dt in dtypes.items())
        raise SpecError(f"the {SIDECAR} files beside the .bin files disagree ({said}"
                        + (f"; none in {redact_url(missing[0])}" if missing else "")
                        + "): one dtype for every file, or pass dtype=")
    return next(iter(dtypes.values()))


def count_tar_tokens(shards: Sequence[Shard], field: str, storage_options: dict, config: FetchConfig, *,
                     show: bool | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each tar shard's tokens per sample (its ``field``'s ``.npy`` header) and its samples'
    ``samples + 1`` byte offsets: a counting pass on rank 0 that reads every shard once,
    whole, through the prefetcher (a bar of bytes on stderr when it is a terminal, or ``show``)."""
    def count() -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        total = sum(_size(s) for s in shards)
        bar = progress(total, desc=f"counting tokens in {len(shards)} shards", unit="B", unit_scale=True,
                       enabled=show)
        with bar, Prefetcher(list(shards), dict(storage_options), config) as fetcher:
            for shard, reader in zip(shards, fetcher, strict=True):
                with contextlib.closing(reader.chunks()) as chunks:
                    data = b"".join(chunks)
                bar.update(len(data))
                out.append(tar_token_counts(data, shard.url, field))
        return out

    return from_rank0(count)
