"""``streamdata tokenize``: text (JSONL, a Parquet column, tar shards' ``.txt`` / ``.json``) into
token shards that ``sd.TokenDataset`` reads: Megatron ``.bin`` + ``.idx`` (uint16 when the
vocabulary fits, else uint32) or Parquet with a ``tokens`` list column, at any URL.

The inputs are listed once (``catalog.specs``); each input object is a unit of work, read
through the package's fetch path (``fetch.prefetcher``: retries, proxies, the same storage
options as the datasets) and tokenized in a pool of ``--workers`` processes. The main process
takes the units' documents in input order and cuts shards by tokens (``write.tokens``), so the
shards are the same bytes whatever the number of workers. A shard is published whole and then
its receipt; a rerun finds the complete shards from the receipts, starts from the input
position after the last one, and writes the rest (see ``write.tokens``).

Tokenizers: ``--tokenizer PATH_OR_URL`` a Hugging Face ``tokenizers`` JSON file
(``tokenizer.json``); ``tiktoken:NAME`` a tiktoken encoding by name (tiktoken downloads it on
first use); ``tiktoken-file:PATH_OR_URL`` a tiktoken BPE file (``base64-token rank`` lines, as
tiktoken's own files), split with GPT-2's pattern. Text is encoded without special tokens: the
ids of ``--bos`` / ``--eos`` are written around each document where asked.

``--chat``: each document is a JSON field ``messages``, a list of ``{"role", "content"}``. A
message is written as the tokens of ``"<|ROLE|>\\n"`` (the header, never trained on), then the
tokens of its content, then the ``--eos`` id when given; the content and that end are trained
on (loss mask 1) in the assistant's messages only. ``--bos`` starts each conversation (mask 0).
The mask goes to ``NAME.mask.bin`` beside each ``NAME.bin`` (one uint8 per token), or to a
``loss_mask`` list<uint8> column in Parquet.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streamdata.cli.common import (
    UsageError,
    add_common,
    bar,
    fetch_options,
    human,
    parse_size,
    storage_options,
    write_out,
)

__all__ = ["INPUT_FORMATS", "Tokenizer", "add_parsers", "load_tokenizer"]

INPUT_FORMATS = ("jsonl", "parquet", "tar")
_SUFFIXES = {"jsonl": (".jsonl", ".ndjson", ".jsonl.gz", ".jsonl.zst", ".ndjson.gz", ".ndjson.zst"),
             "parquet": (".parquet",),
             "tar": (".tar", ".tar.gz", ".tgz", ".tar.zst")}
_WAIT_S = 3600.0  # one unit's tokenization: a bound on the wait, never reached by a working pool


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokenize", help="text (JSONL, Parquet, tar) into token shards (Megatron .bin + .idx, or Parquet)",
        description="Tokenize the documents of SPEC (JSONL files: a field per line; Parquet: a "
                    "string column; tar shards: each sample's .txt, else its .json's field) into "
                    "shards at DEST that sd.TokenDataset reads: Megatron shard-000000.bin + .idx "
                    "(uint16 tokens when the vocabulary fits, else uint32), or Parquet with a "
                    "'tokens' list<int32> column. Shards are published whole, each followed by "
                    "its receipt in DEST/_streamdata.tokenize/; run the same command again after "
                    "a crash and it writes only what is missing. The output is the same bytes "
                    "whatever --workers.")
    p.add_argument("src", metavar="SPEC", nargs="+",
                   help="input files: URLs, brace patterns, prefixes or globs (as the datasets take)")
    p.add_argument("dest", metavar="DEST", help="output directory or prefix (local path or URL)")
    p.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                   help="a tokenizers JSON file (tokenizer.json, path or URL); tiktoken:NAME (e.g. "
                        "tiktoken:cl100k_base, downloaded by tiktoken); tiktoken-file:PATH (a local "
                        "or remote tiktoken BPE file)")
    p.add_argument("--format", choices=("megatron", "parquet"), default="megatron",
                   help="output: megatron (.bin + .idx, default) or parquet (a 'tokens' column)")
    p.add_argument("--input-format", choices=("auto", *INPUT_FORMATS), default="auto",
                   help="how to read SPEC; auto: by the files' suffixes (.jsonl, .parquet, .tar ...)")
    p.add_argument("--field", default=None, metavar="NAME",
                   help="the JSON field (JSONL, a tar sample's .json) or Parquet column holding "
                        "each document (default 'text'; with --chat, 'messages')")
    p.add_argument("--chat", action="store_true",
                   help="documents are conversations, lists of {role, content}: write a loss mask "
                        "(1 on the assistant's tokens) beside the tokens (NAME.mask.bin; Parquet: a "
                        "loss_mask column)")
    p.add_argument("--bos", default=None, metavar="ID",
                   help="a token id (or a token the tokenizer knows, e.g. '<s>') to start each document")
    p.add_argument("--eos", default=None, metavar="ID",
                   help="a token id (or token, e.g. '<|endoftext|>') to end each document (with "
                        "--chat: each message). Without --bos/--eos, TokenDataset(bos_id=, "
                        "eos_id=) can insert them when reading instead")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                      help="close a shard after the document that brings it to N tokens "
                           "(default: --shard-bytes 1GiB worth)")
    size.add_argument("--shard-bytes", type=parse_size, default=None, metavar="BYTES",
                      help="the same, in bytes of tokens (500MB, 1GiB ...; default 1GiB)")
    p.add_argument("--name", default="shard", help="shard names: <name>-000000.bin ... (default: shard)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tokenizing processes (default: the CPUs; 1: in this process)")
    add_common(p)
    p.set_defaults(run=run)


# ---- tokenizers -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build the tokenizer: its kind, its name and (files) its bytes."""

    kind: str  # "tokenizers" | "tiktoken" | "tiktoken-file"
    name: str
    data: bytes = b""

    @property
    def identity(self) -> str:
        return f"{self.kind}:{self.name}:" + (hashlib.sha256(self.data).hexdigest()[:16] if self.data else "")


