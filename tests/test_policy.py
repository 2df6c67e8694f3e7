"""The one error policy and what crosses the worker pipe: counts per reason, one warning per
shard, errors that keep type, url, key and where in the training loop."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import streamdata as sd
from streamdata.config import FetchConfig
from tests.helpers import make_samples, tar_bytes


def _caught(loader) -> BaseException:
    """The error iterating ``loader`` raised, without its traceback (whose frames would keep
    the iterator, and so its workers, alive), once the workers are gone."""
    caught = None
    try:
        for _ in loader:
            pass
    except Exception as exc:
        caught = exc.with_traceback(None)
    gc.collect()  # the finished iterator shuts its workers down
    assert caught is not None, "no error reached the training loop"
    return caught


def _bad_npy_shards(tmp_path, shards: int = 4) -> str:
    """``shards`` shards of 3 samples; the second sample of each has an undecodable .npy."""
    for i, samples in enumerate(make_samples([3] * shards)):
        samples[1]["npy"] = b"not an npy file"
        (tmp_path / f"s-{i}.tar").write_bytes(tar_bytes(samples))
    return str(tmp_path / f"s-{{0..{shards - 1}}}.tar")


def test_a_worker_error_reaches_the_loop_with_type_url_key_and_where(tmp_path):
    """CONTEXT-ACROSS-PROCESSES: the error torch rebuilds from a worker's traceback text has its
    type, URL, key and place."""
    ds = sd.TarDataset(_bad_npy_shards(tmp_path))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    exc = _caught(loader)
    assert type(exc) is sd.DecodeError
    assert exc.url is not None and exc.url.endswith(".tar") and exc.url.startswith(str(tmp_path))
    assert exc.key is not None and exc.key.startswith("s0000")
    assert exc.where is not None and "/2" in exc.where and "worker" in exc.where
    assert exc.url in str(exc)


def test_a_truncated_shard_in_a_worker_is_a_format_error_with_its_url(tmp_path):
    data = tar_bytes(make_samples([4])[0])
    (tmp_path / "cut.tar").write_bytes(data[:700])  # inside the first member's data
    loader = torch.utils.data.DataLoader(sd.TarDataset(str(tmp_path / "cut.tar")), batch_size=None,
                                         num_workers=2)
    exc = _caught(loader)
    assert isinstance(exc, sd.FormatError) and exc.url.endswith("cut.tar")
    assert exc.where is not None and "worker" in exc.where


def test_skips_are_counted_per_reason_over_every_worker(tmp_path):
    ds = sd.TarDataset(_bad_npy_shards(tmp_path), on_error="skip")
    assert ds.skipped == dict.fromkeys(("fetch", "timeout", "format", "decode", "other"), 0)
    assert ds.retried == dict.fromkeys(("throttled", "server", "timeout", "connection", "short", "other"), 0)
    from streamdata.metrics import COUNTERS

    assert set(ds.counts) == set(COUNTERS)  # every counter readable, at 0
    assert {f"skipped.{k}" for k in ds.skipped} | {f"retried.{k}" for k in ds.retried} <= set(ds.counts)
    assert not any(ds.counts.values())
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    keys = [s["__key__"] for s in loader]
    assert len(keys) == 8  # 4 shards x 3 samples, one bad in each
    assert ds.skipped["decode"] == 4 and sum(ds.skipped.values()) == 4
    keys2 = [s["__key__"] for s in loader]  # a second epoch adds to the same counters
    assert sorted(keys2) == sorted(keys) and ds.skipped["decode"] == 8


def test_the_loader_reads_the_same_counts(tmp_path):
    ds = sd.TarDataset(_bad_npy_shards(tmp_path), on_error="skip", batch_size=2)
    with sd.loader(ds, num_workers=2) as feed:
        assert sum(len(b["__key__"]) for b in feed) == 8
        assert feed.skipped["decode"] == 4 and feed.skipped == ds.skipped


def test_a_truncated_shard_skipped_counts_as_format(tmp_path):
    good = tar_bytes(make_samples([2])[0])
    (tmp_path / "a.tar").write_bytes(good)
    (tmp_path / "b.tar").write_bytes(good[:700])
    ds = sd.TarDataset([str(tmp_path / "a.tar"), str(tmp_path / "b.tar")], on_error="skip")
    assert len(list(ds)) == 2
    assert ds.skipped["format"] == 1 and sum(ds.skipped.values()) == 1


def test_one_warning_per_shard_however_many_skips(tmp_path, caplog):
    for i in range(2):
        samples = make_samples([5])[0]
        for s in samples[1:4]:
            s["npy"] = b"bad"
        (tmp_path / f"w-{i}.tar").write_bytes(tar_bytes(samples))
    ds = sd.TarDataset(str(tmp_path / "w-{0..1}.tar"), on_error="skip")
    with caplog.at_level(logging.DEBUG, logger="streamdata"):
        assert len(list(ds)) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "skipped" in r.getMessage()]
    assert len(warnings) == 2 and len(debug) == 4
    assert {r.getMessage().split("w-")[1][0] for r in warnings} == {"0", "1"}
    assert ds.skipped["decode"] == 6


def test_a_callable_policy_decides_and_only_skips_are_counted(tmp_path):
    ds = sd.TarDataset(_bad_npy_shards(tmp_path, 2), on_error=lambda exc: exc.url.endswith("s-0.tar"))
    with pytest.raises(sd.DecodeError, match="s-1.tar"):
        list(ds)
    assert ds.skipped["decode"] == 1
    ds = sd.TarDataset(_bad_npy_shards(tmp_path, 2), on_error=lambda exc: False)
    with pytest.raises(sd.DecodeError):
        list(ds)
    assert sum(ds.skipped.values()) == 0


def test_map_errors_of_ours_follow_the_policy(tmp_path):
    (tmp_path / "m.tar").write_bytes(tar_bytes(make_samples([4])[0]))

    def picky(sample):
        if sample["cls"] % 2:
            raise sd.DecodeError("odd", url=sample["__url__"], key=sample["__key__"])
        return sample

    ds = sd.TarDataset(str(tmp_path / "m.tar"), map=picky, on_error="skip")
    assert [s["cls"] for s in ds] == [0, 2] and ds.skipped["decode"] == 2


def test_flat_options_map_onto_the_fetch_config_in_one_place(tmp_path, monkeypatch):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([1])[0]))
    url = str(tmp_path / "a.tar")
    assert sd.TarDataset(url, window=3, part_size=1 << 20).fetch_config.replace(
        window=32, part_size=8 << 20) == FetchConfig()
    base = FetchConfig(retries=9)
    assert sd.TarDataset(url, fetch_config=base, timeout=5).fetch_config == base.replace(timeout=5)
    with pytest.raises(sd.SpecError, match=r"unknown option 'windw' \(did you mean 'window'\?\).*window"):
        sd.TarDataset(url, windw=3)
    # the nearest of the dataset's own parameters too, from every class's __init__ it has
    with pytest.raises(sd.SpecError, match=r"'shuffle_bufer' \(did you mean 'shuffle_buffer'\?\)"):
        sd.TarDataset(url, shuffle_bufer=100)
    with pytest.raises(sd.SpecError, match=r"unknown option 'max_count' \(did you mean 'maxcount'\?\)"):
        sd.ShardWriter(str(tmp_path / "w-%06d.tar"), max_count=10)
    with pytest.raises(sd.SpecError, match=r"unknown option 'owner'; fetch"):  # nothing near: no hint
        sd.TarDataset(url, owner=1)
    monkeypatch.setenv("STREAMDATA_BYTE_BUDGET", str(1 << 20))
    assert sd.TarDataset(url).fetch_config.byte_budget == 1 << 20


def test_a_format_default_yields_to_the_environment_config_and_options(monkeypatch):
    assert FetchConfig.resolve(defaults={"window": 16}).window == 16
    assert FetchConfig.resolve(defaults={"window": 16}, window=4).window == 4
    assert FetchConfig.resolve(FetchConfig(window=40), defaults={"window": 16}).window == 40
    monkeypatch.setenv("STREAMDATA_WINDOW", "32")
    assert FetchConfig.resolve(defaults={"window": 16}).window == 32


class _Adds(torch.utils.data.IterableDataset):
    def __init__(self, counters, n: int) -> None:
        self.counters, self.n = counters, n

    def __iter__(self):
        for _ in range(self.n):
            self.counters.add("hits")
        yield torch.utils.data.get_worker_info().id


def test_counters_from_concurrent_workers_lose_nothing():
    from streamdata.metrics import Counters

    counters = Counters(["hits", "misses"])
    counters.add("misses", 3)  # the main process's own row
    loader = torch.utils.data.DataLoader(_Adds(counters, 20000), batch_size=None, num_workers=2)
    assert sorted(loader) == [0, 1]
    assert counters.snapshot() == {"hits": 40000, "misses": 3}
