"""AUTOTUNE (streamdata/fetch/tune.py): a reader's window, request limit, byte budget and part size
grow where they held back a part the reader waited for, within their bounds and the memory cap;
throttling wins; the data order is the same with and without; every decision is counted."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest

import streamdata as sd
from streamdata.config import FetchConfig
from streamdata.errors import SpecError
from streamdata.fetch import budget as budget_module
from streamdata.fetch import tune as tune_module
from streamdata.fetch.prefetcher import Prefetcher
from streamdata.fetch.tune import MIN_PART, Held, Tuner

MiB = 1 << 20
SMALLEST = {"window": 1, "max_requests": 1}


@pytest.fixture(autouse=True)
def _nothing_learned():
    budget_module._learned.clear()
    tune_module._learned.clear()
    yield
    budget_module._learned.clear()
    tune_module._learned.clear()


def _consume(t: Tuner, rate: float, seconds: float, step: float = 0.01, start: float = 0.0) -> float:
    """The reader consumes at ``rate`` for ``seconds`` (a fake clock from ``start``); the clock after."""
    now = start
    while now < start + seconds:
        t.budget.released(int(rate * step), now=now)
        now += step
    return now


def test_the_defaults_fetch_as_the_fixed_knobs_do():
    t = Tuner(FetchConfig())
    assert t.knobs() == {"window": 32, "max_requests": 32, "byte_budget": 64 * MiB, "part_size": 8 * MiB}
    assert not t.stalled(Held(window=32, max_requests=32), None)  # at their bounds already
    assert t.knobs()["window"] == 32 and sum(t.decisions.values()) == 0


def test_from_the_smallest_each_knob_grows_once_per_value_that_held_it_up_to_its_bound():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, max_requests=8,
                          tune_from=SMALLEST), key="k")
    assert t.knobs() == {"window": 1, "max_requests": 1, "byte_budget": 8 * MiB, "part_size": 2 * MiB}
    assert t.stalled(Held(window=1), None) and t.window == 4
    assert not t.stalled(Held(window=1), None) and t.window == 4  # the same burst: once
    assert t.stalled(Held(window=4, max_requests=1), None) and (t.window, t.max_requests) == (16, 4)
    assert t.stalled(Held(window=16, max_requests=4), None) and (t.window, t.max_requests) == (32, 8)
    assert not t.stalled(Held(window=32, max_requests=8), None)  # the configured bounds: 32 and 8
    assert t.decisions == {"window": 3, "max_requests": 2, "byte_budget": 0, "part_size": 0}
    # the next pass of this process on the same endpoint starts where this one got to
    assert Tuner(FetchConfig(max_requests=8, tune_from=SMALLEST), key="k").knobs()["window"] == 32
    assert Tuner(FetchConfig(window=8, tune_from=SMALLEST), key="k").knobs()["window"] == 8  # its bound


def test_the_budget_grows_by_budget_growth_and_the_part_size_follows_it_within_the_cap():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST))
    now = _consume(t, 100e6, 1.0)
    assert not t.stalled(Held(budget=8 * MiB), None, now=now)  # no first-byte latency: no growth
    assert not t.stalled(Held(budget=8 * MiB), 0.001, now=now)  # bandwidth made it wait, not latency
    assert t.stalled(Held(budget=8 * MiB), 0.1, now=now)  # 10 MB consumed while it travelled
    assert t.budget.limit == pytest.approx(100e6 * 0.1 * budget_module.MARGIN + 8 * MiB, rel=0.05)
    assert t.part_size == t.budget.limit // 4 and t.decisions["part_size"] == 1
    for _ in range(4):
        now = _consume(t, 1e9, 1.0, start=now)
        t.stalled(Held(budget=t.budget.limit), 0.5, now=now)
    assert t.budget.limit == 128 * MiB and t.part_size == 8 * MiB  # the cap; the configured part size
    assert t.decisions["byte_budget"] == t.budget.grown >= 2


def test_a_far_endpoint_takes_a_budget_step_at_once_and_the_parts_follow():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB))
    assert t.far(0.1) and t.knobs()["byte_budget"] == 16 * MiB and t.part_size == 4 * MiB
    assert (t.window, t.max_requests) == (32, 32)  # at their bounds already
    low = Tuner(FetchConfig(byte_budget=8 * MiB, tune_from=SMALLEST), key="low")
    assert not low.far(0.01) and low.knobs()["window"] == 1  # a near endpoint: nothing
    assert low.far(0.1) and (low.window, low.max_requests) == (4, 4)  # just far: a STEP each
    assert low.decisions == {"window": 1, "max_requests": 1, "byte_budget": 1, "part_size": 1}
    farther = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST),
                    key="farther")
    assert farther.far(0.5)  # five times as far: five times the step, within the bounds
    assert (farther.window, farther.max_requests) == (20, 20) and farther.knobs()["byte_budget"] == 80 * MiB
    assert farther.part_size == 8 * MiB and farther.decisions["byte_budget"] == 1
    farthest = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST),
                     key="farthest")
    assert farthest.far(2.0) and farthest.knobs()["byte_budget"] == 128 * MiB  # the cap
    assert (farthest.window, farthest.max_requests) == (32, 32)  # the configured bounds
    small = Tuner(FetchConfig(part_size=512 * 1024, byte_budget=MiB))
    assert small.part_size == 512 * 1024 and MIN_PART > small.part_size  # never above the configured


def test_a_cold_first_answer_alone_is_not_a_far_endpoint():
    """The far step reads the shortest of the pass's first FAR_PARTS first bytes: a server's
    slow first answer followed by a quick one is a near endpoint."""
    cold = Tuner(FetchConfig(byte_budget=8 * MiB, tune_from=SMALLEST))
    assert not cold.first_byte(0.4) and not cold.first_byte(0.01) and not cold.first_byte(0.5)
    assert cold.knobs()["byte_budget"] == 8 * MiB and (cold.window, cold.max_requests) == (1, 1)
    far = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST))
    assert not far.first_byte(0.3) and far.first_byte(0.25)  # the shorter: 2.5 times FAR_S
    assert far.knobs()["byte_budget"] == 40 * MiB and (far.window, far.max_requests) == (10, 10)


def test_a_near_endpoint_s_first_bytes_move_nothing():
    """Only the far step reads first bytes: at a near endpoint (every first byte under FAR_S,
    whatever the requests in flight) the knobs stay where they start, and grow as stalls ask."""
    near = Tuner(FetchConfig())
    for n in range(1, 9):
        assert not near.first_byte(0.001 + 0.012 * n)
    assert near.knobs() == {"window": 32, "max_requests": 32, "byte_budget": 64 * MiB, "part_size": 8 * MiB}
    assert sum(near.decisions.values()) == 0
    small = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST))
    assert not small.first_byte(0.02) and not small.first_byte(0.02)
    assert small.knobs() == {"window": 1, "max_requests": 1, "byte_budget": 8 * MiB, "part_size": 2 * MiB}
    assert small.stalled(Held(max_requests=1), 0.02) and small.max_requests == 4  # as stalls ask


def test_autotune_off_keeps_every_knob_as_set():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, autotune=False, tune_from=SMALLEST))
    assert t.knobs() == {"window": 32, "max_requests": 32, "byte_budget": 8 * MiB, "part_size": 8 * MiB}
    now = _consume(t, 1e9, 1.0)
    assert not t.far(1.0) and not t.stalled(Held(window=32, budget=8 * MiB), 1.0, now=now)
    assert t.knobs()["byte_budget"] == 8 * MiB and sum(t.decisions.values()) == 0


def test_every_decision_has_a_counter():
    """Each of the tuner's decisions is added to a counter of ``COUNTERS``."""
    from streamdata.fetch.prefetcher import _DECISION
    from streamdata.metrics import COUNTERS

    assert set(_DECISION) == set(Tuner(FetchConfig()).decisions)
    assert set(_DECISION.values()) <= set(COUNTERS)


