"""Stream WebDataset tar and Parquet/Arrow shards from any fsspec URL: look at them, index
them, convert to them, measure how fast they read.

A SPEC is what the datasets take: a URL, a brace pattern (s3://bkt/train-{000000..000127}.tar),
a prefix (gs://bkt/train/) or a glob (s3://bkt/train/*.tar); several SPECs make one list.

Storage options go to fsspec as they are: -o '{"endpoint_url": "http://127.0.0.1:9000"}'
or -o anon=true (repeatable). Credentials come from the environment, as fsspec reads them.

Errors are one line on stderr, with exit code 2. Progress bars are drawn on stderr when it
is a terminal (never in pipes or logs); --quiet turns them off.
Run "streamdata COMMAND --help" for a command's options.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import NoReturn

from streamdata.cli import benchmark, conversion, indexing, inspection, listing, tokenizing
from streamdata.cli.common import UsageError

__all__ = ["main"]

PROG = "streamdata"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``streamdata: error: ...`` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _demo(args: argparse.Namespace) -> int:
    from streamdata.cli.demo import run_demo

    run_demo(shards=args.shards, per_shard=args.per_shard, num_workers=args.workers,
             batch_size=args.batch_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from streamdata import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the full traceback of an unexpected error (a bug: please report it)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True,
                                parser_class=_Parser)
    demo = sub.add_parser("demo", help="stream an epoch from a local S3 server and print the speed",
                          description="Start a local S3 server (moto), write a small tar shard set "
                                      "to it, stream one epoch through a DataLoader and print "
                                      "samples/s and the time to the first batch.")
    demo.add_argument("--shards", type=int, default=32, help="shards to write (default 32)")
    demo.add_argument("--per-shard", type=int, default=64, help="samples per shard (default 64)")
    demo.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    demo.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    demo.set_defaults(run=_demo)
    for module in (listing, inspection, indexing, conversion, tokenizing, benchmark):
        module.add_parsers(sub)
    return parser


def _one_line(text: str) -> str:
    from streamdata.redact import redact

    return " ".join(redact(text).split())


def main(argv: list[str] | None = None) -> int:
    """The ``streamdata`` command; returns the exit code (0 ok, 2 an error, 130 interrupted)."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        return _main(argv, debug)


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line too: ``streamdata: warning: ...``."""
    print(f"{PROG}: warning: {_one_line(str(message))}", file=sys.stderr)


def _main(argv: list[str] | None, debug: bool) -> int:
    from streamdata.errors import StreamDataError

    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} "
                             f"(see '{PROG} {args.command} --help')")
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `streamdata ls ... | head`: stop quietly
        import contextlib
        import os

        with contextlib.suppress(OSError, ValueError, AttributeError):  # no more flush errors at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, StreamDataError, OSError) as exc:
        if debug:
            raise
        text = str(exc) if str(exc) else type(exc).__name__
        if isinstance(exc, OSError) and not isinstance(exc, StreamDataError):
            text = f"{exc.strerror or type(exc).__name__}: {exc.filename}" if exc.filename else text
        print(f"{PROG}: error: {_one_line(text)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still one line, the traceback with --debug
        if debug:
            raise
        print(f"{PROG}: error: unexpected {type(exc).__name__}: {_one_line(str(exc))} "
              "(--debug shows the traceback)", file=sys.stderr)
        return 1
