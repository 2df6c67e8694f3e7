"""One epoch's time with the block shuffle vs the shuffle buffer, through the latency proxy.

An indexed ``sd.TarDataset`` on the embedded S3 server, read through the latency proxy
(``--delay-ms`` one way) by a DataLoader (2 workers, batch 32, no decoding): ``shuffle="block"``
(default window: half the byte budget of samples, 16 pieces each: ranged GETs in a seeded order)
and ``shuffle="buffer"`` (the span read in order, a buffer of 512). The two alternate for
``--rounds`` rounds; medians and their ratio printed.

    python -m benchmarks.shuffle_throughput [--delay-ms 25] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import proxied_shards  # noqa: E402


def epoch_seconds(spec: str, options: dict, mode: str, epoch: int) -> tuple[float, int]:
    import streamdata as sd

    ds = sd.TarDataset(spec, storage_options=options, batch_size=32, decode=False, shuffle=mode, seed=1)
    ds.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    start = time.perf_counter()
    n = sum(len(b["__key__"]) for b in loader)
    return time.perf_counter() - start, n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay of the latency proxy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--sample-kib", type=int, default=32)
    args = parser.parse_args(argv)

    rows: dict[str, list[float]] = {"block": [], "buffer": []}
    with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib, index=True) as bench:
        proxy = bench.proxy
        for k in range(args.rounds):
            for mode in rows:
                proxy.reset_counters()
                took, n = epoch_seconds(bench.spec, bench.options, mode, k)
                assert n == args.samples
                rows[mode].append(took)
                print(f"  round {k + 1}/{args.rounds} {mode}: {took:.2f} s, "
                      f"{proxy.bytes_down / 2**20:.1f} MiB, {proxy.connections} connections", flush=True)
    med = {mode: statistics.median(r) for mode, r in rows.items()}
    print(f"\n{args.delay_ms:g} ms one-way, {args.samples} samples of {args.sample_kib} KiB in {args.shards} "
          f"indexed shards, 2 workers, batch 32; medians of {args.rounds}:")
    for mode, took in med.items():
        print(f"  {mode:6s}: {took:.2f} s per epoch, {args.samples / took:.0f} samples/s")
    print(f"  block / buffer time: {med['block'] / med['buffer']:.2f}")


if __name__ == "__main__":
    main()
