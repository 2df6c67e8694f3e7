"""streamdata: stream WebDataset tar and Arrow/Parquet shards from cloud buckets into PyTorch."""

from .config import FetchConfig
from .dataset import ObjectDataset, ShardedDataset, TarDataset
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
    StreamDataError,
)
from .fetch import FetchItem, Prefetcher
from .urls import Shard, expand_spec
from .world import World

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "BackendMissingError",
    "DecodeError",
    "FetchConfig",
    "FetchItem",
    "FetchTimeoutError",
    "FormatError",
    "ObjectDataset",
    "Prefetcher",
    "Shard",
    "ShardFetchError",
    "ShardNotFoundError",
    "ShardedDataset",
    "SharedMemoryError",
    "SpecError",
    "StreamDataError",
    "TarDataset",
    "World",
    "expand_spec",
]
