"""The block shuffle's window starts, as a training loop sees them: data wait with a fixed step.

Local tar shards with a sample index (``sd.ShardWriter``), or with ``--format parquet`` Parquet
files of 64-row row groups (the same arrays, a fixed-size list column), read with
``shuffle=True`` (the block shuffle) through ``sd.loader`` (2 workers, batch 32) by a loop whose
step sleeps ``--step-ms``:
the loop's total wait for data, its longest single wait, and ``loader.metrics()``'s stall
fraction and verdict. With ``--base NAME=PATH`` the same pass runs on the ``streamdata`` of the
tree at PATH (``git archive <commit> streamdata | tar -x -C PATH``), in the same rounds, order
alternating; ratios this tree over that one per round.

    python -m benchmarks.block_windows [--step-ms 5] [--rounds 5] [--format parquet] [--base before=PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_in_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
import streamdata as sd
root, step, fmt = sys.argv[1], float(sys.argv[2]) / 1000, sys.argv[3]
if fmt == "parquet":
    ds = sd.ParquetDataset(f"{root}/p-*.parquet", shuffle=True, seed=0)
else:
    ds = sd.TarDataset(f"{root}/s-*.tar", shuffle=True, seed=0)
waits = []
with sd.loader(ds, batch_size=32, num_workers=2) as feed:
    it = iter(feed)
    next(it)
    while True:
        time.sleep(step)
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t)
    m = feed.metrics()
print(json.dumps({"wait": sum(waits), "longest": max(waits), "steps": len(waits) + 1, "sd": sd.__file__,
                  "stall_fraction": m["stall_fraction"], "verdict": m["verdict"]}))
"""


def _write(root: str, batches: int, fmt: str) -> None:
    import numpy as np

    import streamdata as sd

    if fmt == "parquet":
        import pyarrow as pa

        per, ids = 3 * 64 * 64, np.arange(batches * 32)
        x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat((ids % 251).astype(np.float32), per)), per)
        sd.write_parquet(pa.table({"id": ids, "x": x}), root + "/p-{shard:04d}.parquet", rows_per_shard=256,
                         row_group_size=64, compression="snappy", log_every_s=1e9)
        return
    with sd.ShardWriter(f"{root}/s-%04d.tar", maxcount=256, progress=False) as sink:
        for i in range(batches * 32):
            sink.write({"__key__": f"{i:08d}", "x.npy": np.full((3, 64, 64), i % 251, np.float32)})


def _run(tree: Path, root: str, step_ms: float, fmt: str) -> dict:
    return run_in_tree(CHILD, [root, str(step_ms), fmt], tree, timeout=600)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--format", choices=("tar", "parquet"), default="tar")
    ap.add_argument("--base", default=None, metavar="NAME=PATH")
    args = ap.parse_args(argv)
    trees = {"this": ROOT}
    if args.base:
        name, _, path = args.base.partition("=")
        trees[name] = Path(path)
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as root:
        _write(root, args.batches, args.format)
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                got = _run(trees[name], root, args.step_ms, args.format)
                rows[name].append(got)
                print(f"round {r} {name:>8}: waited {got['wait']:.3f} s over {got['steps']} steps, longest "
                      f"{got['longest'] * 1000:.1f} ms, stall_fraction {got['stall_fraction']:.3f}, "
                      f"verdict: {got['verdict']}", flush=True)
    for name, got in rows.items():
        print(f"{name}: median wait {statistics.median(g['wait'] for g in got):.3f} s, median longest "
              f"{statistics.median(g['longest'] for g in got) * 1000:.1f} ms, median stall_fraction "
              f"{statistics.median(g['stall_fraction'] for g in got):.3f}")
    if len(trees) == 2:
        other = list(trees)[1]
        for key in ("wait", "longest"):
            ratios = [a[key] / b[key] for a, b in zip(rows["this"], rows[other], strict=True)]
            print(f"this / {other}, {key}: median {statistics.median(ratios):.2f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
