"""streamdata: stream WebDataset tar and Arrow/Parquet shards from cloud buckets into PyTorch."""

from streamdata.catalog.index import build_index
from streamdata.catalog.specs import expand_spec
from streamdata.config import Cache, Fetch, FetchConfig, Retry
from streamdata.datasets.mix import Mix
from streamdata.datasets.objects import ObjectDataset
from streamdata.datasets.sharded import ShardedDataset
from streamdata.datasets.tar import TarDataset
from streamdata.epoch.mix import Schedule
from streamdata.epoch.state import merge_states
from streamdata.epoch.world import World
from streamdata.errors import (
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
from streamdata.feed.cuda import CudaPrefetcher, PinAhead, pin_batch
from streamdata.feed.images import finished as finish_images  # decode_on="device" without sd.loader's device
from streamdata.feed.loader import Loader, loader
from streamdata.feed.metrics import Timed as timed
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.formats import audio as audio  # sd.audio: audio segments decoded only as far as they need
from streamdata.formats import images as images  # sd.images: the fast image path's transforms
from streamdata.formats import video as video  # sd.video: video clips decoded only as far as they need
from streamdata.integrations.prometheus import serve_prometheus
from streamdata.store.urls import Shard
from streamdata.write.tar import ShardWriter

__version__ = "0.1.0"

# pyarrow-backed names load on first use, so `import streamdata` stays light
_LAZY = {"ArrowDataset": "datasets.parquet", "ParquetDataset": "datasets.parquet",
         "TokenDataset": "datasets.tokens",
         "write_arrow": "write.tables", "write_parquet": "write.tables"}


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
    "Cache",
    "CudaPrefetcher",
    "DecodeError",
    "Fetch",
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
    "Retry",
    "Schedule",
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
    "TokenDataset",
    "World",
    "build_index",
    "expand_spec",
    "finish_images",
    "loader",
    "merge_states",
    "pin_batch",
    "serve_prometheus",
    "timed",
    "write_arrow",
    "write_parquet",
]
