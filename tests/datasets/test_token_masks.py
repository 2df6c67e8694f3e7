"""sd.TokenDataset on fine-tuning data: a chat corpus (each conversation a prompt not to train on
and a reply to train on) with its loss masks as .bin + .idx + .mask.bin, flat .bin + .mask.bin
and a Parquet list column beside the tokens. Labels are the tokens where the mask is 1 and -100
elsewhere (the mask's 0s, padding, each document's first token in a sequence); packing "fit" and
"best_fit" never split a conversation; every conversation once per epoch over simulated ranks x
real DataLoader workers, equal steps, exact len(), resume exact on other worlds; malformed masks
as typed errors naming the file."""

from __future__ import annotations

import collections
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamdata as sd
from streamdata.formats.tokens import idx_bytes
from tests.helpers import random_documents, rank_env, resumed_rows, saved_state

BOS, EOS, PAD = 900_001, 900_002, 900_003
IGNORE = -100
CONVERSATIONS = [5, 7, 3, 6]  # conversations per file


def conversations(seed: int = 0, longest: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    """Conversations as (token ids, loss mask): a prompt (mask 0) then a reply (mask 1), each
    token's id unique (1000 + its place in the corpus)."""
    rng = np.random.default_rng(seed)
    out, at = [], 1000
    for _ in range(sum(CONVERSATIONS)):
        prompt, reply = int(rng.integers(1, longest + 1)), int(rng.integers(1, longest + 3))
        out.append((np.arange(at, at + prompt + reply), np.array([0] * prompt + [1] * reply, np.uint8)))
        at += prompt + reply
    return out


def write_chat(root, layout: str, convs=None) -> tuple[str, dict, list[list[int]]]:
    """The corpus in ``layout`` under ``root``: its spec, keyword arguments, and each unit's
    conversations (indices into ``convs``), in the units' order."""
    convs = conversations() if convs is None else convs
    root.mkdir(parents=True, exist_ok=True)
    units, at = [], 0
    for i, n in enumerate(CONVERSATIONS):
        mine = list(range(at, at + n))
        at += n
        tokens = np.concatenate([convs[k][0] for k in mine])
        mask = np.concatenate([convs[k][1] for k in mine])
        if layout == "parquet":  # a list<uint8> mask, and list<bool> in one file; row groups of 3
            kind = pa.list_(pa.bool_()) if i == 1 else pa.list_(pa.uint8())
            table = pa.table({"tokens": pa.array([convs[k][0].tolist() for k in mine], pa.list_(pa.int32())),
                              "loss_mask": pa.array([convs[k][1].astype(bool if i == 1 else np.uint8).tolist()
                                                     for k in mine], kind)})
            pq.write_table(table, root / f"chat-{i}.parquet", row_group_size=3)
            units += [mine[g:g + 3] for g in range(0, n, 3)]
            continue
        if layout == "bin":  # a flat .bin: one conversation per file
            for k in mine:
                convs[k][0].astype(np.uint32).tofile(root / f"chat-{k:03d}.bin")
                convs[k][1].tofile(root / f"chat-{k:03d}.mask.bin")
                units.append([k])
            continue
        tokens.astype(np.int32).tofile(root / f"chat-{i}.bin")
        (root / f"chat-{i}.idx").write_bytes(idx_bytes([len(convs[k][0]) for k in mine], np.int32))
        mask.tofile(root / f"chat-{i}.mask.bin")
        units.append(mine)
    kw = {"idx": {"loss_mask": True}, "bin": {"dtype": "uint32", "loss_mask": True},
          "parquet": {"column": "tokens", "mask_column": "loss_mask"}}[layout]
    return str(root) + "/", kw, units


def piece(ds, conv) -> tuple[list[int], list[int]]:
    """A conversation as the stream holds it: tokens and loss mask, bos (mask 0) and eos (its
    last token's mask) around it."""
    tokens, mask = conv[0].tolist(), conv[1].tolist()
    if ds.bos_id is not None:
        tokens, mask = [ds.bos_id, *tokens], [0, *mask]
    if ds.eos_id is not None:
        tokens, mask = [*tokens, ds.eos_id], [*mask, conv[1][-1]]
    return tokens, mask


def want_labels(tokens: list[int], keys: list[int], mask: list[int]) -> list[int]:
    """The labels of a sequence, as a Hugging Face causal LM takes them (unshifted): the token where
    its mask is 1, else -100; -100 at padding and where a document starts after position 0."""
    out = [t if m else IGNORE for t, m in zip(tokens, mask, strict=True)]
    return [IGNORE if k < 0 or (i and keys[i - 1] != k) else label
            for i, (label, k) in enumerate(zip(out, keys, strict=True))]


def rows(per_rank) -> list[tuple[list[int], list[int]]]:
    return [(ids, labels) for batches in per_rank for b in batches
            for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist(), strict=True)]


