"""Resuming at 50% of an epoch: streamdata's seek vs StatefulDataLoader's naive fast-forward.

A StatefulDataLoader over an indexed ``sd.TarDataset`` (2 workers, batch 32) reads half an
epoch straight from the embedded S3 server and saves its state; a fresh loader, reading through
the latency proxy (``--delay-ms`` one way), loads that state; the time from ``iter()`` to its
first batch, and the bytes it fetched to finish the epoch, are measured. "seek": streamdata's
``load_state_dict`` (the readers start at their next sample with a ranged GET). "naive": the
same dataset behind a wrapper without ``state_dict``, so torchdata fast-forwards by reading and
dropping the first half. The two alternate for ``--rounds`` rounds; medians and ratios printed.

    python -m benchmarks.resume [--delay-ms 25] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import proxied_shards  # noqa: E402


class Plain(torch.utils.data.IterableDataset):
    """A dataset without ``state_dict``: what torchdata can only fast-forward."""

    def __init__(self, dataset: torch.utils.data.IterableDataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)


def _loader(spec: str, options: dict, naive: bool):
    from torchdata.stateful_dataloader import StatefulDataLoader

    import streamdata as sd

    ds = sd.TarDataset(spec, storage_options=options, batch_size=32, decode=False)
    return StatefulDataLoader(Plain(ds) if naive else ds, batch_size=None, num_workers=2,
                              multiprocessing_context="fork")


def run(spec: str, direct: dict, proxied: dict, proxy, naive: bool, half: int) -> tuple[float, int]:
    """``(s to the first batch after the restart, bytes fetched to the epoch's end)``."""
    loader = _loader(spec, direct, naive)
    it = iter(loader)
    for _ in range(half):
        next(it)
    state = loader.state_dict()
    del it, loader
    resumed = _loader(spec, proxied, naive)
    resumed.load_state_dict(state)
    before = proxy.bytes_down
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's "naively fast-forwarding" (expected, for naive)
        start = time.perf_counter()
        it = iter(resumed)
        next(it)
        took = time.perf_counter() - start
        for _ in it:  # the rest of the epoch: what the restart fetched in all
            pass
    fetched = proxy.bytes_down - before
    del it, resumed
    return took, fetched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay of the latency proxy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--sample-kib", type=int, default=32)
    args = parser.parse_args(argv)

    rows: dict[str, list[tuple[float, int]]] = {"seek": [], "naive": []}
    half = args.samples // 32 // 2
    with proxied_shards(args.delay_ms, args.samples, args.shards, args.sample_kib, index=True) as bench:
        for k in range(args.rounds):
            for name in rows:
                took, fetched = run(bench.spec, bench.server.storage_options, bench.options, bench.proxy,
                                    name == "naive", half)
                rows[name].append((took, fetched))
                print(f"  round {k + 1}/{args.rounds} {name}: first batch {took:.3f} s, "
                      f"{fetched / 2**20:.1f} MiB fetched to the end", flush=True)
    med = {name: (statistics.median(t for t, _ in r), statistics.median(b for _, b in r))
           for name, r in rows.items()}
    print(f"\n{args.delay_ms:g} ms one-way, {args.samples} samples of {args.sample_kib} KiB in {args.shards} "
          f"shards, resumed at batch {half} of {2 * half} (2 workers, batch 32), medians of {args.rounds}:")
    for name, (took, fetched) in med.items():
        print(f"  {name:5s}: first batch after restart {took:.3f} s, {fetched / 2**20:.1f} MiB fetched")
    print(f"  seek / naive: time {med['seek'][0] / med['naive'][0]:.2f}, "
          f"bytes {med['seek'][1] / max(med['naive'][1], 1):.3f}")


if __name__ == "__main__":
    main()
