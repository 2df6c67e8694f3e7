"""The GPU feed: host-to-device bandwidth, and a training loop with and without CudaPrefetcher.

1. H2D GB/s of one large copy from pageable and from pinned host memory (CUDA events).
2. A training loop whose compute time equals its load time.  Each batch costs
   ``host_s`` of host-side waiting (a loader's ``__next__``) plus its H2D copy: that is the
   load time; the GPU then computes for as long (a calibrated ``torch.cuda._sleep``) and the
   step ends with a sync, as ``loss.item()`` does.  Without a prefetcher the step takes
   load + compute; with ``CudaPrefetcher`` the target is max(compute, load), within 10%.
3. The real path: tar shards of 3x224x224 uint8 ``.npy`` samples (+ ``.cls``) served over
   loopback HTTP by streamdata's test server (in a child process, so it takes no CPU from
   this one), read by ``sd.TarDataset(batch_size=...)`` through ``sd.loader(num_workers=4)``
   into a small conv net whose step is sized to the loader's own rate.  ``device="cuda"``
   (the prefetcher) against the same loader with a blocking ``.to("cuda")`` in the loop,
   interleaved round by round: samples/s, and the GPU's idle share, 1 - (sum of each step's
   compute, timed with CUDA events) / wall time.

GPU time is measured with CUDA events throughout, wall time with ``perf_counter`` around
loops that sync every step.  Writes ``benchmarks/results/gpu_feed.json`` (after each part).
Without a CUDA device it says so and exits 0.

    python benchmarks/gpu_feed.py [--mb 256] [--host-ms 10] [--steps 60] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import streamdata as sd  # noqa: E402
from streamdata.feed.cuda import CudaPrefetcher  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu_feed.json"


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def h2d_gbps(nbytes: int, pinned: bool, reps: int = 10) -> float:
    """Host-to-device copy bandwidth in GB/s, from pageable or pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=pinned)  # warm up
    start, end = timing_event(), timing_event()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        device.copy_(host, non_blocking=pinned)
    end.record()
    torch.cuda.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def cycles_per_second() -> float:
    """Calibrate ``torch.cuda._sleep`` (a GPU busy-wait measured in clock cycles)."""
    start, end = timing_event(), timing_event()
    torch.cuda._sleep(200_000_000)  # warm up: an idle GPU's clock is low until it has been busy a while
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


def train(feed, steps: int, warmup: int, compute_cycles: int, copy: bool) -> tuple[float, float]:
    """Seconds per step of: (copy,) compute on the batch, sync; and the GPU's idle share."""
    batches = iter(feed)
    spans = []
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x = next(batches)
        if copy:
            x = x.to("cuda")  # the usual blocking copy
        begin, end = timing_event(), timing_event()
        begin.record()
        torch.cuda._sleep(compute_cycles)
        x[:1].sum()  # uses the batch
        end.record()
        end.synchronize()  # syncs, like loss.item()
        if step >= warmup:
            spans.append((begin, end))
    wall = time.perf_counter() - start
    close = getattr(feed, "close", None)
    if close:
        close()
    return wall / steps, 1 - sum(b.elapsed_time(e) for b, e in spans) / 1e3 / wall


# --- 3. the real path: tar shards over loopback HTTP -> TarDataset -> sd.loader -> a conv net ------

