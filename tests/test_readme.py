"""The README's code runs as written: the quick start and every recipe, against local servers.

A recipe names a bucket on the internet (``s3://bkt``, ``gs://bkt``, ``https://data.example.com``)
or a MinIO on ``127.0.0.1:9000``. Each test fills a loopback server with the data the recipe
reads, points those names (and nothing else) at it, gives the recipe's own functions
(``train_step``, ``make_model``) a body that records what it was handed, runs the block, and
checks what the recipe promises: every sample once, the resumed rest, the cache's hits...
S3 credentials and the endpoint reach the recipes as boto finds them on a real machine: from
the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import doc_blocks, make_samples, s3_environment, tar_bytes, torchrun

README = Path(__file__).resolve().parent.parent / "README.md"
MINIO = "http://127.0.0.1:9000"  # the endpoint the README names
TRAIN = 32  # shards of s3://bkt/train-{000000..000031}.tar, 4 samples each
TABLE_ROWS = 1000


def _blocks(heading: str) -> list[str]:
    """The README's ```python blocks under ``heading`` (a whole line), up to the next heading."""
    return doc_blocks(README, heading)


def _keyed(counts: list[int], prefix: str) -> list[list[dict]]:
    shards = make_samples(counts)
    for shard in shards:
        for sample in shard:
            sample["__key__"] = prefix + sample["__key__"]
    return shards


def _keys(shards: list[list[dict]]) -> list[str]:
    return [s["__key__"] for shard in shards for s in shard]


@pytest.fixture(scope="module")
def bkt(s3_server):
    """``bkt`` on the S3 test server: the recipes' shards, a prefix, a second source, tables."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    s3_server.create_bucket("bkt")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    data = {"train": _keyed([4] * TRAIN, "t"), "prefix": _keyed([4] * 4, "p"),
            "extra": _keyed([4] * 8, "e")}
    for i, samples in enumerate(data["train"]):
        fs.pipe_file(f"bkt/train-{i:06d}.tar", tar_bytes(samples))
    for i, samples in enumerate(data["prefix"]):
        fs.pipe_file(f"bkt/train/part-{i:06d}.tar", tar_bytes(samples))
    for i, samples in enumerate(data["extra"]):
        fs.pipe_file(f"bkt/extra/part-{i:06d}.tar", tar_bytes(samples))
    for i in range(4):  # 4 files x 2 row groups
        rows = np.arange(i * TABLE_ROWS // 4, (i + 1) * TABLE_ROWS // 4)
        x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(rows, 8).astype(np.float32)), 8)
        table = pa.table({"x": x, "label": pa.array(rows), "unused": pa.array(rows * 2)})
        with fs.open(f"bkt/tables/part-{i}.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=TABLE_ROWS // 8)
    import streamdata as sd

    # the index the README has the reader build once (`streamdata index SPEC`): exact epochs
    sd.build_index("s3://bkt/train-{000000..000031}.tar", storage_options=s3_server.storage_options,
                   progress=False)
    assert fs.exists("bkt/_streamdata.sdx")
    yield s3_server, fs, data


@pytest.fixture
def aws(bkt, monkeypatch):
    """The test server as the environment's S3 (endpoint and keys), for the recipe and its workers."""
    server, fs, data = bkt
    opts = server.storage_options
    s3_environment(monkeypatch, opts)
    return server, fs, data


def _run(code: str, **names) -> tuple[dict, list]:
    """Run ``code`` with a recording ``train_step``; returns its namespace and what it recorded."""
    seen: list = []
    ns = {"__name__": "__readme__", "train_step": lambda *args: seen.append(args[-1]), **names}
    exec(compile(code, str(README), "exec"), ns)
    import streamdata as sd

    for value in ns.values():  # what the script's exit would end: persistent workers
        if isinstance(value, sd.Loader):
            value.close()
    return ns, seen


def _batch_keys(batches: list) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def test_quick_start_runs(aws):
    server, _, data = aws
    code = _blocks("## Quick start")[0]
    assert MINIO in code
    code = code.replace(MINIO, server.endpoint_url).replace("    ...", "    train_step(batch)")
    _, seen = _run(code)
    assert sorted(_batch_keys(seen)) == sorted(_keys(data["train"]))
    assert all(set(b) >= {"__key__", "npy", "cls"} for b in seen)
    assert tuple(seen[0]["npy"].shape) == (32, 8)


