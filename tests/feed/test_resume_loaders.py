"""Resume through real loaders over the S3 test server: torchdata's StatefulDataLoader (its
per-worker state collection) over sd.TarDataset (with and without an index) and
sd.ParquetDataset, num_workers 0 and 2. Before + after = the uninterrupted epoch, no
"naively fast-forwarding" warning, and, counted at a proxy, no request for a shard whose samples
were all delivered before the stop."""

from __future__ import annotations

import collections
import json
import logging
import time
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest

import streamdata as sd
from benchmarks.faults import FaultProxy
from streamdata.catalog import index as sdx
from tests.helpers import write_shards, write_tables

pytestmark = pytest.mark.s3

torchdata = pytest.importorskip("torchdata.stateful_dataloader")

COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 6]  # 64 samples
ROWS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1]]  # 65 rows


@pytest.fixture(scope="module")
def written(s3_server):
    """One bucket for the module, written once (the tests only read it)."""
    import s3fs

    bucket = f"sd-resume-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    write_shards(fs, f"{bucket}/tar", counts=COUNTS)
    sdx.build_index(f"s3://{bucket}/tar/", s3_server.storage_options, progress=False)
    write_shards(fs, f"{bucket}/plain", counts=COUNTS)
    write_tables(fs, f"{bucket}/pq", ROWS)
    try:
        yield s3_server, bucket
    finally:
        s3_server.delete_bucket(bucket)


@pytest.fixture
def proxied(written):
    """The bucket behind a fresh counting proxy: each test counts only its own requests."""
    server, bucket = written
    with FaultProxy(server.endpoint_url) as proxy:
        yield f"s3://{bucket}/", {**server.storage_options, "endpoint_url": proxy.url}, proxy


BUFFER = 4


def _make(kind, root, options):
    kw = dict(storage_options=options, batch_size=3, shuffle=True, seed=11,
              shuffle_buffer=BUFFER if kind.endswith("+buffer") else 0)
    if kind.startswith("parquet"):
        return sd.ParquetDataset(root + "pq/", **kw)
    if kind.startswith("indexed"):
        return sd.TarDataset(root + "tar/", decode=False, **kw)
    return sd.TarDataset(root + "plain/", decode=False, index=None, **kw)


def _ids(batch):
    return [int(k[1:]) for k in batch["__key__"]] if "__key__" in batch else batch["id"].tolist()


def _object(kind, i):
    """The object holding sample/row ``i``."""
    parquet = kind.startswith("parquet")
    at = np.searchsorted(np.cumsum([sum(g) for g in ROWS] if parquet else COUNTS), i, side="right")
    return f"part-{at}.parquet" if parquet else f"shard-{at:03d}.tar"


def _loader(ds, workers):
    return torchdata.StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                        timeout=60 if workers else 0,
                                        multiprocessing_context="fork" if workers else None)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["indexed", "indexed+buffer", "unindexed", "parquet", "parquet+buffer"])
