"""``streamdata index``: build (or bring up to date) the sample index of a tar spec."""

from __future__ import annotations

import argparse

from streamdata.cli.common import add_common, busy, fetch_options, human, storage_options, write_out
from streamdata.config import Fetch

__all__ = ["add_parsers"]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index", help="build the sample index (_streamdata.sdx) of SPEC's tar shards, for exact epochs",
        description="Read every tar shard of SPEC (in parallel, through the prefetcher) and write "
                    "the sample index: each shard's sample count and the byte offset of every "
                    "sample, about 8 bytes per sample, in one object beside the shards "
                    "(<directory>/_streamdata.sdx). With it the datasets split epochs by sample, "
                    "exactly, and inspect counts samples without reading shards. Resumable: "
                    "shards already indexed and unchanged (size, ETag) are not read again; the "
                    "partial index is saved every few seconds (an index under the older name "
                    "streamdata.sdx is resumed from). Compressed shards are skipped.")
    p.add_argument("spec", nargs="+", metavar="SPEC", help="URL, brace pattern, prefix or glob of tar shards")
    p.add_argument("--output", metavar="URL",
                   help="where to write the index (default: _streamdata.sdx in the shards' directory)")
    p.add_argument("--tokens", metavar="FIELD",
                   help="also count the tokens of each sample's FIELD (a 1-D integer .npy) and keep "
                        "them beside the shards (_streamdata.tokens.npz) for sd.TokenDataset(field=FIELD); "
                        "reads the shards not counted yet a second time")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="shards read at once (default: the prefetcher's window, 32)")
    add_common(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from streamdata.catalog.index import build_index, read_index
    from streamdata.redact import redact_url

    options = storage_options(args)
    fetch = fetch_options(args) | ({} if args.window is None else {"fetch": Fetch(window=args.window)})
    spec = args.spec[0] if len(args.spec) == 1 else list(args.spec)
    url = build_index(spec, storage_options=options, output=args.output,
                      progress=False if args.quiet else None, **fetch)
    with busy(args, "reading the index back"):
        entries = read_index(url, options) or []
    samples = sum(e.samples for e in entries)
    size = sum(8 * (e.samples + 1) for e in entries)
    write_out(f"wrote {redact_url(url)}: {len(entries)} shards, {samples} samples "
              f"(offsets {human(size)})")
    if args.tokens is not None:
        import streamdata as sd

        ds = sd.TokenDataset(spec, seq_len=1, field=args.tokens, storage_options=options,
                             progress=False if args.quiet else None, **fetch)
        counts = ds.save_counts()
        write_out(f"wrote {redact_url(counts)}: {ds.num_tokens} tokens in {len(ds.units_)} shards "
                  f"({ds.counted_shards} counted now)")
    return 0