def test_s3_recipe(aws):
    server, _, data = aws
    code = _blocks("### S3")[0]
    opts = server.storage_options
    code = (code.replace(MINIO, server.endpoint_url)
            .replace('"minio123"', repr(opts["secret"])).replace('"minio"', repr(opts["key"])))
    ns, seen = _run(code)
    assert sorted(s["__key__"] for s in seen) == sorted(_keys(data["prefix"]))
    assert all(s["__url__"].startswith("s3://bkt/train/") for s in seen)
    assert ns["ds"].storage_options["endpoint_url"] == server.endpoint_url


def test_gcs_recipe(gcs_bucket):
    gcs_server, bucket = gcs_bucket
    import gcsfs

    shards = _keyed([4] * 4, "g")
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **gcs_server.storage_options)
    for i, samples in enumerate(shards):
        fs.pipe_file(f"{bucket}/train/part-{i:06d}.tar", tar_bytes(samples))
    code = _blocks("### Google Cloud Storage")[0]
    assert '{"token": "anon"}' in code
    code = code.replace("gs://bkt/", f"gs://{bucket}/").replace(
        '{"token": "anon"}', repr(gcs_server.storage_options))
    _, seen = _run(code)
    assert sorted(s["__key__"] for s in seen) == sorted(_keys(shards))


def test_http_recipe(http_server, tmp_path):
    shards = _keyed([4] * TRAIN, "h")
    for i, samples in enumerate(shards):
        (tmp_path / f"train-{i:06d}.tar").write_bytes(tar_bytes(samples))
    server = http_server(tmp_path)
    code = _blocks("### HTTP(S)")[0]
    code = code.replace("https://data.example.com", server.endpoint_url)
    _, seen = _run(code)
    assert sorted(s["__key__"] for s in seen) == sorted(_keys(shards))


DDP_PRELUDE = '''
import json as _json, os as _os, sys as _sys
import torch as _torch
SEEN = []
epochs = 1
def make_model():
    return _torch.nn.Linear(8, 1)
def train_step(model, batch):
    model(batch["npy"].float()).sum().backward()
    SEEN.append(list(batch["__key__"]))
'''
DDP_POSTLUDE = '''
with open(_os.path.join(_sys.argv[1], f"readme-rank{_os.environ['RANK']}.json"), "w") as _f:
    _json.dump({"batches": SEEN, "undelivered": loader.undelivered}, _f)
'''


@pytest.mark.slow  # a 2-rank torchrun job: about a minute on 2 loaded cores
def test_ddp_recipe_under_torchrun(aws, tmp_path):
    _, _, data = aws
    code = _blocks("### DDP with torchrun")[0]
    job = tmp_path / "train.py"
    job.write_text(DDP_PRELUDE + code + DDP_POSTLUDE)
    ranks = torchrun(job, tmp_path, 2, {"tag": "readme"})
    steps = [len(r["batches"]) for r in ranks]
    assert steps[0] == steps[1] > 0  # the same number of steps on every rank
    keys = [k for r in ranks for b in r["batches"] for k in b]
    assert sorted(keys) == sorted(_keys(data["train"]))  # even shards: every sample once
    assert [r["undelivered"] for r in ranks] == [0, 0]


def test_resume_recipe(aws, tmp_path, monkeypatch):
    _, _, data = aws
    monkeypatch.chdir(tmp_path)
    code = _blocks("### Resume mid-epoch")[0]
    _, seen = _run(code)
    keys = _batch_keys(seen)
    assert len(seen) > 2  # two batches before the restart, the rest after it
    assert Counter(keys) == Counter(_keys(data["train"]))  # every sample once over both runs
    state = json.loads((tmp_path / "data-state.json").read_text())
    assert state["format"] == "streamdata-state"


def test_merge_states_recipe(aws):
    _, _, data = aws
    # (the README points at it: docs/resume.md holds the recipe)
    code = doc_blocks(README.parent / "docs" / "resume.md",
                      "### On another world: one state of every reader's")[0]
    ns, seen = _run(code)
    assert ns["ds"].state_dict()["stages"]  # the merged position was loaded
    keys = _batch_keys(seen)
    assert Counter(keys) == Counter(_keys(data["train"]))  # 2 batches, then the rest, on 1 worker


