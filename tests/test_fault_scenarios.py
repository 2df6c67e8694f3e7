"""Acceptance scenarios for "survive outages": a small uneven tar dataset read through
benchmarks.faults.FaultProxy in front of S3 (most), HTTP and GCS, with DEFAULT options except
where a scenario names one. Each reads every sample exactly once (keys and contents), or
fails with the documented error within the documented time, and ``ds.retried`` counts the
retries by reason (metrics.RETRY_REASONS)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import streamdata as sd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds benchmarks/
from benchmarks.faults import S3_SLOWDOWN_XML, Fault, FaultProxy  # noqa: E402
from tests.helpers import UNEVEN, write_shards  # noqa: E402

pytestmark = pytest.mark.slow  # outages and stalls of seconds each: `make test-slow`, and CI

# ---- the expected defaults, in one place -------------------------------------------
# Retries are deadline-based: a part is retried until a per-part deadline of minutes, so an
# outage shorter than that is survived with default options.
OUTAGES_S = (1.0, 3.0)  # survived with default options (30 s too: test marked slow)
LONG_OUTAGE_S = 30.0
LONG_503_RUN = 12  # consecutive 503 SlowDown answers a read survives (more than 4 retries)
BURST = 3  # faults in a short burst
STALL_TIMEOUT_S = 2.0  # the ``timeout=`` option the stall scenarios set (default: 60 s)
LISTING_TIMEOUT_S = 5.0  # the ``timeout=`` an unanswered listing must honour ...
LISTING_GRACE_S = 10.0  # ... failing within timeout + this
READ_LIMIT_S = 120.0  # a scenario that should pass must do so within this (a hang guard)
# the reason a fault is counted under in ds.retried
REASON = {"reset": "connection", "truncate": "short", "stall": "timeout", "hang": "timeout",
          503: "throttled", 429: "throttled", 500: "server", "refuse": "connection",
          "503": "throttled"}


# ---- helpers -------------------------------------------------------------------------------


def _expected(counts: list[int] = UNEVEN) -> list[str]:
    return [f"s{n:06d}" for n in range(sum(counts))]


def _check_samples(samples: list[dict]) -> None:
    """Every sample of the UNEVEN dataset exactly once, with its contents."""
    keys = [s["__key__"] for s in samples]
    assert sorted(keys) == _expected(), "samples lost or read twice"
    for s in samples:
        n = int(s["__key__"][1:])
        assert int(s["cls"]) == n and s["json"] == {"n": n}
        assert np.array_equal(np.asarray(s["npy"]), np.full(8, n, dtype=np.float32))


def _read(ds) -> list[dict]:
    """All samples of ``ds`` (bounded by READ_LIMIT_S: a hang fails instead of blocking)."""
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.extend(ds)
        except BaseException as exc:  # handed to the test thread
            error.append(exc)

    thread = threading.Thread(target=run, name="scenario-reader", daemon=True)
    thread.start()
    thread.join(READ_LIMIT_S)
    assert not thread.is_alive(), f"reading did not finish within {READ_LIMIT_S} s"
    if error:
        raise error[0]
    return result


def _retried(ds, reason: str) -> int:
    return ds.retried.get(reason, 0)


def _assert_retries(ds, proxy: FaultProxy, reason: str, n: int | None = None) -> None:
    """``ds.retried[reason]`` is ``n`` (or >= 1 when ``n`` is None); no other reason counted."""
    counted = ds.retried
    if n is None:
        assert counted.get(reason, 0) >= 1, (counted, proxy.faults_injected)
    else:
        assert counted.get(reason, 0) == n, (counted, proxy.faults_injected)
    others = {r: c for r, c in counted.items() if r != reason and c}
    assert others == {}, (counted, proxy.faults_injected)


@pytest.fixture
def s3_data(s3_bucket):
    """The UNEVEN dataset under ``s3://bucket/d/``; yields (spec, proxy, options)."""
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/d")
    with FaultProxy(server.endpoint_url) as proxy:
        yield f"s3://{bucket}/d/", proxy, {**server.storage_options, "endpoint_url": proxy.url}


