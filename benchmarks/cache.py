"""The local disk cache (``cache_dir=``): epochs 1 and 2 with it against without it, far from the store.

Starts the embedded S3 server, writes ``--samples`` samples of ``--sample-kib`` KiB in
``--shards`` tar shards, puts a LatencyProxy (``--delay-ms`` one-way, 100 by default) in front
of it, and reads two epochs through ``sd.loader(TarDataset(...), num_workers=2)`` per setting:
``stream`` (no cache) and ``cache`` (a fresh, empty cache directory each round). The settings
alternate for ``--rounds`` rounds. Prints per epoch the median seconds and the bytes that came
through the proxy, and the ratios: epoch 2 without / with the cache (the gain) and epoch 1
with / without (the cost of writing the cache while streaming: 1.0 means none).

    python -m benchmarks.cache [--rounds 3] [--delay-ms 100] [--samples 1024] [--shards 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import proxied_shards  # noqa: E402

SETTINGS = ("stream", "cache")


def _cpu(workers: list) -> float:
    return sum(t.user + t.system for t in (w.cpu_times() for w in workers))


def two_epochs(spec: str, options: dict, proxy, cache_dir: str | None) -> list[dict]:
    """Seconds, the workers' CPU seconds (user + system; epoch 1 includes their start), samples
    and bytes through the proxy for epochs 1 and 2 of one loader (persistent workers)."""
    import psutil

    import streamdata as sd

    me = psutil.Process()
    others = {p.pid for p in me.children()}
    ds = sd.TarDataset(spec, storage_options=options, batch_size=32, cache_dir=cache_dir)
    rows, workers, cpu = [], [], 0.0
    with sd.loader(ds, num_workers=2, pin_memory=False) as feed:
        for epoch in range(2):
            proxy.reset_counters()
            start = time.perf_counter()
            n = sum(len(batch["__key__"]) for batch in feed)
            wall = time.perf_counter() - start
            workers = workers or [p for p in me.children() if p.pid not in others]
            used = _cpu(workers)
            rows.append({"epoch": epoch + 1, "s": wall, "cpu": used - cpu, "samples": n,
                         "bytes": proxy.bytes_down})
            cpu = used
    rows[-1]["counts"] = {k: v for k, v in ds.counts.items() if k.startswith("cache.")}
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay of the latency proxy")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--sample-kib", type=int, default=96)
    parser.add_argument("--cache-root", default=None,
                        help="where the cache directories go (default: a temp dir)")
    args = parser.parse_args(argv)

    root = tempfile.mkdtemp(prefix="sd-cache-bench-", dir=args.cache_root)
    runs: dict[str, list[list[dict]]] = {name: [] for name in SETTINGS}
    try:
        with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib) as bench:
            for k in range(args.rounds):
                order = SETTINGS if k % 2 == 0 else SETTINGS[::-1]
                for name in order:
                    cache_dir = os.path.join(root, f"round{k}") if name == "cache" else None
                    rows = two_epochs(bench.spec, bench.options, bench.proxy, cache_dir)
                    runs[name].append(rows)
                    print(f"  round {k + 1}/{args.rounds} {name:6s}: epoch 1 {rows[0]['s']:.2f} s "
                          f"(CPU {rows[0]['cpu']:.2f} s, {rows[0]['bytes'] / 2**20:.0f} MiB), epoch 2 "
                          f"{rows[1]['s']:.2f} s (CPU {rows[1]['cpu']:.2f} s, "
                          f"{rows[1]['bytes'] / 2**20:.1f} MiB) {rows[1]['counts']}", flush=True)
                    assert rows[0]["samples"] == rows[1]["samples"] == args.samples
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(name: str, epoch: int, key: str = "s") -> float:
        return statistics.median(rows[epoch - 1][key] for rows in runs[name])

    def per_round(epoch: int, a: str, b: str, key: str = "s") -> str:
        return ", ".join(f"{ra[epoch - 1][key] / rb[epoch - 1][key]:.2f}"
                         for ra, rb in zip(runs[a], runs[b], strict=True))

    mib = args.samples * args.sample_kib / 1024
    lines = [f"{datetime.date.today()} · {os.cpu_count()} cores · `python -m benchmarks.cache "
             f"{' '.join(sys.argv[1:])}`".rstrip(), "",
             f"{args.samples} samples of {args.sample_kib} KiB ({mib:.0f} MiB) in {args.shards} shards, "
             f"{args.delay_ms:g} ms one-way, 2 workers; medians of {args.rounds} rounds:", "",
             "| setting | epoch 1 s | workers' CPU s | MiB over the wire | epoch 2 s | workers' CPU s "
             "| MiB over the wire |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in SETTINGS:
        lines.append(f"| {name} | {med(name, 1):.2f} | {med(name, 1, 'cpu'):.2f} | "
                     f"{med(name, 1, 'bytes') / 2**20:.1f} | {med(name, 2):.2f} | "
                     f"{med(name, 2, 'cpu'):.2f} | {med(name, 2, 'bytes') / 2**20:.1f} |")
    lines += ["", f"epoch 2, stream / cache: {med('stream', 2) / med('cache', 2):.2f} "
                  f"(per round: {per_round(2, 'stream', 'cache')})",
              f"epoch 1, cache / stream: {med('cache', 1) / med('stream', 1):.2f} "
              f"(per round: {per_round(1, 'cache', 'stream')}; 1.0 = writing the cache costs nothing)",
              f"epoch 1 workers' CPU, cache / stream: {med('cache', 1, 'cpu') / med('stream', 1, 'cpu'):.2f} "
              f"(per round: {per_round(1, 'cache', 'stream', 'cpu')})"]
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
