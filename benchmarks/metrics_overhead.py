"""What the readers' stage timings cost: CPU time per sample with them on and off.

Each run is a fresh interpreter reading every sample of local tar shards through ``sd.loader``
(decoded, batched), with ``STREAMDATA_STAGE_TIMES`` set to 1 (on) or 0 (off); its CPU time is
the pass's, in the child and its workers (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` around the
loop; imports left out). Rounds are paired and interleaved (on/off order alternates); the ratio
on/off is taken per round.

A whole run's CPU varies by more than the timings could cost (imports, page cache, the
scheduler), so ``--pairs N`` measures it closer: one interpreter, no workers, the same dataset
read in ``N`` pairs of passes, on and off alternating (the setting is read at each pass's
start), each pass's CPU its own (``time.process_time``), the ratio per pair; and, apart from the
timed passes, how many more clock reads a sample makes with the timings on (one pass each way
with ``time.perf_counter_ns`` counted) times what one read and its sum cost (``timeit``): the
clock's share of a sample, as arithmetic, beside the paired ratio.

    python -m benchmarks.metrics_overhead --rounds 7           # the quick profile
    python -m benchmarks.metrics_overhead --samples 4000 --shards 16 --workers 2 --rounds 9
    python -m benchmarks.metrics_overhead --pairs 30           # in one interpreter, closer
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

PAIRS = """
import json, os, statistics, sys, time, timeit
import streamdata as sd
ds = sd.TarDataset(sys.argv[1], index=None)
def one(on):
    os.environ["STREAMDATA_STAGE_TIMES"] = "1" if on else "0"
    n, start = 0, time.process_time()
    with sd.loader(ds, batch_size=32, num_workers=0) as loader:
        for batch in loader:
            n += len(batch["__key__"])
    return time.process_time() - start, n
one(True), one(False)  # warm: imports, page cache, the allocator
rows = []
for i in range(int(sys.argv[2])):
    got = {on: one(on) for on in ((True, False) if i % 2 == 0 else (False, True))}
    rows.append({"on_s": got[True][0], "off_s": got[False][0], "samples": got[True][1]})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
real, reads = time.perf_counter_ns, [0]
def counted():
    reads[0] += 1
    return real()
time.perf_counter_ns = counted
per_sample = {}
for on in (True, False):
    reads[0] = 0
    n = one(on)[1]
    per_sample[on] = reads[0] / n
time.perf_counter_ns = real
number = 2_000_000
setup = "clock = time.perf_counter_ns; acc = [0]; start = clock()"
read_ns = min(timeit.repeat("acc[0] += clock() - start", setup, globals={"time": time}, number=number,
                            repeat=5)) / number * 1e9
from streamdata.datasets.passes import EpochIterator
from streamdata.metrics import StageClock
from streamdata.policy import ErrorPolicy
class Table:
    def add_many(self, row):
        pass
def per_item(make):  # ns per item of a trivial record through one wrapper, the best of 5
    best = []
    for _ in range(5):
        items = make(iter(range(200_000)))
        start = time.process_time()
        for _ in items:
            pass
        best.append((time.process_time() - start) / 200_000 * 1e9)
    return min(best)
each = {on: per_item(lambda it: ErrorPolicy(clock=StageClock(Table()) if on else None).each(
    it, int, pull=StageClock.PARSE, run=StageClock.DECODE)) for on in (True, False)}
samples = {on: per_item(lambda it: EpochIterator(it, lambda: None, clock=StageClock(Table()) if on else None,
                                                 batched=False)) for on in (True, False)}
print(json.dumps({"rows": rows, "reads_on": per_sample[True], "reads_off": per_sample[False],
                  "read_ns": read_ns, "each_ns": each, "samples_ns": samples}))
"""


def _pairs(spec: str, pairs: int, out: str) -> None:
    """The in-process measure (``--pairs``): paired passes in one interpreter, and the clock's
    reads per sample times their cost."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PAIRS, spec, str(pairs)], env=env, stdout=subprocess.PIPE,
                          text=True, timeout=3600, check=True)
    got = json.loads(done.stdout.splitlines()[-1])
    rows = got["rows"]
    ratios = [row["on_s"] / row["off_s"] for row in rows]
    off_us = statistics.median(row["off_s"] / row["samples"] for row in rows) * 1e6
    extra = got["reads_on"] - got["reads_off"]
    summary = {"pairs": pairs, "samples": rows[0]["samples"],
               "on_us_median": statistics.median(row["on_s"] / row["samples"] for row in rows) * 1e6,
               "off_us_median": off_us, "ratio_median": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios),
               "pairs_on_dearer": sum(r > 1 for r in ratios),
               "clock_reads_per_sample_on": got["reads_on"], "clock_reads_per_sample_off": got["reads_off"],
               "ns_per_read_and_sum": got["read_ns"],
               "clock_share_of_a_sample": extra * got["read_ns"] / 1e3 / off_us,
               # the wrappers' own cost per item (a trivial record, on less off): the records'
               # (``policy.each``) and, where a reader puts out samples, its iterator's
               "each_ns_on_off": [got["each_ns"]["true"], got["each_ns"]["false"]],
               "samples_ns_on_off": [got["samples_ns"]["true"], got["samples_ns"]["false"]],
               "wrappers_share_of_a_sample": (got["each_ns"]["true"] - got["each_ns"]["false"]
                                              + got["samples_ns"]["true"] - got["samples_ns"]["false"])
               / 1e3 / off_us,
               "when": time.strftime("%Y-%m-%d")}
    print(json.dumps(summary, indent=1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"summary": summary, "pairs": rows}, indent=1))


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
    ap.add_argument("--pairs", type=int, default=0,
                    help="in one interpreter instead: this many pairs of passes, and the clock's reads")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "metrics_overhead.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = _shards(Path(tmp), args.shards, args.samples, args.floats)
        if args.pairs:
            return _pairs(spec, args.pairs, args.out)
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