class Tokenizer:
    """One interface over a ``tokenizers.Tokenizer`` and a ``tiktoken.Encoding``: ``encode``
    (a batch of texts, no special tokens), ``vocab_size``, ``token_id`` of a token's text."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        if spec.kind == "tokenizers":
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_str(spec.data.decode("utf-8"))
            except Exception as exc:  # the Rust side raises a plain Exception
                raise UsageError(f"--tokenizer {spec.name}: not a tokenizers JSON file ({exc})") from None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            return
        import tiktoken

        if spec.kind == "tiktoken":
            try:
                self._tt = tiktoken.get_encoding(spec.name)
            except ValueError as exc:
                raise UsageError(f"--tokenizer tiktoken:{spec.name}: {exc}") from None
        else:
            from tiktoken_ext.openai_public import r50k_pat_str

            self._tt = tiktoken.Encoding(name=os.path.basename(spec.name) or "bpe", pat_str=r50k_pat_str,
                                         mergeable_ranks=_bpe_ranks(spec.data, spec.name), special_tokens={})
        self.vocab_size = self._tt.n_vocab

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.spec.kind == "tokenizers":
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._tt.encode_ordinary_batch(texts, num_threads=1)

    def token_id(self, text: str) -> int | None:
        if self.spec.kind == "tokenizers":
            return self._hf.token_to_id(text)
        try:
            return self._tt.encode_single_token(text)
        except KeyError:
            return None


def _bpe_ranks(data: bytes, where: str) -> dict[bytes, int]:
    """A tiktoken BPE file's ranks: ``base64(token) rank`` per line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise UsageError(f"--tokenizer tiktoken-file:{where}: line {number} is not "
                             "'<base64 token> <rank>'") from None
    if not ranks:
        raise UsageError(f"--tokenizer tiktoken-file:{where}: no ranks in it")
    return ranks


def load_tokenizer(text: str, options: dict, config: Any) -> Tokenizer:
    """``--tokenizer``'s value as a :class:`Tokenizer` (a file read through the fetch path)."""
    if text.startswith("tiktoken:"):
        return Tokenizer(TokenizerSpec("tiktoken", text.split(":", 1)[1]))
    kind, where = ("tiktoken-file", text.split(":", 1)[1]) if text.startswith("tiktoken-file:") \
        else ("tokenizers", text)
    return Tokenizer(TokenizerSpec(kind, where, _read_whole(where, None, options, config)))


def _token(value: str | None, tok: Tokenizer, option: str) -> int | None:
    if value is None:
        return None
    if value.lstrip("-").isdigit():
        found: int | None = int(value)
    else:
        found = tok.token_id(value)
        if found is None:
            raise UsageError(f"{option} {value!r}: the tokenizer has no such token (give its id)")
    if found is None or found < 0:
        raise UsageError(f"{option} {value}: a token id is >= 0")
    return found


