"""Every documented error case raises the documented exception, naming the URL, before workers start."""

from __future__ import annotations

import gc

import pytest

import streamdata as sd
from tests.helpers import make_samples, tar_bytes


def test_empty_brace_expansion(tmp_path):
    with pytest.raises(sd.SpecError, match="empty range"):
        sd.TarDataset(str(tmp_path / "x-{5..3}.tar"))


def test_empty_list_and_bad_items():
    with pytest.raises(sd.SpecError):
        sd.TarDataset([])
    with pytest.raises(sd.SpecError):
        sd.TarDataset([""])


def test_unknown_protocol():
    with pytest.raises(sd.SpecError, match="unknown protocol 'nosuch'"):
        sd.TarDataset("nosuch://bucket/x.tar")


def test_glob_and_prefix_matching_nothing(tmp_path):
    with pytest.raises(sd.ShardNotFoundError, match="matched no objects"):
        sd.TarDataset(str(tmp_path / "*.tar"))
    with pytest.raises(sd.ShardNotFoundError):
        sd.TarDataset(str(tmp_path / "missing-"))


def test_missing_shards_of_a_pattern(tmp_path):
    (tmp_path / "a-0.tar").write_bytes(tar_bytes(make_samples([1])[0]))
    with pytest.raises(sd.ShardNotFoundError, match="1 of 2 shards") as info:
        sd.TarDataset(str(tmp_path / "a-{0..1}.tar"))
    assert info.value.url.endswith("a-1.tar")


def test_duplicate_shards(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([1])[0]))
    with pytest.raises(sd.SpecError, match="more than once"):
        sd.TarDataset([str(tmp_path / "a.tar")] * 2)


def test_bad_options(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([1])[0]))
    for kwargs in ({"batch_size": 0}, {"on_error": "ignore"}, {"window": 0}, {"decode": "nosuchspec"}):
        with pytest.raises(sd.SpecError):
            sd.TarDataset(str(tmp_path / "a.tar"), **kwargs)


def test_no_such_bucket(s3_server):
    with pytest.raises(sd.ShardNotFoundError, match="s3://no-such-bucket-xyz"):
        sd.TarDataset("s3://no-such-bucket-xyz/train-{0..3}.tar", storage_options=s3_server.storage_options)


def test_no_credentials(s3_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
    options = {k: v for k, v in s3_server.storage_options.items() if k not in ("key", "secret", "token")}
    with pytest.raises(sd.AccessDeniedError, match="access denied. Check credentials"):
        sd.TarDataset("s3://some-bucket/train-{0..1}.tar", storage_options=options)


def test_hdfs_without_client_libraries_names_what_is_missing():
    with pytest.raises(sd.BackendMissingError, match="hdfs:// backend could not start") as info:
        sd.TarDataset("hdfs://namenode:8020/data/train-{000..003}.tar")
    assert "JAVA_HOME" in str(info.value)


def test_object_vanishing_after_listing_raises_fetch_error(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([2])[0]))
    ds = sd.TarDataset(str(tmp_path / "a.tar"), retries=0)
    (tmp_path / "a.tar").unlink()
    with pytest.raises(sd.ShardNotFoundError) as info:
        list(ds)
    assert "a.tar" in str(info.value) and "worker 0/1" in str(info.value)


@pytest.mark.slow
def test_worker_errors_keep_their_type_through_the_dataloader(tmp_path):
    import torch

    (tmp_path / "bad.tar").write_bytes(tar_bytes([{"__key__": "k0", "npy": b"not npy"}]))
    loader = torch.utils.data.DataLoader(sd.TarDataset(str(tmp_path / "bad.tar")), batch_size=None,
                                         num_workers=1, multiprocessing_context="fork")
    caught = None
    try:
        list(loader)
    except Exception as exc:  # keep only the type and text: the traceback pins the workers
        caught = (type(exc), str(exc))
    gc.collect()  # the finished iterator shuts its workers down
    assert caught is not None and caught[0] is sd.DecodeError and "bad.tar" in caught[1]


def test_errors_pickle_with_context():
    import pickle

    err = sd.DecodeError("boom", url="s3://b/k.tar", key="k1", where="rank 0/1, worker 1/2")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is sd.DecodeError and back.key == "k1" and str(back) == str(err)
    assert isinstance(sd.ShardNotFoundError("x"), FileNotFoundError)
    assert isinstance(sd.FetchTimeoutError("x"), TimeoutError)