@pytest.fixture
def http_data(tmp_path: Path, http_server):
    """The UNEVEN dataset on the HTTP test server; yields (spec, proxy)."""
    import fsspec

    (tmp_path / "d").mkdir()
    write_shards(fsspec.filesystem("file"), str(tmp_path / "d"))
    server = http_server(tmp_path)
    with FaultProxy(server.endpoint_url) as proxy:
        yield f"{proxy.url}/d/shard-{{000..{len(UNEVEN) - 1:03d}}}.tar", proxy


@pytest.fixture
def gcs_data(gcs_bucket):
    """The UNEVEN dataset under ``gs://bucket/d/``; yields (spec, proxy, options)."""
    import gcsfs

    server, bucket = gcs_bucket
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/d")
    with FaultProxy(server.endpoint_url) as proxy:
        yield f"gs://{bucket}/d/", proxy, {**server.storage_options, "endpoint_url": proxy.url}


# ---- S3: faults on object reads --------------------------------------------------------------


def test_s3_no_fault_baseline(s3_data) -> None:
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    _check_samples(_read(ds))
    assert proxy.requests.get("get", 0) >= 1 and proxy.faults_injected == {}
    assert sum(ds.retried.values()) == 0


@pytest.mark.parametrize("kind, after_bytes", [("reset", 1000), ("reset", None),
                                               ("truncate", 1000)])
def test_s3_cut_connections(s3_data, kind: str, after_bytes: int | None) -> None:
    """A reset after k body bytes (or before any), a body closed short of its Content-Length:
    each retried (reason connection / short), every sample once."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.add(Fault(kind, after_bytes=after_bytes, match="get", times=BURST))
    _check_samples(_read(ds))
    assert proxy.faults_injected == {kind: BURST}
    _assert_retries(ds, proxy, REASON[kind], BURST)


@pytest.mark.parametrize("status", [503, 429, 500])
def test_s3_error_bursts(s3_data, status: int) -> None:
    """503 SlowDown (S3's XML body), 429, 500: retried, counted as throttled / server."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    body = S3_SLOWDOWN_XML if status == 503 else None
    proxy.add(Fault("status", status=status, body=body, match="get", times=BURST))
    _check_samples(_read(ds))
    assert proxy.faults_injected == {"status": BURST}
    _assert_retries(ds, proxy, REASON[status], BURST)


def test_s3_long_slowdown_run(s3_data) -> None:
    """More consecutive 503 SlowDown answers than today's 4 retries: throttling is waited out."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.add(Fault("status", status=503, body=S3_SLOWDOWN_XML, match="get", times=LONG_503_RUN))
    _check_samples(_read(ds))
    _assert_retries(ds, proxy, "throttled", LONG_503_RUN)


def test_s3_stall_after_headers(s3_data) -> None:
    """Headers, then silence: the request times out (the documented ``timeout`` option) and is
    retried."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options, timeout=STALL_TIMEOUT_S)
    proxy.add(Fault("stall", match="get", times=1))
    _check_samples(_read(ds))
    assert proxy.faults_injected == {"stall": 1}
    _assert_retries(ds, proxy, "timeout", 1)


def test_s3_stall_mid_body(s3_data) -> None:
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options, timeout=STALL_TIMEOUT_S)
    proxy.add(Fault("stall", after_bytes=2000, match="get", times=1))
    _check_samples(_read(ds))
    _assert_retries(ds, proxy, "timeout", 1)


# ---- S3: outages -------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, mode", [(OUTAGES_S[0], "refuse"), (OUTAGES_S[0], "reset"),
                                           (OUTAGES_S[1], "refuse"), (OUTAGES_S[1], "503")])