def test_stateful_dataloader_resumes_by_seeking(proxied, kind, workers, caplog):
    root, options, proxy = proxied
    full = [i for b in _loader(_make(kind, root, options), workers) for i in _ids(b)]
    loader = _loader(_make(kind, root, options), workers)
    it = iter(loader)
    before = [i for _ in range(12) for i in _ids(next(it))]
    state = json.loads(json.dumps(loader.state_dict()))  # plain data, through a JSON file
    del it
    ds = _make(kind, root, options)
    resumed = _loader(ds, workers)
    resumed.load_state_dict(state)
    proxy.reset_counters()
    with caplog.at_level(logging.WARNING):  # torchdata says it through logging, not warnings
        after = [i for b in resumed for i in _ids(b)]
    assert "fast-forwarding" not in caplog.text, "torchdata replayed the epoch"
    assert sorted(before + after) == sorted(full) and len(set(before + after)) == len(full)
    assert before + after == full, "the resumed loader's order differs from the uninterrupted one"
    gets = [t.split("?")[0].rsplit("/", 1)[-1] for k, m, t, _ in proxy.history if m == "GET"]
    done = {_object(kind, i) for i in before} - {_object(kind, i) for i in after}
    readers = max(workers, 1)
    if kind.endswith("+buffer"):  # RESUME-BUFFER: what was delivered behind the buffer, read again
        assert ds.counts["resumed.reread"] < len(before)  # seeks, not a replay (the age of the oldest)
        return
    assert done and not done & set(gets), f"fetched again after resume: {sorted(done & set(gets))}"
    partly = {_object(kind, i) for i in before} & {_object(kind, i) for i in after}
    if not kind.startswith("parquet"):  # (a Parquet file's other row groups are units of their own)
        assert sum(g in partly for g in gets) <= readers + len(partly)  # one part per reader, at most
    if kind == "unindexed":  # the partly read shard of each reader, read again up to the position
        assert ds.counts["resumed.reread"] <= readers * max(COUNTS)
    else:
        assert ds.counts["resumed.reread"] == 0  # seeks: ranged GETs from the next sample


@pytest.mark.parametrize("workers,new_workers", [(0, 0), (2, 2), (2, 0), (0, 3)])
def test_sd_loader_saves_every_readers_position(proxied, workers, new_workers):
    """Loader.state_dict() holds every worker's position (what the loop received, whatever the
    workers had prefetched), so it restarts on another number of workers too."""
    root, options, proxy = proxied
    kw = dict(storage_options=options, shuffle=True, seed=2, shuffle_buffer=0, decode=False)
    everything = [i for b in sd.loader(sd.TarDataset(root + "tar/", **kw), batch_size=4, num_workers=0)
                  for i in _ids(b)]
    with sd.loader(sd.TarDataset(root + "tar/", **kw), batch_size=4, num_workers=workers) as loader:
        it = iter(loader)
        before = [i for _ in range(5) for i in _ids(next(it))]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
    assert None not in state["stages"][-1]["delivered"]
    assert sum(state["stages"][-1]["delivered"]) == len(before)
    with sd.loader(sd.TarDataset(root + "tar/", **kw), batch_size=4, num_workers=new_workers) as loader:
        loader.load_state_dict(state)
        after = [i for b in loader for i in _ids(b)]
        with pytest.raises(sd.SpecError, match="before the loader's first iteration"):
            loader.load_state_dict(state)
    assert sorted(before + after) == sorted(everything) and len(set(before + after)) == len(everything)


def _checked(batch):
    assert isinstance(batch, dict), f"the feed's transform got a {type(batch).__name__}"
    return {**batch, "seen": True}


def test_sd_loader_with_a_feed_records_what_comes_out_of_it(proxied):
    """With the GPU feed (here on the CPU, with a transform), tags come off before the feed and are
    recorded as its batches come out: the transform sees plain batches, the state what it gave."""
    root, options, proxy = proxied
    kw = dict(storage_options=options, shuffle=True, seed=2, shuffle_buffer=0, decode=False)
    make = lambda: sd.TarDataset(root + "tar/", **kw)  # noqa: E731
    everything = [i for b in sd.loader(make(), batch_size=4, num_workers=0) for i in _ids(b)]
    with sd.loader(make(), batch_size=4, num_workers=2, device="cpu", transform=_checked) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        before = [i for b in got for i in _ids(b)]
        state = loader.state_dict()
        del it
    assert all(b["seen"] for b in got)
    assert sum(state["stages"][-1]["delivered"]) == len(before)
    with sd.loader(make(), batch_size=4, num_workers=1, device="cpu", transform=_checked) as loader:
        loader.load_state_dict(state)
        after = [i for b in loader for i in _ids(b)]
    assert sorted(before + after) == sorted(everything) and len(set(before + after)) == len(everything)


