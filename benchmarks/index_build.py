"""Index build rate: ``build_index`` against a plain read of the same bytes, at a one-way delay.

Starts the embedded S3 server, writes tar shards, puts a :class:`~benchmarks.proxy.LatencyProxy`
(25 ms one-way by default) in front of it and, in interleaved rounds (the order alternates),
times:

- ``index``: ``streamdata.build_index(spec, output=<a fresh key>)``: listing, the (missing)
  index's GET, every shard read through the prefetcher and parsed for offsets, the index
  written (a PUT, a copy, a DELETE);
- ``read``: ``expand_spec(spec)`` and the same shards read through a ``Prefetcher`` with the
  same options, bytes dropped: the wire rate the index build can hope for.

Both report MB/s of shard bytes; ``index / read`` is their ratio per round. Each round also
times ``build_index`` once more on the index just written (every entry fresh: no shard is
read): the fixed cost of a build (listing, the index's GET, writing it), which a small
dataset's rate pays in full.

    python -m benchmarks.index_build                  # 32 shards of 8 MiB, 3 rounds, 25 ms
    python -m benchmarks.index_build --quick          # 8 shards of 1 MiB, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MiB, replace_in_options, shard_pattern, upload_shards, upstream  # noqa: E402


def _index(spec: str, options: dict, output: str) -> float:
    import streamdata as sd

    start = time.perf_counter()
    sd.build_index(spec, options, output, progress=False)
    return time.perf_counter() - start


def _read(spec: str, options: dict) -> tuple[float, int]:
    import streamdata as sd

    start = time.perf_counter()
    shards = sd.expand_spec(spec, options)
    n = 0
    with sd.Prefetcher(shards, options) as fetcher:
        for reader in fetcher:
            for chunk in reader.chunks():
                n += len(chunk)
    return time.perf_counter() - start, n


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    import streamdata as sd
    from benchmarks.proxy import LatencyProxy
    from streamdata.catalog.index import read_index
    from streamdata.testing import S3Server

    with S3Server() as server:
        bucket = "bench"
        server.create_bucket(bucket)
        samples = args.shards * args.shard_mib * MiB // args.sample_bytes
        t = time.perf_counter()
        upload_shards(server.boto3_client(), bucket, "tar/train", samples, args.shards, args.sample_bytes)
        spec = shard_pattern(bucket, "tar/train", args.shards)
        total = sum(s.size or 0 for s in sd.expand_spec(spec, server.storage_options))
        print(f"{args.shards} shards, {total / MiB:.1f} MiB, {samples} samples of {args.sample_bytes} B, "
              f"written in {time.perf_counter() - t:.1f} s; one-way delay {args.delay_ms:g} ms", flush=True)
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=args.delay_ms / 1000) as proxy:
            options = replace_in_options(server.storage_options, server.endpoint_url,
                                         proxy.url_for(server.endpoint_url))
            sd.expand_spec(spec, options)  # botocore's models load once per process: not in round 1
            rates: dict[str, list[float]] = {"index": [], "read": []}
            fixed: list[float] = []
            for r in range(args.rounds):
                order = ["index", "read"] if r % 2 == 0 else ["read", "index"]
                for method in order:
                    if method == "index":
                        seconds = _index(spec, options, f"s3://{bucket}/idx/round-{r}.sdx")
                        fixed.append(_index(spec, options, f"s3://{bucket}/idx/round-{r}.sdx"))
                    else:
                        seconds, n = _read(spec, options)
                        assert n == total, (n, total)
                    rates[method].append(total / MiB / seconds)
                index, read = rates["index"][-1], rates["read"][-1]
                print(f"round {r + 1}: index {index:7.1f} MB/s   read {read:7.1f} MB/s   "
                      f"index / read {index / read:.2f}   fixed cost (rebuild, nothing to read) "
                      f"{fixed[-1]:.2f} s", flush=True)
            entries = read_index(f"s3://{bucket}/idx/round-0.sdx", server.storage_options)
            assert sum(e.samples for e in entries) == samples, "the index must count every sample"
    ratios = [i / r for i, r in zip(rates["index"], rates["read"], strict=True)]
    print(f"median of {args.rounds} rounds: index {statistics.median(rates['index']):.1f} MB/s, read "
          f"{statistics.median(rates['read']):.1f} MB/s, index / read {statistics.median(ratios):.2f}, "
          f"fixed cost {statistics.median(fixed):.2f} s")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--shard-mib", type=int, default=8)
    p.add_argument("--sample-bytes", type=int, default=64 * 1024)
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--quick", action="store_true", help="8 shards of 1 MiB, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.shards, args.shard_mib = 8, 1
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
