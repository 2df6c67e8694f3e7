"""Time to plan one reader's exact epoch (``streamdata.epoch.plan.reader_span``): pure, no I/O.

    python -m benchmarks.plan                              # 1M shards x 4096 ranks x 8 workers
    python -m benchmarks.plan --shards 100000 --ranks 64 --workers 4

Every reader plans only its own span, in O(shards + readers): the shards' counts in the epoch's
seeded order, their running sum, a binary search for the span's ends. Prints the seconds per
reader (median and max over a few readers spread across the job) with shuffle on and off,
with and without drop_last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from streamdata.epoch.plan import reader_span
from streamdata.epoch.world import World


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--readers", type=int, default=5, help="readers timed, spread over the job")
    args = parser.parse_args(argv)
    counts = np.random.default_rng(0).integers(1, 2000, args.shards)
    slots = args.ranks * args.workers
    picks = np.linspace(0, slots - 1, args.readers).astype(int)
    print(f"{args.shards:,} shards ({int(counts.sum()):,} samples), {args.ranks} ranks x "
          f"{args.workers} workers; seconds to plan one reader's epoch:")
    for shuffle in (True, False):
        for drop_last in (False, True):
            times = []
            for slot in picks:
                world = World(int(slot) // args.workers, args.ranks, int(slot) % args.workers, args.workers)
                start = time.perf_counter()
                span = reader_span(counts, world, seed=0, epoch=3, shuffle=shuffle, batch_size=32,
                                   drop_last=drop_last)
                times.append(time.perf_counter() - start)
                assert span.samples > 0
            print(f"  shuffle={shuffle!s:5} drop_last={drop_last!s:5}  "
                  f"median {statistics.median(times):.3f} s  max {max(times):.3f} s")


if __name__ == "__main__":
    main()
