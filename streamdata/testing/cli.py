"""``python -m streamdata.testing {s3,gcs,http}``: run one test server in the foreground."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time

from streamdata.testing._moto import _serve_s3
from streamdata.testing._process import _Managed
from streamdata.testing.gcs import GCSServer
from streamdata.testing.http import HTTPServer


def _watch_stdin_then_exit() -> None:
    """Exit this process when stdin reaches EOF, i.e. when the parent is gone."""

    def watch() -> None:
        try:
            while os.read(0, 4096):  # raw fd: no buffer lock held at interpreter exit
                pass
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="streamdata-testing-parent-watch", daemon=True).start()


def _serve_until_interrupted(server: _Managed) -> None:
    """Run ``server`` until Ctrl-C or SIGTERM, then stop it (and any child it has)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with server:
        print(f"serving {server!r}; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def _package_doc() -> str | None:
    """The package docstring (what ``--help`` prints above the commands)."""
    return importlib.import_module(__package__).__doc__


def main(argv: list[str] | None = None) -> None:
    """``python -m streamdata.testing {s3,gcs,http}``: run one test server in the foreground."""
    parser = argparse.ArgumentParser(prog="python -m streamdata.testing", description=_package_doc(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    s3 = commands.add_parser("s3", help="moto S3 with keep-alive")
    s3.add_argument("--ready-file", help="write the bound port here once listening")
    s3.add_argument("--exit-with-parent", action="store_true",
                    help="exit when stdin closes (used by S3Server)")
    gcs = commands.add_parser("gcs", help="fake-gcs-server, in memory")
    web = commands.add_parser("http", help="serve a directory with Range support")
    web.add_argument("root", help="directory to serve")
    for sub in (s3, gcs, web):
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--port", type=int, default=0, help="0: any free port")
    for sub in (s3, web):
        sub.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.command == "s3":
        if args.exit_with_parent:
            _watch_stdin_then_exit()
        _serve_s3(args.host, args.port, args.latency, args.ready_file)
    elif args.command == "gcs":
        _serve_until_interrupted(GCSServer(host=args.host, port=args.port or None))
    else:
        _serve_until_interrupted(HTTPServer(args.root, host=args.host, port=args.port or None,
                                            latency=args.latency))
