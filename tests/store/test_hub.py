"""The Hugging Face Hub as a store (``hf://``), against a loopback Hub (``streamdata.testing.hub``):
datasets read every sample exactly, through the resolve endpoint's redirects; the listing is
paginated; the token reaches the Hub and nothing a user sees; the job's request rate holds
(RATE-SHARE); 429s are backed off as asked and counted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest

import streamdata as sd
from streamdata.redact import redact
from streamdata.store.hub import canonical_path, resolve_url
from streamdata.store.rate import RateGovernor, share_of
from streamdata.testing import HubServer
from tests.helpers import ROOT, UNEVEN, doc_blocks, torchrun, write_shards, write_tables

TOKEN = "hf_" + "PlantedHubToken" + "0123456789abcdef"
REPO = "owner/corpus"


@pytest.fixture
def hub_files(tmp_path):
    """A repository's files: tar shards under data/, Parquet under the conversion's revision,
    flat token files under tokens/."""
    fs = fsspec.filesystem("file", auto_mkdir=True)
    main, parquet = tmp_path / "main", tmp_path / "parquet"
    keys = write_shards(fs, str(main / "data"), UNEVEN)
    ids = write_tables(fs, str(parquet / "default" / "train"), [[5, 3], [4], [6, 2]])
    tokens = []
    for i, n in enumerate((300, 170)):
        part = np.arange(len(tokens), len(tokens) + n, dtype=np.uint16)
        tokens += part.tolist()
        (main / "tokens").mkdir(exist_ok=True)
        part.tofile(main / "tokens" / f"part-{i}.bin")
    return {"main": main, "parquet": parquet, "keys": keys, "ids": ids, "tokens": tokens}


@pytest.fixture
def hub(hub_files):
    server = HubServer(token=TOKEN, redirect=True, page_size=3)
    server.add(REPO, hub_files["main"]).add(REPO, hub_files["parquet"], revision="refs/convert/parquet")
    with server:
        yield server, {"endpoint": server.endpoint_url, "token": TOKEN}


def kinds(server: HubServer) -> Counter:
    return Counter(r.kind for r in server.requests)


def test_parquet_alias_and_resolve_urls():
    assert canonical_path("datasets/o/n@~parquet/default/train/0.parquet") == \
        "datasets/o/n@refs%2Fconvert%2Fparquet/default/train/0.parquet"
    assert canonical_path("datasets/o/n/a@b.tar") == "datasets/o/n/a@b.tar"
    assert resolve_url("hf://datasets/o/n@~parquet/default/0.parquet", "http://h") == \
        "http://h/datasets/o/n/resolve/refs%2Fconvert%2Fparquet/default/0.parquet"
    assert resolve_url("hf://datasets/o/n/data/x.tar", "http://h") == "http://h/datasets/o/n/resolve/main/data/x.tar"
    with pytest.raises(sd.SpecError, match="names no file"):
        resolve_url("hf://datasets/o/n", "http://h")


def test_tar_and_parquet_read_every_sample_once_through_redirects(hub, hub_files):
    server, options = hub
    ds = sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options=options)
    assert len(ds.shards) == len(UNEVEN) and all(s.size for s in ds.shards)
    listed = kinds(server)
    assert listed["tree"] >= 3  # a directory of 7 files, 3 per page: the Link header followed
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        keys = [k for batch in loader for k in batch["__key__"]]
    assert sorted(keys) == sorted(hub_files["keys"])
    seen = kinds(server)
    redirected = sum(r.kind == "resolve" and r.answer == 302 for r in server.requests)
    assert redirected == seen["cdn"] > 0, server.requests  # each GET redirected once, then served
    assert seen["tree"] == listed["tree"]  # the readers list nothing
    assert all(r.authorized for r in server.requests if r.kind in ("info", "tree", "resolve"))

    pq = sd.ParquetDataset(f"hf://datasets/{REPO}@~parquet/default/train/", storage_options=options)
    with sd.loader(pq, batch_size=5, num_workers=2) as loader:
        ids = [int(i) for batch in loader for i in batch["id"]]
    assert sorted(ids) == hub_files["ids"]


def test_the_token_goes_to_the_hub_only(hub_files):
    """A redirect to another origin (the Hub's CDN) does not carry the token."""
    with HubServer() as cdn, HubServer(token=TOKEN, redirect=cdn).add(REPO, hub_files["main"]) as origin:
        ds = sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options={"endpoint": origin.endpoint_url,
                                                                          "token": TOKEN})
        assert sorted(s["__key__"] for s in ds) == sorted(hub_files["keys"])
        assert all(r.bearer for r in origin.requests if r.kind in ("info", "tree", "resolve"))
        served = [r for r in cdn.requests if r.kind == "cdn"]
        assert served and not any(r.bearer for r in served)