def test_s3_outage(s3_data, seconds: float, mode: str) -> None:
    """Every request fails for ``seconds`` as the read starts; default options ride it out."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.outage(seconds=seconds, mode=mode)
    _check_samples(_read(ds))
    _assert_retries(ds, proxy, REASON[mode])


def test_s3_long_outage(s3_data) -> None:
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.outage(seconds=LONG_OUTAGE_S, mode="refuse")
    _check_samples(_read(ds))
    _assert_retries(ds, proxy, "connection")


def test_s3_faults_through_loader_workers(s3_data) -> None:
    """Two DataLoader workers: every sample once; retries summed over the workers."""
    spec, proxy, options = s3_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.add(Fault("reset", after_bytes=500, match="get", times=2))
    proxy.add(Fault("status", status=503, match="get", times=2))
    loader = sd.loader(ds, num_workers=2, batch_size=None, pin_memory=False,
                       persistent_workers=False)
    _check_samples(list(loader))
    assert proxy.faults_injected == {"reset": 2, "status": 2}
    assert _retried(ds, "connection") == 2 and _retried(ds, "throttled") == 2, ds.retried


# ---- S3: faults on the constructor's listing -------------------------------------------------


@pytest.mark.parametrize("fault", [Fault("status", status=503, match="list", times=2),
                                   Fault("status", status=500, match="list", times=2),
                                   Fault("reset", match="list", times=2)],
                         ids=["503", "500", "reset"])
def test_s3_listing_faults_are_retried(s3_data, fault: Fault) -> None:
    spec, proxy, options = s3_data
    proxy.add(Fault(**{**fault.__dict__}))  # a fresh copy: parametrize shares the instance
    ds = sd.TarDataset(spec, storage_options=options)
    assert proxy.faults_injected == {fault.kind: 2}
    _check_samples(_read(ds))


def test_s3_unanswered_listing_times_out(s3_data) -> None:
    """The endpoint accepts the listing and never answers: the constructor raises
    FetchTimeoutError naming the URL within ``timeout`` + LISTING_GRACE_S."""
    spec, proxy, options = s3_data
    proxy.add(Fault("hang", match="list", times=None))
    outcome: list = []

    def construct() -> None:
        try:
            outcome.append(sd.TarDataset(spec, storage_options=options, timeout=LISTING_TIMEOUT_S))
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=construct, name="scenario-listing", daemon=True)
    thread.start()
    thread.join(LISTING_TIMEOUT_S + LISTING_GRACE_S)
    elapsed = time.monotonic() - started
    proxy.clear()  # let a constructor still waiting finish (it is a daemon thread either way)
    assert outcome, f"the constructor was still waiting after {elapsed:.0f} s"
    err = outcome[0]
    assert isinstance(err, sd.FetchTimeoutError), repr(err)
    assert spec.rstrip("/").split("//", 1)[1].split("/", 1)[0] in str(err)  # the bucket


# ---- HTTP ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault, reason", [
    (Fault("reset", after_bytes=700, match="get", times=BURST), "connection"),
    (Fault("status", status=503, match="get", times=BURST), "throttled"),
    (Fault("truncate", after_bytes=700, match="get", times=BURST), "short"),
], ids=["reset", "503", "truncate"])
def test_http_faults(http_data, fault: Fault, reason: str) -> None:
    spec, proxy = http_data
    ds = sd.TarDataset(spec)
    proxy.add(Fault(**{**fault.__dict__}))
    _check_samples(_read(ds))
    assert proxy.faults_injected == {fault.kind: BURST}
    _assert_retries(ds, proxy, reason, BURST)


def test_http_outage(http_data) -> None:
    spec, proxy = http_data
    ds = sd.TarDataset(spec)
    proxy.outage(seconds=OUTAGES_S[1], mode="refuse")
    _check_samples(_read(ds))
    _assert_retries(ds, proxy, "connection")


# ---- GCS -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault, reason", [
    (Fault("reset", after_bytes=700, match="get", times=BURST), "connection"),
    (Fault("status", status=503, match="get", times=BURST), "throttled"),
], ids=["reset", "503"])
def test_gcs_faults(gcs_data, fault: Fault, reason: str) -> None:
    spec, proxy, options = gcs_data
    ds = sd.TarDataset(spec, storage_options=options)
    proxy.add(Fault(**{**fault.__dict__}))
    _check_samples(_read(ds))
    assert proxy.faults_injected == {fault.kind: BURST}
    _assert_retries(ds, proxy, reason, BURST)


def test_gcs_listing_503(gcs_data) -> None:
    spec, proxy, options = gcs_data
    proxy.add(Fault("status", status=503, match="list", times=2))
    ds = sd.TarDataset(spec, storage_options=options)
    assert proxy.faults_injected == {"status": 2}
    _check_samples(_read(ds))