# ---- reading the inputs (in the workers) -------------------------------------------------------


def _read_whole(url: str, size: int | None, options: dict, config: Any) -> bytes:
    return b"".join(_chunks(url, size, options, config))


def _chunks(url: str, size: int | None, options: dict, config: Any) -> Iterator[bytes]:
    """An object's bytes in chunks, through the fetch path (``Prefetcher``)."""
    from streamdata.fetch.prefetcher import FetchItem, Prefetcher
    from streamdata.store.urls import split_url

    if split_url(url)[0] == "file" and "://" not in url:
        url = "file://" + os.path.abspath(url)
    with Prefetcher([FetchItem(url, size)], dict(options), config) as fetcher:
        for reader in fetcher:
            yield from reader.chunks()


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        rest += chunk
        *whole, rest = rest.split(b"\n")
        yield from whole
    if rest:
        yield rest


@dataclasses.dataclass(frozen=True)
class Job:
    """The settings every worker tokenizes with."""

    tokenizer: TokenizerSpec
    input_format: str
    field: str
    chat: bool
    bos: int | None
    eos: int | None
    dtype: str
    options: dict
    config: Any


@dataclasses.dataclass
class Tokenized:
    """One unit's documents: their tokens back to back, each one's length, and the loss mask."""

    unit: int
    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None
    nbytes: int


_WORKER: dict[str, Any] = {}


def _init_worker(job: Job) -> None:
    _WORKER["job"], _WORKER["tokenizer"] = job, Tokenizer(job.tokenizer)


