"""``streamdata ls``: the objects a dataset would read for a spec, with sizes and totals."""

from __future__ import annotations

import argparse
import json

from streamdata.cli.common import add_common, add_format, human, list_shards, write_out

__all__ = ["add_parsers"]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls", help="list the objects a dataset would read for SPEC, with sizes and totals",
        description="Expand SPEC exactly as the datasets do (the same suffix rules: a prefix or "
                    "glob keeps only the objects the dataset of the format reads; brace patterns "
                    "and names are taken as given) and print each object's size in bytes and its "
                    "URL (passwords and signatures masked), then the totals.")
    p.add_argument("spec", nargs="+", metavar="SPEC",
                   help="URL, brace pattern, prefix or glob (several: one list)")
    add_format(p)
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="print at most N objects (the totals still count all)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: format, shards [{url, size}], total bytes")
    add_common(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from streamdata.redact import redact_url

    fmt, shards = list_shards(args, args.spec, args.format)
    known = [s.size for s in shards if s.size is not None]
    total = sum(known)
    if args.json:
        write_out(json.dumps({"format": fmt, "count": len(shards), "total_bytes": total,
                              "unknown_sizes": len(shards) - len(known),
                              "shards": [{"url": redact_url(s.url), "size": s.size} for s in shards]}))
        return 0
    shown = shards if args.limit is None else shards[: max(args.limit, 0)]
    for s in shown:
        write_out(f"{s.size if s.size is not None else '?':>14}  {redact_url(s.url)}")
    if len(shards) > len(shown):
        write_out(f"{'...':>14}  {len(shards) - len(shown)} more")
    unknown = len(shards) - len(known)
    write_out(f"{len(shards)} {fmt} object{'s' if len(shards) != 1 else ''}, {total} bytes ({human(total)})"
              + (f", {unknown} of unknown size" if unknown else ""))
    return 0
