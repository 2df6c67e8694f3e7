"""What the readers' stage timings cost: CPU time per sample with them on and off.

Each run is a fresh interpreter reading every sample of local tar shards through ``sd.loader``
(decoded, batched), with ``STREAMDATA_STAGE_TIMES`` set to 1 (on) or 0 (off); its CPU time is
the pass's, in the child and its workers (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` around the
loop; imports left out). Rounds are paired and interleaved (on/off order alternates); the ratio
on/off is taken per round.

    python -m benchmarks.metrics_overhead --rounds 7           # the quick profile
    python -m benchmarks.metrics_overhead --samples 4000 --shards 16 --workers 2 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import resource, sys, time
import streamdata as sd
def cpu():
    mine, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return mine.ru_utime + mine.ru_stime + kids.ru_utime + kids.ru_stime
ds = sd.TarDataset(sys.argv[1], index=None)
n, start = 0, cpu()
with sd.loader(ds, batch_size=32, num_workers=int(sys.argv[2])) as loader:
    for batch in loader:
        n += len(batch["__key__"])
print(n, cpu() - start)  # the workers' CPU too: joined by close()
"""


def _shards(folder: Path, shards: int, samples: int, floats: int) -> str:
    import numpy as np

    from tests.helpers import tar_bytes

    n = 0
    for i in range(shards):
        batch = []
        for _ in range(samples // shards):
            batch.append({"__key__": f"s{n:08d}", "npy": np.full(floats, n, dtype=np.float32), "cls": n})
            n += 1
        (folder / f"shard-{i:04d}.tar").write_bytes(tar_bytes(batch))
    return f"file://{folder}/shard-{{0000..{shards - 1:04d}}}.tar"


def _one(spec: str, workers: int, on: bool) -> tuple[float, int]:
    """CPU seconds of one run's pass (its process and its workers, imports left out) and its
    samples."""
    env = dict(os.environ, STREAMDATA_STAGE_TIMES="1" if on else "0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RUN, spec, str(workers)], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    n, cpu = done.stdout.split()
    return float(cpu), int(n)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--floats", type=int, default=64, help="float32s in each sample's array")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "metrics_overhead.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = _shards(Path(tmp), args.shards, args.samples, args.floats)
        _one(spec, args.workers, True)  # warm the page cache and the imports
        rows = []
        for r in range(args.rounds):
            got: dict[bool, tuple[float, int]] = {}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                got[on] = _one(spec, args.workers, on)
            (cpu_on, n), (cpu_off, n_off) = got[True], got[False]
            assert n == n_off
            rows.append({"on_us": cpu_on / n * 1e6, "off_us": cpu_off / n * 1e6, "ratio": cpu_on / cpu_off})
            print(f"round {r}: on {rows[-1]['on_us']:.1f} us/sample, off {rows[-1]['off_us']:.1f}, "
                  f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    ratios = [row["ratio"] for row in rows]
    summary = {"samples": args.samples, "workers": args.workers, "rounds": args.rounds,
               "on_us_median": statistics.median(row["on_us"] for row in rows),
               "off_us_median": statistics.median(row["off_us"] for row in rows),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "when": time.strftime("%Y-%m-%d")}
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
