"""Compressed shards and the shard writer, side by side, interleaved rounds, as ratios.

    python -m benchmarks.compressed decode    # gzip / zstd vs plain tar, one reader (0 ms)
    python -m benchmarks.compressed upload    # sd.ShardWriter vs serial fsspec puts at 25 ms

``decode``: (1) the raw inflate rate of the libraries we could use (zlib, ISA-L, zstandard) on
the same tar bytes; (2) one reader (``num_workers=0``: one DataLoader worker's work) reading
the same samples from local ``.tar``, ``.tar.gz`` and ``.tar.zst`` shards through
``sd.TarDataset(decode=False)``: samples/s and tar MB/s, and the ratio to the plain tar.

``upload``: the same shards (built once, in memory) written to moto's S3 through a
``LatencyProxy`` (``--delay`` one way) by ``sd.ShardWriter`` (background uploads,
``--concurrency``; straight to the final name, and ``publish="copy"``: a temporary key copied
into place) and by a plain loop of ``fs.pipe_file`` (one PUT after the other): MB/s each and
the ratios. The writer's time includes building the tar shards (encoding every sample).
"""

from __future__ import annotations

import argparse
import gzip
import io
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from benchmarks.common import tar_bytes, upstream


def _samples(n: int, size: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        # compressible like real features: small integers in float32, plus JSON
        arr = rng.integers(0, 64, size // 4).astype(np.float32)
        out.append({"__key__": f"s{i:06d}", "npy": arr, "cls": i % 10, "json": {"i": i, "tag": "x" * 40}})
    return out


def _shards(args: argparse.Namespace) -> tuple[list[dict], int, list[bytes], int]:
    """The samples, samples per shard, the tar shards (bytes) and their total size."""
    samples = _samples(args.samples, args.sample_kb * 1024)
    per = args.samples // args.shards
    tars = [tar_bytes(samples[i * per:(i + 1) * per]) for i in range(args.shards)]
    return samples, per, tars, sum(len(t) for t in tars)


def _rate(fn, nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e6


def decode(args: argparse.Namespace) -> None:
    import isal.isal_zlib as isal_zlib
    import zstandard

    import streamdata as sd

    _, per, tars, total = _shards(args)
    packed = {"tar": tars, "tar.gz": [gzip.compress(t, 6) for t in tars],
              "tar.zst": [zstandard.ZstdCompressor(level=3).compress(t) for t in tars]}
    print(f"{args.samples} samples of {args.sample_kb} KiB in {args.shards} shards: "
          f"tar {total / 1e6:.1f} MB, "
          f"gzip -6 {sum(map(len, packed['tar.gz'])) / 1e6:.1f} MB, "
          f"zstd -3 {sum(map(len, packed['tar.zst'])) / 1e6:.1f} MB")

    def inflate(lib):
        def run():
            for data in packed["tar.gz"]:
                d = lib.decompressobj(wbits=31)
                while data:
                    d.decompress(data, 1 << 20)
                    data = d.unconsumed_tail
        return run

    def unzstd():
        for data in packed["tar.zst"]:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
            while reader.read(1 << 20):
                pass

    libs = {"gzip: zlib": inflate(zlib), "gzip: isal": inflate(isal_zlib), "zstd: zstandard": unzstd}
    rates: dict[str, list[float]] = {k: [] for k in libs}
    for _ in range(args.rounds):
        for name, fn in libs.items():
            rates[name].append(_rate(fn, total))
    print("\nraw decompression, tar MB/s out (median of rounds, interleaved):")
    for name, values in rates.items():
        print(f"  {name:16s} {statistics.median(values):8.0f}")
    gain = statistics.median(rates["gzip: isal"]) / statistics.median(rates["gzip: zlib"])
    print(f"  isal / zlib: {gain:.2f}x")

    with tempfile.TemporaryDirectory() as tmp:
        for kind, blobs in packed.items():
            for i, blob in enumerate(blobs):
                Path(tmp, f"{kind.replace('.', '_')}-{i:03d}.{kind}").write_bytes(blob)
        read: dict[str, list[float]] = {k: [] for k in packed}
        for _ in range(args.rounds):
            for kind in packed:
                ds = sd.TarDataset(f"{tmp}/{kind.replace('.', '_')}-*.{kind}", decode=False)
                start = time.perf_counter()
                n = sum(1 for _ in ds)
                read[kind].append(n / (time.perf_counter() - start))
                assert n == per * args.shards, (kind, n)
    plain = statistics.median(read["tar"])
    print("\none reader (a DataLoader worker's work), local files, decode=False, median of rounds:")
    for kind, values in read.items():
        med = statistics.median(values)
        print(f"  .{kind:8s} {med:9.0f} samples/s  {med * total / (per * args.shards) / 1e6:7.0f} tar MB/s"
              f"  {med / plain:5.2f}x plain   rounds: {', '.join(f'{v:.0f}' for v in values)}")


def upload(args: argparse.Namespace) -> None:
    import fsspec

    import streamdata as sd
    from benchmarks.proxy import LatencyProxy
    from streamdata.testing import S3Server

    samples, per, tars, total = _shards(args)
    server = S3Server().start()
    try:
        with LatencyProxy(*upstream(server.endpoint_url), delay_s=args.delay / 1000) as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
            times: dict[str, list[float]] = {"ShardWriter": [], "ShardWriter copy": [], "serial put": []}
            for r in range(args.rounds):
                for name in times:
                    bucket = f"bench-{name.replace(' ', '-').lower()}-{r}"
                    server.create_bucket(bucket)
                    start = time.perf_counter()
                    if name.startswith("ShardWriter"):
                        with sd.ShardWriter(f"s3://{bucket}/w-%04d.tar", maxcount=per,
                                            storage_options=options, concurrency=args.concurrency,
                                            index=False, progress=False,
                                            publish="copy" if "copy" in name else None) as w:
                            for s in samples[:per * args.shards]:
                                w.write(s)
                    else:
                        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
                        for i, data in enumerate(tars):
                            fs.pipe_file(f"{bucket}/p-{i:04d}.tar", data)
                    times[name].append(time.perf_counter() - start)
                    server.delete_bucket(bucket)
    finally:
        server.stop()
    print(f"{args.shards} shards of {total / args.shards / 1e6:.1f} MB ({total / 1e6:.0f} MB) to moto S3 at "
          f"{args.delay:.0f} ms one-way delay, {args.rounds} rounds interleaved:")
    rates = {k: [total / t / 1e6 for t in v] for k, v in times.items()}
    for name, values in rates.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"  {name:12s} {statistics.median(values):6.1f} MB/s   rounds: {each}")
    for name in ("ShardWriter", "ShardWriter copy"):
        ratio = statistics.median(rates[name]) / statistics.median(rates["serial put"])
        print(f"  {name} / serial put: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["decode", "upload"])
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--sample-kb", type=int, default=64)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay", type=float, default=25.0, help="one-way delay, ms (upload)")
    p.add_argument("--concurrency", type=int, default=4, help="ShardWriter uploads at once")
    args = p.parse_args(argv)
    if args.samples is None:
        args.samples = 512 if args.what == "decode" else 256
    decode(args) if args.what == "decode" else upload(args)


if __name__ == "__main__":
    main()
