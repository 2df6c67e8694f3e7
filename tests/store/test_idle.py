"""IDLE-WHILE-LISTING: the constructor's own work runs while the listing's request is in
flight, against the real S3 test server behind a counting proxy."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import streamdata as sd
from streamdata.errors import SpecError
from streamdata.store import idle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.faults import Fault, FaultProxy  # noqa: E402
from tests.helpers import make_samples, tar_bytes  # noqa: E402

COUNTS = [3, 2]


def _put(server, bucket: str) -> str:
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples(COUNTS)):
        s3.put_object(Bucket=bucket, Key=f"d/s-{i}.tar", Body=tar_bytes(shard))
    return f"s3://{bucket}/d/s-{{0..{len(COUNTS) - 1}}}.tar"


def _outcomes(proxy: FaultProxy) -> list[tuple[str, str]]:
    return [(kind, outcome) for kind, _, _, outcome in proxy.history]


def test_work_runs_while_the_listing_is_in_flight(s3_bucket) -> None:
    server, bucket = s3_bucket
    spec = _put(server, bucket)
    seen: list[list[tuple[str, str]]] = []
    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        proxy.add(Fault("hang", match="list", seconds=0.5, times=1))
        def work() -> None:  # waits (bounded) for the request to reach the proxy
            deadline = time.monotonic() + 2
            while not proxy.history and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(_outcomes(proxy))

        with idle.pending(work):
            shards = sd.expand_spec(spec, options)
        # it ran once, when the listing had reached the server and not been answered
        assert seen == [[("list", "hang")]], seen
        assert _outcomes(proxy) == [("list", "hang"), ("list", "200 hang")]
    assert len(shards) == len(COUNTS)


def test_work_no_listing_ran_runs_when_the_block_ends(tmp_path: Path) -> None:
    for i, shard in enumerate(make_samples(COUNTS)):
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(shard))
    spec = str(tmp_path / "s-{0..1}.tar")
    order: list[str] = []
    with idle.pending(lambda: order.append("work")):
        sd.expand_spec(spec)  # local files: no LITE-S3 listing to wait on
        order.append("listed")
    assert order == ["listed", "work"]


def test_an_error_in_the_work_is_raised_after_the_listing_not_retried_as_one(s3_bucket) -> None:
    server, bucket = s3_bucket
    spec = _put(server, bucket)

    def bad() -> None:
        raise SpecError("bad decode spec")

    with FaultProxy(server.endpoint_url) as proxy:
        options = dict(server.storage_options, endpoint_url=proxy.url)
        done = []
        with pytest.raises(SpecError, match="bad decode spec"):
            with idle.pending(bad):
                done.append(sd.expand_spec(spec, options))
        assert proxy.requests == {"list": 1}  # the listing was not tried again
        assert len(done) == 1  # and it finished


def test_a_bad_decode_spec_is_still_refused_by_the_constructor(s3_bucket) -> None:
    server, bucket = s3_bucket
    spec = _put(server, bucket)
    with pytest.raises(SpecError, match="unknown image spec"):
        sd.TarDataset(spec, storage_options=server.storage_options, decode="no-such-spec", index=None)
    ds = sd.TarDataset(spec, storage_options=server.storage_options, index=None)
    assert ds._decoder is not None  # made while listing
    assert sorted(int(s["cls"]) for s in ds) == list(range(sum(COUNTS)))  # decoded
