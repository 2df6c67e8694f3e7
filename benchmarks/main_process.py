"""The main process's cost per batch: what the training process spends to receive a batch.

Local tar shards with a sample index (``sd.ShardWriter``), small samples (a ``[3, 16, 16]``
float32 array and a label), read through ``sd.loader(ds, batch_size=64, num_workers=2)`` and,
for reference, through a plain ``DataLoader(ds_batched, batch_size=None, num_workers=2,
pin_memory=True)`` over the same dataset batching itself. The loop's step does nothing, so the
main process is as busy as it can be: the figures are its CPU time per batch (``getrusage``:
every thread of the main process, workers not counted) and the batches per second the loop
took. With ``--base NAME=PATH`` the ``sd.loader`` pass also runs on the ``streamdata`` of the tree at
PATH (``git archive <commit> streamdata | tar -x -C PATH``), in the same rounds, order
alternating; ratios this tree over that one per round.

    python -m benchmarks.main_process [--rounds 5] [--batches 400] [--base before=PATH]
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
import json, resource, sys, time
import torch
import streamdata as sd
root, how = sys.argv[1], sys.argv[2]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
if how == "dataloader":
    ds = sd.TarDataset(f"{root}/s-*.tar", batch_size=64)
    feed = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True,
                                       prefetch_factor=4, persistent_workers=True)
else:
    ds = sd.TarDataset(f"{root}/s-*.tar")
    feed = sd.loader(ds, batch_size=64, num_workers=2, persistent_workers=True)
for _ in feed:  # the first epoch starts the workers: not timed
    pass
c, t, n = cpu(), time.perf_counter(), 0
for epoch in range(2):
    for batch in feed:
        n += 1
c, t = cpu() - c, time.perf_counter() - t
getattr(feed, "close", lambda: None)()
print(json.dumps({"cpu_us": c / n * 1e6, "batches_s": n / t, "batches": n, "sd": sd.__file__}))
"""


def _write(root: str, batches: int) -> None:
    import numpy as np

    import streamdata as sd

    with sd.ShardWriter(f"{root}/s-%04d.tar", maxcount=1024, progress=False) as sink:
        for i in range(batches * 64):
            sink.write({"__key__": f"{i:08d}", "x.npy": np.full((3, 16, 16), i % 251, np.float32),
                        "cls": str(i % 10).encode()})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400, help="batches in an epoch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base", default=None, metavar="NAME=PATH")
    args = ap.parse_args(argv)
    runs = {"sd.loader": (ROOT, "loader"), "DataLoader": (ROOT, "dataloader")}
    if args.base:
        name, _, path = args.base.partition("=")
        runs[f"sd.loader@{name}"] = (Path(path), "loader")
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as root:
        _write(root, args.batches)
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                tree, how = runs[name]
                got = run_in_tree(CHILD, [root, how], tree, timeout=600)
                rows[name].append(got)
                print(f"round {r} {name:>20}: main process {got['cpu_us']:.0f} us CPU per batch, "
                      f"{got['batches_s']:.0f} batches/s", flush=True)
    for name, got in rows.items():
        print(f"{name}: median {statistics.median(g['cpu_us'] for g in got):.0f} us CPU per batch, "
              f"{statistics.median(g['batches_s'] for g in got):.0f} batches/s")
    first = "sd.loader"
    for other in list(runs)[1:]:
        for key in ("cpu_us", "batches_s"):
            ratios = [a[key] / b[key] for a, b in zip(rows[first], rows[other], strict=True)]
            print(f"{first} / {other}, {key}: median {statistics.median(ratios):.2f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
