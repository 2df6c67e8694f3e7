"""Audio and video: tar shards of H.264 videos -> one 16-frame clip each, ``uint8 [B, 16, 3, 112, 112]``.

The embedded S3 server holds tar shards of videos made by ``tests/media/synth.py`` (10 s at
25 fps, 128x128, a keyframe every second, random pixels below the frame number so that the
files have a realistic size per second), behind a :class:`~benchmarks.proxy.LatencyProxy`; each
method reads all of them once, 2 workers, batch 4, in interleaved rounds, at each one-way delay:

- ``clip``: ``sd.TarDataset(decode=sd.video.RandomClip(16, stride=2, size=112))``: the clip
  chosen from the header, one seek to the keyframe before it, decoded to its end;
- ``whole``: ``decode=False`` and a ``map`` that decodes every frame of the file with PyAV (RGB),
  then takes the same 16 frames and scales them the same way.

``clips/s`` counts the whole run; ``CPU ms/clip`` is the CPU time of the process and its workers
over the clips. Then ``--object-seconds`` of video stored as one object, a 2-second clip of
it (``sd.ObjectDataset(decode=sd.video.RandomClip(25, stride=2))``), at each delay, in
interleaved rounds:

- ``ahead``: ``ranged=True``, a sequential run's requests sent together (``read_ahead``, 2 MiB);
- ``serial``: ``ranged=True, read_ahead=0``, one request at a time;
- ``whole``: the object fetched whole.

The time of ``ds[0]`` (the dataset made and its object listed before), requests, bytes read
against the object's size; ratios ahead / serial and ahead / whole per round.

    python -m benchmarks.media                # 3 rounds, 0 and 100 ms (~5 min on 2 cores)
    python -m benchmarks.media --objects-only # the standalone object's part only
    python -m benchmarks.media --quick        # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streamdata as sd
from benchmarks.common import replace_in_options, upstream
from benchmarks.proxy import LatencyProxy
from streamdata.testing import S3Server
from tests.helpers import tar_bytes
from tests.media.synth import video_bytes

CLIP = {"frames": 16, "stride": 2, "size": 112}


class WholeThenClip:
    """The baseline ``map``: every frame of the file decoded (PyAV, RGB), then ``RandomClip``'s
    frames (the same choice) taken and scaled as it scales them."""

    def __init__(self) -> None:
        self.clip = sd.video.RandomClip(**CLIP)

    def __call__(self, sample: dict) -> dict:
        import io

        import av
        import numpy as np
        import torch

        from streamdata.formats.images import sample_key
        from streamdata.formats.video import _out_size, probe

        data = sample["mp4"]
        info = probe(io.BytesIO(data))
        (numbers,) = self.clip.clips(info, self.clip.rng(sample_key(sample)))
        with av.open(io.BytesIO(data)) as container:
            container.streams.video[0].codec_context.thread_count = 1  # as RandomClip's default
            frames = [f.to_ndarray(format="rgb24", threads=1) for f in container.decode(video=0)]
        oh, ow, crop = _out_size(info.width, info.height, self.clip.size)  # type: ignore[arg-type]
        picked = []
        for k in numbers:
            hwc = av.VideoFrame.from_ndarray(frames[min(k, len(frames) - 1)], format="rgb24").reformat(
                width=ow, height=oh, interpolation="AREA", threads=1).to_ndarray()
            if crop is not None:
                y, x = (oh - crop[0]) // 2, (ow - crop[1]) // 2
                hwc = hwc[y:y + crop[0], x:x + crop[1]]
            picked.append(hwc.transpose(2, 0, 1))
        out = dict(sample)
        out["mp4"] = {"frames": torch.from_numpy(np.ascontiguousarray(np.stack(picked))),
                      "pts": torch.tensor([k / info.fps for k in numbers], dtype=torch.float64)}
        return out


def _run(method: str, spec: str, options: dict, workers: int) -> dict:
    kw: dict[str, Any] = {"decode": sd.video.RandomClip(**CLIP)} if method == "clip" else {
        "decode": False, "map": WholeThenClip()}
    cpu0, start = os.times(), time.perf_counter()
    ds = sd.TarDataset(spec, storage_options=options, batch_size=4, seed=1, **kw)
    n = 0
    with sd.loader(ds, num_workers=workers) as loader:
        for batch in loader:
            assert tuple(batch["mp4"]["frames"].shape[1:]) == (CLIP["frames"], 3, CLIP["size"], CLIP["size"])
            n += len(batch["__key__"])
    elapsed = time.perf_counter() - start
    cpu1 = os.times()
    cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system
           - cpu0.user - cpu0.system - cpu0.children_user - cpu0.children_system)
    return {"clips": n, "clips_per_s": n / elapsed, "cpu_ms_per_clip": 1e3 * cpu / max(n, 1)}


OBJECT_MODES = ("ahead", "serial", "whole")


def _object(url: str, options: dict, mode: str) -> dict:
    kw: dict[str, Any] = {"ranged": mode != "whole"}
    if mode == "serial":
        kw["read_ahead"] = 0
    ds = sd.ObjectDataset(url, storage_options=options, decode=sd.video.RandomClip(25, stride=2, seed=5),
                          **kw)
    try:
        start = time.perf_counter()  # the clip: its client's first connection, requests, decoding
        out = ds[0]
        stats = ds.reader_stats()
    finally:
        ds.close()
    assert out["mp4"]["frames"].shape[0] == 25
    return {"s": time.perf_counter() - start, "bytes": sum(r["bytes"] for r in stats),
            "requests": sum(r["requests"] for r in stats), "pts": out["mp4"]["pts"][[0, -1]].tolist()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 round, fewer and shorter videos")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delays", default="0,100", help="one-way delays in ms, comma-separated")
    p.add_argument("--videos", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0, help="each video's length in the shards")
    p.add_argument("--object-seconds", type=float, default=120.0, help="the standalone video's length")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--objects-only", action="store_true", help="only the standalone object's part")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.videos, args.seconds, args.object_seconds = 1, 8, 4.0, 20.0
    if args.objects_only:
        args.videos = 0
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    methods = [] if args.objects_only else ["clip", "whole"]
    fps = 25
    made = time.perf_counter()
    frames = int(args.seconds * fps)
    videos = [video_bytes(frames, fps=fps, gop=fps, size=128, noise=1) for _ in range(args.videos)]
    big = video_bytes(int(args.object_seconds * fps), fps=fps, gop=fps, size=256, noise=1)
    per_shard = 4
    mean_mb = statistics.fmean(map(len, videos)) / 1e6 if videos else 0.0
    print(f"{args.videos} videos of {args.seconds:g} s ({mean_mb:.2f} MB each), a {args.object_seconds:g} s "
          f"object of {len(big) / 1e6:.1f} MB; made in {time.perf_counter() - made:.0f} s", flush=True)
    results: dict[tuple[str, float], list[dict]] = {}
    objects: dict[tuple[str, float], list[dict]] = {}
    with S3Server() as server:
        server.create_bucket("bench")
        client = server.boto3_client()
        for s in range(0, args.videos, per_shard):
            group = range(s, min(s + per_shard, args.videos))
            body = tar_bytes([{"__key__": f"v{i:04d}", "mp4": videos[i]} for i in group])
            client.put_object(Bucket="bench", Key=f"tar/train-{s // per_shard:04d}.tar", Body=body)
        client.put_object(Bucket="bench", Key="big/movie.mp4", Body=big)
        n_shards = -(-args.videos // per_shard)
        spec = f"s3://bench/tar/train-{{0000..{n_shards - 1:04d}}}.tar"
        for delay in delays:
            with LatencyProxy(*upstream(server.endpoint_url), delay_s=delay / 1000) as proxy:
                options = replace_in_options(server.storage_options, server.endpoint_url,
                                             proxy.url_for(server.endpoint_url))
                for r in range(args.rounds):
                    order = methods if r % 2 == 0 else methods[::-1]  # interleaved, alternating first
                    for method in order:
                        row = _run(method, spec, options, args.workers)
                        results.setdefault((method, delay), []).append(row)
                    turn = OBJECT_MODES[r % 3:] + OBJECT_MODES[:r % 3]  # interleaved, each first in turn
                    for mode in turn:
                        objects.setdefault((mode, delay), []).append(
                            _object("s3://bench/big/movie.mp4", options, mode))

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    if methods:
        print(f"\nTar shards, {args.workers} workers, batch 4, {args.rounds} rounds "
              "(medians; ratios clip / whole)")
        print(f"{'delay ms':>8} {'method':6} {'clips/s':>8} {'CPU ms/clip':>12}")
    for delay in delays if methods else []:
        for method in methods:
            rows = results[(method, delay)]
            rate, cpu = med(rows, "clips_per_s"), med(rows, "cpu_ms_per_clip")
            print(f"{delay:8g} {method:6} {rate:8.1f} {cpu:12.1f}")
        c, w = results[("clip", delay)], results[("whole", delay)]
        rate = [a["clips_per_s"] / b["clips_per_s"] for a, b in zip(c, w, strict=True)]
        cpu = [a["cpu_ms_per_clip"] / b["cpu_ms_per_clip"] for a, b in zip(c, w, strict=True)]
        print(f"{delay:8g} clip / whole: clips/s x{statistics.median(rate):.2f}, CPU per clip "
              f"x{statistics.median(cpu):.2f} (rounds: {', '.join(f'{x:.2f}' for x in rate)})")
    print(f"\nA 2-second clip (25 frames, stride 2) of one {args.object_seconds:g} s object "
          f"({len(big) / 1e6:.1f} MB), sd.ObjectDataset, {args.rounds} rounds (medians)")
    print(f"{'delay ms':>8} {'mode':6} {'s':>6} {'requests':>8} {'MB':>6} {'of object':>9}")
    for delay in delays:
        for mode in OBJECT_MODES:
            rows = objects[(mode, delay)]
            print(f"{delay:8g} {mode:6} {med(rows, 's'):6.2f} {med(rows, 'requests'):8.0f} "
                  f"{med(rows, 'bytes') / 1e6:6.2f} {med(rows, 'bytes') / len(big):9.1%}")
        ahead, serial, whole = (objects[(m, delay)] for m in OBJECT_MODES)
        for name, other in (("serial", serial), ("whole", whole)):
            ratio = [a["s"] / b["s"] for a, b in zip(ahead, other, strict=True)]
            print(f"{delay:8g} ahead / {name}: time x{statistics.median(ratio):.2f} "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in ratio)})")


if __name__ == "__main__":
    main()
