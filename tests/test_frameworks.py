"""docs/frameworks.md's recipes under the real frameworks (2 CPU processes, gloo, the S3 test
server, 13 uneven tar shards with a sample index): every sample exactly once per epoch, the same
steps on every rank, and a run stopped at a seeded step resumed through the framework's own
checkpointing exactly (no sample twice, none lost). Each recipe is the marked block of its job in
tests/jobs/, kept identical to the page here."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from tests.helpers import doc_blocks, torchrun, write_shards

DOC = Path(__file__).resolve().parent.parent / "docs" / "frameworks.md"
JOBS = Path(__file__).parent / "jobs"
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17, 6]  # 119 samples
TIME_LIMIT_S = 240


def _recipe(job: str) -> str:
    text = (JOBS / job).read_text()
    start = text.index("\n", text.index("# --- recipe:")) + 1
    return text[start:text.index("# --- end of recipe ---")].strip()


def _doc_block(heading: str) -> str:
    return doc_blocks(DOC, f"## {heading}")[0].strip()


@pytest.mark.parametrize("heading,job", [("Lightning", "lightning_job.py"), ("Ray Train", "ray_train_job.py"),
                                         ("Accelerate", "accelerate_job.py"),
                                         ("Lightning Fabric", "fabric_job.py"),
                                         ("Several nodes", "multinode_job.py")])
def test_the_pages_recipes_are_the_jobs(heading, job):
    assert _doc_block(heading) == _recipe(job)


@pytest.fixture(scope="module")
def shards(s3_server):
    import uuid

    import s3fs

    import streamdata as sd

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    keys = write_shards(fs, f"{bucket}/train", counts=COUNTS)
    sd.build_index(f"s3://{bucket}/train/", storage_options=s3_server.storage_options, progress=False)
    try:
        yield {"spec": f"s3://{bucket}/train/", "storage_options": s3_server.storage_options}, keys
    finally:
        s3_server.delete_bucket(bucket)


def _check(runs: list[list[dict]], everything: list[str], epochs: int = 2) -> None:
    """Each run's ranks trained the same number of steps; over the runs, every epoch trained every
    sample exactly once."""
    for run in runs:
        steps = [rank["steps"] for rank in run]
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
    for epoch in range(epochs):
        got = collections.Counter(k for run in runs for rank in run
                                  for k in rank["trained"].get(str(epoch), []))
        assert max(got.values()) == 1, f"epoch {epoch}: twice {sorted(k for k, n in got.items() if n > 1)}"
        assert sorted(got) == sorted(everything), f"epoch {epoch}: lost {sorted(set(everything) - set(got))}"


@pytest.mark.slow
def test_lightning_trainer_ddp_resumes_from_its_checkpoint_exactly(shards, tmp_path):
    """Lightning's set-up probes the loader with iter() before loading its state; with the sample
    index the loader has a ``len()``: Lightning's progress bar total is each epoch's steps on each
    rank and its fetcher takes nothing ahead (HELD-AHEAD-DETECTED finds 0; without a ``len()`` it
    holds one, ``tests/feed/test_frameworks_loader.py``). The resumed run trains exactly the rest."""
    case, everything = shards
    stop = random.Random(7).randint(2, 13)  # of about 15 steps over two epochs
    cfg = {**case, "ckpt_dir": str(tmp_path / "ckpts")}
    first = torchrun(JOBS / "lightning_job.py", tmp_path, 2, {**cfg, "tag": "first", "stop": stop},
                     TIME_LIMIT_S)
    assert (tmp_path / "ckpts" / "last.ckpt").exists()
    assert sum(len(v) for v in first[0]["trained"].values()) > 0
    after = torchrun(JOBS / "lightning_job.py", tmp_path, 2, {**cfg, "tag": "after"}, TIME_LIMIT_S)
    _check([first, after], everything)
    assert [rank["held_ahead"] for rank in first + after] == [0] * 4  # found: HELD-AHEAD-DETECTED
    for epoch in ("0", "1"):
        steps = {first[r]["epoch_steps"].get(epoch, 0) + after[r]["epoch_steps"].get(epoch, 0)
                 for r in (0, 1)}
        totals = {rank["totals"][epoch] for rank in first + after if epoch in rank["totals"]}
        assert totals == steps, (epoch, totals, steps)  # the progress bar's total: the epoch's steps


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate launch"])
def test_accelerate_resumes_from_its_saved_state_exactly(shards, tmp_path, launcher):
    """Accelerator under torchrun and under ``accelerate launch``: prepare() hands the sd.loader
    back unchanged (no second split), save_state/load_state carry its position
    (register_for_checkpointing), and a plain DataLoader over a streamdata dataset that went
    through prepare() is refused as it starts (SELF-SPLIT)."""
    case, everything = shards
    stop = random.Random(13).randint(2, 13)
    cfg = {**case, "ckpt_dir": str(tmp_path / "state")}
    job = JOBS / "accelerate_job.py"
    first = torchrun(job, tmp_path, 2, {**cfg, "tag": "first", "stop": stop, "resume": False}, TIME_LIMIT_S,
                     launcher)
    after = torchrun(job, tmp_path, 2, {**cfg, "tag": "after", "resume": True}, TIME_LIMIT_S, launcher)
    assert first[0]["steps"] == stop - 1
    _check([first, after], everything)
    for rank in first + after:
        assert rank["passed_through"] is True
        assert rank["refusal"] is not None and "sd.loader" in rank["refusal"], rank["refusal"]


@pytest.mark.slow
def test_fabric_resumes_from_its_checkpoint_exactly(shards, tmp_path):
    """Fabric(strategy="ddp") under torchrun: setup_dataloaders takes DataLoaders only (a TypeError
    for an sd.loader, which needs none of it); the loader in fabric.save's state resumes exactly
    through fabric.load."""
    case, everything = shards
    stop = random.Random(17).randint(2, 13)
    cfg = {**case, "ckpt_path": str(tmp_path / "fabric.ckpt")}
    first = torchrun(JOBS / "fabric_job.py", tmp_path, 2, {**cfg, "tag": "first", "stop": stop}, TIME_LIMIT_S)
    assert (tmp_path / "fabric.ckpt").exists() and first[0]["steps"] == stop - 1
    after = torchrun(JOBS / "fabric_job.py", tmp_path, 2, {**cfg, "tag": "after"}, TIME_LIMIT_S)
    _check([first, after], everything)
    assert "DataLoader" in first[0]["refusal"]


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_list_once_and_fill_each_nodes_cache_once(shards, tmp_path):
    """Two torchrun agents on loopback (c10d rendezvous), 2 ranks each, each node's ranks sharing
    its cache_dir: exact epochs and equal steps over the 4 ranks, one listing and one index GET for
    the job, and each node's cache filled once in the first epoch and read, not fetched, in the
    second (no shard GET)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from benchmarks.faults import FaultProxy

    case, everything = shards
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(JOBS.parent.parent), OMP_NUM_THREADS="1")
    with FaultProxy(case["storage_options"]["endpoint_url"]) as proxy:
        options = {**case["storage_options"], "endpoint_url": proxy.url}
        agents = []
        for node in range(2):
            cfg = {"tag": "nodes", "node": node, "spec": case["spec"], "storage_options": options,
                   "cache_dir": str(tmp_path / f"cache-node{node}")}
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                 "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--node_rank={node}",
                 str(JOBS / "multinode_job.py"), str(tmp_path), json.dumps(cfg)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        errors = []
        for agent in agents:
            try:
                _, err = agent.communicate(timeout=TIME_LIMIT_S)
            except subprocess.TimeoutExpired:
                for a in agents:
                    a.kill()
                pytest.fail("the two-node job hung")
            if agent.returncode:
                errors.append(err[-6000:])
        assert not errors, "\n".join(errors)
        requests = dict(proxy.requests)
        transfers = [t for t in proxy.transfers if t[0] == "get" and t[1].endswith(".tar")]
    ranks = [json.loads((tmp_path / f"nodes-rank{r}.json").read_text()) for r in range(4)]
    _check([ranks], everything)
    assert requests["list"] == 1, requests
    shard_gets = len(transfers)
    assert requests["get"] == 1 + shard_gets, requests  # the index, once; the rest: shards' ranges
    for node in range(2):
        mine = [r for r in ranks if r["node"] == node]
        assert len(mine) == 2
        first = sum(r["cache"][0]["misses"] for r in mine)
        filled = sorted(p.name for p in (tmp_path / f"cache-node{node}").glob("*.sdc"))
        assert first > 0 and len(filled) == first  # one entry per item read, written once
        # the counts are cumulative; a persistent worker has queued its next pass when an epoch
        # ends (NEXT-EPOCH-EARLY): no miss after the first epoch, every later read a hit
        assert sum(r["cache"][1]["misses"] for r in mine) == first
        assert sum(r["cache"][1]["hits"] for r in mine) >= first
    assert shard_gets == sum(r["cache"][0]["misses"] for r in ranks)  # epoch 1's reads only


