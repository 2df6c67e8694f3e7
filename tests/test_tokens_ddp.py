"""Real ``torchrun`` jobs over ``sd.TokenDataset`` (gloo on CPU, the S3 test server), for flat
.bin, Megatron .bin + .idx (also with packing="fit"), Parquet list columns and tar shards of
.npy fields: a whole epoch on 2 ranks x 2 workers (every token of the stream in exactly one
sequence, equal steps), and, for flat .bin and tar, on 1 and 3 ranks x 0 and 2 workers; the
same job stopped at a seeded step, its state restarted on 2 x 2, 3 x 1 and 1 x 0: before +
after = the epoch's sequences exactly."""

from __future__ import annotations

import collections
import io
import random
import tarfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from streamdata.formats.tokens import idx_bytes
from tests.helpers import npy_tar, torchrun

JOB = Path(__file__).parent / "jobs" / "tokens_job.py"
TIME_LIMIT_S = 300
WORLDS = (("same", 2, 2), ("three", 3, 1), ("one", 1, 0))  # tag, ranks, workers
LENGTHS = [[30, 0, 75, 12], [160], [9, 14, 3, 40, 21], [55, 66]]  # documents per file: 485 tokens
WHOLE = [(name, tag, workers) for name in ("bin", "tar") for tag in ("one", "three") for workers in (0, 2)]


def _write(fs, bucket: str) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    at = 0
    for i, lengths in enumerate(LENGTHS):
        docs = [np.arange(at + sum(lengths[:k]), at + sum(lengths[:k + 1])) for k in range(len(lengths))]
        at += sum(lengths)
        flat = np.concatenate(docs).astype(np.uint16)
        fs.pipe_file(f"{bucket}/bin/part-{i}.bin", flat.tobytes())
        fs.pipe_file(f"{bucket}/idx/part-{i}.bin", flat.tobytes())
        fs.pipe_file(f"{bucket}/idx/part-{i}.idx", idx_bytes(lengths, np.uint16))
        fs.pipe_file(f"{bucket}/tar/part-{i}.tar", npy_tar(docs, np.uint16, "doc"))
        with fs.open(f"{bucket}/parquet/part-{i}.parquet", "wb") as f:
            pq.write_table(pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))}),
                           f, row_group_size=2)
    common = {"seq_len": 16, "batch_size": 3, "shuffle": True, "seed": 5}
    return {"bin": {"spec": f"s3://{bucket}/bin/", "options": {**common, "dtype": "uint16"}},
            "idx": {"spec": f"s3://{bucket}/idx/", "options": {**common, "eos_id": 60000, "partial": "pad",
                                                             "targets": True}},
            "idx-fit": {"spec": f"s3://{bucket}/idx/",
                        "options": {**common, "eos_id": 60000, "packing": "fit", "documents": True}},
            "parquet": {"spec": f"s3://{bucket}/parquet/",
                        "options": {**common, "column": "tokens", "bos_id": 60001}},
            "tar": {"spec": f"s3://{bucket}/tar/",
                    "options": {**common, "field": "npy", "bos_id": 60001, "eos_id": 60000}}}


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    import s3fs

    import streamdata as sd

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    tmp_path = tmp_path_factory.mktemp("tokens-ddp")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
        cases = _write(fs, bucket)
        for case in cases.values():
            case["options"]["storage_options"] = s3_server.storage_options
        everything = {}
        for name, case in cases.items():  # the epoch's sequences, read by one reader here
            ds = sd.TokenDataset(case["spec"], **case["options"])
            ds.set_epoch(1)
            everything[name] = [tuple(s) for b in ds for s in b["input_ids"].tolist()]
        stops = {name: random.Random(7 + i).randint(2, 8) for i, name in enumerate(cases)}
        first = torchrun(JOB, tmp_path, 2, {"workers": 2, "tag": "first", "cases": {
            **{f"{name}-whole": case for name, case in cases.items()},
            **{name: {**case, "stop": stops[name], "save": str(tmp_path / f"{name}.json")}
               for name, case in cases.items()}}}, TIME_LIMIT_S)
        after = {tag: torchrun(JOB, tmp_path, nproc, {"workers": workers, "tag": tag, "cases": {
            **{name: {**case, "load": str(tmp_path / f"{name}.json")} for name, case in cases.items()},
            **{f"{name}-whole-{w}": {**cases[name], "workers": w} for name, t, w in WHOLE if t == tag}}},
            TIME_LIMIT_S) for tag, nproc, workers in WORLDS}
        yield everything, stops, first, after
    finally:
        s3_server.delete_bucket(bucket)