def _documents(job: Job, url: str, size: int | None) -> Iterator[Any]:
    """The unit's documents in order: texts, or (``chat``) message lists."""
    from streamdata.errors import FormatError
    from streamdata.formats.compress import decompressed

    def bad(where: str, what: str) -> FormatError:
        return FormatError(f"{url}: {where} {what}", url=url, key=where)

    def pick(value: Any, where: str) -> Any:
        if not isinstance(value, dict) or job.field not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise bad(where, f"has no field {job.field!r} ({keys}): choose the field with --field")
        return value[job.field]

    if job.input_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(pa.BufferReader(_read_whole(url, size, job.options, job.config)),
                                  columns=[job.field])
        except (pa.ArrowInvalid, KeyError, OSError) as exc:
            raise FormatError(f"{url}: no Parquet column {job.field!r} to read ({exc}): choose it with "
                              "--field", url=url) from None
        values = table.column(0).to_pylist()
        for row, value in enumerate(values):
            if value is None:
                raise bad(f"row {row}", "is null: every row must hold a document")
            yield json.loads(value) if job.chat and isinstance(value, str) else value
        return
    chunks, _ = decompressed(_chunks(url, size, job.options, job.config), url)
    if job.input_format == "jsonl":
        for number, line in enumerate(_lines(chunks), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise bad(f"line {number}", f"is not JSON ({exc})") from None
            yield pick(value, f"line {number}")
        return
    from streamdata.formats.tar import samples_from_chunks

    for sample in samples_from_chunks(chunks, url):
        key = f"sample {sample['__key__']!r}"
        if "txt" in sample and not job.chat:
            try:
                yield sample["txt"].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise bad(key, f"has a .txt that is not UTF-8 ({exc})") from None
        elif "json" in sample:
            try:
                value = json.loads(sample["json"])
            except ValueError as exc:
                raise bad(key, f"has a .json that is not JSON ({exc})") from None
            yield pick(value, key)
        else:
            raise bad(key, "has no .txt or .json member to tokenize")


def tokenize_unit(unit: int, url: str, size: int | None) -> Tokenized:
    """A unit's documents tokenized (in a worker, or in the main process with one worker)."""
    from streamdata.errors import FormatError

    job: Job = _WORKER["job"]
    tok: Tokenizer = _WORKER["tokenizer"]
    pieces: list[list[int]] = []
    masks: list[list[int]] = []
    docs = list(_documents(job, url, size))
    bos, eos = [job.bos] if job.bos is not None else [], [job.eos] if job.eos is not None else []
    if not job.chat:
        for n, text in enumerate(docs):
            if not isinstance(text, str):
                raise FormatError(f"{url}: document {n} is a {type(text).__name__}, not text", url=url)
        pieces = [bos + ids + eos for ids in tok.encode(docs)]
    else:
        for n, messages in enumerate(docs):
            ids, mask = chat_tokens(tok, messages, job.bos, job.eos, url, n)
            pieces.append(ids)
            masks.append(mask)
    lengths = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
    tokens = np.fromiter(itertools.chain.from_iterable(pieces), np.int64, int(lengths.sum()))
    if len(tokens) and int(tokens.max()) >= np.iinfo(job.dtype).max + 1:
        raise FormatError(f"{url}: token id {int(tokens.max())} does not fit {job.dtype}", url=url)
    loss = np.fromiter(itertools.chain.from_iterable(masks), np.uint8, len(tokens)) if job.chat else None
    return Tokenized(unit, tokens.astype(job.dtype), lengths, loss, size or 0)


def chat_tokens(tok: Tokenizer, messages: Any, bos: int | None, eos: int | None, url: str = "",
                n: int = 0) -> tuple[list[int], list[int]]:
    """A conversation's tokens and loss mask (the template in the module docstring)."""
    from streamdata.errors import FormatError

    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise FormatError(f"{url}: document {n} is not a list of {{\"role\": str, \"content\": str}} "
                          "messages (--chat)", url=url, key=f"document {n}")
    texts = [t for m in messages for t in (f"<|{m['role']}|>\n", m["content"])]
    encoded = tok.encode(texts) if texts else []
    ids: list[int] = [bos] if bos is not None else []
    mask: list[int] = [0] * len(ids)
    for i, m in enumerate(messages):
        head, body = encoded[2 * i], encoded[2 * i + 1] + ([eos] if eos is not None else [])
        train = int(m["role"] == "assistant")
        ids += head + body
        mask += [0] * len(head) + [train] * len(body)
    return ids, mask


# ---- the command ------------------------------------------------------------------------------


def _input_format(args: argparse.Namespace, urls: list[str]) -> str:
    if args.input_format != "auto":
        return str(args.input_format)
    found = set()
    for url in urls:
        path = url.split("?", 1)[0].lower()
        kind = next((k for k, ends in _SUFFIXES.items() if path.endswith(ends)), None)
        if kind is None:
            known = ", ".join(s for ends in _SUFFIXES.values() for s in ends)
            raise UsageError(f"{url}: not a known input ({known}): name the format with --input-format")
        found.add(kind)
    if len(found) > 1:
        raise UsageError(f"the inputs mix formats ({', '.join(sorted(found))}): tokenize them separately")
    return found.pop()


def _ordered(submit: Callable[[int], Any], count: int, window: int) -> Iterator[Tokenized]:
    """``submit(i)``'s results for i in range(count), in order, ``window`` in flight."""
    pending: collections.deque = collections.deque()
    nxt = 0
    try:
        while nxt < count or pending:
            while nxt < count and len(pending) < window:
                pending.append(submit(nxt))
                nxt += 1
            yield pending.popleft().result(timeout=_WAIT_S)
    finally:
        for future in pending:
            future.cancel()


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system tells)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    from streamdata.catalog.specs import expand_spec
    from streamdata.config import FetchConfig
    from streamdata.write.tokens import TokenShardWriter, completed, remove_temporaries, token_dtype_for

    options = storage_options(args)
    config = FetchConfig.resolve(None, **fetch_options(args))
    workers = args.workers if args.workers is not None else _cpus()
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        raise UsageError(f"--name {args.name!r}: letters, digits, '_', '.', '-', starting with a "
                         "letter or digit")
    suffixes = tuple(s for ends in _SUFFIXES.values() for s in ends)
    if args.input_format != "auto":
        suffixes = _SUFFIXES[args.input_format]
    shards = expand_spec(list(args.src), options, suffixes=suffixes, config=config)
    input_format = _input_format(args, [s.url for s in shards])
    tok = load_tokenizer(args.tokenizer, options, config)
    bos, eos = _token(args.bos, tok, "--bos"), _token(args.eos, tok, "--eos")
    dtype = token_dtype_for(max([tok.vocab_size - 1] + [t for t in (bos, eos) if t is not None]))
    shard_tokens = args.shard_tokens or (args.shard_bytes or 1 << 30) // dtype.itemsize
    if shard_tokens < 1:
        raise UsageError("--shard-tokens / --shard-bytes must give at least one token per shard")
    field = args.field or ("messages" if args.chat else "text")
    job = Job(tok.spec, input_format, field, args.chat, bos, eos, dtype.name, options, config)
    settings = {"tokenizer": tok.spec.identity, "format": args.format, "input_format": input_format,
                "field": field, "chat": args.chat, "bos": bos, "eos": eos, "dtype": dtype.name,
                "shard_tokens": shard_tokens, "name": args.name,
                "inputs": [[s.url, s.size] for s in shards]}
    dest = args.dest if "://" in args.dest else os.path.abspath(args.dest)
    _check_job(dest, settings, options, config)
    done = completed(dest, args.format, args.name, options, config)
    remove_temporaries(dest, args.name, options, config)
    start = time.perf_counter()
    todo = list(range(done.unit, len(shards)))
    finished = done.unit >= len(shards)
    if finished:
        write_out(f"complete  {done.shards} shards, {done.documents} documents, {done.tokens} tokens "
                  f"at {dest}: nothing to do")
        return 0
    pool = None
    if workers > 1 and len(todo) > 1:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=context,
                                                      initializer=_init_worker, initargs=(job,))
        pool.submit(int).result(timeout=_WAIT_S)  # the workers start now, before the writer's threads

        def submit(i: int) -> Any:
            return pool.submit(tokenize_unit, todo[i], shards[todo[i]].url, shards[todo[i]].size)
    else:
        _init_worker(job)

        def submit(i: int) -> Any:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(tokenize_unit(todo[i], shards[todo[i]].url, shards[todo[i]].size))
            return future
    try:
        total = sum(shards[i].size or 0 for i in todo) or None
        writer = TokenShardWriter(dest, fmt=args.format, dtype=dtype, mask=args.chat,
                                  shard_tokens=shard_tokens, name=args.name, start_shard=done.shards,
                                  storage_options=options, config=config,
                                  meta={"tokenizer": tok.spec.identity})
        with bar(args, total, "tokenize", unit="B", unit_scale=True) as pbar, writer as out:
            for result in _ordered(submit, len(todo), 2 * workers):
                skip = done.doc if result.unit == done.unit else 0  # (done by the shards kept)
                a = int(result.lengths[:skip].sum())
                out.add(result.tokens[a:], result.lengths[skip:],
                        None if result.mask is None else result.mask[a:], result.unit, skip)
                pbar.update(result.nbytes)
                pbar.set_postfix(shards=out.next_index, tokens=done.tokens + out.tokens, refresh=False)
            out.finish((len(shards), 0))
    except concurrent.futures.process.BrokenProcessPool as exc:
        from streamdata.errors import StreamDataError

        raise StreamDataError(f"a tokenizing process died ({exc}; out of memory? an input file is read "
                              "whole by one process): run the command again, with fewer --workers; "
                              "the complete shards are kept") from None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    elapsed = time.perf_counter() - start
    documents, tokens = done.documents + out.documents, done.tokens + out.tokens
    resumed = f" (resumed after {done.shards} complete shards)" if done.shards else ""
    write_out(f"tokenized {documents} documents, {tokens} {dtype.name} tokens into {out.next_index} "
              f"{args.format} shards in {elapsed:.1f} s ({out.tokens / max(elapsed, 1e-9):.0f} tokens/s, "
              f"{human(out.tokens * dtype.itemsize)} written){resumed}")
    write_out(f"output    {dest}")
    return 0


def _check_job(dest: str, settings: dict, options: dict, config: Any) -> None:
    """``DEST/_streamdata.tokenize/job.json``: written when new; when there, the same settings
    or a UsageError (a rerun resumes only the job it started)."""
    from streamdata.errors import ShardNotFoundError
    from streamdata.write.tokens import JOB_DIR
    from streamdata.write.upload import Uploader

    url = dest.rstrip("/") + f"/{JOB_DIR}/job.json"
    try:
        old = json.loads(_read_whole(url, None, options, config))
    except (ShardNotFoundError, FileNotFoundError):
        old = None
    if old is not None:
        if old != json.loads(json.dumps(settings)):
            changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise UsageError(f"{dest} holds shards tokenized with other settings ({', '.join(changed)} "
                             f"differ, see {url}): write to another DEST, or remove it first")
        return
    from streamdata.store.urls import split_url

    uploader = Uploader(split_url(url)[0], options, config=config, progress=False)
    try:
        spool = uploader.spool_path(url)
        with open(spool, "w") as f:
            json.dump(settings, f, sort_keys=True, indent=1)
        uploader.submit(spool, url)
        uploader.wait()
    finally:
        uploader.close()
