"""loader.metrics() on a CUDA device: the GPU feed's pinning and copy times beside the stall
fraction, for a loop with a known step time (docs/metrics.md).

    python benchmarks/gpu_metrics.py [--step-ms 5] [--batches 200]

Writes local tar shards of float arrays, reads them through ``sd.loader(..., device="cuda")``
with 2 workers and a training step that sleeps ``--step-ms`` after a small matmul on the
device, and prints the metrics dict as JSON, with an outside stopwatch's data wait beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout
import streamdata as sd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    root = tempfile.mkdtemp()
    with sd.ShardWriter(f"{root}/s-%04d.tar", maxcount=256, progress=False) as sink:
        for i in range(args.batches * 32):
            sink.write({"__key__": f"{i:08d}", "x.npy": np.full((3, 64, 64), i % 251, np.float32)})
    ds = sd.TarDataset(f"{root}/s-*.tar", shuffle=True, seed=0)
    w = torch.randn(64, 64, device="cuda")
    waited, steps = 0.0, 0
    with sd.loader(ds, batch_size=32, num_workers=2, device="cuda") as feed:
        it = iter(feed)
        first = time.perf_counter()
        batch = next(it)
        first = time.perf_counter() - first
        while True:
            (batch["x.npy"].flatten(0, 1) @ w).sum().item()
            time.sleep(args.step_ms / 1000)
            steps += 1
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waited += time.perf_counter() - t
        report = feed.metrics()
    print(json.dumps({"device": torch.cuda.get_device_name(), "stopwatch_data_wait_s": round(waited, 4),
                      "stopwatch_first_batch_s": round(first, 4), "stopwatch_steps": steps,
                      "metrics": report}, indent=1, default=str))
    print(f"gpu_metrics: data_wait_s {report['data_wait_s']:.3f} (stopwatch {waited:.3f}), stall_fraction "
          f"{report['stall_fraction']:.3f}, feed.pin_s {report['feed.pin_s']:.3f}, feed.copy_s "
          f"{report['feed.copy_s']:.3f}, verdict: {report['verdict']}")


if __name__ == "__main__":
    main()
