"""``streamdata tokenize``: text from JSONL, Parquet and tar shards into token shards that
``sd.TokenDataset`` reads back exactly, locally and on the loopback S3 server; the same bytes
whatever ``--workers``; chat loss masks on exactly the assistant's tokens; a run killed with
SIGKILL and run again finishes with the bytes of an uninterrupted run."""

from __future__ import annotations

import base64
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamdata as sd
from streamdata.cli import main
from streamdata.formats.tokens import parse_idx
from tests.helpers import doc_blocks, s3_environment, tar_bytes

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while streams of data flow into shards of "
         "tokens and models learn").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A tiny BPE trained here, saved as tokenizer.json; its end token is '<eos>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts(300, seed=1) + ["<|user|>\n<|assistant|>\n<|system|>\n"],
                            trainers.BpeTrainer(vocab_size=150, special_tokens=["[UNK]", "<eos>"],
                                                show_progress=False))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def write_jsonl(folder: Path, docs: list, per_file: int, key: str = "text") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(0, len(docs), per_file):
        with open(folder / f"part-{f // per_file:04d}.jsonl", "w") as out:
            out.writelines(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs[f:f + per_file]))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def read_documents(spec: str | list[str], **options) -> list[list[int]]:
    """Every document of the corpus, in order, as sd.TokenDataset reads it (one padded
    sequence holding them all; doc_ids split it)."""
    ds = sd.TokenDataset(spec, seq_len=1 << 20, partial="pad", documents=True, **options)
    (batch,) = list(ds)
    docs: list[list[int]] = []
    for token, doc in zip(batch["input_ids"].tolist(), batch["doc_ids"].tolist(), strict=True):
        if doc == len(docs):
            docs.append([])
        docs[doc].append(token)
    return docs[:-1]  # the padding is a document of its own


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_jsonl_to_megatron_reads_back_exactly(tmp_path, capsys, hf_tokenizer):
    tok, path = hf_tokenizer
    docs = texts(250)
    write_jsonl(tmp_path / "in", docs, per_file=60)
    code, out, err = run_cli(capsys, "tokenize", str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "out"),
                             "--tokenizer", path, "--eos", "<eos>", "--shard-tokens", "700", "--workers", "1")
    assert code == 0, err
    eos = tok.token_to_id("<eos>")
    expected = [encode(tok, d) + [eos] for d in docs]
    assert f"tokenized 250 documents, {sum(map(len, expected))} uint16 tokens" in out
    bins = sorted((tmp_path / "out").glob("shard-*.bin"))
    assert len(bins) > 3
    for b in bins:  # uint16 (150 ids), Megatron pairs that agree, documents whole
        index = parse_idx(b.with_suffix(".idx").read_bytes(), "idx", "bin", b.stat().st_size)
        assert index.dtype == np.uint16 and index.tokens >= 700 or b == bins[-1]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    assert read_documents(str(tmp_path / "out") + "/") == expected
    # run again: every shard is complete, nothing is written
    before = files_of(tmp_path / "out")
    code, out, _ = run_cli(capsys, "tokenize", str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "out"),
                           "--tokenizer", path, "--eos", "<eos>", "--shard-tokens", "700")
    assert code == 0 and "nothing to do" in out and files_of(tmp_path / "out") == before
    # other settings into the same DEST: refused, one line
    code, out, err = run_cli(capsys, "tokenize", str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "out"),
                             "--tokenizer", path, "--shard-tokens", "700")
    assert code == 2 and "other settings" in err and "eos" in err and err.count("\n") == 1


def test_the_same_bytes_whatever_the_workers(tmp_path, capsys, hf_tokenizer):
    _, path = hf_tokenizer
    write_jsonl(tmp_path / "in", texts(300, seed=3), per_file=25)
    outs = []
    for workers, fmt in (("1", "megatron"), ("2", "megatron"), ("1", "parquet"), ("2", "parquet")):
        dest = tmp_path / f"out-{workers}-{fmt}"
        code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "in") + "/", str(dest), "--tokenizer", path,
                               "--shard-tokens", "500", "--workers", workers, "--format", fmt)
        assert code == 0, err
        outs.append(files_of(dest))
    assert outs[0] == outs[1] and outs[2] == outs[3]
    assert len([n for n in outs[0] if n.endswith(".bin")]) > 5


