"""The GPU feed: host-to-device bandwidth, and a training loop with and without CudaPrefetcher.

1. H2D GB/s of one large copy from pageable and from pinned host memory (CUDA events).
2. A training loop whose compute time equals its load time.  Each batch costs
   ``host_s`` of host-side waiting (a loader's ``__next__``) plus its H2D copy: that is the
   load time; the GPU then computes for as long (a calibrated ``torch.cuda._sleep``) and the
   step ends with a sync, as ``loss.item()`` does.  Without a prefetcher the step takes
   load + compute; with ``CudaPrefetcher`` the target is max(compute, load), within 10%.

Writes ``benchmarks/results/gpu_feed.json``.  Without a CUDA device it says so and exits 0.

    python benchmarks/gpu_feed.py [--mb 256] [--host-ms 10] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamdata.cuda import CudaPrefetcher  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu_feed.json"


def h2d_gbps(nbytes: int, pinned: bool, reps: int = 10) -> float:
    """Host-to-device copy bandwidth in GB/s, from pageable or pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=pinned)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        device.copy_(host, non_blocking=pinned)
    end.record()
    torch.cuda.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def cycles_per_second() -> float:
    """Calibrate ``torch.cuda._sleep`` (a GPU busy-wait measured in clock cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    torch.cuda.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


class Source:
    """Pinned batches from a ring of buffers, each after ``host_s`` of host-side waiting."""

    def __init__(self, nbytes: int, host_s: float, count: int, ring: int = 8) -> None:
        self.buffers = [torch.ones(nbytes // 4, dtype=torch.float32, pin_memory=True) for _ in range(ring)]
        self.host_s, self.count = host_s, count

    def __iter__(self):
        for i in range(self.count):
            time.sleep(self.host_s)
            yield self.buffers[i % len(self.buffers)]


def train(feed, steps: int, warmup: int, compute_cycles: int, copy: bool) -> float:
    """Seconds per step of: (copy,) compute on the batch, sync."""
    batches = iter(feed)
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x = next(batches)
        if copy:
            x = x.to("cuda")  # the usual blocking copy
        torch.cuda._sleep(compute_cycles)
        x[:1].sum().item()  # uses the batch and syncs, like loss.item()
    seconds = (time.perf_counter() - start) / steps
    close = getattr(feed, "close", None)
    if close:
        close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="batch size in MB")
    parser.add_argument("--host-ms", type=float, default=10.0, help="host-side wait per batch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: skipping the GPU feed benchmark")
        return
    nbytes = args.mb * 1_000_000
    name = torch.cuda.get_device_name()
    pageable, pinned = h2d_gbps(nbytes, False), h2d_gbps(nbytes, True)
    print(f"{name}; torch {torch.__version__}")
    print(f"H2D {args.mb} MB: pageable {pageable:.1f} GB/s, pinned {pinned:.1f} GB/s")

    host_s = args.host_ms / 1e3
    load_s = host_s + nbytes / (pinned * 1e9)
    compute_cycles = int(load_s * cycles_per_second())
    count = args.steps + args.warmup + 4
    rows = [{"loop": "blocking .to()", "s_per_step": train(Source(nbytes, host_s, count), args.steps,
                                                           args.warmup, compute_cycles, copy=True)}]
    for depth in (1, 2):
        feed = CudaPrefetcher(Source(nbytes, host_s, count), device="cuda", depth=depth)
        rows.append({"loop": f"CudaPrefetcher depth={depth}",
                     "s_per_step": train(feed, args.steps, args.warmup, compute_cycles, copy=False)})
    print(f"\nload {load_s * 1e3:.1f} ms (host {host_s * 1e3:.1f} + H2D {(load_s - host_s) * 1e3:.1f}), "
          f"compute {load_s * 1e3:.1f} ms; ideal step max(compute, load) = {load_s * 1e3:.1f} ms")
    print("| loop | ms/step | vs max(compute, load) |")
    print("|---|---:|---:|")
    for row in rows:
        row["vs_ideal"] = row["s_per_step"] / load_s
        print(f"| {row['loop']} | {row['s_per_step'] * 1e3:.1f} | {row['vs_ideal']:.2f}x |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "gpu_feed", "device": name, "torch": torch.__version__, "batch_mb": args.mb,
        "h2d_gbps": {"pageable": pageable, "pinned": pinned}, "load_s": load_s, "compute_s": load_s,
        "rows": rows,
    }, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
