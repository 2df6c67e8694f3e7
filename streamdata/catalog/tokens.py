"""Token files' counts before any reader starts, once per job on rank 0 (LIST-ONCE): each
``.bin``'s Megatron ``.idx``, read whole and checked against its ``.bin``'s listed size; a flat
``.bin``'s dtype from the ``tokens.json`` beside it. A tar shard's tokens per sample come from a
counting pass that reads each shard once per job (its ``.npy`` headers), split among the ranks:

Invariant (COUNT-SHARED): the shards whose counts are not kept (``save_tar_counts``) are divided
among the ranks, balanced by bytes (the largest first, each to the rank with the fewest bytes so
far: a pure function of the shard list, the same on every rank); each rank reads only its share,
and an all-gather gives every rank every share's counts. So every shard is read once per job,
every rank holds the same counts, and no rank waits for a whole corpus to be read: the gather
waits only for the slowest share (about the average share plus one shard), not for rank 0's
reading all of it under the process group's timeout."""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import posixpath
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from streamdata.catalog.footers import read_footers, with_sizes
from streamdata.catalog.index import default_index_url, entry_name, write_object
from streamdata.catalog.specs import listing_deadline
from streamdata.config import FetchConfig
from streamdata.errors import AccessDeniedError, FormatError, ShardNotFoundError, SpecError
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.formats.tokens import (
    MASK_SUFFIX,
    MegatronIndex,
    TarCounts,
    decode_tar_counts,
    encode_tar_counts,
    parse_idx,
    tar_token_counts,
    token_dtype,
)
from streamdata.policy import ErrorPolicy
from streamdata.progress import progress
from streamdata.ranks import each_rank, from_rank0, is_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard, known_size

__all__ = ["COUNTS_NAME", "SIDECAR", "TarCounted", "count_tar_tokens", "default_counts_url", "idx_url",
           "mask_shards", "mask_url", "read_indexes", "rank_share", "save_tar_counts", "sidecar_dtype"]

log = logging.getLogger("streamdata")

SLOW_COUNT_S = 30.0  # a counting pass that took longer says how to keep its counts (a warning)

COUNTS_NAME = "_streamdata.tokens.npz"  # a tar corpus's counts, beside its shards (save_tar_counts)

SIDECAR = "tokens.json"  # beside flat .bin files: {"dtype": "uint16"}


def idx_url(bin_url: str) -> str:
    """Where a ``.bin``'s Megatron index lies: beside it, ``.idx`` for ``.bin``."""
    return bin_url[:-4] + ".idx" if bin_url.endswith(".bin") else bin_url + ".idx"


def mask_url(bin_url: str) -> str:
    """Where a ``.bin``'s loss mask lies: beside it, ``NAME.mask.bin`` for ``NAME.bin``."""
    return (bin_url[:-4] if bin_url.endswith(".bin") else bin_url) + MASK_SUFFIX


def mask_shards(bins: Sequence[str], listed: dict[str, Shard], tokens: Sequence[int],
                storage_options: dict, config: FetchConfig) -> list[Shard]:
    """The loss mask of each of ``bins`` (``.bin`` URLs, of ``tokens[i]`` tokens), with its
    size: from the listing (``listed``), else one HEAD each, all at once, on rank 0. A missing
    mask is a ShardNotFoundError and one of another size a FormatError, naming it."""
    def sizes() -> list[Shard]:
        masks = [listed.get(mask_url(url)) or Shard(mask_url(url)) for url in bins]
        try:
            return with_sizes(masks, storage_options, config)
        except ShardNotFoundError as exc:
            exc.message += (f"; loss_mask=True reads a loss mask beside each NAME.bin: NAME{MASK_SUFFIX}, "
                            "one uint8 per token")
            raise

    masks = from_rank0(sizes)
    for m, n in zip(masks, tokens, strict=True):
        if known_size(m) != n:
            raise FormatError(f"{redact_url(m.url)} is {known_size(m)} bytes where its .bin holds {n} tokens "
                              "(a loss mask is one uint8 per token)", url=m.url, key="mask")
    return masks