def write_shards(root: str, samples: int, shards: int) -> str:
    """``samples`` 3x224x224 uint8 ``.npy`` samples with a ``.cls`` label, in ``shards`` tars."""
    with sd.ShardWriter(f"{root}/train-%06d.tar", maxcount=-(-samples // shards), progress=False) as sink:
        for i in range(samples):
            image = np.full((3, 224, 224), i % 251, dtype=np.uint8)
            sink.write({"__key__": f"{i:06d}", "npy": image, "cls": i % 10})
    return f"/train-{{000000..{len(sink.urls) - 1:06d}}}.tar"


def _serve(root: str, conn, stop) -> None:
    """The child process: serve ``root`` until ``stop`` is set."""
    from streamdata.testing.http import HTTPServer

    server = HTTPServer(root).start()
    conn.send(server.endpoint_url)
    stop.wait()
    server.stop()


class ConvNet(torch.nn.Module):
    """A few convolutions; ``step`` runs ``reps`` forward/backward/SGD passes on one batch."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10),
        ).to(device)
        self.opt = torch.optim.SGD(self.parameters(), lr=1e-3)

    def step(self, images: torch.Tensor, labels: torch.Tensor, reps: int) -> torch.Tensor:
        x = images.float().div_(255)
        for _ in range(reps):
            loss = F.cross_entropy(self.net(x), labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return loss


def ms_per_rep(model: ConvNet, batch: int, device: str) -> float:
    images = torch.randint(0, 255, (batch, 3, 224, 224), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    model.step(images, labels, 3)  # warm up (cuDNN picks its kernels)
    begin, end = timing_event(), timing_event()
    begin.record()
    model.step(images, labels, 10)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 10


VARIANTS = {"prefetch": "sd.loader(device='cuda')",
            "thread": "CudaPrefetcher(sd.loader(...), thread=True)",
            "blocking": "sd.loader + blocking .to()"}


def feed_run(ds, device: str, variant: str, epochs: int, model: ConvNet | None = None,
             reps: int = 0) -> dict:
    """One loader over ``epochs`` epochs, the first a warm-up (workers start, first requests).
    ``prefetch``: ``sd.loader(device=...)`` (the DataLoader pins in its thread, the prefetcher
    copies in this one); ``thread``: the prefetcher with a pin-ahead thread of its own between
    the DataLoader and this loop; ``blocking``: a blocking ``.to(device)`` in the loop.  Every
    step syncs (as ``loss.item()`` does); its compute is timed with CUDA events."""
    spans, samples = [], 0
    prefetch = variant != "blocking"
    with sd.loader(ds, num_workers=4, **({"device": device} if variant == "prefetch" else {})) as loader:
        feed = CudaPrefetcher(loader, device=device, thread=True) if variant == "thread" else loader
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            if epoch == 1:
                began = time.perf_counter()
            for batch in feed:
                images, labels = batch["npy"], batch["cls"]
                if not prefetch:
                    images = images.to(device, non_blocking=False)
                    labels = labels.to(device, non_blocking=False)
                begin, end = timing_event(), timing_event()
                begin.record()
                if model is not None:
                    model.step(images, labels, reps)
                else:
                    images[:1, :1, :1, :1].sum()  # the batch only
                end.record()
                end.synchronize()
                if epoch >= 1:
                    spans.append((begin, end))
                    samples += len(labels)
        wall = time.perf_counter() - began
    busy = sum(b.elapsed_time(e) for b, e in spans) / 1e3
    return {"variant": VARIANTS[variant],
            "samples_per_s": samples / wall, "ms_per_step": wall / len(spans) * 1e3,
            "gpu_busy_ms_per_step": busy / len(spans) * 1e3, "gpu_idle": 1 - busy / wall,
            "samples": samples}


def real_path(args: argparse.Namespace, device: str = "cuda") -> dict:
    """Part 3; returns its results (the tables are printed as they come)."""
    context = multiprocessing.get_context("spawn")  # the child does not inherit CUDA
    with tempfile.TemporaryDirectory(prefix="gpu_feed-") as root:
        began = time.perf_counter()
        spec = write_shards(root, args.samples, args.shards)
        wrote = time.perf_counter() - began
        parent, child = context.Pipe()
        stop = context.Event()
        server = context.Process(target=_serve, args=(root, child, stop), daemon=True)
        server.start()
        child.close()  # the child's end lives in the child only: recv() raises if it dies
        try:
            if not parent.poll(120):
                raise RuntimeError("the HTTP server process did not start within 120 s")
            ds = sd.TarDataset(parent.recv() + spec, batch_size=args.batch)
            load = feed_run(ds, device, "prefetch", args.epochs)
            model = ConvNet(device)
            rep_ms = ms_per_rep(model, args.batch, device)
            load_ms = load["ms_per_step"]
            reps = max(1, round(load_ms / rep_ms))
            print(f"\nreal path: {args.samples} samples of 3x224x224 uint8 in {args.shards} shards "
                  f"(written in {wrote:.1f} s), batch {args.batch}, 4 workers, HTTP on loopback; "
                  f"the loader alone: {load_ms:.1f} ms/batch ({load['samples_per_s']:.0f} samples/s); "
                  f"one conv-net pass {rep_ms:.2f} ms, {reps} per step")
            rows = []
            for round_ in range(args.rounds):  # interleaved: A B, A B, ...
                for variant in VARIANTS:
                    row = feed_run(ds, device, variant, args.epochs, model, reps)
                    rows.append({"round": round_, **row})
        finally:
            stop.set()
            server.join(10)
            if server.is_alive():
                server.terminate()
    print("| variant | round | samples/s | ms/step | GPU busy ms/step | GPU idle |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['variant']} | {row['round']} | {row['samples_per_s']:.0f} | "
              f"{row['ms_per_step']:.1f} | {row['gpu_busy_ms_per_step']:.1f} | {row['gpu_idle']:.1%} |")
    def per_round(variant: str) -> list[float]:  # variant / blocking, samples/s, round by round
        mine = {r["round"]: r["samples_per_s"] for r in rows if r["variant"] == VARIANTS[variant]}
        base = {r["round"]: r["samples_per_s"] for r in rows if r["variant"] == VARIANTS["blocking"]}
        return [mine[k] / base[k] for k in sorted(mine)]

    ratios, thread_ratios = per_round("prefetch"), per_round("thread")
    idle = {v: statistics.median(r["gpu_idle"] for r in rows if r["variant"] == v)
            for v in dict.fromkeys(r["variant"] for r in rows)}
    print(f"prefetcher / blocking samples/s, round by round: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f}); with a pin-ahead thread / blocking: "
          f"{', '.join(f'{r:.2f}' for r in thread_ratios)} (median {statistics.median(thread_ratios):.2f}); "
          "median GPU idle: " + ", ".join(f"{v} {x:.1%}" for v, x in idle.items()))
    return {"samples": args.samples, "shards": args.shards, "batch": args.batch, "workers": 4,
            "sample_bytes": 3 * 224 * 224, "epochs_per_run": args.epochs, "measured_epochs": args.epochs - 1,
            "loader_alone": load, "ms_per_conv_pass": rep_ms, "passes_per_step": reps, "rows": rows,
            "samples_per_s_ratio": ratios, "samples_per_s_ratio_median": statistics.median(ratios),
            "thread_samples_per_s_ratio": thread_ratios,
            "gpu_idle_median": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="batch size in MB")
    parser.add_argument("--host-ms", type=float, default=10.0, help="host-side wait per batch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="real path: samples written")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="real path: samples per batch")
    parser.add_argument("--epochs", type=int, default=4, help="real path: epochs per run, 1st warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="real path: rounds of both variants")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test (~20 s)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.steps, args.samples, args.epochs, args.rounds = 64, 20, 512, 2, 1
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
    loops = [("blocking .to()", Source(nbytes, host_s, count), True)]
    loops += [(f"CudaPrefetcher depth={depth}",
               CudaPrefetcher(Source(nbytes, host_s, count), device="cuda", depth=depth), False)
              for depth in (1, 2)]
    rows = []
    for loop, feed, copy in loops:
        s_per_step, idle = train(feed, args.steps, args.warmup, compute_cycles, copy=copy)
        rows.append({"loop": loop, "s_per_step": s_per_step, "gpu_idle": idle})
    print(f"\nload {load_s * 1e3:.1f} ms (host {host_s * 1e3:.1f} + H2D {(load_s - host_s) * 1e3:.1f}), "
          f"compute {load_s * 1e3:.1f} ms; ideal step max(compute, load) = {load_s * 1e3:.1f} ms")
    print("| loop | ms/step | vs max(compute, load) | GPU idle |")
    print("|---|---:|---:|---:|")
    for row in rows:
        row["vs_ideal"] = row["s_per_step"] / load_s
        print(f"| {row['loop']} | {row['s_per_step'] * 1e3:.1f} | {row['vs_ideal']:.2f}x | "
              f"{row['gpu_idle']:.1%} |")
    results = {
        "benchmark": "gpu_feed", "device": name, "torch": torch.__version__, "batch_mb": args.mb,
        "h2d_gbps": {"pageable": pageable, "pinned": pinned}, "load_s": load_s, "compute_s": load_s,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    try:
        results["real_path"] = real_path(args)
    except Exception:  # the first parts' numbers stay written; the error goes with them
        traceback.print_exc()
        results["real_path"] = {"error": traceback.format_exc()}
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    if "error" in results["real_path"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