@pytest.mark.slow
def test_parquet_and_tar_inputs_to_s3(s3_bucket, tmp_path, capsys, hf_tokenizer):
    import s3fs

    server, bucket = s3_bucket
    tok, path = hf_tokenizer
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    docs = texts(120, seed=5)
    for i in range(3):  # Parquet: a 'body' column
        buf = pa.BufferOutputStream()
        pq.write_table(pa.table({"body": docs[i * 40:(i + 1) * 40], "n": list(range(40))}), buf)
        fs.pipe_file(f"{bucket}/pq/part-{i}.parquet", buf.getvalue().to_pybytes())
    for i in range(2):  # tar: .txt members in one shard, .json in the other
        samples = [{"__key__": f"{i}-{k:03d}", **({"txt": d.encode()} if i == 0 else
                                                   {"json": json.dumps({"body": d}).encode()})}
                   for k, d in enumerate(docs[i * 60:(i + 1) * 60])]
        fs.pipe_file(f"{bucket}/tar/part-{i}.tar", tar_bytes(samples))
    opts = ["-o", json.dumps(server.storage_options)]
    expected = [[1] + encode(tok, d) for d in docs]  # --bos 1
    for src, fmt in (("pq", "megatron"), ("tar", "parquet")):
        dest = f"s3://{bucket}/out-{src}/"
        code, out, err = run_cli(capsys, "tokenize", f"s3://{bucket}/{src}/", dest, "--tokenizer", path,
                                 "--field", "body", "--bos", "1", "--shard-tokens", "400", "--format", fmt,
                                 "--workers", "2", *opts)
        assert code == 0, err
        extra = {"column": "tokens"} if fmt == "parquet" else {}
        assert read_documents(dest, storage_options=server.storage_options, **extra) == expected
        # the same bytes as a local run
        local = tmp_path / src
        code, _, err = run_cli(capsys, "tokenize", f"s3://{bucket}/{src}/", str(local), "--tokenizer", path,
                               "--field", "body", "--bos", "1", "--shard-tokens", "400", "--format", fmt,
                               "--workers", "1", *opts)
        assert code == 0, err
        remote = {p.split(f"out-{src}/", 1)[1]: fs.cat_file(p) for p in fs.find(f"{bucket}/out-{src}")}
        assert {k: v for k, v in remote.items() if "job.json" not in k} == \
            {k: v for k, v in files_of(local).items() if "job.json" not in k}