def labelled(batch) -> list[tuple]:
    """Each sequence of ``batch`` followed by its labels."""
    return [tuple(ids + labels) for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                                       strict=True)]


def epoch(ds, world_size: int, num_workers: int) -> list[list[dict]]:
    per_rank = []
    for rank in range(world_size):
        with rank_env(rank, world_size):
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                                 timeout=60 if num_workers else 0)
            per_rank.append([{k: v.clone() for k, v in b.items()} for b in loader])
    return per_rank


def check_whole(ds, convs, got) -> list[int]:
    """Packing "fit" / "best_fit": each sequence whole conversations, then padding; each
    conversation's labels as ``want_labels`` says. The conversations seen, in order."""
    first = {int(c[0][0]): k for k, c in enumerate(convs)}
    seen = []
    for ids, labels in got:
        at, keys, mask, tokens = 0, [], [], []
        while at < len(ids) and ids[at] != PAD:
            k = first[ids[at + (ds.bos_id is not None)]]  # (a conversation starts here, whole)
            toks, m = piece(ds, convs[k])
            assert ids[at:at + len(toks)] == toks, f"conversation {k} split or out of order"
            tokens, keys, mask = tokens + toks, keys + [k] * len(toks), mask + m
            seen.append(k)
            at += len(toks)
        assert ids[at:] == [PAD] * (len(ids) - at)
        pad = len(ids) - at
        assert labels == want_labels(tokens + [PAD] * pad, keys + [-1] * pad, mask + [0] * pad)
    return seen


def concat_stream(ds, convs, units, ep: int) -> dict[tuple, tuple[list[int], list[int]]]:
    """Packing "concat": each sequence of the epoch (a run of the stream) -> its keys and mask."""
    tokens, keys, mask = [], [], []
    for u in ds.plan(ep).order:
        for k in units[u]:
            toks, m = piece(ds, convs[k])
            tokens, keys, mask = tokens + toks, keys + [k] * len(toks), mask + m
    w = ds.width
    return {tuple(tokens[s:s + w]): (keys[s:s + w], mask[s:s + w]) for s in range(0, len(tokens) - w + 1, w)}


CASES = [("idx", "concat"), ("idx", "fit"), ("idx", "best_fit"), ("parquet", "concat"), ("bin", "best_fit"),
         ("bin", "concat")]


# the sequence shuffle: blocks of 4 sequences, windows of 2 blocks (not for Parquet: refused)
SEQUENCES = {"shuffle": "sequences", "block_bytes": 4 * 16 * 4, "window_blocks": 2}


@pytest.mark.parametrize("layout,packing,shuffled", [(*c, False) for c in CASES] +
                         [(*c, True) for c in CASES if c[0] != "parquet"])  # (refused: test_token_shuffle)
@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 2)])
@pytest.mark.parametrize("specials", [False, True])
def test_labels_follow_the_mask_and_every_conversation_once(tmp_path, layout, packing, shuffled, world_size,
                                                            num_workers, specials):
    convs = conversations()
    spec, kw, units = write_chat(tmp_path / layout, layout, convs)
    order = SEQUENCES if shuffled else {"shuffle": True}
    ds = sd.TokenDataset(spec, seq_len=15, targets=True, batch_size=2, seed=2, packing=packing,
                         pad_id=PAD, documents=packing == "best_fit",
                         **({"bos_id": BOS, "eos_id": EOS} if specials else {}), **order, **kw)
    for ep in range(2):
        ds.set_epoch(ep)
        per_rank = epoch(ds, world_size, num_workers)
        assert len({len(b) for b in per_rank}) == 1, "unequal steps"
        got = rows(per_rank)
        assert len(got) == ds.num_sequences
        assert all(len(ids) == len(labels) == 16 for ids, labels in got)
        if packing == "concat":
            want = concat_stream(ds, convs, units, ep)
            assert sorted(tuple(ids) for ids, _ in got) == sorted(want)  # every whole sequence once
            for ids, labels in got:
                keys, mask = want[tuple(ids)]
                assert labels == want_labels(ids, keys, mask)
        else:
            seen = check_whole(ds, convs, got)
            assert sorted(seen) == list(range(len(convs))), "a conversation lost or twice"
        if packing == "best_fit" and "doc_ids" in per_rank[0][0]:  # documents=True: cu_seqlens still right
            for b in (b for batches in per_rank for b in batches):
                for i in range(len(b["input_ids"])):
                    starts = b["cu_seqlens"][i].tolist()
                    assert starts[0] == 0 and starts[-1] == 16
                    assert (b["position_ids"][i] == 0).sum() == len(set(starts)) - 1


