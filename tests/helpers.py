"""Shared test helpers: build WebDataset shards, read datasets through a DataLoader, stop and
resume them on simulated ranks, start and run the torchrun jobs (tests/jobs/), and take the code
blocks a docs page gives."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import numpy as np
import torch
import webdataset as wds

UNEVEN = [5, 1, 9, 3, 0, 7, 2]  # samples per shard: uneven on purpose, one empty shard
ROOT = Path(__file__).resolve().parent.parent


def doc_blocks(page: str | Path, heading: str | None = None) -> list[str]:
    """The ```python blocks of ``page`` (a path, or one relative to the repository: "README.md",
    "docs/images.md"), under ``heading`` (a whole line, e.g. "## Recipe") up to the next heading
    of level 2 or 3; the whole page's without one."""
    text = (ROOT / page).read_text()
    if heading is not None:
        start = text.index(f"\n{heading}\n") + len(heading) + 2
        stop = re.search(r"\n#{2,3} ", text[start:])
        text = text[start:start + stop.start()] if stop else text[start:]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def tar_bytes(samples: list[dict]) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as writer:
        for sample in samples:
            writer.write(sample)
    return buf.getvalue()


def make_samples(counts: list[int], floats: int = 8) -> list[list[dict]]:
    """Per shard, samples with a unique key, an .npy array derived from it, a .cls and a .json."""
    shards, n = [], 0
    for count in counts:
        shard = []
        for _ in range(count):
            shard.append({"__key__": f"s{n:06d}", "npy": np.full(floats, n, dtype=np.float32),
                          "cls": n, "json": {"n": n}})
            n += 1
        shards.append(shard)
    return shards


def write_shards(fs, prefix: str, counts: list[int] = UNEVEN, floats: int = 8) -> list[str]:
    """Write ``prefix/shard-000.tar``... through fsspec ``fs``; returns all keys in order."""
    keys = []
    for i, shard in enumerate(make_samples(counts, floats)):
        fs.pipe_file(f"{prefix}/shard-{i:03d}.tar", tar_bytes(shard))
        keys += [s["__key__"] for s in shard]
    return keys


def s3_environment(monkeypatch, storage_options: dict) -> None:
    """The test server as the environment's S3 (endpoint, keys, region), as a user's recipe
    finds it without storage_options; a profile or session token of the machine's is removed."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", storage_options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", storage_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", storage_options["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def rank_env(rank: int | None, world_size: int | None):
    """RANK/WORLD_SIZE set for the block (a simulated DDP rank), restored after."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_keys(ds, num_workers: int, context: str | None = "fork", rank: int | None = None,
              world_size: int | None = None) -> list[str]:
    """All keys one rank reads through a DataLoader (RANK/WORLD_SIZE set for the read)."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=num_workers,
            multiprocessing_context=context if num_workers else None, timeout=60 if num_workers else 0)
        keys = []
        for item in loader:
            keys += item["__key__"] if isinstance(item["__key__"], list) else [item["__key__"]]
        return keys


def in_forked_child(target, timeout: float = 30.0):
    """Run ``target(conn)`` in a forked child; what it ``conn.send``s (None if nothing within
    ``timeout``), once the child has been joined."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, conn = ctx.Pipe()
    proc = ctx.Process(target=target, args=(conn,))
    proc.start()
    try:
        return parent.recv() if parent.poll(timeout) else None
    finally:
        proc.join(timeout)


def rank_batches(ds, rank: int, world_size: int, num_workers: int, field: str = "id") -> list[list]:
    """``field`` of each batch one simulated rank's DataLoader yields, as lists."""
    with rank_env(rank, world_size):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                             timeout=60 if num_workers else 0)
        return [list(b[field].tolist() if hasattr(b[field], "tolist") else b[field]) for b in loader]


def check_exact_epochs(ds, total: int, world_size: int, num_workers: int, drop_last: bool,
                       batch_size: int) -> None:
    """Two epochs of ``ds`` (rows ``id`` 0..total-1) over simulated ranks x real workers:
    equal steps per rank, no duplicate, every row once (or, with drop_last, full batches, the
    left-out counted, and a different left-out set each epoch): EQUAL-STEPS."""
    import collections

    left_out_sets = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        before = ds.counts["planned.left_out"]
        per_rank = [rank_batches(ds, r, world_size, num_workers) for r in range(world_size)]
        steps = [len(b) for b in per_rank]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        ids = [i for batches in per_rank for b in batches for i in b]
        dupes = [k for k, n in collections.Counter(ids).items() if n > 1]
        assert not dupes, f"duplicates {dupes}"
        if not drop_last:
            assert sorted(ids) == list(range(total))
            assert ds.counts["planned.left_out"] == 0
        else:
            assert all(len(b) == batch_size for batches in per_rank for b in batches)
            left_out = total - len(ids)
            assert 0 <= left_out < world_size * max(num_workers, 1) * batch_size
            # every rank's worker 0 counts the job's figure (here all ranks share one process)
            assert ds.counts["planned.left_out"] - before == world_size * left_out
            left_out_sets.append(frozenset(range(total)) - frozenset(ids))
    if drop_last and left_out_sets[0]:
        assert left_out_sets[0] != left_out_sets[1], "the same samples left out every epoch"


def take(it, n: int) -> list:
    """Up to ``n`` items of the iterator ``it`` (fewer where it ends)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def saved_state(make, stop: int, rows, world_size: int = 2, num_workers: int = 2) -> tuple[list, dict]:
    """Simulated ranks (``world_size``, each ``sd.loader(make(), num_workers=...)``) each take
    ``stop`` batches: the rows (``rows(batch)``, a list per batch) they delivered, and their states
    merged and passed through JSON, as a checkpoint stores them."""
    import json

    import streamdata as sd
    from streamdata.epoch.state import merge_states

    before, states = [], []
    for rank in range(world_size):
        with rank_env(rank, world_size), sd.loader(make(), num_workers=num_workers) as loader:
            it = iter(loader)
            before += [r for b in take(it, stop) for r in rows(b)]
            states.append(loader.state_dict())
            del it
    return before, json.loads(json.dumps(merge_states(states)))


def resumed_rows(make, state: dict, world_size: int, num_workers: int, rows) -> tuple[list, list[int]]:
    """``state`` loaded on ``world_size`` simulated ranks x ``num_workers`` workers: the rows they
    delivered to the epoch's end, and each rank's steps."""
    import streamdata as sd

    after, steps = [], []
    for rank in range(world_size):
        with rank_env(rank, world_size), sd.loader(make(), num_workers=num_workers) as loader:
            loader.load_state_dict(state)
            batches = [rows(b) for b in loader]
            steps.append(len(batches))
            after += [r for b in batches for r in b]
    return after, steps


def stopped_state(make, world_size: int, stop: int) -> dict:
    """Simulated ranks (``world_size``) each iterate ``make()`` for ``stop`` items and stop: their
    states merged."""
    from streamdata.epoch.state import merge_states

    states = []
    for rank in range(world_size):
        with rank_env(rank, world_size):
            ds = make()
            it = iter(ds)
            take(it, stop)
            states.append(ds.state_dict())
            it.close()
    return merge_states(states)


def stop_and_resume(make_loader, stop: int, rows) -> list:
    """A loader from ``make_loader()`` stops after ``stop`` batches; its state (through JSON)
    loaded into a fresh one, which runs to the end: the rows (``rows(batch)``) of both, in order."""
    import json

    loader = make_loader()
    it = iter(loader)
    before = [r for b in take(it, stop) for r in rows(b)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = make_loader()
    resumed.load_state_dict(state)
    return before + [r for b in resumed for r in rows(b)]


def check_one_corrupt(ds, policy: str, keys: list[str], bad: str, error: type, shard: str,
                      counter: str) -> None:
    """``ds`` over shards of ``keys`` whose sample ``bad`` (in the shard whose URL ends with
    ``shard``) is corrupt: with ``on_error="raise"`` an ``error`` naming both; with ``"skip"``
    every other key in order, the one skipped counted under ``counter``."""
    import pytest

    if policy == "raise":
        with pytest.raises(error) as info:
            list(ds)
        assert info.value.key == bad and info.value.url.endswith(shard)
        return
    got = [k for batch in ds for k in batch["__key__"]]
    assert got == [k for k in keys if k != bad]
    assert ds.skipped[counter] == 1 and sum(ds.skipped.values()) == 1


def s3_tar_shards(s3_server, folder: str, counts: list[int], sample) -> tuple[str, list[str]]:
    """Tar shards ``folder/shard-000.tar``... in a fresh bucket of the test S3 server, ``counts``
    samples each, ``sample(n)`` the n-th (with its ``__key__``), indexed (an exact epoch, an exact
    resume): their brace spec and the keys in order."""
    import uuid

    import s3fs

    from streamdata.catalog.index import build_index

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    keys, n = [], 0
    for s, count in enumerate(counts):
        samples = [sample(n + i) for i in range(count)]
        fs.pipe_file(f"{bucket}/{folder}/shard-{s:03d}.tar", tar_bytes(samples))
        keys += [x["__key__"] for x in samples]
        n += count
    spec = f"s3://{bucket}/{folder}/shard-{{000..{len(counts) - 1:03d}}}.tar"
    build_index(spec, s3_server.storage_options, progress=False)
    return spec, keys


def npy_tar(docs: list, dtype, name: str) -> bytes:
    """A tar shard of one sample per document, its tokens (as ``dtype``) a .npy field: members
    ``{name}0000.npy``..."""
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for k, doc in enumerate(docs):
            npy = io.BytesIO()
            np.save(npy, doc.astype(dtype))
            info = tarfile.TarInfo(f"{name}{k:04d}.npy")
            info.size = len(npy.getvalue())
            tar.addfile(info, io.BytesIO(npy.getvalue()))
    return out.getvalue()


def random_documents(rng, longest: int, widest: int) -> tuple[list, int, int, list[int]]:
    """A pure token plan's input drawn from ``rng``: 1-5 documents (each 1..``longest``-1 values
    in 0..14), a sequence width in 4..``widest``-1 and 0-2 special tokens per document:
    ``(docs, width, specials, tokens)``, ``tokens`` each document's count with its specials."""
    docs = [rng.integers(0, 15, rng.integers(1, longest)) for _ in range(rng.integers(1, 6))]
    width, specials = int(rng.integers(4, widest)), int(rng.integers(0, 3))
    tokens = [int(d.sum()) + specials * len(d) for d in docs]
    return docs, width, specials, tokens


def write_tables(fs, prefix: str, groups: list[list[int]], suffix: str = "parquet") -> list[int]:
    """``prefix/part-{i}.{suffix}``: Parquet files (one row group per entry) or Arrow IPC files
    (one record batch per entry) of a column ``id`` numbering the rows; returns the ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, n = pa.schema([("id", pa.int64())]), 0
    for i, sizes in enumerate(groups):
        with fs.open(f"{prefix}/part-{i}.{suffix}", "wb") as f, \
                (pq.ParquetWriter(f, schema) if suffix == "parquet" else pa.ipc.new_file(f, schema)) as w:
            for size in sizes:
                w.write_table(pa.table({"id": np.arange(n, n + size)}))
                n += size
    return list(range(n))


def torchrun(job, tmp_path, nproc: int, cfg: dict, time_limit_s: float = 240,
             launcher: str = "torchrun") -> list[dict]:
    """Run ``job`` (tests/jobs/*.py) under ``torchrun`` (or ``accelerate launch``, which starts
    the ranks the same way: ``--multi_gpu``, the one switch that makes it start more than one
    process on a machine without GPUs) on ``nproc`` ranks with ``cfg``; each rank's
    ``{tag}-rank{R}.json``. A hang fails the test after ``time_limit_s``."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
               f"--main_process_port={port}"]
    cmd += [str(job), str(tmp_path), json.dumps(cfg)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=time_limit_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {launcher} job hung (no end within {time_limit_s} s): {exc.stderr!s:.2000}")
    assert done.returncode == 0, done.stderr[-12000:]  # a stopped rank's stacks too (``jobs._leave``)
    return [json.loads((Path(tmp_path) / f"{cfg['tag']}-rank{r}.json").read_text()) for r in range(nproc)]


def once_after_a_resume(job, tmp_path, base: dict, keys: list[str], field: str, rest_ranks: int,
                        rest: dict) -> list[dict]:
    """Torchrun runs of ``job`` with ``base``: a whole epoch on 2 ranks, each of ``keys`` once in
    the ranks' ``field`` (a dict per key), equal steps; then 2 ranks that stop after 2 steps and
    save, and ``rest_ranks`` ranks that resume (``rest`` over ``base``): each key once over both,
    with the value the whole epoch gave it. The whole epoch's results."""
    import collections

    state = str(tmp_path / "state.json")
    whole = torchrun(job, tmp_path, 2, {**base, "tag": "whole"})
    values = {k: v for r in whole for k, v in r[field].items()}
    assert sorted(values) == keys and sum(len(r[field]) for r in whole) == len(keys)  # exactly once
    assert whole[0]["steps"] == whole[1]["steps"]

    first = torchrun(job, tmp_path, 2, {**base, "tag": "first", "stop": 2, "save": state})
    after = torchrun(job, tmp_path, rest_ranks, {**base, "tag": "rest", "load": state, **rest})
    got = collections.Counter(k for r in first + after for k in r[field])
    assert sorted(got) == keys and max(got.values()) == 1
    assert all(values[k] == v for r in first + after for k, v in r[field].items())
    return whole


def ddp_job(config_json: str, features: int = 8):
    """A torchrun job's start: its config, the gloo process group (60 s timeout), and a tiny seeded
    DDP model (``features`` inputs) with its SGD optimizer: ``(cfg, rank, model, optimizer)``."""
    import datetime
    import json

    import torch.distributed as dist

    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(features, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return cfg, rank, model, optimizer


def ddp_steps(loader, model, optimizer, features, cfg: dict, rank: int):
    """The batches of ``loader`` (resumed from the state file ``cfg["load"]`` if set), each after
    one DDP training step on ``features(batch)``; after ``cfg["stop"]`` steps every rank takes
    ``loader.state_dict()`` (a collective), rank 0 writes it to ``cfg["save"]``, and it ends."""
    import json

    if cfg.get("load"):
        with open(cfg["load"]) as f:
            loader.load_state_dict(json.load(f))
    for steps, batch in enumerate(loader, 1):
        loss = model(features(batch)).square().mean()  # DDP all-reduces the grads
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield batch
        if steps == cfg.get("stop"):
            state = loader.state_dict()  # every rank's positions (a collective)
            if rank == 0:
                with open(cfg["save"], "w") as f:
                    json.dump(state, f)
            return