def read_indexes(shards: Sequence[Shard], storage_options: dict, config: FetchConfig) -> list[MegatronIndex]:
    """The ``.idx`` of each of ``shards`` (``.bin`` files of known size), in order: one GET each,
    all at once, on rank 0; a missing, malformed or mismatched index raises, naming it."""
    def read() -> dict[str, bytes]:
        idx = with_sizes([Shard(idx_url(s.url)) for s in shards], storage_options, config)
        most = max(known_size(s) for s in idx)
        return read_footers(idx, storage_options, config, tail_bytes=max(most, 16),
                            footer_length=lambda tail, s: known_size(s), policy=ErrorPolicy("raise"))

    data = from_rank0(read)
    return [parse_idx(data[idx_url(s.url)], idx_url(s.url), s.url, known_size(s)) for s in shards]


def _read_small(url: str, storage_options: dict, config: FetchConfig, *, looked_up: bool = True
                ) -> bytes | None:
    """A small object's bytes (one GET, no HEAD first), ``None`` when there is none; one
    ``looked_up`` on the user's behalf is also ``None`` (with a warning) where access is denied:
    S3 answers 403, not 404, for a missing key to a caller without s3:ListBucket."""
    config = config.replace(retry_deadline=listing_deadline(config), cache_dir=None)
    try:
        with Prefetcher([FetchItem(url, None, ((0, None),))], dict(storage_options), config) as fetcher:
            return next(iter(fetcher)).read()
    except ShardNotFoundError as exc:
        exc.with_traceback(None)
        return None
    except AccessDeniedError as exc:
        if not looked_up:
            raise
        warnings.warn(f"could not read {redact_url(url)} (access denied: {exc.message[:200]}); "
                      "reading without it", stacklevel=2)
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


def default_counts_url(shards: Sequence[Shard]) -> str | None:
    """Where a tar corpus's counts are kept by default: ``_streamdata.tokens.npz`` in the shards'
    longest common directory (``None`` where they share none)."""
    try:
        return default_index_url([s.url for s in shards]).rsplit("/", 1)[0] + "/" + COUNTS_NAME
    except SpecError:
        return None


