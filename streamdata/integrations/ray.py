"""Ray Data: write a Ray Dataset as streamdata shards, read streamdata shards into one.

``ShardsDatasink`` (``ds.write_datasink(ShardsDatasink("s3://bkt/train"))``): each write task
writes its blocks to shards of its own, ``{prefix}-{task:06d}-{shard:06d}.tar`` (or
``.parquet``), through :class:`~streamdata.write.tar.ShardWriter` / ``write_parquet``: in
parallel across tasks, each shard uploaded under a temporary name and moved into place whole
(PUBLISH-WHOLE). A tar task returns its shards' index entries (the offsets recorded while
writing); the driver writes the sample index once, after every task has finished
(``on_write_complete``), merged into any index already in the directory. A failed write leaves
the index as it was: the shards of the failed job are not in it. Columns are named by extension
(``png``, ``npy``, ``cls``, ``json``...), encoded as :class:`ShardWriter` encodes them; a row
without ``__key__`` gets ``{task:06d}-{row:09d}``.

``ShardsDatasource`` (``ray.data.read_datasource(ShardsDatasource(sd.TarDataset(url)))``): the
dataset is built once, on the driver (one listing, one index read: LIST-ONCE); read task ``i``
of ``n`` reads the share of reader ``i`` of ``n`` (``epoch.world.pinned``), so with the index
the tasks split the samples exactly (EXACTLY-ONCE, equal spans within one sample), without one
by whole shards. Each sample becomes a row (``__key__`` and one column per field).

Ray is imported only here, and this module only when used (``pip install streamdata[ray]``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from ray.data import Datasink, Datasource, ReadTask
from ray.data.block import Block, BlockAccessor, BlockMetadata

from streamdata.catalog.index import default_index_url, write_index
from streamdata.epoch.world import World, pinned
from streamdata.errors import SpecError
from streamdata.write.tar import ShardWriter

__all__ = ["ShardsDatasink", "ShardsDatasource"]

FORMATS = ("tar", "parquet")


class ShardsDatasink(Datasink):
    """Write a Ray Dataset under ``url`` (a directory: any fsspec URL) as ``format`` shards;
    see the module docstring. ``maxcount`` / ``maxsize`` bound a tar shard (``ShardWriter``),
    ``rows_per_shard`` a Parquet one; ``index``: the sample index of the tar shards."""

    def __init__(self, url: str, *, format: str = "tar", storage_options: Mapping[str, Any] | None = None,
                 prefix: str = "part", maxcount: int = 100_000, maxsize: float = 3e9,
                 rows_per_shard: int | None = None, index: bool = True, **writer_options: Any) -> None:
        if format not in FORMATS:
            raise SpecError(f"ShardsDatasink: format must be one of {FORMATS}, got {format!r}")
        self.url, self.format, self.prefix = url.rstrip("/"), format, prefix
        self.storage_options = dict(storage_options or {})
        self.maxcount, self.maxsize, self.rows_per_shard = maxcount, maxsize, rows_per_shard
        self.index, self.writer_options = index, writer_options
        self.urls: list[str] = []  # after the write: every shard, in task order

    def get_name(self) -> str:
        return f"StreamdataShards({self.format})"

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict:
        task = int(ctx.task_idx)
        pattern = f"{self.url}/{self.prefix}-{task:06d}-{{shard:06d}}.{self.format}"
        if self.format == "parquet":
            return {"urls": self._write_parquet(blocks, pattern), "entries": []}
        with ShardWriter(pattern, self.maxcount, self.maxsize, storage_options=self.storage_options,
                         index=False, progress=False, **self.writer_options) as writer:
            for n, row in enumerate(_rows(blocks)):
                if "__key__" not in row:
                    row = {"__key__": f"{task:06d}-{n:09d}", **row}
                writer.write(row)
        return {"urls": writer.urls, "entries": writer.entries}

    def _write_parquet(self, blocks: Iterable[Block], pattern: str) -> list[str]:
        from streamdata.write.tables import write_parquet

        tables = (BlockAccessor.for_block(block).to_arrow() for block in blocks)
        tables = (t for t in tables if t.num_rows)
        first = next(tables, None)
        if first is None:
            return []
        return write_parquet(itertools.chain([first], tables), pattern, rows_per_shard=self.rows_per_shard,
                             storage_options=self.storage_options, **self.writer_options)

    def on_write_complete(self, write_result: Any) -> None:
        """Every task has written its shards: the sample index, once, for all of them."""
        returns = list(write_result.write_returns)
        self.urls = [url for r in returns for url in r["urls"]]
        entries = [e for r in returns for e in r["entries"]]
        if self.index and entries:
            write_index(default_index_url([e.name for e in entries]), entries,
                        storage_options=self.storage_options)


def _rows(blocks: Iterable[Block]) -> Iterator[dict]:
    for block in blocks:
        row: Mapping[str, Any]
        for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True):
            yield dict(row)


class ShardsDatasource(Datasource):
    """Read a streamdata dataset (``sd.TarDataset``, ``sd.ParquetDataset``... built on the driver,
    unbatched) into a Ray Dataset: read task ``i`` of ``n`` reads reader ``i``'s share of the
    dataset's epoch; ``rows_per_block`` samples per block."""

    def __init__(self, dataset: Any, *, rows_per_block: int = 1024) -> None:
        super().__init__()
        if getattr(dataset, "batch_size", None) is not None:
            raise SpecError(f"ShardsDatasource reads samples: build {type(dataset).__name__} without "
                            f"batch_size (got {dataset.batch_size}); Ray batches the rows itself")
        self.dataset, self.rows_per_block = dataset, rows_per_block

    def estimate_inmemory_data_size(self) -> int | None:
        sizes = [s.size for s in self.dataset.shards]
        return None if any(size is None for size in sizes) else int(sum(sizes))

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        counts = self.dataset.sample_counts()
        most = int(counts.sum()) if counts is not None else len(self.dataset.units())
        tasks = max(1, min(int(parallelism), most))
        out = []
        for i in range(tasks):
            meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
            out.append(ReadTask(_Read(self.dataset, i, tasks, self.rows_per_block), meta,
                                per_task_row_limit=per_task_row_limit))
        return out

    def get_name(self) -> str:
        return f"Streamdata({type(self.dataset).__name__})"


class _Read:
    """One read task: reader ``rank`` of ``readers``' share, in blocks (a picklable callable)."""

    def __init__(self, dataset: Any, rank: int, readers: int, rows_per_block: int) -> None:
        self.dataset, self.rank, self.readers, self.rows_per_block = dataset, rank, readers, rows_per_block

    def __call__(self) -> Iterator[Block]:
        rows: list[dict] = []
        with pinned(World(rank=self.rank, world_size=self.readers)):
            for sample in self.dataset:
                rows.append(sample)
                if len(rows) >= self.rows_per_block:
                    yield _block(rows)
                    rows = []
        if rows:
            yield _block(rows)


def _column(values: list) -> Any:
    """Arrays (numpy, or torch tensors as numpy) of one shape stacked: a tensor column, or a plain
    one for scalars; anything else (keys, bytes, ints) as it is."""
    arrays = [_array(v) for v in values]
    if arrays and all(a is not None for a in arrays) and len({a.shape for a in arrays}) == 1:  # type: ignore[union-attr]
        return np.stack(arrays)  # type: ignore[arg-type]
    return values


def _array(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return None


def _block(rows: list[dict]) -> Block:
    names = list(dict.fromkeys(k for row in rows for k in row))
    return BlockAccessor.batch_to_block({k: _column([row.get(k) for row in rows]) for k in names})