def test_token_dataset_reads_every_token(hub, hub_files):
    _, options = hub
    ds = sd.TokenDataset(f"hf://datasets/{REPO}/tokens/", seq_len=10, dtype="uint16", storage_options=options)
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        seqs = [row.tolist() for batch in loader for row in batch["input_ids"]]
    want = hub_files["tokens"]
    assert sorted(t for s in seqs for t in s) == want[: len(want) // 10 * 10] or \
        len(seqs) == len(want) // 10  # TOKENS-ONCE: whole sequences, one partial dropped
    assert len({tuple(s) for s in seqs}) == len(seqs) == len(want) // 10


def test_a_wrong_token_is_access_denied_and_never_shown(hub):
    server, options = hub
    wrong = "hf_" + "PlantedWrongToken" + "0123456789abcdef"
    with pytest.raises(sd.StreamDataError) as caught:
        sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options={**options, "token": wrong})
    texts = [str(caught.value), repr(caught.value), str(caught.value.url)]
    assert not any(wrong in t or TOKEN in t for t in texts), texts
    ds = sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options=options)
    assert TOKEN not in repr(ds)
    assert redact(f"Bearer {TOKEN} and {TOKEN}") == "Bearer hf_*** and hf_***"


def test_throttled_answers_wait_as_asked_and_are_counted(hub, hub_files):
    server, options = hub
    ds = sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options=options,
                       fetch=sd.Fetch(max_requests_per_s=1000.0, max_requests=1))
    server.throttle(3, retry_after=1)
    keys = [s["__key__"] for s in ds]  # in this process: its counters are this process's
    assert sorted(keys) == sorted(hub_files["keys"])
    assert ds.counts["retried.throttled"] == 3
    log = [r for r in server.requests if r.kind == "resolve"]
    refused = [r for r in log if r.answer == 429]
    assert len(refused) == 3
    # Retry-After holds the reader's next request (RATE-SHARE's hold): none within the second asked
    for answer in refused:
        assert not [r for r in log if answer.at < r.at < answer.at + 0.9], log


def test_the_governor_spaces_its_slots():
    governor = RateGovernor(50.0)
    delays = [governor.reserve() for _ in range(5)]
    assert delays[0] == 0.0
    assert all(later > earlier for earlier, later in zip(delays, delays[1:], strict=False))
    assert delays[-1] == pytest.approx(4 / 50.0, abs=0.02)
    governor.hold(5.0)
    assert governor.reserve() > 4.0
    assert share_of(8.0, 4) == 2.0 and share_of(None, 4) is None and share_of(math.inf, 4) is None
    with pytest.raises(sd.SpecError, match="max_requests_per_s"):
        sd.TarDataset("hf://datasets/o/n/x.tar", fetch=sd.Fetch(max_requests_per_s=0), listing=False)


