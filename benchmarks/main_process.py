"""The main process's cost per batch: what the training process spends to receive a batch.

Local tar shards with a sample index (``sd.ShardWriter``), small samples, so that the hand-off
dominates: ``--fields 1`` a ``[3, 16, 16]`` float32 array and a label, ``--fields 20`` twenty
``[4]`` float32 arrays and a label. Read through ``sd.loader(ds, batch_size=64, num_workers=2)``
and, for reference, through plain ``DataLoader(ds_batched, batch_size=None, num_workers=2,
pin_memory=False / True)`` over the same dataset batching itself (torch's collation in the
workers). The loop's step does nothing, so the main process is as busy as it can be: the
figures are the main thread's CPU time per batch (``time.thread_time``), the whole main
process's (``getrusage``: every thread of it, a pinning thread included; workers not counted)
and the batches per second the loop took. With ``--base NAME=PATH`` the ``sd.loader`` pass also
runs on the ``streamdata`` of the tree at PATH (``git archive <commit> streamdata | tar -x -C
PATH``), in the same rounds, order alternating; ratios this tree over the others per round.

    python -m benchmarks.main_process [--rounds 5] [--batches 400] [--fields 1 20] [--base before=PATH]
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
if how.startswith("dataloader"):
    ds = sd.TarDataset(f"{root}/s-*.tar", batch_size=64)
    feed = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, pin_memory=how.endswith("pin"),
                                       prefetch_factor=4, persistent_workers=True)
else:
    ds = sd.TarDataset(f"{root}/s-*.tar")
    feed = sd.loader(ds, batch_size=64, num_workers=2, persistent_workers=True)
for _ in feed:  # the first epoch starts the workers: not timed
    pass
c, m, t, n = cpu(), time.thread_time(), time.perf_counter(), 0
for epoch in range(2):
    for batch in feed:
        n += 1
c, m, t = cpu() - c, time.thread_time() - m, time.perf_counter() - t
getattr(feed, "close", lambda: None)()
print(json.dumps({"cpu_us": c / n * 1e6, "thread_us": m / n * 1e6, "batches_s": n / t, "batches": n,
                  "sd": sd.__file__}))
"""


def _write(root: str, batches: int, fields: int) -> None:
    import numpy as np

    import streamdata as sd

    with sd.ShardWriter(f"{root}/s-%04d.tar", maxcount=1024, progress=False) as sink:
        for i in range(batches * 64):
            sample = {"__key__": f"{i:08d}", "cls": str(i % 10).encode()}
            if fields == 1:
                sample["x.npy"] = np.full((3, 16, 16), i % 251, np.float32)
            else:
                sample.update({f"f{f:02d}.npy": np.full((4,), i % 251, np.float32) for f in range(fields)})
            sink.write(sample)


KEYS = (("thread_us", "main thread us CPU per batch"), ("cpu_us", "main process us CPU per batch"),
        ("batches_s", "batches/s"))


def _case(fields: int, args: argparse.Namespace, runs: dict[str, tuple[Path, str]]) -> None:
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as root:
        _write(root, args.batches, fields)
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                tree, how = runs[name]
                got = run_in_tree(CHILD, [root, how], tree, timeout=600)
                rows[name].append(got)
                print(f"{fields} fields, round {r} {name:>22}: main thread {got['thread_us']:.0f} us, "
                      f"process {got['cpu_us']:.0f} us CPU per batch, {got['batches_s']:.0f} batches/s",
                      flush=True)
    print(f"\n{fields} field(s) + label, 64 samples a batch, 2 workers, {args.rounds} rounds (medians)")
    print("| | " + " | ".join(label for _, label in KEYS) + " |")
    print("|---|" + "---:|" * len(KEYS))
    for name, got in rows.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(g[key] for g in got):.0f}" for key, _ in KEYS)
              + " |")
    first = "sd.loader"
    for other in list(runs)[1:]:
        for key, label in KEYS:
            ratios = [a[key] / b[key] for a, b in zip(rows[first], rows[other], strict=True)]
            print(f"{first} / {other}, {label}: median {statistics.median(ratios):.2f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400, help="batches in an epoch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fields", type=int, nargs="+", default=[1, 20],
                    help="array fields a sample has: 1 ([3,16,16] f32) or more ([4] f32 each)")
    ap.add_argument("--base", default=None, metavar="NAME=PATH")
    args = ap.parse_args(argv)
    runs = {"sd.loader": (ROOT, "loader"), "DataLoader": (ROOT, "dataloader"),
            "DataLoader(pin_memory)": (ROOT, "dataloader-pin")}
    if args.base:
        name, _, path = args.base.partition("=")
        runs[f"sd.loader@{name}"] = (Path(path), "loader")
    for fields in args.fields:
        _case(fields, args, runs)


if __name__ == "__main__":
    main()
