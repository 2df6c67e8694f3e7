"""The sequence shuffle's cost: ``sd.TokenDataset`` over one flat ``.bin`` read in order
(``shuffle=False``) against ``shuffle="sequences"`` (blocks of ``--block-mb`` in a seeded order
across the file, windows of ``--window-blocks`` blocks permuted in each reader).

Writes one ``--mb`` MB ``.bin`` of uint16 tokens to the embedded S3 server, puts a
:class:`~benchmarks.proxy.LatencyProxy` in front of it and measures, per one-way delay, one whole
epoch of each (dataset construction included) through ``sd.loader`` with ``--workers`` workers:
tokens/s, and from ``loader.metrics()`` the GETs (``requests``) and bytes fetched per token.
Rounds are interleaved (sequential, shuffled, sequential, ...) and the tokens/s ratio is taken
per round, so a noisy machine moves both alike.

    python -m benchmarks.token_shuffle            # 64 MB, 0 and 100 ms, 3 rounds
    python -m benchmarks.token_shuffle --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import upstream, write_report  # noqa: E402
from benchmarks.proxy import LatencyProxy  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
METHODS = ("sequential", "sequences")


def _measure(method: str, url: str, options: dict, args: argparse.Namespace) -> dict[str, float]:
    """One epoch: tokens/s (construction included), requests and bytes fetched."""
    import streamdata as sd

    start = time.perf_counter()
    shuffle: Any = "sequences" if method == "sequences" else False
    extra = ({"block_bytes": int(args.block_mb * 2**20), "window_blocks": args.window_blocks}
             if shuffle else {})
    ds = sd.TokenDataset(url, seq_len=args.seq_len, targets=True, batch_size=args.batch, dtype="uint16",
                         shuffle=shuffle, storage_options=options, **extra)
    tokens = 0
    # (not persistent: no next epoch queued, NEXT-EPOCH-EARLY, in the epoch's requests and bytes)
    with sd.loader(ds, num_workers=args.workers, persistent_workers=False) as loader:
        for batch in loader:
            tokens += batch["input_ids"].numel()
        m = loader.metrics()
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "tokens_per_s": tokens / seconds, "requests": m["requests"],
            "bytes": m["bytes"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from streamdata.testing import S3Server

    rows: list[dict[str, Any]] = []
    with S3Server() as server:
        server.create_bucket("bench-shuffle")
        tokens = int(args.mb * 2**20) // 2
        body = np.random.default_rng(0).integers(0, 50257, tokens, dtype=np.uint16).tobytes()
        server.boto3_client().put_object(Bucket="bench-shuffle", Key="train.bin", Body=body)
        url = "s3://bench-shuffle/train.bin"
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=0.0) as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
            for delay_ms in args.delays:
                proxy.set_delay(delay_ms / 1000)
                got: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
                for _ in range(args.rounds):  # interleaved rounds
                    for method in METHODS:
                        got[method].append(_measure(method, url, options, args))
                row: dict[str, Any] = {"delay_ms": delay_ms}
                for method in METHODS:
                    runs = got[method]
                    row[method] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                                   "tokens": runs[0]["tokens"],
                                   "requests": statistics.median(r["requests"] for r in runs),
                                   "bytes_per_token": statistics.median(r["bytes"] / r["tokens"]
                                                                        for r in runs),
                                   "requests_per_mtoken": statistics.median(r["requests"] / r["tokens"] * 1e6
                                                                            for r in runs)}
                ratios = [b["tokens_per_s"] / a["tokens_per_s"]
                          for a, b in zip(got["sequential"], got["sequences"], strict=True)]
                row["speed_ratio_median"], row["speed_ratios"] = statistics.median(ratios), ratios
                row["requests_ratio"] = row["sequences"]["requests"] / max(row["sequential"]["requests"], 1)
                rows.append(row)
                a, b = row["sequential"], row["sequences"]
                print(f"  {delay_ms:>5.0f} ms  sequential {a['tokens_per_s']:>12,.0f} tok/s "
                      f"{a['requests']:>5.0f} GETs "
                      f"{a['bytes_per_token']:.3f} B/tok | sequences {b['tokens_per_s']:>12,.0f} tok/s "
                      f"{b['requests']:>5.0f} GETs {b['bytes_per_token']:.3f} B/tok | speed ratio "
                      f"{row['speed_ratio_median']:.2f} ({', '.join(f'{r:.2f}' for r in ratios)}), "
                      f"GETs x{row['requests_ratio']:.2f}", flush=True)
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[0, 100])
    p.add_argument("--mb", type=float, default=64, help="the .bin's size")
    p.add_argument("--block-mb", type=float, default=4, help="block_bytes, in MiB")
    p.add_argument("--window-blocks", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="4 MB, 1 round")
    p.add_argument("--out", type=Path, default=RESULTS / "token_shuffle.json")
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.block_mb, args.rounds, args.seq_len = 4, 0.25, 1, 256
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
