"""streamdata: stream WebDataset tar and Arrow/Parquet shards from cloud buckets into PyTorch."""

from .config import FetchConfig
from .cuda import CudaPrefetcher, PinAhead, pin_batch
from .dataset import ShardedDataset
from .errors import (
    AccessDeniedError,
    BackendMissingError,
    DecodeError,
    FetchTimeoutError,
    FormatError,
    ShardFetchError,
    ShardNotFoundError,
    SharedMemoryError,
    SpecError,
    StaleIndexError,
    StreamDataError,
)
from .fetch import FetchItem, Prefetcher
from .index import build_index
from .mix import Mix
from .objects import ObjectDataset
from .presets import Loader, loader
from .shardwriter import ShardWriter
from .tarset import TarDataset
from .urls import Shard, expand_spec
from .world import World

__version__ = "0.1.0"

# pyarrow-backed names load on first use, so `import streamdata` stays light
_LAZY = {"ArrowDataset": "parquet", "ParquetDataset": "parquet",
         "write_arrow": "write", "write_parquet": "write"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'streamdata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "AccessDeniedError",
    "ArrowDataset",
    "BackendMissingError",
    "CudaPrefetcher",
    "DecodeError",
    "FetchConfig",
    "FetchItem",
    "FetchTimeoutError",
    "FormatError",
    "Loader",
    "Mix",
    "ObjectDataset",
    "ParquetDataset",
    "PinAhead",
    "Prefetcher",
    "Shard",
    "ShardFetchError",
    "ShardNotFoundError",
    "ShardWriter",
    "ShardedDataset",
    "SharedMemoryError",
    "SpecError",
    "StaleIndexError",
    "StreamDataError",
    "TarDataset",
    "World",
    "build_index",
    "expand_spec",
    "loader",
    "pin_batch",
    "write_arrow",
    "write_parquet",
]
