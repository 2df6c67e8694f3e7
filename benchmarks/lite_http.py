"""LITE-HTTP A/B: LITE-S3's ranged GETs on streamdata's own HTTP/1.1 client (``store.http1``) or on aiohttp.

One embedded S3 server; per round, two fresh interpreters (order alternating round by round),
one per client (``STREAMDATA_LITE_HTTP=1`` / ``0``), each reading every shard in ``part``-byte
ranged GETs through ``AsyncClient`` (its throttle keeps ``max_requests`` in flight), the
bodies as chunks (as the prefetcher asks), no parsing. Reported per round: the child's import
of what the GET path needs (the client's first request included), MB/s and process CPU
(user + system, every thread) per MB, and the ratios h1 / aiohttp.

    python -m benchmarks.lite_http --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import asyncio, json, resource, sys, time
import torch  # a training job has it: asyncio, ssl and http.client come with it
from streamdata.store.client import AsyncClient
from streamdata.config import FetchConfig
opts, urls, size, part = json.loads(sys.argv[1])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
client = AsyncClient("s3", opts, FetchConfig(max_requests=32))
t0, c0 = time.monotonic(), cpu()
client.io.run(client.get(urls[0], 0, 1), 60)  # opens the path: imports, pool, first connection
t1, c1 = time.monotonic(), cpu()
async def all_parts():
    tasks = [asyncio.ensure_future(client.get(u, a, min(a + part, size), chunks=True))
             for u in urls for a in range(0, size, part)]
    n = 0
    for done in asyncio.as_completed(tasks):
        n += sum(map(len, await done))
    return n
n = client.io.run(all_parts(), 600)
t2, c2 = time.monotonic(), cpu()
client.close()
print(json.dumps({"open_s": t1 - t0, "open_cpu_s": c1 - c0, "bytes": n, "s": t2 - t1, "cpu_s": c2 - c1,
                  "aiohttp": "aiohttp" in sys.modules}))
"""


def _child(flag: str, args: list) -> dict:
    env = dict(os.environ, STREAMDATA_LITE_HTTP=flag)
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], cwd=str(ROOT), env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--shard-mib", type=int, default=8)
    p.add_argument("--part-mib", type=int, default=8)
    a = p.parse_args(argv)
    from streamdata.testing import S3Server

    size = a.shard_mib << 20
    with S3Server() as server:
        s3 = server.boto3_client()
        s3.create_bucket(Bucket="litehttp")
        blob = os.urandom(size)
        for i in range(a.shards):
            s3.put_object(Bucket="litehttp", Key=f"s-{i}.bin", Body=blob)
        urls = [f"s3://litehttp/s-{i}.bin" for i in range(a.shards)]
        args = [server.storage_options, urls, size, a.part_mib << 20]
        rows = []
        for k in range(a.rounds):
            order = ("1", "0") if k % 2 == 0 else ("0", "1")
            got = {flag: _child(flag, args) for flag in order}
            rows.append(got)
            h, o = got["1"], got["0"]
            assert not h["aiohttp"] and o["aiohttp"], got
            print(f"[{k + 1}/{a.rounds}] h1: open {h['open_s']:.3f} s, "
                  f"{h['bytes'] / h['s'] / 1e6:,.0f} MB/s, "
                  f"{h['cpu_s'] / h['bytes'] * 1e9:.2f} CPU ms/MB | aiohttp: open {o['open_s']:.3f} s, "
                  f"{o['bytes'] / o['s'] / 1e6:,.0f} MB/s, {o['cpu_s'] / o['bytes'] * 1e9:.2f} CPU ms/MB",
                  flush=True)

    def ratio(f) -> str:
        values = [f(r["1"]) / f(r["0"]) for r in rows]
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print("\n| h1 / aiohttp, per round: median (min-max) | value |\n|---|---:|")
    print(f"| opening the path (first GET, imports in it), wall | {ratio(lambda r: r['open_s'])} |")
    print(f"| opening the path, CPU | {ratio(lambda r: r['open_cpu_s'])} |")
    print(f"| MB/s | {ratio(lambda r: r['bytes'] / r['s'])} |")
    print(f"| CPU per MB | {ratio(lambda r: r['cpu_s'] / r['bytes'])} |")


if __name__ == "__main__":
    main()