def _seqs(ranks: list[dict], name: str) -> list[tuple]:
    return [tuple(s) for r in ranks for s in r[name]["seqs"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bin", "idx", "idx-fit", "parquet", "tar"])
def test_torchrun_every_token_once_and_exact_resume(runs, name):
    everything, stops, first, after = runs
    whole = [r[f"{name}-whole"] for r in first]
    assert whole[0]["all_steps"] == [whole[0]["steps"]] * 2, "unequal steps"
    assert collections.Counter(_seqs(first, f"{name}-whole")) == collections.Counter(everything[name])
    assert [r[name]["steps"] for r in first] == [stops[name]] * 2
    before = _seqs(first, name)
    for tag, _, _ in WORLDS:
        run = after[tag]
        assert len(set(run[0][name]["all_steps"])) == 1, (tag, run[0][name]["all_steps"])
        got = collections.Counter(before + _seqs(run, name))
        assert got == collections.Counter(everything[name]), f"{tag}: a sequence lost or twice"



@pytest.mark.slow
@pytest.mark.parametrize("name,tag,workers", WHOLE)
def test_torchrun_whole_epoch_on_one_and_three_ranks(runs, name, tag, workers):
    everything, _, _, after = runs
    ranks = [r[f"{name}-whole-{workers}"] for r in after[tag]]
    assert ranks[0]["all_steps"] == [ranks[0]["steps"]] * len(ranks), "unequal steps"
    got = collections.Counter(_seqs(after[tag], f"{name}-whole-{workers}"))
    assert got == collections.Counter(everything[name]), "a sequence lost or twice"


COUNT_JOB = Path(__file__).parent / "jobs" / "token_count_job.py"
COUNT_SHARDS = [[300], [5, 7, 9], [1000, 20], [64] * 6, [3], [250, 250], [17, 33, 80]]  # tokens per sample


@pytest.mark.slow  # (a torchrun job: the slow suite, run in CI too)
def test_torchrun_a_tar_corpus_without_counts_is_counted_in_shares(s3_bucket, tmp_path):
    """COUNT-SHARED: 2 ranks build a TokenDataset over tar shards of .npy without kept counts,
    each rank through a counting proxy of its own: each reads only its share of the shards (its
    proxy sees GETs of those shards alone, their bytes; rank 0's also the listing), the shares
    cover every shard once, and every rank gets the counts one process gets; a malformed shard in
    one rank's share is the same FormatError, naming it, on both."""
    import s3fs

    import streamdata as sd
    from benchmarks.faults import FaultProxy
    from streamdata.catalog.tokens import rank_share

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    at = 0
    for i, lengths in enumerate(COUNT_SHARDS):
        docs = []
        for n in lengths:
            docs.append(np.arange(at, at + n))
            at += n
        fs.pipe_file(f"{bucket}/npy/part-{i}.tar", npy_tar(docs, np.uint16, "doc"))
        fs.pipe_file(f"{bucket}/bad/part-{i}.tar", npy_tar(docs, np.uint16, "doc"))
    out = io.BytesIO()  # a 2-D .npy: no token array
    np.save(out, np.zeros((2, 2), np.uint16))
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as tar:
        info = tarfile.TarInfo("doc0000.npy")
        info.size = len(out.getvalue())
        tar.addfile(info, io.BytesIO(out.getvalue()))
    fs.pipe_file(f"{bucket}/bad/part-5.tar", bad.getvalue())
    options = {"seq_len": 16, "field": "npy", "counts": None, "storage_options": server.storage_options}
    alone = sd.TokenDataset(f"s3://{bucket}/npy/", **options)
    assert alone.counted_shards == alone.counted_here == len(COUNT_SHARDS)
    with pytest.raises(sd.FormatError, match="part-5.tar"):
        sd.TokenDataset(f"s3://{bucket}/bad/", **options)
    with FaultProxy(server.endpoint_url) as p0, FaultProxy(server.endpoint_url) as p1:
        cases = {"npy": {"spec": f"s3://{bucket}/npy/", "options": options, "endpoints": [p0.url, p1.url]},
                 "bad": {"spec": f"s3://{bucket}/bad/", "options": options}}
        ranks = torchrun(COUNT_JOB, tmp_path, 2, {"tag": "count", "cases": cases}, TIME_LIMIT_S)
        seen = [(p.requests, [t for t in p.transfers if t[0] == "get" and t[1].endswith(".tar")])
                for p in (p0, p1)]
    shares = [rank_share(alone.shards, r, 2) for r in range(2)]
    assert sorted(s.url for share in shares for s in share) == sorted(s.url for s in alone.shards)
    for r, ((requests, gets), share) in enumerate(zip(seen, shares, strict=True)):
        assert 0 < len(share) < len(COUNT_SHARDS)
        # rank 0 lists, LIST-ONCE (no tokens.json looked for: that is a flat .bin's); each rank GETs
        # its share's shards
        want = {"list": 1, "get": len(share)} if r == 0 else {"get": len(share)}
        assert requests == want, (r, requests)
        assert sorted(path.rsplit("/", 1)[1] for _, path, _, _ in gets) == sorted(
            s.url.rsplit("/", 1)[1] for s in share), (r, gets)
        assert sum(n for *_, n in gets) == sum(s.size for s in share)
        assert ranks[r]["npy"]["here"] == len(share)
    for r in ranks:
        assert r["npy"]["counted"] == len(COUNT_SHARDS) and r["npy"]["tokens"] == alone.num_tokens
        assert r["npy"]["counts"] == [c.tolist() for c, _ in alone.token_layout.counted] == COUNT_SHARDS
        assert r["npy"]["offsets"] == [o.tolist() for _, o in alone.token_layout.counted]
        assert r["bad"]["error"] == "FormatError" and "part-5.tar" in r["bad"]["url"], r["bad"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_rank_shares_cover_every_shard_once_balanced_by_bytes(world_size):
    """COUNT-SHARED's split: the shares partition the shards, each in the shards' order, and no
    share holds more than the average share plus the largest shard."""
    from streamdata.catalog.tokens import rank_share
    from streamdata.store.urls import Shard

    rng = random.Random(world_size)
    sizes = [0, 10, 500, 10_000, 2_000_000]
    shards = [Shard(f"s3://b/part-{i:03d}.tar", rng.choice(sizes)) for i in range(41)]
    shares = [rank_share(shards, r, world_size) for r in range(world_size)]
    assert sorted(s.url for share in shares for s in share) == [s.url for s in shards]
    assert all(share == sorted(share, key=shards.index) for share in shares)
    loads = [sum(s.size for s in share) for share in shares]
    total, largest = sum(s.size for s in shards), max(s.size for s in shards)
    assert max(loads) <= total / world_size + largest
    assert shares == [rank_share(list(shards), r, world_size) for r in range(world_size)]  # the same anywhere