def test_best_fit_packs_tighter_than_next_fit(tmp_path):
    spec, kw, _ = write_chat(tmp_path / "idx", "idx")
    made = {p: sd.TokenDataset(spec, seq_len=16, packing=p, eos_id=EOS, **kw) for p in ("fit", "best_fit")}
    assert made["best_fit"].num_sequences < made["fit"].num_sequences
    assert made["best_fit"].num_tokens == made["fit"].num_tokens


def test_best_fit_truncates_a_conversation_longer_than_a_sequence(tmp_path):
    convs = conversations(seed=1, longest=12)  # some longer than 12 tokens
    spec, kw, _ = write_chat(tmp_path / "idx", "idx", convs)
    ds = sd.TokenDataset(spec, seq_len=12, batch_size=3, packing="best_fit", pad_id=PAD, **kw)
    got = rows(epoch(ds, 2, 0))
    long = [c for c in convs if len(c[0]) > 12]
    assert long and ds.counts["tokens.truncated"] == sum(len(c[0]) - 12 for c in long)
    firsts = collections.Counter(ids[0] for ids, _ in got)
    for c in long:  # alone in its sequence, its first 12 tokens, labels as its mask says
        (ids, labels), = [(ids, labels) for ids, labels in got if ids[0] == int(c[0][0])]
        assert ids == c[0][:12].tolist() and firsts[ids[0]] == 1
        assert labels == [t if m else IGNORE for t, m in zip(c[0][:12].tolist(), c[1][:12].tolist(),
                                                              strict=True)]
    kept = sum(1 for ids, _ in got for t in ids if t != PAD)
    assert kept + ds.counts["tokens.truncated"] == sum(len(c[0]) for c in convs)


@pytest.mark.parametrize("layout,packing,order", [("idx", "best_fit", {"shuffle": True}),
                                                  ("parquet", "concat", {"shuffle": True}),
                                                  ("idx", "best_fit", SEQUENCES),
                                                  ("bin", "concat", SEQUENCES)])
@pytest.mark.parametrize("new", [(2, 2), (3, 1), (1, 0)])
def test_resume_is_exact_on_any_world(tmp_path, layout, packing, order, new):
    spec, kw, _ = write_chat(tmp_path / layout, layout)
    make = lambda: sd.TokenDataset(spec, seq_len=10, batch_size=2, seed=9, packing=packing,  # noqa: E731
                                   eos_id=EOS, partial="pad", pad_id=PAD, **order, **kw)
    row = labelled
    everything = collections.Counter(r for b in make() for r in row(b))
    before, state = saved_state(make, 2, row)
    after, steps = resumed_rows(make, state, *new, row)
    assert len(set(steps)) == 1, steps
    assert collections.Counter(before + after) == everything


@pytest.mark.parametrize("packing,drop_last", [("best_fit", False), ("best_fit", True), ("fit", False)])
def test_len_is_exact_every_epoch(tmp_path, packing, drop_last):
    """With shuffle=True each epoch packs its own order (next fit: into more or fewer sequences):
    len() is that epoch's."""
    rng = np.random.default_rng(1)
    for i in range(12):  # files of 1 to 4 conversations of 1 to 8 tokens
        lengths = rng.integers(1, 9, rng.integers(1, 5))
        np.arange(lengths.sum()).astype(np.int32).tofile(tmp_path / f"p{i}.bin")
        (tmp_path / f"p{i}.idx").write_bytes(idx_bytes(lengths, np.int32))
        (np.arange(lengths.sum()) % 2).astype(np.uint8).tofile(tmp_path / f"p{i}.mask.bin")
    ds = sd.TokenDataset(str(tmp_path) + "/", seq_len=10, batch_size=2, shuffle=True, seed=0, packing=packing,
                         drop_last=drop_last, loss_mask=True)
    if packing == "fit":
        assert len({ds.plan(ep).sequences for ep in range(3)}) > 1
    for ep in range(3):
        for rank in range(2):
            with rank_env(rank, 2), sd.loader(ds, num_workers=2) as loader:
                loader.set_epoch(ep)
                assert len(loader) == len(list(loader)), (ep, rank)