def _unit_bytes(kind, root, options):
    """Per object name, the byte ranges of its units with the ids they hold: a tar shard's
    samples (from the index's offsets), a Parquet file's row groups (its column chunks)."""
    import fsspec

    if kind == "indexed":
        entries = sdx.read_index(root + "tar/" + sdx.INDEX_NAME, options)
        out, n = {}, 0
        for entry in entries:
            offsets = [int(o) for o in entry.offsets]
            out[entry.name.rsplit("/", 1)[-1]] = [(offsets[i], offsets[i + 1], {n + i})
                                                  for i in range(entry.samples)]
            n += entry.samples
        return out
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    out, n = {}, 0
    for i in range(len(ROWS)):
        with fs.open(f"{root[5:]}pq/part-{i}.parquet", "rb") as f:
            meta = pq.ParquetFile(f).metadata
        groups = []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            cols = [group.column(c) for c in range(group.num_columns)]
            start = min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                        for c in cols)
            stop = start + sum(c.total_compressed_size for c in cols)
            groups.append((start, stop, set(range(n, n + group.num_rows))))
            n += group.num_rows
        out[f"part-{i}.parquet"] = groups
    return out


def _recorded(proxy, limit: float = 10.0) -> int:
    """How many answers the proxy forwarded so far, once each one whose head went out has been
    recorded whole (a transfer is logged after its last byte: the client may be done sooner)."""
    end = time.monotonic() + limit
    while len(proxy.transfers) < len(proxy.history) and time.monotonic() < end:
        time.sleep(0.005)
    return len(proxy.transfers)


def _transferred(transfers):
    """(object name, first byte, stop) of each object GET the proxy forwarded."""
    for kind, path, header, sent in transfers:
        if kind != "get" or not sent:
            continue
        first = int(header.split("=", 1)[1].split("-", 1)[0]) if header else 0
        yield path.rsplit("/", 1)[-1], first, first + sent


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["indexed", "parquet"])
def test_bytes_read_again_after_resume(proxied, kind, workers):
    """Measured at the proxy (the ranges and bytes it forwarded after the restart): no byte of a
    sample delivered before the stop is fetched again with a tar index (each reader's ranged GET
    starts at its next sample's offset: less than one part per reader); with
    Parquet, none of a row group delivered whole, and at most one partly delivered row group per
    reader (fetched whole and sliced)."""
    root, options, proxy = proxied
    units = _unit_bytes(kind, root, options)
    loader = _loader(_make(kind, root, options), workers)
    it = iter(loader)
    before = {i for _ in range(12) for i in _ids(next(it))}
    state = loader.state_dict()
    del it
    # the resumed loader talks through a proxy of its own: the first loader's prefetches still
    # in flight at the stop (its window) must not count as fetched again; nor do the new
    # dataset's constructor reads (Parquet footers), before the resumed pass
    with FaultProxy(f"http://{proxy.upstream_host}:{proxy.upstream_port}") as proxy:
        resumed = _loader(_make(kind, root, {**options, "endpoint_url": proxy.url}), workers)
        constructor = _recorded(proxy)
        resumed.load_state_dict(state)
        after = [i for b in resumed for i in _ids(b)]
        transfers = list(proxy.transfers)[constructor:]
    assert not before & set(after)
    assert len(before) + len(after) == sum(len(ids) for v in units.values() for _, _, ids in v)
    again = collections.Counter()  # bytes fetched again, by whether the unit was delivered whole or in part
    fetched = set()  # the ids of the units fetched
    for name, first, stop in _transferred(transfers):
        for a, b, ids in units.get(name, ()):
            overlap = max(0, min(b, stop) - max(a, first))
            fetched |= ids if overlap else set()
            if overlap and ids & before:
                again["whole" if ids <= before else "part"] += overlap
    assert set(after) <= fetched, "the proxy did not see what the resumed loader read"
    assert again["whole"] == 0, f"{again['whole']} bytes of units delivered before the stop fetched again"
    if kind == "indexed":
        assert again["part"] == 0  # (a sample is one unit: delivered or not)
    else:
        largest = max(b - a for v in units.values() for a, b, _ in v)
        assert again["part"] <= max(workers, 1) * largest, again
