"""loader.metrics(): the stall fraction against a stopwatch in the training loop, the readers'
stage timings and the verdict, log_every / on_metrics, sd.timed, all ranks under torchrun; the
first two also with ``device="cuda"`` (the feed's pinning and copy times), where CUDA is.

The slow part of each case is made dominant by a wide margin (a map that sleeps, a proxy that
delays every request), so the assertions hold on a loaded machine; the one timed tolerance is
the issue's: the reported stall fraction within 0.05 of the one measured here.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import fsspec
import pytest
import torch

import streamdata as sd
from streamdata.feed.metrics import verdict
from streamdata.metrics import MODALITIES, STAGES
from tests.helpers import torchrun, write_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.proxy import LatencyProxy  # noqa: E402

JOB = Path(__file__).parent.parent / "jobs" / "metrics_job.py"


def _local(tmp_path: Path, counts: list[int], floats: int = 8) -> str:
    (tmp_path / "shards").mkdir()
    write_shards(fsspec.filesystem("file"), str(tmp_path / "shards"), counts=counts, floats=floats)
    return f"file://{tmp_path}/shards/shard-{{000..{len(counts) - 1:03d}}}.tar"


# the loader as a CPU job runs it, and with device="cuda" (its batches used on the GPU, the
# feed's pinning and copy times reported too); the second only where CUDA is (tests/conftest.py)
DEVICES = [None, pytest.param("cuda", marks=pytest.mark.cuda)]


def _use_on(device: str | None):
    """What a step does with its batch: on a device, read it there (so it counts as delivered
    only once usable)."""
    if device is None:
        return None

    def use(batch) -> None:
        assert batch["npy"].is_cuda
        batch["npy"].sum().item()

    return use


def _train(loader, step_s: float, use=None) -> dict:
    """Iterate ``loader`` with a training step of ``step_s`` (after ``use(batch)``, if given),
    timing each ``next()`` as the loader should: the first batch's wait apart, the wall from
    its delivery to the end."""
    it, waits, steps = iter(loader), 0.0, 0
    start = time.perf_counter()
    batch = next(it)
    first = time.perf_counter()
    while True:
        if use is not None:
            use(batch)
        time.sleep(step_s)
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            waits += time.perf_counter() - asked
            break
        waits += time.perf_counter() - asked
        steps += 1
    end = time.perf_counter()
    return {"first": first - start, "wait": waits, "wall": end - first, "steps": steps + 1,
            "fraction": waits / (end - first)}


def _check_readers(ds) -> list[dict]:
    rows = ds.reader_stats()
    assert rows, "no reader accounted its stages"
    for row in rows:
        stages = sum(row[f"{s}_ns"] for s in STAGES)
        assert 0 < stages <= row["busy_ns"] + 1000 and row["busy_ns"] <= row["wall_ns"], row
    return rows


@pytest.mark.parametrize("device", DEVICES)
def test_a_well_fed_loader_reports_no_stall(tmp_path, device):
    # a training step of 0.4 s: on a 2-core machine loaded five times over, the main process's
    # own share of a batch (the DataLoader's receive, recycle's release) and the workers' turn
    # on a core come to 10-15 ms a step, counted as waiting
    ds = sd.TarDataset(_local(tmp_path, [32] * 4), index=None)
    with sd.loader(ds, batch_size=16, num_workers=2, device=device) as loader:
        seen = _train(loader, 0.4, _use_on(device))
        m = loader.metrics()
    if device is not None:  # every batch was pinned and copied: host time, far less than the loop's
        assert 0 < m["feed.pin_s"] < seen["wall"] and 0 < m["feed.copy_s"] < seen["wall"], m
    assert m["steps"] == seen["steps"] == 8
    assert m["stall_fraction"] <= 0.05 and m["verdict"] is None, m
    assert abs(m["data_wait_s"] - seen["wait"]) < 0.02 + 0.05 * seen["wait"], (m, seen)
    assert abs(m["wall_s"] - seen["wall"]) < 0.05 * seen["wall"], (m, seen)
    assert m["samples"] == 128 and m["batches"] == 8 and m["requests"] >= 4 and m["bytes"] > 0
    json.dumps(m)  # JSON-ready
    _check_readers(ds)


@pytest.mark.parametrize("device", DEVICES)
def test_a_slow_map_is_decode_time_and_the_verdict_says_cpu_bound(tmp_path, device):
    def slow(sample):
        time.sleep(0.004)
        return sample

    ds = sd.TarDataset(_local(tmp_path, [40] * 6), index=None, map=slow)
    with sd.loader(ds, batch_size=8, num_workers=2, device=device) as loader:
        seen = _train(loader, 0.002, _use_on(device))
        m = loader.metrics()
    if device is not None:
        assert m["feed.pin_s"] > 0 and m["feed.copy_s"] > 0, m
    assert seen["fraction"] > 0.5  # starved: the workers make a batch in ~16 ms per worker
    assert abs(m["stall_fraction"] - seen["fraction"]) <= 0.05, (m, seen)
    assert m["stage.map_s"] > 3 * max(m[f"stage.{s}_s"] for s in STAGES if s != "map"), m
    assert m["verdict"].startswith("CPU-bound: workers are")
    assert "more workers or a lighter map" in m["verdict"]
    for row in _check_readers(ds):
        assert row["map_ns"] == max(row[f"{s}_ns"] for s in STAGES)
    json.dumps(m)


def test_a_slow_store_is_waiting_for_bytes_and_the_verdict_says_io_bound(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/m", counts=[30] * 4, floats=512)
    up = urlsplit(server.endpoint_url)
    with LatencyProxy(up.hostname, up.port, delay_s=0.04) as proxy:
        opts = dict(server.storage_options, endpoint_url=proxy.url_for(server.endpoint_url))
        # one small part at a time per reader: each costs a round trip through the proxy
        ds = sd.TarDataset(f"s3://{bucket}/m/shard-{{000..003}}.tar", storage_options=opts, index=None,
                           max_requests=1, window=1, part_size=16 * 1024, first_part=16 * 1024,
                           byte_budget=16 * 1024, byte_budget_max=16 * 1024)
        with sd.loader(ds, batch_size=4, num_workers=2) as loader:
            seen = _train(loader, 0.002)
            m = loader.metrics()
    assert seen["fraction"] > 0.5
    assert abs(m["stall_fraction"] - seen["fraction"]) <= 0.05, (m, seen)
    assert m["stage.wait_bytes_s"] > 3 * max(m[f"stage.{s}_s"] for s in STAGES if s != "wait_bytes"), m
    assert m["verdict"].startswith("I/O-bound") and "raise window/max_requests" in m["verdict"]
    assert m["requests"] >= 4 * 4 and m["first_byte_s"] > 0.04  # the proxy's delay, at least
    for row in _check_readers(ds):
        assert row["wait_bytes_ns"] == max(row[f"{s}_ns"] for s in STAGES)


def _readers(wall: float, **stages: float) -> dict:
    return {"readers.wall_s": wall, **{f"stage.{s}_s": stages.get(s, 0.0) for s in STAGES}}


def test_the_verdict_tells_io_from_cpu_from_the_hand_off():
    """Readers waiting for bytes more than working: I/O; working half their time or more: CPU;
    neither, while the loop waits (measured on an H200: a 5 ms step waited 14% with workers 20%
    busy): the hand-off, where more workers or a lighter map would not help."""
    assert verdict({"stall_fraction": 0.05, **_readers(10.0, map=9.0)}) is None
    io = verdict({"stall_fraction": 0.4, **_readers(10.0, wait_bytes=6.0, parse=1.0)})
    assert io.startswith("I/O-bound")
    assert verdict({"stall_fraction": 0.4, **_readers(10.0, map=5.0, parse=1.0)}).startswith("CPU-bound")
    idle = verdict({"stall_fraction": 0.14, **_readers(3.0, wait_bytes=0.1, parse=0.2, collate=0.2)})
    assert idle.startswith("hand-off-bound: workers are only 13% busy and wait for bytes 3%")
    assert "prefetch_factor" in idle and "more workers" not in idle


def test_log_every_calls_back_every_n_steps_with_the_dict(tmp_path, caplog):
    ds = sd.TarDataset(_local(tmp_path, [12] * 2), index=None)
    got: list[dict] = []
    with sd.loader(ds, batch_size=2, num_workers=0, log_every=4, on_metrics=got.append) as loader:
        assert sum(1 for _ in loader) == 12
    assert [m["steps"] for m in got] == [4, 8, 12]
    json.dumps(got)
    with caplog.at_level(logging.INFO, logger="streamdata"), \
            sd.loader(ds, batch_size=2, num_workers=0, log_every=5) as loader:
        for _ in loader:
            pass
    lines = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert [line.split(":")[1] for line in lines] == [" step 5", " step 10"]
    with pytest.raises(sd.SpecError):
        sd.loader(ds, on_metrics=print)  # no interval


def test_metrics_in_the_main_process_and_across_epochs(tmp_path):
    ds = sd.TarDataset(_local(tmp_path, [10] * 3), index=None)
    with sd.loader(ds, batch_size=5, num_workers=0) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        m = loader.metrics()
        # num_workers=0: the reader batches with its plan's sizes, as a worker does (EQUAL-STEPS)
        assert m == {**m, "steps": 12, "samples": 60, "batches": 12, "readers": 1}
        every = loader.metrics(all_ranks=True)  # one rank: its own dict
        assert every["straggler"] == 0 and every["ranks"][0]["steps"] == 12
        assert every["straggler_data_wait_s"] == every["ranks"][0]["data_wait_s"]


def test_timed_wraps_a_plain_dataloader_and_any_iterable(tmp_path):
    ds = sd.TarDataset(_local(tmp_path, [16] * 2), index=None, batch_size=4)
    timed = sd.timed(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    assert len(list(timed)) == 8
    m = timed.metrics()
    assert m["steps"] == 8 and m["samples"] == 32 and "stage.parse_s" in m
    plain = sd.timed(range(5))
    assert list(plain) == list(range(5))
    pm = plain.metrics()
    assert pm["steps"] == 5 and "stage.parse_s" not in pm and "samples" not in pm
    json.dumps(pm)


def test_stage_times_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMDATA_STAGE_TIMES", "0")
    ds = sd.TarDataset(_local(tmp_path, [8] * 2), index=None, batch_size=4)
    assert len(list(ds)) == 4
    assert all(row["busy_ns"] == 0 and row["samples"] == 0 for row in ds.reader_stats())


@pytest.mark.slow  # a torchrun job (~15 s)
def test_all_ranks_under_torchrun_names_the_straggler(tmp_path):
    spec = _local(tmp_path, [24] * 4)
    ranks = torchrun(JOB, tmp_path, 2, {"tag": "metrics", "spec": spec}, 240)
    for r, out in enumerate(ranks):
        gathered = out["all"]
        assert [g["rank"] for g in gathered["ranks"]] == [0, 1]
        assert gathered["ranks"][r]["steps"] == out["mine"]["steps"] > 0
        assert gathered["straggler"] == 1  # its map sleeps
        assert gathered["straggler_data_wait_s"] == max(g["data_wait_s"] for g in gathered["ranks"])


def test_the_tensorboard_example_writes_events_read_back(tmp_path):
    """docs/metrics.md's TensorBoard callback, for real: its scalars read back from the files."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs"))

    def to_tensorboard(m):
        writer.add_scalars("data", {"stall_fraction": m["stall_fraction"], "data_wait_s": m["data_wait_s"]},
                           m["steps"])
        writer.add_scalars("stages", {k[6:-2]: v for k, v in m.items() if k.startswith("stage.")}, m["steps"])

    ds = sd.TarDataset(_local(tmp_path, [12] * 2), index=None)
    with sd.loader(ds, batch_size=2, num_workers=0, log_every=3, on_metrics=to_tensorboard) as loader:
        for _ in loader:
            pass
    writer.close()
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "runs"))
    runs.Reload()
    scalars = {run: runs.Scalars(run, tags["scalars"][0]) for run, tags in runs.Runs().items()
               if tags["scalars"]}
    assert len(scalars) == 2 + len(STAGES) + len(MODALITIES)  # add_scalars: one run per name
    for events in scalars.values():
        assert [e.step for e in events] == [3, 6, 9, 12]