@pytest.mark.slow
def test_the_governor_holds_the_jobs_rate(hub):
    """Two DataLoader workers, 8 requests/s between them: counted at the server."""
    server, options = hub
    rate = 8.0
    ds = sd.TarDataset(f"hf://datasets/{REPO}/data/", storage_options=options,
                       fetch=sd.Fetch(max_requests_per_s=rate, part_size=4096, first_part=4096))
    server.clear()
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        assert sum(len(b["__key__"]) for b in loader) == sum(UNEVEN)
    times = sorted(r.at for r in server.requests if r.kind == "resolve")
    assert len(times) >= 20, len(times)
    span = times[-1] - times[0]
    # two readers, each at most one request at its start, then one every 2 / rate seconds
    assert (len(times) - 2) / span <= rate * 1.15, (len(times), span)
    assert ds.counts["paced.requests"] > 0


_SUBPROCESS = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.DEBUG)
    import streamdata as sd
    ds = sd.TarDataset(sys.argv[1], index=None)
    print(repr(ds))
    print(sorted(s["__key__"] for s in ds)[:3])
    try:
        sd.TarDataset(sys.argv[1] + "missing-shard.tar", listing=False, index=None).__iter__().__next__()
    except sd.StreamDataError as exc:
        print("error:", exc, repr(exc))
""")


@pytest.mark.slow
def test_hf_endpoint_and_hf_token_from_the_environment_never_printed(hub, tmp_path):
    """huggingface_hub reads HF_ENDPOINT at import: a fresh process."""
    server, _ = hub
    env = {"HF_ENDPOINT": server.endpoint_url, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT),
           "HF_HOME": str(tmp_path / "hf-home"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _SUBPROCESS, f"hf://datasets/{REPO}/data/"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "s000000" in done.stdout and "error: " in done.stdout and "missing-shard" in done.stdout
    assert TOKEN not in done.stdout + done.stderr
    assert "PlantedHubToken" not in done.stdout + done.stderr
    hub_requests = [r for r in server.requests if r.kind in ("info", "tree", "resolve")]
    assert hub_requests and all(r.authorized for r in hub_requests), hub_requests


JOB = Path(__file__).resolve().parent.parent / "jobs" / "hub_job.py"


@pytest.mark.slow
def test_a_torchrun_job_lists_once_and_reads_every_sample_once(hub, hub_files, tmp_path, monkeypatch):
    """torchrun, 2 ranks x 2 workers: one listing for the job (what one process's costs), every
    sample once over the ranks, the token sent with every Hub request and printed nowhere, and
    the job's request rate held by its four readers' shares (RATE-SHARE)."""
    server, options = hub
    spec = f"hf://datasets/{REPO}/data/"
    sd.TarDataset(spec, storage_options=options, index=None)
    one = kinds(server)
    server.clear()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint_url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    rate = 8.0
    ranks = torchrun(JOB, tmp_path, 2, {"tag": "hub", "spec": spec, "fetch": {
        "max_requests_per_s": rate, "part_size": 4096, "first_part": 4096}})
    seen = kinds(server)
    times = sorted(r.at for r in server.requests if r.kind == "resolve")
    assert len(times) >= 20, len(times)
    assert (len(times) - 4) / (times[-1] - times[0]) <= rate * 1.15, (len(times), times[-1] - times[0])
    assert seen["tree"] == one["tree"] and seen["info"] == one["info"], (one, seen)
    keys = [k for r in ranks for k in r["keys"]]
    assert sorted(keys) == sorted(hub_files["keys"])
    assert all(r.authorized for r in server.requests if r.kind in ("info", "tree", "resolve"))
    assert not any(TOKEN in json.dumps(r) for r in ranks)


def test_the_docs_recipe_runs(hub, monkeypatch):
    """docs/storage.md's recipe, against the loopback Hub (huggingface_hub's endpoint and
    token as HF_ENDPOINT and HF_TOKEN would set them)."""
    from huggingface_hub import constants

    server, _ = hub
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint_url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (code,) = doc_blocks("docs/storage.md", "## Hugging Face Hub")
    scope: dict = {}
    exec(code.replace("OWNER/NAME", REPO), scope)
    assert len(scope["train"].shards) == len(UNEVEN) and len(scope["rows"].shards) == 3
    assert scope["tokens"].fetch_config.max_requests_per_s == 20
    assert scope["loader"] is not None