def test_mask_reads_are_ranged_like_the_tokens(tmp_path):
    """Each token read is followed by a read of the same span of NAME.mask.bin (one byte a token,
    one more before it for an eos's mask): no whole-file download."""
    from streamdata.datasets.tokens import TokenMask

    spec, kw, _ = write_chat(tmp_path / "idx", "idx")
    ds = sd.TokenDataset(spec, seq_len=7, eos_id=EOS, **kw)
    with rank_env(1, 3):
        p = ds.reader_pass(None)
        items = [ds.fetch_segment(r.unit, *r.part) for r in p.reads]
    assert [isinstance(r.unit, TokenMask) for r in p.reads] == [False, True] * (len(p.reads) // 2)
    for tokens, mask in zip(items[::2], items[1::2], strict=True):
        assert mask.url == tokens.url[:-4] + ".mask.bin"
        (a, b), = tokens.ranges
        (c, d), = mask.ranges
        assert d == b // 4 and c in (a // 4 - 1, a // 4, 0)  # (int32 tokens)
    assert sum(d - c for it in items[1::2] for c, d in it.ranges) < ds.num_tokens / 2


def test_a_missing_mask_names_it(tmp_path):
    spec, kw, _ = write_chat(tmp_path / "idx", "idx")
    (tmp_path / "idx" / "chat-2.mask.bin").unlink()
    with pytest.raises(sd.ShardNotFoundError, match=r"chat-2\.mask\.bin.*loss_mask"):
        sd.TokenDataset(spec, seq_len=8, **kw)
    ds = sd.TokenDataset(spec, seq_len=8)  # without loss_mask, the masks are not read (nor listed as tokens)
    assert ds.layout == "idx" and len(ds.units_) == 4


def test_a_mask_of_another_length_or_values(tmp_path):
    spec, kw, _ = write_chat(tmp_path / "idx", "idx")
    path = tmp_path / "idx" / "chat-1.mask.bin"
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(sd.FormatError, match=r"chat-1\.mask\.bin.*one uint8 per token"):
        sd.TokenDataset(spec, seq_len=8, **kw)
    path.write_bytes(good[:-1] + b"\x07")
    ds = sd.TokenDataset(spec, seq_len=8, batch_size=2, **kw)
    with pytest.raises(sd.FormatError, match=r"chat-1\.mask\.bin.*0 and 1 only"):
        list(ds)


def test_a_parquet_mask_that_does_not_match_its_tokens(tmp_path):
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32())),
                             "loss_mask": pa.array([[0, 1, 1], [1]], pa.list_(pa.uint8())),
                             "note": ["a", "b"]}), root / "a.parquet")
    ds = sd.TokenDataset(str(root) + "/", seq_len=2, column="tokens", loss_mask=True)
    assert ds.mask_column == "loss_mask"
    with pytest.raises(sd.FormatError, match=r"a\.parquet.*loss mask 'loss_mask'"):
        list(ds)
    with pytest.raises(sd.SpecError, match="loss-mask column 'note'"):
        list(sd.TokenDataset(str(root) + "/", seq_len=2, column="tokens", mask_column="note"))


def test_masks_are_refused_where_there_are_none(tmp_path):
    spec, _, _ = write_chat(tmp_path / "idx", "idx")
    with pytest.raises(sd.SpecError, match="tar shards"):
        sd.TokenDataset(spec, seq_len=8, field="npy", loss_mask=True)
    with pytest.raises(sd.SpecError, match="mask_column"):
        sd.TokenDataset(spec, seq_len=8, mask_column="loss_mask")
    with pytest.raises(sd.SpecError, match="packing='best_fit'"):
        sd.TokenDataset(spec, seq_len=8, column="tokens", packing="best_fit")


# ---- the plan, pure -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_best_fit_plan_keeps_every_document_whole_once(seed):
    from streamdata.epoch.tokens import best_fit_plan, fit_plan

    rng = np.random.default_rng(seed)
    docs, width, specials, tokens = random_documents(rng, 30, 16)
    window = int(rng.integers(1, 4))
    plan = best_fit_plan(tokens, docs, width, specials, seed=seed, epoch=1, shuffle=True, window=window)
    again = best_fit_plan(tokens, docs, width, specials, seed=seed, epoch=1, shuffle=True, window=window)
    assert again.pieces.tolist() == plan.pieces.tolist() and again.firsts.tolist() == plan.firsts.tolist()
    starts, at = [], 0
    for u in plan.order:
        for n in docs[u] + specials:
            starts.append((at, int(n)))
            at += int(n)
    held = sorted(map(tuple, plan.pieces.tolist()))
    assert held == sorted((a, a + min(n, width)) for a, n in starts if n)  # each document once, whole
    assert plan.truncated == sum(max(n - width, 0) for _, n in starts)
    lengths = plan.lengths(0, plan.sequences)
    assert len(lengths) == plan.sequences and (lengths > 0).all() and (lengths <= width).all()
    assert lengths.sum() == sum(tokens) - plan.truncated
    nxt = fit_plan(tokens, docs, width, specials, seed=seed, epoch=1, shuffle=True)
    if not plan.truncated:
        assert plan.sequences <= nxt.sequences + window  # (no worse than next fit, window by window)