def tiktoken_file(folder: Path) -> tuple[object, str]:
    """A tiktoken BPE file made by hand: the 256 bytes, then a few merges."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"he", b"the", b" t", b" the", b"qu", b"ck", b"ok", b"en", b"tok", b"en"):
        ranks.setdefault(merge, len(ranks))
    path = folder / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    enc = tiktoken.Encoding(name="tiny", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={})
    return enc, str(path)


def test_tiktoken_file_tokenizer(tmp_path, capsys):
    enc, path = tiktoken_file(tmp_path)
    docs = texts(80, seed=7)
    write_jsonl(tmp_path / "in", docs, per_file=30)
    code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "in") + "/", str(tmp_path / "out"),
                           "--tokenizer", f"tiktoken-file:{path}", "--eos", "0", "--shard-tokens", "2000")
    assert code == 0, err
    expected = [enc.encode_ordinary(d) + [0] for d in docs]  # type: ignore[attr-defined]
    assert read_documents(str(tmp_path / "out") + "/") == expected


def conversations(n: int) -> list[list[dict]]:
    rng = random.Random(11)
    roles = ["system", "user", "assistant", "user", "assistant"]
    return [[{"role": r, "content": t}
             for r, t in zip(roles[:rng.randint(2, 5)], texts(5, seed=i), strict=False)] for i in range(n)]


def test_chat_masks_mark_exactly_the_assistant_tokens(tmp_path, capsys, hf_tokenizer):
    tok, path = hf_tokenizer
    chats = conversations(40)
    write_jsonl(tmp_path / "in", chats, per_file=15, key="messages")
    eos = tok.token_to_id("<eos>")
    ids, masks = [], []
    for messages in chats:
        doc, mask = [], []
        for m in messages:
            head, body = encode(tok, f"<|{m['role']}|>\n"), encode(tok, m["content"]) + [eos]
            doc += head + body
            mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
        ids.append(doc)
        masks.append(mask)
    for fmt in ("megatron", "parquet"):
        dest = tmp_path / fmt
        code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "in") + "/", str(dest), "--tokenizer", path,
                               "--chat", "--eos", "<eos>", "--shard-tokens", "600", "--format", fmt,
                               "--workers", "2")
        assert code == 0, err
        if fmt == "megatron":
            bins = sorted(p for p in dest.glob("shard-*.bin") if not p.name.endswith(".mask.bin"))
            assert len(bins) > 2
            got = np.concatenate([np.fromfile(b, np.uint16) for b in bins])
            mask = np.concatenate([np.fromfile(b.with_suffix(".mask.bin"), np.uint8) for b in bins])
            assert read_documents([str(b) for b in bins]) == ids
        else:
            table = pq.read_table(sorted(str(p) for p in dest.glob("*.parquet")))
            assert table.column("tokens").to_pylist() == ids
            assert table.schema.field("loss_mask").type == pa.list_(pa.uint8())
            got = np.concatenate([np.asarray(r) for r in table.column("tokens").to_pylist()])
            mask = np.concatenate([np.asarray(r) for r in table.column("loss_mask").to_pylist()])
            assert read_documents(str(dest) + "/", column="tokens") == ids
        assert got.tolist() == [t for d in ids for t in d]
        assert mask.tolist() == [m for d in masks for m in d]
        assert 0 < mask.sum() < len(mask)
        # read back as fine-tuning data: the directory listed (the masks are no token files),
        # whole conversations packed, labels exactly the assistant's tokens
        longest = max(len(d) for d in ids)
        if fmt == "megatron":
            ds = sd.TokenDataset(str(dest) + "/", seq_len=longest, loss_mask=True, packing="best_fit")
        else:  # (best fit needs the lengths before reading: an .idx's)
            ds = sd.TokenDataset(str(dest) + "/", seq_len=longest, loss_mask=True, column="tokens",
                                 partial="pad")
        seqs = list(ds)
        labels = np.concatenate([np.asarray(s["labels"]) for s in seqs])
        inputs = np.concatenate([np.asarray(s["input_ids"]) for s in seqs])
        trained = inputs[labels != -100]
        assert (labels[labels != -100] == trained).all()
        assert sorted(trained.tolist()) == sorted(got[mask == 1].tolist())


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, hf_tokenizer):
    _, path = hf_tokenizer
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "out"),
                           "--tokenizer", path, "--workers", "1")
    assert code == 2 and "a.jsonl" in err and "line 2" in err and "--field" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "out2"),
                           "--tokenizer", str(tmp_path / "in" / "a.jsonl"))
    assert code == 2 and "tokenizers JSON" in err


def _receipts(dest: Path) -> int:
    folder = dest / "_streamdata.tokenize"
    return len([p for p in folder.glob("shard-*.json")]) if folder.exists() else 0


@pytest.mark.slow
def test_killed_midway_and_run_again_gives_the_same_bytes(tmp_path, capsys, hf_tokenizer):
    """RECEIPT-LAST: a run killed with SIGKILL (the command and its workers) after some
    receipts leaves only whole files under final names; run again, it keeps the complete shards,
    writes the rest, and the output is the bytes of an uninterrupted run."""
    tok, path = hf_tokenizer
    docs = texts(6000, seed=13)
    write_jsonl(tmp_path / "in", docs, per_file=150)
    args = ["tokenize", str(tmp_path / "in") + "/", "--tokenizer", path, "--eos", "<eos>",
            "--shard-tokens", "300", "--workers", "2", "--quiet"]
    code, out, err = run_cli(capsys, *args[:2], str(tmp_path / "whole"), *args[2:])
    assert code == 0, err
    whole = files_of(tmp_path / "whole")
    shards = len([n for n in whole if n.endswith(".idx")])
    dest = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "streamdata", *args[:2], str(dest), *args[2:]], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _receipts(dest) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, mid-write
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    left = files_of(dest)
    assert 5 <= _receipts(dest) < shards  # killed midway
    for name, data in left.items():  # every file under a final name is whole: the same bytes
        if not name.startswith(".") and "/." not in name:
            assert whole[name] == data, name
    code, out, err = run_cli(capsys, *args[:2], str(dest), *args[2:])
    assert code == 0 and "resumed after" in out, err
    assert files_of(dest) == whole  # no temporary left, no duplicate, no partial shard
    eos = tok.token_to_id("<eos>")
    assert read_documents(str(dest) + "/") == [encode(tok, d) + [eos] for d in docs]


@pytest.mark.slow
def test_the_docs_command_runs(s3_server, tmp_path, monkeypatch, hf_tokenizer):
    """docs/tokens.md, "From text to tokens": its command, then its Python block."""
    import s3fs

    tok, path = hf_tokenizer
    s3_server.create_bucket("text")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    docs = texts(90, seed=17)
    for i in range(3):
        fs.pipe_file(f"text/web/part-{i}.jsonl",
                     "".join(json.dumps({"text": d}) + "\n" for d in docs[i * 30:(i + 1) * 30]).encode())
    s3_environment(monkeypatch, s3_server.storage_options)
    monkeypatch.chdir(tmp_path)
    Path("tokenizer.json").write_bytes(Path(path).read_bytes())
    section = (ROOT / "docs" / "tokens.md").read_text().split("## From text to tokens", 1)[1]
    command = next(line for line in section.splitlines() if line.startswith("$ streamdata tokenize"))
    assert main(shlex.split(command)[2:] + ["--quiet"]) == 0
    (code,) = doc_blocks("docs/tokens.md", "## From text to tokens")
    ns: dict = {}
    exec(compile(code, "From text to tokens", "exec"), ns)
    eos = tok.token_to_id("<eos>")
    assert ns["docs"] == [encode(tok, d) + [eos] for d in docs]


def test_help_and_the_progress_bar(tmp_path, capsys, monkeypatch, hf_tokenizer):
    with pytest.raises(SystemExit) as info:
        main(["tokenize", "--help"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and out.startswith("usage: streamdata tokenize")
    assert "--storage-options" in out and "tiktoken-file:PATH" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "\n    tokenize " in capsys.readouterr().out
    _, path = hf_tokenizer
    write_jsonl(tmp_path / "in", texts(20), per_file=10)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["tokenize", str(tmp_path / "in") + "/", str(tmp_path / "out"), "--tokenizer", path,
                 "--workers", "1"]) == 0
    assert "tokenize" in capsys.readouterr().err  # the bar, on a terminal


def test_http_inputs_and_tokenizer_and_errors_from_workers(tmp_path, capsys, http_server, hf_tokenizer):
    tok, path = hf_tokenizer
    docs = texts(60, seed=19)
    write_jsonl(tmp_path / "web", docs, per_file=20)
    (tmp_path / "web" / "tokenizer.json").write_bytes(Path(path).read_bytes())
    server = http_server(tmp_path / "web")
    spec = server.url("").rstrip("/") + "/part-{0000..0002}.jsonl"  # a brace pattern over HTTP
    code, _, err = run_cli(capsys, "tokenize", spec, str(tmp_path / "out"), "--tokenizer",
                           server.url("tokenizer.json"), "--workers", "2")
    assert code == 0, err
    assert read_documents(str(tmp_path / "out") + "/") == [encode(tok, d) for d in docs]
    # a bad line in a worker's file: one line naming it, no shard of the files after it
    (tmp_path / "bad").mkdir()
    write_jsonl(tmp_path / "bad", docs, per_file=20)
    with open(tmp_path / "bad" / "part-0001.jsonl", "a") as f:
        f.write("{not json\n")
    code, _, err = run_cli(capsys, "tokenize", str(tmp_path / "bad") + "/", str(tmp_path / "out-bad"),
                           "--tokenizer", path, "--workers", "2")
    assert code == 2 and "part-0001.jsonl" in err and "line 21" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_rerun_on_s3_finishes_what_a_crash_left(s3_bucket, tmp_path, capsys, hf_tokenizer):
    """What a crash leaves on S3 (shards without receipts, a receipt without its shard, a
    temporary key): the rerun keeps the complete shards from shard 0 and writes the rest."""
    import s3fs

    server, bucket = s3_bucket
    tok, path = hf_tokenizer
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    docs = texts(200, seed=23)
    for i in range(4):
        fs.pipe_file(f"{bucket}/in/part-{i}.jsonl",
                     "".join(json.dumps({"text": d}) + "\n" for d in docs[i * 50:(i + 1) * 50]).encode())
    args = ["tokenize", f"s3://{bucket}/in/", f"s3://{bucket}/out/", "--tokenizer", path, "--eos", "<eos>",
            "--shard-tokens", "400", "--workers", "2", "-o", json.dumps(server.storage_options)]
    assert run_cli(capsys, *args)[0] == 0
    whole = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/out")}
    receipts = sorted(p for p in whole if "/_streamdata.tokenize/shard-" in p)
    assert len(receipts) > 6
    fs.rm_file(receipts[3])  # shard 3: its files, no receipt
    fs.rm_file(receipts[5].replace("_streamdata.tokenize/", "").replace(".json", ".idx"))  # 5: no .idx
    for p in receipts[7:]:
        fs.rm_file(p)
    fs.pipe_file(f"{bucket}/out/.shard-000007.bin.0123456789.tmp", b"partial")
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and "resumed after 3 complete shards" in out, (out, err)
    assert {p: fs.cat_file(p) for p in fs.find(f"{bucket}/out")} == whole
    eos = tok.token_to_id("<eos>")
    assert read_documents(f"s3://{bucket}/out/", storage_options=server.storage_options) == \
        [encode(tok, d) + [eos] for d in docs]