def test_config_autotune_and_tune_from(monkeypatch):
    assert FetchConfig().autotune is True
    assert FetchConfig(tune_from={"window": 2}).tune_from == (("window", 2),)
    hash(FetchConfig(tune_from={"window": 2, "max_requests": 1}))  # still hashable
    monkeypatch.setenv("STREAMDATA_AUTOTUNE", "0")
    assert FetchConfig.from_env().autotune is False
    with pytest.raises(SpecError, match="tune_from"):
        FetchConfig(tune_from={"part_size": 1})
    with pytest.raises(SpecError, match="tune_from"):
        FetchConfig(tune_from={"window": 0})
    with pytest.raises(SpecError, match="autotune"):
        FetchConfig(autotune="yes")


def test_a_part_held_by_the_throttle_is_not_the_request_limits():
    """READER-THROTTLE wins: when 503s lowered the throttle below the tuned limit, a part held
    back is tagged with nothing the tuner would grow."""
    with Prefetcher([], config=FetchConfig(max_requests=8, tune_from={"max_requests": 4})) as fetcher:
        fetcher._inflight = 4
        assert fetcher._holds(MiB, Held()) == Held(max_requests=4)
        fetcher.throttle.limit = 2.0  # throttled: 2 allowed
        fetcher._inflight = 2
        assert fetcher._holds(MiB, Held()) == Held()
        assert not fetcher._may_send(MiB)


def _objects(s3_bucket, count: int, size: int) -> tuple[object, list[bytes], str]:
    server, bucket = s3_bucket
    s3 = server.boto3_client()
    blobs = [os.urandom(size) for _ in range(count)]
    for i, blob in enumerate(blobs):
        s3.put_object(Bucket=bucket, Key=f"tune/o-{i}", Body=blob)
    return server, blobs, f"s3://{bucket}/tune/o-{{0..{count - 1}}}"


