"""The ``streamdata`` command: ``demo`` (the README's first command) and ``ls`` (expand a spec)."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> int:
    from .redact import redact_url
    from .urls import expand_spec

    options = json.loads(args.storage_options) if args.storage_options else {}
    shards = expand_spec(args.spec, options)
    total = sum(s.size or 0 for s in shards)
    for s in shards[: args.limit]:
        print(f"{s.size if s.size is not None else '?':>12}  {redact_url(s.url)}")
    if len(shards) > args.limit:
        print(f"... {len(shards) - args.limit} more")
    print(f"{len(shards)} shards, {total / 1e6:.1f} MB listed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamdata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream an epoch from a local S3 server and print the speed")
    demo.add_argument("--shards", type=int, default=32)
    demo.add_argument("--per-shard", type=int, default=64)
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=32)
    ls = sub.add_parser("ls", help="expand a shard spec and list the shards with their sizes")
    ls.add_argument("spec")
    ls.add_argument("--storage-options", help="JSON dict passed to fsspec")
    ls.add_argument("--limit", type=int, default=20)
    args = parser.parse_args(argv)
    from .errors import StreamDataError

    try:
        if args.command == "demo":
            from .demo import run_demo

            run_demo(shards=args.shards, per_shard=args.per_shard, num_workers=args.workers,
                     batch_size=args.batch_size)
            return 0
        return _ls(args)
    except StreamDataError as exc:
        print(f"streamdata: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
