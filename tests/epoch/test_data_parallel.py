"""The data-parallel place (``ranks.data_parallel``): how it is given, what is refused, and that a
replica reads what a rank of that place reads in a job of as many ranks. The real 4-rank
TP=2 x DP=2 job is tests/test_dp_groups.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamdata as sd
from streamdata.errors import SpecError
from streamdata.ranks import DataParallel, data_parallel
from tests.helpers import rank_env


@pytest.fixture
def parquet_spec(tmp_path):
    ids = 0
    for i, groups in enumerate([[5, 1, 9], [3], [7, 2], [13, 4]]):  # 44 rows
        with pq.ParquetWriter(tmp_path / f"part-{i}.parquet", pa.schema([("id", pa.int64())])) as w:
            for n in groups:
                w.write_table(pa.table({"id": np.arange(ids, ids + n)}))
                ids += n
    return str(tmp_path) + "/", ids


def test_none_given_is_no_place():
    assert data_parallel() is None


def test_rank_and_size_make_a_place():
    assert data_parallel(1, 3) == DataParallel(1, 3)


@pytest.mark.parametrize("kwargs,says", [
    ({"dp_rank": 1}, "go together"),
    ({"dp_size": 2}, "go together"),
    ({"dp_rank": 2, "dp_size": 2}, "0 <= dp_rank < dp_size"),
    ({"dp_rank": -1, "dp_size": 2}, "0 <= dp_rank < dp_size"),
    ({"dp_rank": 0, "dp_size": 0}, "0 <= dp_rank < dp_size"),
    ({"dp_rank": 0.0, "dp_size": 2}, "0 <= dp_rank < dp_size"),
    ({"dp_rank": 0, "dp_size": 2, "group": object()}, "one way"),
])
def test_a_wrong_place_is_refused(kwargs, says):
    with pytest.raises(SpecError, match=says):
        data_parallel(**kwargs)


def test_a_whole_mesh_is_refused_with_its_dimensions():
    class TwoD:  # the shape of a 2-D DeviceMesh, as far as the check reads it
        ndim, mesh_dim_names = 2, ("dp", "tp")

    with pytest.raises(SpecError, match=r"mesh\['dp'\].*\('dp', 'tp'\)"):
        data_parallel(mesh=TwoD())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_replica_reads_what_that_rank_reads(parquet_spec, num_workers):
    """REPLICA-PLAN: replica r of n (whatever the global rank) reads rank r of n's batches; the
    replicas split the epoch exactly."""
    spec, total = parquet_spec

    def batches(**place):
        ds = sd.ParquetDataset(spec, shuffle=True, seed=4, **place)
        with sd.loader(ds, batch_size=4, num_workers=num_workers) as loader:
            return [b["id"].tolist() for b in loader]

    by_rank = []
    for rank in range(2):
        with rank_env(rank, 2):
            by_rank.append(batches())
    replicas = [batches(dp_rank=r, dp_size=2) for r in range(2)]
    assert replicas == by_rank
    with rank_env(1, 4):  # the place wins over the global rank
        assert batches(dp_rank=0, dp_size=2) == by_rank[0]
    ids = sorted(i for b in replicas[0] + replicas[1] for i in b)
    assert ids == list(range(total))


def test_the_loader_gives_the_place_to_the_dataset(parquet_spec):
    spec, _ = parquet_spec
    ds = sd.ParquetDataset(spec)
    sd.loader(ds, batch_size=4, dp_rank=1, dp_size=2)
    assert ds.data_parallel == DataParallel(1, 2)
    with pytest.raises(SpecError, match="give it once"):
        sd.loader(ds, batch_size=4, dp_rank=0, dp_size=2)


def test_the_loader_refuses_a_place_for_a_dataset_it_cannot_split():
    with pytest.raises(SpecError, match="cannot be split by data-parallel group"):
        sd.loader(list(range(8)), batch_size=4, dp_rank=0, dp_size=2)


def test_a_mix_takes_the_place_to_its_sources(parquet_spec):
    spec, _ = parquet_spec
    a, b = sd.ParquetDataset(spec), sd.ParquetDataset(spec, seed=1)
    mix = sd.Mix([a, b], weights=[1, 1], dp_rank=1, dp_size=2)
    assert a.data_parallel == b.data_parallel == mix.data_parallel == DataParallel(1, 2)
    with pytest.raises(SpecError):
        sd.Mix([sd.ParquetDataset(spec, dp_rank=0, dp_size=2), sd.ParquetDataset(spec, dp_rank=1, dp_size=2)],
               weights=[1, 1])


def _accelerate_env(monkeypatch, **sizes):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, value in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", str(value))


def test_accelerate_parallelism_config_gives_the_place(monkeypatch, caplog):
    """LAUNCHER-PLACE: accelerate's mesh puts data parallelism outermost: replicas of tp*cp ranks."""
    _accelerate_env(monkeypatch, tp=2, cp=2, dp_shard=3)
    with rank_env(9, 12), caplog.at_level("INFO", logger="streamdata"):
        assert data_parallel() == DataParallel(2, 3)
        assert data_parallel(0, 1) == DataParallel(0, 1)  # a place given wins
    assert "replica 2 of 3, from accelerate's parallelism config" in caplog.text


def test_accelerate_without_model_parallelism_changes_nothing(monkeypatch):
    _accelerate_env(monkeypatch, tp=1, dp_shard=4)
    with rank_env(3, 4):
        assert data_parallel() is None


def test_accelerate_sizes_that_do_not_fit_the_job_are_refused(monkeypatch):
    _accelerate_env(monkeypatch, tp=2, dp_shard=3)
    with rank_env(0, 4), pytest.raises(SpecError, match="3 data-parallel x 2 model-parallel ranks, the job"):
        data_parallel()


def test_a_launcher_place_reaches_the_dataset_and_leaves_other_datasets_alone(monkeypatch, parquet_spec):
    spec, _ = parquet_spec
    _accelerate_env(monkeypatch, tp=2, dp_shard=2)
    with rank_env(3, 4):
        assert sd.ParquetDataset(spec).data_parallel == DataParallel(1, 2)
        sd.loader(list(range(8)), batch_size=4)  # not ours to split: no error
