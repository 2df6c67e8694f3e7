"""Epoch 2's first batch with persistent workers: NEXT-EPOCH-EARLY on and off.

With ``sd.loader``'s persistent workers, a worker whose pass has asked for its last shard starts
the next epoch's requests at once (``streamdata/dataset.py``, NEXT-EPOCH-EARLY), so the next
``iter(loader)`` finds its first shards on the way. This runs the embedded S3 server behind the
latency proxy, ``--epochs`` epochs per loader, the two settings alternating for ``--rounds``
rounds, and prints the medians over epochs 2.. of the time from ``iter()`` to the first batch
and of the epoch's wall time, and their ratios.

    python -m benchmarks.next_epoch [--delay-ms 100] [--epochs 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import proxied_shards  # noqa: E402


def run(spec: str, options: dict, early: bool, epochs: int) -> list[tuple[float, float]]:
    """``(first batch s, epoch s)`` for epochs 2.. of one persistent loader."""
    import streamdata as sd

    ds = sd.TarDataset(spec, storage_options=options, batch_size=32, index=None)
    rows = []
    with sd.loader(ds, num_workers=2, pin_memory=False) as loader:
        ds.early_next_epoch = early  # read by the workers when they start (the first iter)
        for epoch in range(epochs):
            start = time.perf_counter()
            first = None
            for _ in loader:
                if first is None:
                    first = time.perf_counter() - start
            if epoch:
                rows.append((first, time.perf_counter() - start))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay of the latency proxy")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--sample-kib", type=int, default=96)
    args = parser.parse_args(argv)

    rows: dict[str, list[tuple[float, float]]] = {"early": [], "late": []}
    with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib) as bench:
        for k in range(args.rounds):
            for name in rows:
                got = run(bench.spec, bench.options, name == "early", args.epochs)
                rows[name] += got
                print(f"  round {k + 1}/{args.rounds} {name}: first batch "
                      f"{', '.join(f'{f:.3f}' for f, _ in got)} s", flush=True)
    med = {name: (statistics.median(f for f, _ in r), statistics.median(w for _, w in r))
           for name, r in rows.items()}
    print(f"\n{args.delay_ms:g} ms one-way, {args.samples} samples in {args.shards} shards, 2 persistent "
          f"workers, medians over epochs 2..{args.epochs} of {args.rounds} rounds:")
    for name, (first, wall) in med.items():
        print(f"  {name:5s}: first batch {first:.3f} s, epoch {wall:.3f} s")
    print(f"  early / late: first batch {med['early'][0] / med['late'][0]:.2f}, "
          f"epoch {med['early'][1] / med['late'][1]:.2f}")


if __name__ == "__main__":
    main()
