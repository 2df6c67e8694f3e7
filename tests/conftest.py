"""Shared fixtures: real S3 / GCS / HTTP servers, and a guard against leaked threads
and processes.

Tests that use the S3 or GCS fixtures are marked ``s3`` / ``gcs`` automatically, and
tests marked ``cuda`` are skipped without a CUDA device.  Set
``STREAMDATA_TEST_S3_ENDPOINT`` / ``STREAMDATA_TEST_GCS_ENDPOINT`` (see docker/README.md)
to run against MinIO / a dockerised fake-gcs-server instead of local subprocesses.
"""

from __future__ import annotations

import os

# Before anything imports gcsfs: its default class probes a gRPC API that fake-gcs-server
# does not serve, stalling each open for up to 60 s (see streamdata.testing.gcs._use_plain_gcsfs).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import contextlib
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from streamdata.errors import BackendMissingError
from streamdata.testing import (
    GCSServer,
    HTTPServer,
    S3Endpoint,
    S3Server,
    ServerError,
    gcs_from_env,
    s3_from_env,
)

if TYPE_CHECKING:
    import psutil

pytest_plugins = ("pytester",)  # test_servers.py checks the leak guard in a sub-run

_LEAK_GRACE_S = 2.0  # time a finished test's threads and processes get to wind down
# Helpers multiprocessing (and torch's file_system sharing strategy) start once per
# interpreter and keep until exit: not leaks.
_PROCESS_SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                       "torch_shm_manager")
_S3_FIXTURES = {"s3_server", "s3_bucket"}
_GCS_FIXTURES = {"gcs_server", "gcs_bucket"}


# --------------------------------------------------------------------------- markers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark s3/gcs tests by the fixtures they use; skip cuda tests without a device."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _S3_FIXTURES:
            item.add_marker(pytest.mark.s3)
        if names & _GCS_FIXTURES:
            item.add_marker(pytest.mark.gcs)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in cuda_items:
            item.add_marker(skip)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_report_header(config: pytest.Config) -> list[str]:
    s3, gcs = s3_from_env(), gcs_from_env()
    return [f"streamdata S3 tests: {s3.endpoint_url if s3 else 'moto subprocess'}",
            f"streamdata GCS tests: {gcs.endpoint_url if gcs else 'fake-gcs-server subprocess'}"]


# --------------------------------------------------------------------------- servers


def _unique_bucket() -> str:
    return f"sd-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server | S3Endpoint]:
    """The S3 endpoint for the session: $STREAMDATA_TEST_S3_ENDPOINT, or moto."""
    external = s3_from_env()
    if external is not None:
        yield external
        return
    try:
        server = S3Server().start()
    except BackendMissingError as err:
        pytest.skip(f"S3 test server unavailable: {err}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server | S3Endpoint) -> Iterator[tuple[S3Server | S3Endpoint, str]]:
    """A fresh, uniquely named bucket: ``(server, bucket_name)``; deleted afterwards."""
    name = _unique_bucket()
    s3_server.create_bucket(name)
    yield s3_server, name
    try:
        s3_server.delete_bucket(name)
    except Exception as err:  # cleanup only; the test's own result stands
        warnings.warn(f"could not delete S3 bucket {name}: {err}", stacklevel=1)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """fake-gcs-server for the session ($STREAMDATA_TEST_GCS_ENDPOINT, or the bundled
    binary); the GCS tests skip, with the reason, if the binary cannot run."""
    external = gcs_from_env()
    if external is not None:
        yield external.start()
        return
    try:
        server = GCSServer().start()
    except (BackendMissingError, ServerError, OSError) as err:
        pytest.skip(f"fake-gcs-server cannot run here: {err}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(gcs_server: GCSServer) -> Iterator[tuple[GCSServer, str]]:
    """A fresh, uniquely named bucket: ``(server, bucket_name)``; deleted afterwards."""
    name = _unique_bucket()
    gcs_server.create_bucket(name)
    yield gcs_server, name
    try:
        gcs_server.delete_bucket(name)
    except Exception as err:
        warnings.warn(f"could not delete GCS bucket {name}: {err}", stacklevel=1)


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[Callable[..., HTTPServer]]:
    """Factory: ``http_server(root_dir=tmp_path, **kwargs)`` starts an HTTPServer,
    stopped when the test ends."""
    started: list[HTTPServer] = []

    def make(root_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> HTTPServer:
        server = HTTPServer(root_dir if root_dir is not None else tmp_path, **kwargs)
        started.append(server.start())
        return server

    yield make
    for server in started:
        server.stop()


# --------------------------------------------------------------------------- leak guard


def _watched_threads() -> set[threading.Thread]:
    """Threads a test must not leave running: non-daemon ones and any of ours."""
    return {t for t in threading.enumerate()
            if t is not threading.main_thread() and t.is_alive()
            and (not t.daemon or t.name.startswith("streamdata"))}


def _child_processes() -> dict[tuple[int, float], psutil.Process]:
    """This process's descendants, keyed by (pid, start time), less multiprocessing's own."""
    import psutil

    children = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            try:
                command = " ".join(proc.cmdline())
            except psutil.ZombieProcess:  # exited but never joined: still a leak
                command = ""
            if not any(name in command for name in _PROCESS_SINGLETONS):
                children[(proc.pid, proc.create_time())] = proc
        except psutil.Error:  # gone meanwhile
            pass
    return children


def _describe(proc: psutil.Process) -> str:
    import psutil

    try:
        command = proc.cmdline()
        what = ("a forked copy of this process (a DataLoader worker?)"
                if command == psutil.Process().cmdline() else " ".join(command)[:120])
        return f"pid {proc.pid} ({proc.status()}): {what}"
    except psutil.ZombieProcess:
        return f"pid {proc.pid} (exited but never joined)"
    except psutil.Error:
        return f"pid {proc.pid} (already gone)"


def _end_processes(procs: list[psutil.Process]) -> None:
    """Terminate (then kill) leaked children so that one leak does not fail later tests."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=3)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=3)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Remember each phase's report on the item, for the leak guard."""
    report = yield
    setattr(item, f"_report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _no_leaked_threads_or_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a non-daemon or ``streamdata*`` thread, or a child
    process, behind (after a short grace period for joins and exits).  Leaked processes
    are ended either way; a test that already failed only gets a warning."""
    threads_before = _watched_threads()
    procs_before = set(_child_processes())
    yield
    deadline = time.monotonic() + _LEAK_GRACE_S
    while True:
        threads = _watched_threads() - threads_before
        procs = {key: p for key, p in _child_processes().items() if key not in procs_before}
        if not threads and not procs:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    lines = [f"thread {t.name!r} (daemon={t.daemon})" for t in sorted(threads, key=str)]
    lines += [f"process {_describe(p)}" for p in procs.values()]
    _end_processes(list(procs.values()))
    message = "test left running:\n  " + "\n  ".join(lines)
    call_report = getattr(request.node, "_report_call", None)
    if call_report is not None and call_report.failed:
        warnings.warn(f"{message}\n(after the test failed)", stacklevel=1)
        return
    pytest.fail(message, pytrace=False)


@pytest.fixture
def restore_sharing_strategy():
    """Put torch's sharing strategy back after a test that changes it."""
    import torch.multiprocessing

    before = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.multiprocessing.set_sharing_strategy(before)
