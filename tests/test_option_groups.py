"""Typed option groups (docs/loading.md, "Options"): ``fetch=sd.Fetch(...)``, ``retry=sd.Retry(...)``
and ``cache=sd.Cache(...)`` give a dataset or writer the same ``FetchConfig`` as the flat keywords,
which still work with a ``DeprecationWarning`` naming the group to use; a field left ``None``
takes its environment variable, else its default; an option given twice, or a group of the wrong
type, is a ``SpecError``."""

from __future__ import annotations

import warnings

import fsspec
import pytest

import streamdata as sd
from tests.helpers import write_shards


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    write_shards(fsspec.filesystem("file"), str(root), counts=[3, 4])
    return str(root) + "/"


def test_groups_give_the_config_the_flat_keywords_give(spec, tmp_path):
    flat = dict(window=3, max_requests=5, byte_budget=8 << 20, retry_deadline=20.0, retries=2, timeout=7.0,
                cache_dir=str(tmp_path / "c"), cache_limit=1 << 30)
    with pytest.warns(DeprecationWarning, match=r"flat fetch options.*fetch=sd.Fetch\(window=...\)"):
        old = sd.TarDataset(spec, **flat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the groups warn nothing
        new = sd.TarDataset(spec, fetch=sd.Fetch(window=3, max_requests=5, byte_budget=8 << 20),
                            retry=sd.Retry(deadline=20.0, retries=2, timeout=7.0),
                            cache=sd.Cache(dir=str(tmp_path / "c"), limit=1 << 30))
    assert new.fetch_config == old.fetch_config
    assert [s["__key__"] for s in new] == [s["__key__"] for s in old]


def test_a_field_not_given_takes_its_environment_variable_else_its_default(spec, monkeypatch):
    monkeypatch.setenv("STREAMDATA_WINDOW", "6")
    assert sd.TarDataset(spec, fetch=sd.Fetch(max_requests=2)).fetch_config.window == 6
    assert sd.TarDataset(spec, fetch=sd.Fetch(window=2)).fetch_config.window == 2
    monkeypatch.delenv("STREAMDATA_WINDOW")
    assert sd.TarDataset(spec, fetch=sd.Fetch()).fetch_config == sd.FetchConfig()


def test_an_option_given_twice_or_a_wrong_group_is_refused(spec):
    with pytest.raises(sd.SpecError, match=r"window is given twice"), pytest.warns(DeprecationWarning):
        sd.TarDataset(spec, window=3, fetch=sd.Fetch(window=4))
    with pytest.raises(sd.SpecError, match=r"retry= takes sd.Retry"):
        sd.TarDataset(spec, retry=sd.Fetch(window=4))
    with pytest.raises(sd.SpecError, match=r"did you mean 'retry'"):
        sd.TarDataset(spec, retyr=sd.Retry(deadline=1))
    with pytest.raises(TypeError):
        sd.Fetch(8)  # keyword-only: a group's fields are named


def test_writers_and_the_object_dataset_take_the_groups(spec, tmp_path):
    objects = sd.ObjectDataset(spec, retry=sd.Retry(timeout=9.0))
    assert objects.fetch_config.timeout == 9.0
    with sd.ShardWriter(str(tmp_path / "out-%06d.tar"), maxcount=10, retry=sd.Retry(retries=1)) as sink:
        sink.write({"__key__": "a", "txt": "x"})
    assert (tmp_path / "out-000000.tar").exists()