def test_from_the_smallest_behind_a_slow_link_the_knobs_grow_and_the_bytes_are_the_same(s3_bucket):
    """30 ms one-way, one object ahead and one request at a time, a 1 MiB budget: the reader
    waits, the window and request limit grow, the budget within its cap; the bytes come in the
    same order as with the knobs fixed, and the fetcher never holds more than its cap and a part."""
    from benchmarks.proxy import LatencyProxy

    server, blobs, spec = _objects(s3_bucket, 24, 512 * 1024)
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.03) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        got = {}
        for on in (True, False):
            config = FetchConfig(part_size=256 * 1024, window=8, max_requests=8, byte_budget=MiB,
                                 byte_budget_max=4 * MiB, tune_from=SMALLEST, autotune=on)
            with Prefetcher(sd.expand_spec(spec, server.storage_options), options, config) as fetcher:
                got[on] = [b"".join(reader.chunks()) for reader in fetcher]
            if on:
                tuned = fetcher.tuner
                # the window to its bound; the request limit grew, within its bound
                assert tuned.window == 8 and 1 < tuned.max_requests <= 8
                assert tuned.decisions["window"] >= 1 and tuned.decisions["max_requests"] >= 1
                assert MiB <= tuned.budget.limit <= 4 * MiB
                assert fetcher.peak_reserved <= 4 * MiB + config.part_size
                assert fetcher.peak_inflight <= 8
            else:
                # off: the knobs as set (``tune_from`` is where tuning starts), the budget fixed
                assert (fetcher.tuner.window, fetcher.tuner.max_requests, fetcher.budget.limit) == (8, 8, MiB)
                assert sum(fetcher.tuner.decisions.values()) == 0
                assert fetcher.peak_reserved <= MiB + config.part_size
    assert got[True] == got[False] == blobs


def test_decisions_and_knobs_are_in_the_loaders_metrics(s3_bucket):
    from benchmarks.proxy import LatencyProxy
    from tests.helpers import make_samples, tar_bytes

    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples([40] * 8, floats=1024)):
        s3.put_object(Bucket=bucket, Key=f"tune-tar/s-{i}.tar", Body=tar_bytes(shard))
    up = urlsplit(server.endpoint_url)
    spec = f"s3://{bucket}/tune-tar/s-{{0..7}}.tar"
    with LatencyProxy(up.hostname, up.port, delay_s=0.02) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url_for(server.endpoint_url)}
        keys, metrics = {}, {}
        for on in (True, False):
            ds = sd.TarDataset(spec, storage_options=options, index=None, decode=False, batch_size=10,
                               shuffle=True, seed=3, part_size=64 * 1024, byte_budget=256 * 1024,
                               window=8, max_requests=8, tune_from=SMALLEST, autotune=on)
            loader = sd.loader(ds, num_workers=0)
            keys[on] = [k for batch in loader for k in batch["__key__"]]
            metrics[on] = loader.metrics()
    assert keys[True] == keys[False] and len(keys[True]) == 320  # only timing changes
    on, off = metrics[True], metrics[False]
    assert on["tuned.window"] >= 1 and on["tuned.max_requests"] >= 1
    assert off["tuned.window"] == off["tuned.max_requests"] == off["budget.grown"] == 0
    assert all(f"knob.{k}" in on for k in ("window", "max_requests", "byte_budget", "part_size"))


def test_the_docs_recipe_runs(s3_bucket, monkeypatch, capsys):
    """docs/metrics.md's "I/O that tunes itself" block, for real (the bucket and the workers
    swapped for the test server's and none): it starts at 8 MiB and reports its knobs."""
    from tests.helpers import doc_blocks, make_samples, s3_environment, tar_bytes

    server, bucket = s3_bucket
    s3 = server.boto3_client()
    for i, shard in enumerate(make_samples([2] * 32)):  # one batch of 64: the loop's one step
        s3.put_object(Bucket=bucket, Key=f"train-{i:06d}.tar", Body=tar_bytes(shard))
    s3_environment(monkeypatch, server.storage_options)
    (code,) = doc_blocks("docs/metrics.md", "## I/O that tunes itself")
    code = (code.replace("s3://bucket/", f"s3://{bucket}/").replace("num_workers=4", "num_workers=0")
            .replace("{000000..000127}", "{000000..000031}"))
    assert "{000000..000031}" in code
    ns: dict = {"__name__": "__docs__"}
    exec(compile(code, "docs/metrics.md", "exec"), ns)
    ns["loader"].close()
    window, requests, budget = (int(v) for v in capsys.readouterr().out.split())
    assert window >= 0 and requests >= 0 and 8 * MiB <= budget <= 128 * MiB
    assert ns["ds"].fetch_config.tune_from == (("max_requests", 1), ("window", 1))
