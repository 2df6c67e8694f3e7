"""Large per-sample arrays through DataLoader workers: pickled NumPy vs shared-memory tensors.

The case: an iterable yields 1000x150 float64 arrays (1.2 MB each)
after a simulated 3.125 ms fetch; batches of 128 (154 MB); a 50 ms simulated train step;
``prefetch_factor=4``, persistent spawn workers.

* ``plain``:      the report's setup, ``collate_fn=lambda records: records``: every batch is a
                  list of NumPy arrays, pickled by the worker and unpickled by the main process.
* ``streamdata``: ``sd.loader`` with the same settings: the worker stacks the samples into one
                  tensor in shared memory (``streamdata.batch.collate``); only a handle crosses.

Prints seconds per batch (wall) and CPU seconds per batch (main process + workers), and writes
``benchmarks/results/large_arrays.json``.  About three minutes with the defaults.

    python benchmarks/large_arrays.py [--workers 0 1 2] [--batches 25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamdata.batch.collate import shared_memory_space  # noqa: E402
from streamdata.feed.loader import loader  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "large_arrays.json"


class SeedArrays(IterableDataset):
    """The report's MyIterableDataset: ``n`` samples, each after a simulated fetch."""

    def __init__(self, n: int, shape: tuple[int, int], fetch_s: float) -> None:
        self.n, self.shape, self.fetch_s = n, shape, fetch_s

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.fetch_s)
            yield np.random.random(self.shape)


def records(batch: list) -> list:
    """The report's collate_fn: the list of NumPy arrays, as is."""
    return batch


def make_loader(mode: str, workers: int, args: argparse.Namespace):
    dataset = SeedArrays(args.samples, tuple(args.shape), args.fetch_s)
    extra = {}
    if workers:
        extra = dict(prefetch_factor=4, persistent_workers=True, multiprocessing_context="spawn")
    if mode == "plain":
        return DataLoader(dataset, batch_size=args.batch_size, num_workers=workers,
                          collate_fn=records, **extra)
    return loader(dataset, batch_size=args.batch_size, num_workers=workers, pin_memory=False,
                  **extra)


def workers_cpu_s() -> float:
    """CPU seconds used so far by this process's children (the DataLoader workers)."""
    try:
        import psutil
    except ImportError:  # the `bench` extra is not installed
        return float("nan")
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def measure(mode: str, workers: int, args: argparse.Namespace) -> dict:
    feed = make_loader(mode, workers, args)
    batches = iter(feed)
    for _ in range(args.warmup):
        next(batches)
        time.sleep(args.step_s)
    wall, cpu, worker_cpu = time.perf_counter(), time.process_time(), workers_cpu_s()
    for _ in range(args.batches):
        batch = next(batches)
        time.sleep(args.step_s)  # the simulated train step
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    worker_cpu = workers_cpu_s() - worker_cpu
    kind = type(batch).__name__
    if isinstance(batch, list):
        kind = f"list of {len(batch)} {type(batch[0]).__name__}"
    del batch, batches
    if hasattr(feed, "close"):
        feed.close()
    return {"mode": mode, "workers": workers, "s_per_batch": wall / args.batches,
            "main_cpu_s_per_batch": cpu / args.batches,
            "worker_cpu_s_per_batch": worker_cpu / args.batches, "batch_type": kind}


def cpu_cell(row: dict) -> str:
    return f"{row['main_cpu_s_per_batch']:.3f} + {row['worker_cpu_s_per_batch']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=25, help="measured batches per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small arrays, few batches: a smoke test")
    args = parser.parse_args()
    args.shape, args.batch_size, args.samples = [1000, 150], 128, 10_000
    args.fetch_s, args.step_s = 0.003125, 0.05
    if args.quick:
        args.shape, args.batches, args.warmup = [100, 150], 4, 1
    batch_mb = args.batch_size * np.prod(args.shape) * 8 / 1e6
    print(f"batch: {args.batch_size} x {args.shape[0]}x{args.shape[1]} float64 = {batch_mb:.1f} MB; "
          f"fetch {args.fetch_s * 1e3:.3f} ms/sample, step {args.step_s * 1e3:.0f} ms; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load_before:.1f} before the run: other work will skew the timings")
    rows = []
    for workers in args.workers:
        for mode in ("plain", "streamdata"):
            rows.append(measure(mode, workers, args))
            print(f"  {mode:10s} workers={workers}: {rows[-1]['s_per_batch']:.3f} s/batch "
                  f"({rows[-1]['batch_type']})", flush=True)
    print()
    print("| workers | plain s/batch | streamdata s/batch | speed-up | CPU s/batch, main + workers:"
          " plain | streamdata |")
    print("|---:|---:|---:|---:|---:|---:|")
    for workers in args.workers:
        plain, sd = (next(r for r in rows if r["mode"] == m and r["workers"] == workers)
                     for m in ("plain", "streamdata"))
        print(f"| {workers} | {plain['s_per_batch']:.3f} | {sd['s_per_batch']:.3f} | "
              f"{plain['s_per_batch'] / sd['s_per_batch']:.2f}x | {cpu_cell(plain)} | {cpu_cell(sd)} |")
    space = shared_memory_space()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "large_arrays", "quick": args.quick, "batch_mb": batch_mb,
        "batches": args.batches, "warmup": args.warmup, "cpus": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(),
        "dev_shm_bytes": space[1] if space else None,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]}, "rows": rows,
    }, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
