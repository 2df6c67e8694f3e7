"""Shuffle quality at equal memory: the block shuffle (``blocks``) vs the shuffle buffer (``stages``).

    python -m benchmarks.shuffle_quality                   # 100,000 samples, 100 shards
    python -m benchmarks.shuffle_quality --samples 20000 --memory 256 1024

Pure CPU, no server: both shuffles run on integer positions with the library's own code. The
epoch is ``--shards`` equal shards read by one reader, shards in the epoch's seeded order
(``plan.reader_span``, as every pass does); each sample carries a label from one of ``--classes``
classes, written in two layouts real shards often have:

- ``sorted``: the dataset written label by label (each class one contiguous run);
- ``clustered``: runs of one class of random length (mean ``--run``), classes at random.

For each memory size M (samples held: the buffer's size, the block shuffle's window; the block
shuffle with ``--pieces`` pieces per window: 1 = contiguous windows, 16 = the default), over
``--epochs`` epochs: the mean absolute displacement from reading order over the span (a uniform
permutation: 1/3), the lag-1 autocorrelation of the labels (uniform: about 0), the share of
neighbours with the same label (uniform: 1/classes), and for a resume at ``--resumes`` random
points, the samples read again (block: the delivered part of the window it stopped in; buffer:
what ``rewind`` reads again, those delivered behind the first not delivered).
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from streamdata.epoch.blocks import PIECES, block_reads, block_shuffled
from streamdata.epoch.buffer import shuffled
from streamdata.epoch.plan import reader_span
from streamdata.epoch.rewind import rewind_point
from streamdata.epoch.sharding import reader_seed
from streamdata.epoch.world import World

WORLD = World(0, 1, 0, 1)


def labels_for(layout: str, n: int, classes: int, run: int, rng: np.random.Generator) -> np.ndarray:
    if layout == "sorted":
        return np.arange(n) * classes // n
    lengths = rng.geometric(1 / run, n)
    labels = np.repeat(rng.integers(0, classes, len(lengths)), lengths)
    return labels[:n]


def span_positions(counts: np.ndarray, seed: int, epoch: int) -> tuple[np.ndarray, object]:
    span = reader_span(counts, WORLD, seed=seed, epoch=epoch, shuffle=True)
    starts = np.concatenate(([0], np.cumsum(counts)))
    return np.concatenate([np.arange(starts[s.unit] + s.start, starts[s.unit] + s.stop)
                           for s in span.segments]), span


def block_order(span, counts: np.ndarray, memory: int, seed: int, epoch: int, d: int = 0,
                pieces: int = PIECES) -> tuple[list, int]:
    starts = np.concatenate(([0], np.cumsum(counts)))
    material = reader_seed(WORLD, seed=seed, epoch=epoch)
    reads, plan = block_reads(span, d, memory, True, material, tables=False, pieces=pieces)
    positions = [int(starts[s.unit]) + p for s in reads for p in range(s.start, s.stop)]
    return list(block_shuffled(positions, plan)), plan.skip


def buffer_order(reading: np.ndarray, memory: int, seed: int, epoch: int) -> list:
    rng = random.Random(str(reader_seed(WORLD, seed=seed, epoch=epoch)))
    return list(shuffled(reading.tolist(), memory, rng))


def quality(out: list, reading: np.ndarray, labels: np.ndarray) -> tuple[float, float, float]:
    out = np.asarray(out)
    rank = np.empty(len(reading), dtype=np.int64)
    rank[reading] = np.arange(len(reading))  # each sample's place in reading order
    displacement = float(np.abs(rank[out] - np.arange(len(out))).mean() / len(out))
    lab = labels[out].astype(float)
    autocorr = float(np.corrcoef(lab[:-1], lab[1:])[0, 1])
    same = float((labels[out][:-1] == labels[out][1:]).mean())
    return displacement, autocorr, same


def buffer_reread(memory: int, n: int, d: int, seed: int, epoch: int) -> int:
    rng_seed = str(reader_seed(WORLD, seed=seed, epoch=epoch))
    m = rewind_point(lambda records: shuffled(records, memory, random.Random(rng_seed)), [1] * n, d, False)
    return d - m


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--run", type=int, default=64, help="mean run of one class (clustered)")
    parser.add_argument("--memory", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resumes", type=int, default=5)
    parser.add_argument("--pieces", type=int, nargs="+", default=[1, PIECES],
                        help="pieces per block window (1: contiguous windows)")
    args = parser.parse_args(argv)
    counts = np.full(args.shards, args.samples // args.shards, dtype=np.int64)
    n = int(counts.sum())
    rng = np.random.default_rng(0)
    print(f"{n:,} samples in {args.shards} shards, {args.classes} classes; one reader; "
          f"means over {args.epochs} epochs (uniform permutation: displacement 0.333, autocorr 0, "
          f"same-label {1 / args.classes:.3f})")
    print(f"{'layout':<10} {'memory':>7} {'shuffle':<9} {'displ.':>7} {'autocorr':>9} {'same':>6} "
          f"{'reread mean':>12} {'reread max':>11}")
    spans = [span_positions(counts, 0, epoch) for epoch in range(max(args.epochs, 1))]  # one per epoch
    for layout in ("sorted", "clustered"):
        labels = labels_for(layout, n, args.classes, args.run, rng)
        for memory in args.memory:
            names = [f"block/{k}" for k in args.pieces] + ["buffer"]
            rows: dict[str, list] = {name: [] for name in names}
            rereads: dict[str, list] = {name: [] for name in names}
            for epoch in range(args.epochs):  # interleaved: each shuffle in turn, per epoch
                reading, span = spans[epoch]
                points = random.Random(epoch).sample(range(1, n), args.resumes)
                for k in args.pieces:
                    out, _ = block_order(span, counts, memory, 0, epoch, pieces=k)
                    rows[f"block/{k}"].append(quality(out, reading, labels))
                    for d in points:
                        rest, skip = block_order(span, counts, memory, 0, epoch, d, pieces=k)
                        assert rest == out[d:]  # the position alone restores the rest
                        rereads[f"block/{k}"].append(skip)
                rows["buffer"].append(quality(buffer_order(reading, memory, 0, epoch), reading, labels))
                rereads["buffer"] += [buffer_reread(memory, n, d, 0, epoch) for d in points]
            for name in names:
                q = np.mean(rows[name], axis=0)
                r = rereads[name]
                print(f"{layout:<10} {memory:>7} {name:<9} {q[0]:>7.3f} {q[1]:>9.3f} {q[2]:>6.3f} "
                      f"{np.mean(r):>12.0f} {max(r):>11}")
        reading, _ = spans[0]
        uniform = quality(np.random.default_rng(1).permutation(reading).tolist(), reading, labels)
        print(f"{layout:<10} {'all':>7} {'uniform':<9} {uniform[0]:>7.3f} {uniform[1]:>9.3f} "
              f"{uniform[2]:>6.3f} {'':>12} {'':>11}")


if __name__ == "__main__":
    main()