def _fresh(url: str, field: str, shards: Sequence[Shard], storage_options: dict, config: FetchConfig,
           auto: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The counts in the file at ``url`` (of ``field``) of the shards whose size and ETag still
    match; none where there is no file at the default location (``auto``), a SpecError at a
    location the user named."""
    data = _read_small(url, storage_options, config, looked_up=auto)
    if data is None:
        if auto:
            return {}
        raise SpecError(f"no token counts at {redact_url(url)}: write them there with "
                        "ds.save_counts(url) (or `streamdata index SPEC --tokens FIELD`), or pass "
                        "counts='auto' (beside the shards) or counts=None")
    kept_field, entries = decode_tar_counts(data, url)
    if kept_field != field:
        return {}
    by_name = {e.name: e for e in entries}
    out = {}
    for s in shards:
        e = by_name.get(entry_name(url, s.url)) or by_name.get(s.url)
        if e is not None and e.size == s.size and (not (s.etag and e.etag) or s.etag == e.etag):
            out[s.url] = (e.counts, e.offsets)
    return out


def save_tar_counts(url: str, field: str, shards: Sequence[Shard],
                    counted: Sequence[tuple[np.ndarray, np.ndarray]], storage_options: dict,
                    config: FetchConfig) -> None:
    """The counting pass's results for ``shards`` kept at ``url`` (``encode_tar_counts``), so
    that later jobs count only shards that are new or changed."""
    entries = [TarCounts(entry_name(url, s.url), known_size(s), s.etag, c, o)
               for s, (c, o) in zip(shards, counted, strict=True)]
    write_object(url, encode_tar_counts(field, entries), storage_options, config,
                 what="write the token counts")


class TarCounted(NamedTuple):
    """A tar corpus's counts (``count_tar_tokens``): per shard, tokens per sample and the samples'
    ``samples + 1`` byte offsets; the shards the job's counting pass read (every rank's share), and
    those this rank read (COUNT-SHARED)."""

    counts: list[tuple[np.ndarray, np.ndarray]]
    counted: int
    here: int


def rank_share(shards: Sequence[Shard], rank: int, world_size: int) -> list[Shard]:
    """Rank ``rank``'s share of ``shards`` (COUNT-SHARED): the largest first, each to the rank with
    the fewest bytes so far (ties: the lower rank); in the shards' order. A pure function of the
    list, so every rank computes every rank's share alike."""
    if world_size <= 1:
        return list(shards)
    loads = [(0, r) for r in range(world_size)]
    mine: list[int] = []
    for i in sorted(range(len(shards)), key=lambda i: (-known_size(shards[i]), i)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(i)
        heapq.heappush(loads, (load + known_size(shards[i]), r))
    return [shards[i] for i in sorted(mine)]


def _count(shards: Sequence[Shard], field: str, storage_options: dict, config: FetchConfig,
           bar: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each of ``shards`` read once, whole, through the prefetcher, and counted."""
    out = {}
    with Prefetcher(list(shards), dict(storage_options), config) as fetcher:
        for shard, reader in zip(shards, fetcher, strict=True):
            with contextlib.closing(reader.chunks()) as chunks:
                data = b"".join(chunks)
            bar.update(len(data))
            out[shard.url] = tar_token_counts(data, shard.url, field)
    return out


def count_tar_tokens(shards: Sequence[Shard], field: str, storage_options: dict, config: FetchConfig, *,
                     show: bool | None = None, counts_url: str | None = None, auto: bool = True
                     ) -> TarCounted:
    """Each tar shard's tokens per sample (its ``field``'s ``.npy`` header) and its samples'
    ``samples + 1`` byte offsets: the counts kept at ``counts_url`` (``save_tar_counts``; read on
    rank 0, LIST-ONCE) for shards whose size and ETag still match, and a counting pass that reads
    each other shard once, whole, through the prefetcher, each rank its share (COUNT-SHARED; a bar
    of bytes of rank 0's share on its stderr when it is a terminal, or ``show``). ``auto``:
    ``counts_url`` is the default location (a file missing there is no error)."""
    known = from_rank0(lambda: {} if counts_url is None else
                       _fresh(counts_url, field, shards, storage_options, config, auto))
    todo = [s for s in shards if s.url not in known]
    here = [0]

    def share(rank: int, world_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        mine = rank_share(todo, rank, world_size)
        here[0] = len(mine)
        if rank == 0 and todo:
            log.info("counting the tokens of %d tar shards (%d bytes)%s; ds.save_counts() or `streamdata "
                     "index SPEC --tokens %s` keeps the counts for later jobs", len(todo),
                     sum(known_size(s) for s in todo),
                     f", split over {world_size} ranks" if world_size > 1 else "", field)
        desc = f"counting tokens in {len(mine)}{f' of {len(todo)}' if len(mine) < len(todo) else ''} shards"
        bar = progress(sum(known_size(s) for s in mine), desc=desc, unit="B", unit_scale=True,
                       enabled=show if mine and rank == 0 else False)
        with bar:
            return _count(mine, field, storage_options, config, bar)

    start = time.monotonic()
    shares = each_rank(share)
    took = time.monotonic() - start
    for counted in shares:
        known.update(counted)
    if todo and took > SLOW_COUNT_S and is_rank0():
        log.warning("counting the tokens of %d tar shards took %.0f s: ds.save_counts() (on one rank) or "
                    "`streamdata index SPEC --tokens %s` keeps the counts, so later jobs read none",
                    len(todo), took, field)
    return TarCounted([known[s.url] for s in shards], len(todo), here[0])