def test_augmented_mask_agrees_with_a_built_stream():
    from streamdata.epoch.tokens import augmented_mask, raw_range

    rng = np.random.default_rng(5)
    for _ in range(300):
        lengths = rng.integers(0, 6, rng.integers(1, 6))
        bos, eos = bool(rng.integers(2)), bool(rng.integers(2))
        raw = rng.integers(0, 2, lengths.sum()).astype(np.uint8)
        stream, at = [], 0
        for n in lengths:
            m = raw[at:at + n].tolist()
            stream += [*([0] if bos else []), *m, *([m[-1] if n else 0] if eos else [])]
            at += n
        a, b = sorted(rng.integers(0, len(stream) + 1, 2))
        if a == b:
            continue
        lo, hi = raw_range(lengths, a, b, bos, eos)
        lo = max(lo - 1, 0) if eos else lo
        assert augmented_mask(lengths, a, b, raw[lo:hi], lo, bos, eos).tolist() == stream[a:b]


# ---- a real torchrun job -------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_2x2_every_conversation_once_and_resume(s3_bucket, tmp_path):
    """2 ranks x 2 workers under torchrun (gloo), on S3: a whole epoch of best-fit packed
    conversations with labels (every conversation once, whole, equal steps), and Parquet's
    (every sequence once); the same job stopped at step 2 and resumed here on one reader."""
    import s3fs

    from tests.helpers import torchrun
    from tests.test_tokens_ddp import JOB, TIME_LIMIT_S

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    convs = conversations()
    cases, reference = {}, {}
    for layout, packing in (("idx", "best_fit"), ("parquet", "concat")):
        local, kw, _ = write_chat(tmp_path / layout, layout, convs)
        for path in sorted((tmp_path / layout).iterdir()):
            fs.pipe_file(f"{bucket}/{layout}/{path.name}", path.read_bytes())
        options = {**kw, "seq_len": 16, "batch_size": 2, "shuffle": True, "seed": 3, "packing": packing,
                   "eos_id": EOS, "pad_id": PAD, "storage_options": server.storage_options}
        case = {"spec": f"s3://{bucket}/{layout}/", "options": options}
        cases[f"{layout}-whole"] = case
        cases[layout] = {**case, "stop": 2, "save": str(tmp_path / f"{layout}.json")}
        ds = sd.TokenDataset(local, **{k: v for k, v in options.items() if k != "storage_options"})
        ds.set_epoch(1)
        reference[layout] = (ds, [r for b in ds for r in labelled(b)])
    ranks = torchrun(JOB, tmp_path, 2, {"workers": 2, "tag": "sft", "cases": cases}, TIME_LIMIT_S)
    for layout, (ds, everything) in reference.items():
        whole = [tuple(s) for r in ranks for s in r[f"{layout}-whole"]["seqs"]]
        assert ranks[0][f"{layout}-whole"]["all_steps"] == [ranks[0][f"{layout}-whole"]["steps"]] * 2
        assert collections.Counter(whole) == collections.Counter(everything)
        if layout == "idx":  # every conversation once, whole, its labels as its mask says
            seen = check_whole(ds, convs, [(list(s[:16]), list(s[16:])) for s in whole])
            assert sorted(seen) == list(range(len(convs)))
        before = [tuple(s) for r in ranks for s in r[layout]["seqs"]]
        assert [r[layout]["steps"] for r in ranks] == [2, 2]
        again = sd.TokenDataset(f"s3://{bucket}/{layout}/", **cases[layout]["options"])
        with sd.loader(again, num_workers=0) as loader:
            loader.set_epoch(1)
            loader.load_state_dict(json.loads((tmp_path / f"{layout}.json").read_text()))
            after = [r for b in loader for r in labelled(b)]
        assert collections.Counter(before + after) == collections.Counter(everything)