def _script(job: str, tmp_path: Path, cfg: dict, time_limit_s: float = TIME_LIMIT_S) -> None:
    """Run ``tests/jobs/{job}`` as a plain script (it starts its own processes); a hang fails
    the test after ``time_limit_s``."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(JOBS.parent.parent), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, str(JOBS / job), str(tmp_path), json.dumps(cfg)], env=env,
                              capture_output=True, text=True, timeout=time_limit_s)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{job} hung (no end within {time_limit_s} s): {exc.stderr!s:.3000}")
    assert done.returncode == 0, done.stderr[-12000:]


@pytest.mark.slow
@pytest.mark.parametrize("move_to_device", [False, True])
def test_ray_train_restarts_a_lost_worker_from_its_last_checkpoint_exactly(shards, tmp_path, move_to_device):
    """TorchTrainer, 2 CPU workers: prepare_data_loader passes the loader through (or, with Ray's
    default ``move_to_device=True``, wraps it in a loader one batch ahead, which the loader finds
    without being told: HELD-AHEAD-DETECTED); rank 1 dies mid-epoch (os._exit) on the
    first attempt, FailureConfig restarts both workers from the last reported checkpoint (the
    loader's state in it), and the attempts together train every sample of both epochs exactly
    once, the same steps on both ranks; one listing per attempt."""
    import json

    from benchmarks.faults import FaultProxy

    case, everything = shards
    stop = random.Random(11).randint(3, 7)  # of 16 steps over two epochs: within the first
    with FaultProxy(case["storage_options"]["endpoint_url"]) as proxy:
        options = {**case["storage_options"], "endpoint_url": proxy.url}
        _script("ray_train_job.py", tmp_path, {"spec": case["spec"], "storage_options": options, "stop": stop,
                                               "storage_path": str(tmp_path / "ray"),
                                               "move_to_device": move_to_device}, 2 * TIME_LIMIT_S)
        listings = proxy.requests["list"]
    assert (tmp_path / "killed").exists()  # rank 1 did die on the first attempt
    result = json.loads((tmp_path / "ray-result.json").read_text())
    assert result["error"] is None and result["metrics"]["epoch"] == 1
    lines = {r: [json.loads(line) for line in (tmp_path / f"ray-rank{r}.jsonl").read_text().splitlines()]
             for r in range(2)}
    resumed = {line["from"] for line in lines[0]} - {0}
    assert len(resumed) == 1, resumed  # one restart, from a reported checkpoint
    restart = resumed.pop()
    assert 1 <= restart < stop
    # mid-epoch (not at an epoch's end, where every batch handed out is consumed): the resumed
    # attempt's first step is in the epoch the checkpoint's step was
    epoch_of = {x["step"]: x["epoch"] for x in lines[0] if x["from"] == 0}
    first = min((x for x in lines[0] if x["from"] == restart), key=lambda x: x["step"])
    assert first["step"] == restart + 1 and first["epoch"] == epoch_of[restart], (restart, first)
    assert listings == 2  # one per attempt: rank 0 lists, the other rank is told
    runs = []
    for attempt in (0, restart):  # the first attempt counts up to the checkpoint the second loaded
        kept = {r: [x for x in lines[r] if x["from"] == attempt and (attempt or x["step"] <= restart)]
                for r in range(2)}
        runs.append([{"steps": len(kept[r]), "trained": _by_epoch(kept[r])} for r in range(2)])
    _check(runs, everything)
    held = {x["held_ahead"] for r in range(2) for x in lines[r]}
    assert held == {1 if move_to_device else 0}, held  # found, not given: HELD-AHEAD-DETECTED


def _by_epoch(lines: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in lines:
        out.setdefault(str(line["epoch"]), []).extend(line["keys"])
    return out
