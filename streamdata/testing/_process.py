"""What every test server shares: the subprocess wrapper (log, readiness wait, shutdown),
the command line that starts this package's CLI in a child, ports and HTTP probes."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamdata.errors import BackendMissingError, StreamDataError

_INSTALL_HINT = "pip install 'streamdata[test]'"
_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.05


class ServerError(StreamDataError, RuntimeError):
    """A test server did not come up (the message carries the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- processes


class _ServerProcess:
    """One server subprocess: its log file, its readiness wait and its shutdown."""

    def __init__(self, name: str, argv: list[str], *, exit_with_parent: bool = False) -> None:
        self.name = name
        self.tmpdir = tempfile.TemporaryDirectory(prefix=f"streamdata-{name}-")
        self.log_path = Path(self.tmpdir.name) / "server.log"
        self._log = open(self.log_path, "wb")
        try:
            # stdin=PIPE: with --exit-with-parent the child exits when this pipe closes,
            # so a server never outlives a test run that was killed.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if exit_with_parent else subprocess.DEVNULL,
                stdout=self._log, stderr=subprocess.STDOUT)
        except BaseException:
            self._log.close()
            self.tmpdir.cleanup()
            raise

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace").strip()
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout: float = _READY_TIMEOUT_S) -> None:
        """Poll ``ready()`` until true; raise :class:`ServerError` on exit or deadline."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.name} server exited with code {code}:\n{self.log_tail()}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} server not ready after {timeout:.0f} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """Terminate, wait, kill if needed; then drop the log and temp dir."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
        self._log.close()
        self.tmpdir.cleanup()


# ``python -m streamdata.testing`` would run streamdata/__init__.py, which imports torch:
# seconds of start-up and hundreds of MB per server for nothing.  The server child instead
# registers a bare package object, so only this package, config.py and errors.py load.
_BARE_PACKAGE_MAIN = (
    "import sys, types; package = types.ModuleType('streamdata'); "
    "package.__path__ = [sys.argv.pop(1)]; sys.modules['streamdata'] = package; "
    "from streamdata.testing import main; main()"
)


def _cli_argv(*args: str) -> list[str]:
    """Command line running this package's CLI without importing all of streamdata."""
    return [sys.executable, "-c", _BARE_PACKAGE_MAIN, str(Path(__file__).resolve().parents[1]),
            *args]


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of a GET on ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (OSError, http.client.HTTPException):
        return None


class _Managed:
    """Context-manager plumbing shared by the servers: ``with X() as x`` = start/stop."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

class _Subprocess(_Managed):
    """A server running in a ``_ServerProcess``; ``port`` goes back to the requested one on stop."""

    _process: Any = None
    _requested_port: int | None = None
    port: int | None = None

    def stop(self) -> None:
        """Stop the subprocess (terminate, then kill after 5 s)."""
        if self._process is not None:
            self._process.stop()
            self._process = None
            self.port = self._requested_port

def _require(*modules: str) -> None:
    """Raise BackendMissingError naming the test extra if a module cannot be imported."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendMissingError(f"{', '.join(missing)} not installed: {_INSTALL_HINT}")

