"""Parquet benchmark: bytes moved by column projection, and throughput under latency.

Writes a Parquet dataset of 8 float64 columns to the embedded S3 server, puts a
:class:`~benchmarks.proxy.LatencyProxy` in front of it and measures, per one-way delay:

- ``streamdata``: ``ParquetDataset`` (row groups split across workers, async ranged reads of
  only the requested column chunks) in a ``DataLoader``;
- ``pyarrow.dataset``: ``pyarrow.dataset`` over s3fs, files split across the same workers in a
  plain ``IterableDataset``, each batch turned into tensors the same way.

Both read all 8 columns and 2 of them; bytes are counted at the proxy (``bytes_down``).

    python -m benchmarks.parquet            # full run (~3 min on 2 cores)
    python -m benchmarks.parquet --quick    # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import mean_std, upstream, write_report  # noqa: E402
from benchmarks.proxy import LatencyProxy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
COLUMNS = [f"f{i}" for i in range(8)]
# the baseline's tensors alias Arrow memory, as ours do; torch warns once per process about it
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
TWO = COLUMNS[:2]


class PyarrowDatasetReader(torch.utils.data.IterableDataset):
    """The plain baseline: ``pyarrow.dataset`` over s3fs, whole files split across workers."""

    def __init__(self, urls: list[str], columns: list[str], batch_size: int, storage_options: dict) -> None:
        super().__init__()
        self.urls, self.columns, self.batch_size = urls, columns, batch_size
        self.storage_options = storage_options

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        import pyarrow.dataset as pads
        import s3fs
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        paths = [u[len("s3://"):] for u in self.urls[worker::workers]]
        if not paths:
            return
        dataset = pads.dataset(paths, format="parquet", filesystem=PyFileSystem(FSSpecHandler(fs)))
        for batch in dataset.to_batches(columns=self.columns, batch_size=self.batch_size):
            pairs = zip(batch.column_names, batch.columns, strict=True)  # one name per column
            yield {name: torch.from_numpy(col.to_numpy()) for name, col in pairs}


def _loader(method: str, urls: list[str], columns: list[str], options: dict, args: argparse.Namespace) -> Any:
    if method == "streamdata":
        from streamdata.datasets.parquet import ParquetDataset

        prefix = urls[0].rsplit("/", 1)[0] + "/"  # one listing, as a user would write it
        ds: Any = ParquetDataset(prefix, columns, batch_size=args.batch, storage_options=options)
    else:
        ds = PyarrowDatasetReader(urls, columns, args.batch, options)
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers,
                                       multiprocessing_context="fork", timeout=300)


def _measure(method: str, urls: list[str], columns: list[str], options: dict, proxy: LatencyProxy,
             args: argparse.Namespace) -> dict[str, float]:
    """One pass: rows/s over the whole pass (dataset construction included), and steady rows/s
    after the first batch (start-up excluded)."""
    proxy.reset_counters()
    start = time.perf_counter()
    rows, first_at, first_rows = 0, None, 0
    for batch in _loader(method, urls, columns, options, args):
        rows += len(batch[columns[0]])
        if first_at is None:
            first_at, first_rows = time.perf_counter(), rows
    end = time.perf_counter()
    seconds = end - start
    steady = (rows - first_rows) / (end - first_at) if first_at and end > first_at else float("nan")
    return {"seconds": seconds, "rows": rows, "rows_per_s": rows / seconds, "steady_rows_per_s": steady,
            "ttfb_s": (first_at or end) - start,
            "payload_mb_per_s": rows * len(columns) * 8 / seconds / 1e6, "bytes_down": proxy.bytes_down}


def _prepare(server: Any, args: argparse.Namespace) -> list[str]:
    from streamdata.write.tables import write_parquet

    bucket = "bench-parquet"
    server.create_bucket(bucket)
    rng = np.random.default_rng(0)
    per_file = args.rows // args.files

    def tables() -> Iterator[pa.Table]:
        for _ in range(args.files):
            yield pa.table({name: rng.random(per_file) for name in COLUMNS})

    return write_parquet(tables(), f"s3://{bucket}/data/part-{{shard:03d}}.parquet",
                         rows_per_shard=per_file, row_group_size=args.row_group,
                         storage_options=server.storage_options)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from streamdata.testing import S3Server

    results: list[dict[str, Any]] = []
    with S3Server() as server:
        urls = _prepare(server, args)
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.0) as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
            for delay_ms in args.delays:
                proxy.set_delay(delay_ms / 1000)
                for method in args.methods:
                    for label, cols in (("8 columns", COLUMNS), ("2 columns", TWO)):
                        runs = [_measure(method, urls, cols, options, proxy, args) for _ in range(args.reps)]
                        rps, rps_sd = mean_std([r["rows_per_s"] for r in runs])
                        row = {"delay_ms": delay_ms, "method": method, "columns": label,
                               "rows_per_s": rps, "rows_per_s_sd": rps_sd,
                               "steady_rows_per_s": mean_std([r["steady_rows_per_s"] for r in runs])[0],
                               "ttfb_s": mean_std([r["ttfb_s"] for r in runs])[0],
                               "payload_mb_per_s": mean_std([r["payload_mb_per_s"] for r in runs])[0],
                               "bytes_down": int(np.mean([r["bytes_down"] for r in runs])),
                               "rows": runs[0]["rows"], "reps": args.reps}
                        results.append(row)
                        print(f"  {delay_ms:>5.0f} ms  {method:<16} {label:<10} {rps:>12,.0f} rows/s "
                              f"{row['bytes_down'] / 1e6:>8.1f} MB down", flush=True)
    _add_ratios(results)
    return {"when": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "pyarrow": pa.__version__,
                        "torch": torch.__version__},
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "results": results}


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """bytes of 2 columns / bytes of 8 (same method, delay); streamdata / pyarrow.dataset speed."""
    key = {(r["delay_ms"], r["method"], r["columns"]): r for r in results}
    for r in results:
        full = key.get((r["delay_ms"], r["method"], "8 columns"))
        r["bytes_vs_8_columns"] = r["bytes_down"] / full["bytes_down"] if full else float("nan")
        base = key.get((r["delay_ms"], "pyarrow.dataset", r["columns"]))
        r["speed_vs_pyarrow_dataset"] = r["rows_per_s"] / base["rows_per_s"] if base else float("nan")


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'delay':>6} {'method':<16} {'columns':<10} {'rows/s':>11} {'steady':>11} {'ttfb':>6} "
          f"{'MB/s':>6} {'MB down':>8} {'bytes/8col':>10} {'vs pa.ds':>8}")
    for r in report["results"]:
        print(f"{r['delay_ms']:>4.0f}ms {r['method']:<16} {r['columns']:<10} {r['rows_per_s']:>11,.0f} "
              f"{r['steady_rows_per_s']:>11,.0f} {r['ttfb_s']:>5.2f}s {r['payload_mb_per_s']:>6.1f} "
              f"{r['bytes_down'] / 1e6:>8.1f} {r['bytes_vs_8_columns']:>10.2f} "
              f"{r['speed_vs_pyarrow_dataset']:>7.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[25, 100],
                   help="one-way delays in ms, comma-separated")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["streamdata", "pyarrow.dataset"])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--row-group", type=int, default=62_500)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small data, one repetition")
    p.add_argument("--out", type=Path, default=RESULTS / "parquet.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.row_group, args.reps = 200_000, 12_500, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print_table(report)
    print()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