def test_mix_recipe(aws):
    _, _, data = aws
    code = _blocks("### Mixing sources")[0]
    _, seen = _run(code)
    keys = _batch_keys(seen)
    assert len(keys) == len(set(keys)) > 0  # no sample twice in the mix's epoch
    train, extra = set(_keys(data["train"])), set(_keys(data["extra"]))
    assert set(keys) <= train | extra
    # stop="first": the mix ends when a source runs out; at 0.3 that is the 32-sample one
    assert set(keys) & extra == extra and set(keys) & train


def test_parquet_recipe(aws):
    code = _blocks("### Parquet and Arrow")[0]
    _, seen = _run(code)
    labels = [int(v) for b in seen for v in b["label"]]
    assert sorted(labels) == list(range(TABLE_ROWS))
    assert set(seen[0]) == {"x", "label"}  # only the columns asked for
    assert tuple(seen[0]["x"].shape) == (256, 8)
    assert all((b["x"][:, 0] == b["label"]).all() for b in seen)


def test_cache_recipe(aws, tmp_path, capsys):
    _, _, data = aws
    code = _blocks("### Local disk cache")[0]
    assert "/local/nvme/sd-cache" in code
    cache = tmp_path / "sd-cache"
    ns, seen = _run(code.replace("/local/nvme/sd-cache", str(cache)))
    keys = _batch_keys(seen)
    assert Counter(keys) == Counter(_keys(data["train"]) * 2)  # two whole epochs
    counts = ns["ds"].counts
    # epoch 1 fills the cache (misses), epoch 2 reads the same units from it (as many hits)
    assert counts["cache.hits"] >= counts["cache.misses"] > 0
    assert capsys.readouterr().out.split() == [str(counts["cache.hits"]), str(counts["cache.misses"])]
    assert any(cache.iterdir())


def test_gpu_feed_recipe(aws):
    import torch

    _, _, data = aws
    code = _blocks("### The GPU feed")[0]
    _, seen = _run(code)
    assert sorted(_batch_keys(seen)) == sorted(_keys(data["train"]))
    want = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA: passed through
    assert all(b["npy"].device.type == want for b in seen)


def test_networks_recipe(aws):
    """Through a real forward proxy (CONNECT), the only way to the name, to a TLS front whose
    certificate only the recipe's CA file trusts; botocore signs (keys from the environment)."""
    from streamdata.testing import ForwardProxy, TLSFront

    server, _, data = aws
    code = _blocks("### Networks: proxies and private certificates")[0]
    with ForwardProxy({"s3.corp.example": "127.0.0.1"}) as proxy, \
            TLSFront(server.endpoint_url, names=["s3.corp.example"]) as front:
        code = (code.replace("https://s3.corp.example", f"https://s3.corp.example:{front.port}")
                .replace("http://proxy.corp.example:3128", proxy.url)
                .replace("/etc/ssl/certs/corp-ca.pem", front.ca_file))
        _, seen = _run(code)
    assert sorted(s["__key__"] for s in seen) == sorted(_keys(data["train"]))
    assert any(method == "CONNECT" and target.startswith("s3.corp.example:")
               for method, target in proxy.requests)


def test_errors_recipe(aws, capsys):
    _, _, data = aws
    code = _blocks("### Errors")[0]
    ns, seen = _run(code)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "not there: s3://bkt/no-such-prefix/"
    assert sorted(s["__key__"] for s in seen) == sorted(_keys(data["train"]))
    assert ns["ds"].skipped == {"fetch": 0, "timeout": 0, "format": 0, "decode": 0, "other": 0}
    assert out[1] == str(ns["ds"].skipped)


def test_writing_recipe(aws):
    import streamdata as sd

    _, fs, _ = aws
    code = _blocks("### Writing shards")[0]
    _run(code)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("bkt/written/")) == [
        "_streamdata.sdx", "train-000000.tar", "train-000001.tar", "train-000002.tar"]
    samples = list(sd.TarDataset("s3://bkt/written/"))
    assert sorted(s["__key__"] for s in samples) == [f"{i:08d}" for i in range(250)]
    assert all(int(s["npy"][0]) == int(s["__key__"]) and s["cls"] == int(s["__key__"]) % 10
               for s in samples)
