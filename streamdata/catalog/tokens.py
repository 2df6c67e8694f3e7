"""Token files' counts before any reader starts: each ``.bin``'s Megatron ``.idx``, read whole,
once per job on rank 0 (LIST-ONCE), and checked against its ``.bin``'s listed size."""

from __future__ import annotations

from collections.abc import Sequence

from streamdata.catalog.footers import read_footers, with_sizes
from streamdata.config import FetchConfig
from streamdata.errors import SpecError
from streamdata.formats.tokens import MegatronIndex, parse_idx
from streamdata.policy import ErrorPolicy
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["idx_url", "read_indexes"]


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
