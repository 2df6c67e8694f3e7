"""sd.TokenDataset: every token of an epoch in exactly one sequence (TOKENS-ONCE) over simulated
ranks x real DataLoader workers, for flat .bin, Megatron .bin + .idx and Parquet list columns;
equal steps; documents' ids, positions and cu_seqlens; resume exact to the token on the same
and on other worlds; corrupt inputs as typed errors naming the URL."""

from __future__ import annotations

import collections
import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamdata as sd
from streamdata.batch.tokens import varlen_cu_seqlens
from streamdata.epoch.state import merge_states
from streamdata.formats.tokens import idx_bytes
from tests.helpers import rank_env, resumed_rows, saved_state, take

# documents' lengths per file: uneven, with empty documents and an empty file
DOCS = [[5, 0, 17, 3], [40], [], [1, 2, 3, 4, 5, 6, 7], [23, 9], [11]]
BOS, EOS, PAD = 900_001, 900_002, 900_003  # outside every document's ids


def _corpus(tmp_path, layout):
    """Files of ``layout`` whose tokens are their global positions (each token unique); the
    spec, keyword arguments, and each file's documents as arrays."""
    root = tmp_path / layout
    root.mkdir()
    docs, at = [], 0
    for lengths in DOCS:
        starts = at + np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        docs.append([np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, lengths, strict=False)])
        at += sum(lengths)
    for i, file_docs in enumerate(docs):
        flat = np.concatenate(file_docs) if file_docs else np.zeros(0, np.int64)
        if layout == "parquet":
            half = max(1, len(file_docs) // 2)  # two row groups where it can
            rows = [d.astype(np.int32).tolist() for d in file_docs] + ([None] if i == 0 else [])
            table = pa.table({"tokens": pa.array(rows, pa.list_(pa.int32())), "n": np.arange(len(rows))})
            pq.write_table(table, root / f"part-{i}.parquet", row_group_size=half)
        elif layout == "tar":  # one sample per document, its tokens a 1-D .npy (dtypes vary)
            _write_tar(root / f"part-{i}.tar", [(f"s{i}-{k:03d}", {"npy": _npy(d.astype(
                np.uint32 if k % 2 else np.int64)), "txt": b"x"}) for k, d in enumerate(file_docs)])
        else:
            dtype = np.int32 if layout == "idx" else np.uint32  # (Megatron's types: int32 past 65500)
            flat.astype(dtype).tofile(root / f"part-{i}.bin")
            if layout == "idx":
                (root / f"part-{i}.idx").write_bytes(idx_bytes([len(d) for d in file_docs], dtype))
    kw = {"parquet": {"column": "tokens"}, "idx": {}, "bin": {"dtype": "uint32"},
          "tar": {"field": "npy"}}[layout]
    if layout == "bin":  # a flat .bin is one document per file
        docs = [[np.concatenate(d)] if d else [] for d in docs]
    return str(root) + "/", kw, docs


def _npy(array):
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _write_tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for name, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _stream(ds, docs, epoch):
    """The epoch's token stream and each token's document, built independently of the reader."""
    order = ds.plan(epoch).order
    files = [d for d in docs if d]  # (empty files are no units)
    if ds.column is not None:  # units are row groups: the order permutes them
        units = []
        for file_docs, lengths in zip(files, [x for x in DOCS if x], strict=True):
            half = max(1, len(lengths) // 2)
            rows = [*file_docs, *([np.zeros(0, np.int64)] if lengths is DOCS[0] else [])]
            units += [rows[k:k + half] for k in range(0, len(rows), half)]
    else:
        units = files
    specials = (ds.bos_id is not None) + (ds.eos_id is not None)
    units = [u for u in units if sum(len(d) + specials for d in u)]  # (what holds no token is no unit)
    tokens, keys, key = [], [], 0
    for u in order:
        for d in units[u]:
            piece = [*([ds.bos_id] if ds.bos_id is not None else []), *d.tolist(),
                     *([ds.eos_id] if ds.eos_id is not None else [])]
            tokens += piece
            keys += [key] * len(piece)
            key += 1
    return tokens, keys


def _check_documents(seq, batch_row, keys):
    doc_ids, pos, cu = (batch_row[k].tolist() for k in ("doc_ids", "position_ids", "cu_seqlens"))
    width = len(seq)
    starts = [0] + [i for i in range(1, width) if keys[i] != keys[i - 1]]
    assert doc_ids == [sum(1 for s in starts if s <= i) - 1 for i in range(width)]
    assert pos == [i - max(s for s in starts if s <= i) for i in range(width)]
    assert cu == starts + [width] * (width + 1 - len(starts))


def _epoch(ds, world_size, num_workers):
    per_rank = []
    for rank in range(world_size):
        with rank_env(rank, world_size):
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                                 timeout=60 if num_workers else 0)
            per_rank.append([{k: v.clone() for k, v in b.items()} for b in loader])
    return per_rank


@pytest.mark.parametrize("layout", ["bin", "idx", "parquet", "tar"])
@pytest.mark.parametrize("world_size,num_workers",
                         [(1, 0), (2, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("partial,documents,specials", [("drop", False, False), ("pad", False, False),
                                                        ("pad", True, True), ("drop", True, True)])
def test_every_token_once_with_equal_steps(tmp_path, layout, world_size, num_workers, partial, documents,
                                           specials):
    spec, kw, docs = _corpus(tmp_path, layout)
    ds = sd.TokenDataset(spec, seq_len=6, batch_size=2, shuffle=True, seed=4, partial=partial,
                         documents=documents, targets=partial == "pad", pad_id=PAD,
                         **({"bos_id": BOS, "eos_id": EOS} if specials else {}), **kw)
    width = ds.width
    for epoch in range(2):
        ds.set_epoch(epoch)
        stream, keys = _stream(ds, docs, epoch)
        assert len(stream) == ds.num_tokens
        before = dict(ds.counts)
        per_rank = _epoch(ds, world_size, num_workers)
        assert len({len(b) for b in per_rank}) == 1, f"unequal steps {[len(b) for b in per_rank]}"
        rows = [(b, i) for batches in per_rank for b in batches for i in range(len(b["input_ids"]))]
        got = sorted(tuple(b["input_ids"][i].tolist()) for b, i in rows)
        whole, rest = divmod(len(stream), width)
        want = [tuple(stream[k * width:(k + 1) * width]) for k in range(whole)]
        if partial == "pad" and rest:
            want.append(tuple(stream[whole * width:] + [PAD] * (width - rest)))
        assert got == sorted(want)  # each sequence a run of the stream, each once: every token once
        padded = ds.counts["tokens.padded"] - before["tokens.padded"]
        dropped = ds.counts["tokens.dropped"] - before["tokens.dropped"]
        assert (padded, dropped) == ((width - rest) % width, 0) if partial == "pad" else (0, rest)
        if documents:
            by_seq = {tuple(stream[k * width:(k + 1) * width]): keys[k * width:(k + 1) * width]
                      for k in range(whole)}
            if partial == "pad" and rest:
                by_seq[want[-1]] = keys[whole * width:] + [-1] * (width - rest)
            for b, i in rows:
                seq = tuple(b["input_ids"][i].tolist())
                _check_documents(seq, {k: b[k][i] for k in b}, by_seq[seq])


@pytest.mark.parametrize("world_size,num_workers", [(2, 2), (3, 0)])
def test_drop_last_gives_full_batches_everywhere(tmp_path, world_size, num_workers):
    spec, kw, _ = _corpus(tmp_path, "idx")
    ds = sd.TokenDataset(spec, seq_len=4, batch_size=3, drop_last=True, **kw)
    per_rank = _epoch(ds, world_size, num_workers)
    assert len({len(b) for b in per_rank}) == 1
    assert all(tuple(b["input_ids"].shape) == (3, 4) for batches in per_rank for b in batches)
    seqs = [tuple(r) for batches in per_rank for b in batches for r in b["input_ids"].tolist()]
    assert len(seqs) == len(set(seqs))
    assert len(seqs) + ds.counts["planned.left_out"] // world_size == ds.num_sequences


def test_a_bin_is_read_in_ranges(tmp_path):
    """Each reader fetches only the bytes of its span (no whole-file download)."""
    spec, kw, _ = _corpus(tmp_path, "bin")
    ds = sd.TokenDataset(spec, seq_len=5, batch_size=None, **kw)
    with rank_env(1, 3):
        p = ds.reader_pass(None)
        items = [ds.fetch_segment(r.unit, *r.part) for r in p.reads]
    fetched = sum(e - s for item in items for s, e in item.ranges)
    assert fetched == 4 * sum(r.part.stop - r.part.start for r in p.reads)
    assert fetched < 4 * ds.num_tokens / 2


def _delivered(batch):
    return [tuple(r) for r in batch["input_ids"].tolist()]


@pytest.mark.parametrize("layout", ["idx", "parquet", "tar"])
@pytest.mark.parametrize("new", [(2, 2), (3, 1), (1, 0)])
def test_resume_is_exact_to_the_token_on_any_world(tmp_path, layout, new):
    """2 ranks x 2 workers stop at a seeded step; the state restarts on 2x2, 3x1 and 1x0: every
    sequence of the epoch once (so every token once), none lost, equal steps after."""
    spec, kw, _ = _corpus(tmp_path, layout)
    make = lambda: sd.TokenDataset(spec, seq_len=3, batch_size=2, shuffle=True, seed=9,  # noqa: E731
                                   bos_id=BOS, eos_id=EOS, partial="pad", pad_id=PAD, **kw)
    everything = [s for b in make() for s in _delivered(b)]
    stop = int(np.random.default_rng(11).integers(1, 6))
    before, state = saved_state(make, stop, _delivered)
    after, steps = resumed_rows(make, state, *new, _delivered)
    assert len(set(steps)) == 1, steps
    # (sequences of inserted tokens only, e.g. an empty document's bos-eos, may repeat: a multiset)
    got, want = collections.Counter(before + after), collections.Counter(everything)
    assert not got - want, f"delivered twice: {got - want}"
    assert not want - got, f"lost: {want - got}"


def test_the_same_world_continues_each_readers_span(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "bin")
    ds = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    full = [s for b in ds for s in _delivered(b)]
    for stop in (0, 1, 3, 7):
        ds = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
        it = iter(ds)
        head = [s for b in take(it, stop) for s in _delivered(b)]
        state = json.loads(json.dumps(ds.state_dict()))
        it.close()
        again = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
        again.load_state_dict(state)
        assert head + [s for b in again for s in _delivered(b)] == full


def test_varlen_cu_seqlens_flattens_a_batch():
    cu = torch.tensor([[0, 2, 4, 4, 4], [0, 1, 4, 4, 4]], dtype=torch.int32)
    assert varlen_cu_seqlens(cu).tolist() == [0, 2, 4, 5, 8]


def test_a_foreign_state_is_refused(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "bin")
    state = sd.TokenDataset(spec, seq_len=4, **kw).state_dict()
    with pytest.raises(sd.SpecError):
        sd.TokenDataset(spec, seq_len=5, **kw).load_state_dict(state)


# ---- corrupt inputs -------------------------------------------------------------------------


def test_an_idx_that_does_not_match_its_bin(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "idx")
    (tmp_path / "idx" / "part-1.idx").write_bytes(idx_bytes([39], np.int32))  # the .bin holds 40
    with pytest.raises(sd.FormatError, match="does not match its .bin") as info:
        sd.TokenDataset(spec, seq_len=4, **kw)
    assert info.value.url.endswith("part-1.bin")


def test_an_idx_that_is_not_one(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "idx")
    (tmp_path / "idx" / "part-3.idx").write_bytes(b"not an index at all, longer than a header")
    with pytest.raises(sd.FormatError, match="part-3.idx is not a usable Megatron index") as info:
        sd.TokenDataset(spec, seq_len=4, **kw)
    assert info.value.url.endswith("part-3.idx")


def test_a_missing_idx_names_it(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "idx")
    (tmp_path / "idx" / "part-4.idx").unlink()
    with pytest.raises(sd.StreamDataError, match="part-4.idx"):
        sd.TokenDataset(spec, seq_len=4, **kw)


def test_a_non_integer_column(tmp_path):
    floats = pa.array([[0.5, 1.5]], pa.list_(pa.float32()))
    pq.write_table(pa.table({"tokens": floats}), tmp_path / "f.parquet")
    with pytest.raises(sd.SpecError, match=r"f.parquet is list<element: float>, not a list of integer"):
        sd.TokenDataset(str(tmp_path / "f.parquet"), seq_len=4, column="tokens")
    pq.write_table(pa.table({"tokens": ["a b c"]}), tmp_path / "g.parquet")
    with pytest.raises(sd.SpecError, match="g.parquet is string"):
        sd.TokenDataset(str(tmp_path / "g.parquet"), seq_len=4, column="tokens")


def test_a_truncated_bin(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "bin")
    path = tmp_path / "bin" / "part-1.bin"
    path.write_bytes(path.read_bytes()[:-2])  # half a uint32
    with pytest.raises(sd.FormatError, match="part-1.bin: 158 bytes is not a whole number") as info:
        sd.TokenDataset(spec, seq_len=4, **kw)
    assert info.value.url.endswith("part-1.bin")


def test_a_bin_truncated_after_listing(tmp_path):
    """The listing said more bytes than the read finds: a FormatError naming the URL, no hang."""
    spec, kw, _ = _corpus(tmp_path, "bin")
    ds = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    path = tmp_path / "bin" / "part-4.bin"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(sd.StreamDataError, match="part-4.bin"):
        list(ds)


def test_a_non_integer_dtype_is_refused(tmp_path):
    spec, _, _ = _corpus(tmp_path, "bin")
    with pytest.raises(sd.SpecError, match="integer dtype"):
        sd.TokenDataset(spec, seq_len=4, dtype="float32")


# ---- a mix of token sources -----------------------------------------------------------------


def _mix_sources(tmp_path):
    """Two flat-.bin corpora (ids below and above 30000), 3 files of 2000 tokens each."""
    for name, base in (("a", 0), ("b", 30000)):
        (tmp_path / name).mkdir()
        for i in range(3):
            (np.arange(2000) + base + i * 2000).astype(np.uint16).tofile(tmp_path / name / f"p{i}.bin")

    def make(**kw):
        return sd.Mix([sd.TokenDataset(str(tmp_path / "a") + "/", seq_len=8, dtype="uint16", shuffle=True),
                       sd.TokenDataset(str(tmp_path / "b") + "/", seq_len=8, dtype="uint16", shuffle=True,
                                       seed=1)], weights=[0.7, 0.3], seed=0, batch_size=4, **kw)
    return make


def test_a_mix_of_token_sources_keeps_its_proportions(tmp_path):
    make = _mix_sources(tmp_path)
    seqs = [tuple(r) for b in make(samples=4000) for r in b["input_ids"].tolist()]
    share = sum(s[0] < 30000 for s in seqs) / len(seqs)
    assert len(seqs) == 4000 and abs(share - 0.7) <= 0.02, share
    assert all(list(s) == list(range(s[0], s[0] + 8)) for s in seqs)  # whole runs of a stream


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1)])
def test_a_mix_of_token_sources_resumes_exactly(tmp_path, old, new):
    """Stopped at a step on ``old`` simulated ranks, resumed on ``new``: each source's sequences
    at most once, and delivered + counted undelivered = the source's epoch (stop="first")."""
    make = _mix_sources(tmp_path)
    got, mixes, state = [], [], None
    for leg, ranks in enumerate([old, new]):
        states, steps = [], []
        for rank in range(ranks):
            with rank_env(rank, ranks):
                mixes.append(make(stop="first"))
                if state is not None:
                    mixes[-1].load_state_dict(state)
                it = iter(mixes[-1])
                batches = list(take(it, 7) if leg == 0 else it)
                steps.append(len(batches))
                got += [tuple(r) for b in batches for r in b["input_ids"].tolist()]
                states.append(mixes[-1].state_dict())
                it.close()
        assert len(set(steps)) == 1, steps
        state = json.loads(json.dumps(merge_states(states)))
    assert len(got) == len(set(got)), "a sequence twice"
    for k, total in enumerate((3 * 2000 // 8, 3 * 2000 // 8)):
        mine = sum((s[0] >= 30000) == bool(k) for s in got)
        assert mine + sum(m.counts[f"mix.undelivered.{k}"] for m in mixes) == total


@pytest.mark.parametrize("layout", ["idx", "parquet", "tar"])
def test_over_http_every_token_once(http_server, tmp_path, layout):
    """Over HTTP (sizes by HEAD, ranged GETs): the same sequences as from the local files."""
    spec, kw, _ = _corpus(tmp_path, layout)
    server = http_server(tmp_path / layout)
    suffix = {"parquet": "parquet", "tar": "tar"}.get(layout, "bin")
    names = [p.name for p in sorted((tmp_path / layout).glob(f"*.{suffix}"))]
    url = server.endpoint_url + "/{" + ",".join(names) + "}"
    opts = dict(seq_len=5, batch_size=2, shuffle=True, seed=2, bos_id=BOS, **kw)
    local = [tuple(s) for b in sd.TokenDataset(spec, **opts) for s in b["input_ids"].tolist()]
    remote = []
    for rank in range(2):
        with rank_env(rank, 2):
            remote += [tuple(s) for b in sd.TokenDataset(url, **opts) for s in b["input_ids"].tolist()]
    assert remote == local  # two ranks' contiguous spans, in rank order: the one reader's epoch


def test_a_flat_bin_separator_ends_documents(tmp_path):
    """sep_id (nanoGPT's end-of-text token) splits a flat .bin into documents for cu_seqlens."""
    tokens = np.array([5, 6, 0, 7, 0, 8, 9, 10, 0, 11, 12, 0], np.uint16)  # 0 ends each document
    tokens.tofile(tmp_path / "a.bin")
    (tokens + 20).tofile(tmp_path / "b.bin")  # no separator: one document, from the file's start
    ds = sd.TokenDataset(str(tmp_path) + "/", seq_len=8, batch_size=3, dtype="uint16", sep_id=0,
                         documents=True)
    b = next(iter(ds))
    assert b["input_ids"].tolist() == [[5, 6, 0, 7, 0, 8, 9, 10], [0, 11, 12, 0, 25, 26, 20, 27],
                                       [20, 28, 29, 30, 20, 31, 32, 20]]
    assert b["cu_seqlens"][0].tolist() == [0, 3, 5, 8] + [8] * 5
    assert b["cu_seqlens"][1].tolist() == [0, 1, 4, 8] + [8] * 5  # (b.bin: no 0 among its tokens)
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    with pytest.raises(sd.SpecError, match="sep_id"):
        sd.TokenDataset(str(tmp_path) + "/", seq_len=8, sep_id=0, idx=True)


def test_on_s3_every_token_once(s3_bucket, tmp_path):
    _on_object_store(s3_bucket, tmp_path, "s3")


def test_on_gcs_every_token_once(gcs_bucket, tmp_path):
    _on_object_store(gcs_bucket, tmp_path, "gcs")


def _on_object_store(server_bucket, tmp_path, store):
    """2 ranks x 2 workers over the object store: the local epoch's sequences, each once."""
    server, bucket = server_bucket
    if store == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    else:
        import gcsfs

        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options)
    spec, kw, _ = _corpus(tmp_path, "idx")
    for path in sorted((tmp_path / "idx").iterdir()):
        fs.pipe_file(f"{bucket}/tok/{path.name}", path.read_bytes())
    opts = dict(seq_len=7, batch_size=2, shuffle=True, seed=1, eos_id=EOS, documents=True, **kw)
    local = [tuple(s) for b in sd.TokenDataset(spec, **opts) for s in b["input_ids"].tolist()]
    remote = sd.TokenDataset(f"{'s3' if store == 's3' else 'gs'}://{bucket}/tok/",
                             storage_options=server.storage_options, **opts)
    per_rank = _epoch(remote, 2, 2)
    assert len({len(b) for b in per_rank}) == 1
    got = [tuple(s) for batches in per_rank for b in batches for s in b["input_ids"].tolist()]
    assert collections.Counter(got) == collections.Counter(local)


# ---- packing that never splits a document ---------------------------------------------------


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 2), (3, 1)])
def test_fit_packing_keeps_documents_whole(tmp_path, world_size, num_workers):
    """packing="fit": every document (shorter than a sequence) lies whole in one sequence, every
    token once, the padding counted, equal steps."""
    spec, kw, docs = _corpus(tmp_path, "idx")
    ds = sd.TokenDataset(spec, seq_len=20, batch_size=2, shuffle=True, seed=3, packing="fit", pad_id=PAD,
                         eos_id=EOS, documents=True, **kw)
    per_rank = _epoch(ds, world_size, num_workers)
    assert len({len(b) for b in per_rank}) == 1
    seqs = [r for batches in per_rank for b in batches for r in b["input_ids"].tolist()]
    assert len(seqs) == ds.num_sequences
    real = [t for s in seqs for t in s if t not in (EOS, PAD)]
    everything = [int(t) for file_docs in docs for d in file_docs for t in d]
    assert sorted(real) == sorted(everything)  # every token once
    assert ds.counts["tokens.padded"] == sum(s.count(PAD) for s in seqs) > 0
    for file_docs in docs:
        for d in file_docs:
            if 0 < len(d) < 20:  # (the 40- and 23-token documents cannot fit: cut in pieces)
                holders = [s for s in seqs if int(d[0]) in s]
                assert len(holders) == 1 and all(int(t) in holders[0] for t in d), f"document {d} split"


def test_fit_packing_resumes_on_another_world(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "idx")
    make = lambda: sd.TokenDataset(spec, seq_len=12, batch_size=2, packing="fit", eos_id=EOS,  # noqa: E731
                                   shuffle=True, seed=8, **kw)
    everything = collections.Counter(tuple(s) for b in make() for s in b["input_ids"].tolist())
    before, states = [], []
    for rank in range(2):
        with rank_env(rank, 2):
            ds = make()
            it = iter(ds)
            before += [tuple(s) for b in take(it, 2) for s in b["input_ids"].tolist()]
            states.append(ds.state_dict())
            it.close()
    state = json.loads(json.dumps(merge_states(states)))
    after = []
    for rank in range(3):
        with rank_env(rank, 3):
            ds = make()
            ds.load_state_dict(state)
            after += [tuple(s) for b in ds for s in b["input_ids"].tolist()]
    assert collections.Counter(before + after) == everything


def test_fit_packing_needs_known_documents(tmp_path):
    spec, _, _ = _corpus(tmp_path, "parquet")
    with pytest.raises(sd.SpecError, match="packing='fit'"):
        sd.TokenDataset(spec, seq_len=8, column="tokens", packing="fit")


# ---- tar shards of .npy token fields ---------------------------------------------------------


def test_a_tar_is_read_by_sample_spans(tmp_path):
    """A reader fetches the bytes of the samples its span needs, not whole shards."""
    spec, kw, _ = _corpus(tmp_path, "tar")
    ds = sd.TokenDataset(spec, seq_len=5, batch_size=None, **kw)
    sizes = {u.url: u.size for u in ds.units_}
    with rank_env(1, 3):
        p = ds.reader_pass(None)
        items = [ds.fetch_segment(r.unit, *r.part) for r in p.reads]
    assert all(item.ranges and len(item.ranges) == 1 for item in items)
    fetched = sum(e - s for item in items for s, e in item.ranges)
    assert fetched < sum(sizes.values()) / 2


@pytest.mark.parametrize("array,what", [(np.zeros((2, 3), np.int32), r"an array of shape \(2, 3\)"),
                                        (np.ones(4, np.float32), "float32 values")])
def test_a_tar_field_that_is_not_1d_integer_tokens(tmp_path, array, what):
    spec, kw, _ = _corpus(tmp_path, "tar")
    _write_tar(tmp_path / "tar" / "part-9.tar", [("good", {"npy": _npy(np.arange(3))}),
                                                ("bad", {"npy": _npy(array)})])
    with pytest.raises(sd.FormatError, match=f"part-9.tar: sample 'bad' holds {what}") as info:
        sd.TokenDataset(spec, seq_len=4, **kw)
    assert info.value.url.endswith("part-9.tar") and info.value.key == "bad"


def test_a_tar_sample_without_the_field(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "tar")
    _write_tar(tmp_path / "tar" / "part-9.tar", [("k1", {"tokens.npy": _npy(np.arange(3))})])
    with pytest.raises(sd.FormatError, match=r"sample 'k1' has no field 'npy' \(it has \['tokens.npy'\]\)"):
        sd.TokenDataset(spec, seq_len=4, **kw)
    ds = sd.TokenDataset(str(tmp_path / "tar" / "part-9.tar"), seq_len=3, field="Tokens.npy")
    assert [b["input_ids"].tolist() for b in ds] == [[0, 1, 2]]


def test_a_tar_changed_after_counting(tmp_path):
    spec, kw, _ = _corpus(tmp_path, "tar")
    ds = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    path = tmp_path / "tar" / "part-1.tar"
    size = path.stat().st_size
    _write_tar(path, [("s1-000", {"npy": _npy(np.arange(30, dtype=np.int64)), "txt": b"x"})])
    path.write_bytes(path.read_bytes().ljust(size, b"\0")[:size])  # same size, other tokens
    with pytest.raises(sd.StreamDataError, match="part-1.tar"):
        list(ds)


# ---- a flat .bin's dtype from tokens.json ----------------------------------------------------


def test_a_flat_bin_dtype_from_its_sidecar(tmp_path):
    spec, kw, docs = _corpus(tmp_path, "bin")
    want = [s for b in sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw) for s in _delivered(b)]
    (tmp_path / "bin" / "tokens.json").write_text(json.dumps({"dtype": "uint32"}))
    ds = sd.TokenDataset(spec, seq_len=4, batch_size=2)
    assert ds.layout == "bin" and ds.dtype == np.dtype("<u4")
    assert [s for b in ds for s in _delivered(b)] == want
    (tmp_path / "bin" / "tokens.json").write_text(json.dumps({"dtype": "float16"}))
    with pytest.raises(sd.SpecError, match="tokens.json: tokens must be an integer dtype"):
        sd.TokenDataset(spec, seq_len=4)
    (tmp_path / "bin" / "tokens.json").write_text("uint16")
    with pytest.raises(sd.FormatError, match="tokens.json is not"):
        sd.TokenDataset(spec, seq_len=4)


def test_a_flat_bin_without_dtype_says_how_to_fix(tmp_path):
    spec, _, _ = _corpus(tmp_path, "bin")
    with pytest.raises(sd.StreamDataError, match=r"\.idx.*pass dtype= \(e.g. 'uint16'\) or put a tokens.js"):
        sd.TokenDataset(spec, seq_len=4)


def test_sidecars_that_disagree(tmp_path):
    for name, dtype in (("a", "uint16"), ("b", "uint32")):
        (tmp_path / name).mkdir()
        np.arange(8, dtype=dtype).tofile(tmp_path / name / "x.bin")
        (tmp_path / name / "tokens.json").write_text(json.dumps({"dtype": dtype}))
    with pytest.raises(sd.SpecError, match="disagree"):
        sd.TokenDataset([str(tmp_path / "a" / "x.bin"), str(tmp_path / "b" / "x.bin")], seq_len=4)


def test_a_tar_corpus_counts_kept_between_jobs(tmp_path):
    """save_counts() keeps the pass's counts; a later constructor reads only new or changed shards
    and yields the same sequences; a corrupt counts file is a FormatError naming it."""
    spec, kw, _ = _corpus(tmp_path, "tar")
    first = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    assert first.counted_shards == len(DOCS)
    want = [s for b in first for s in _delivered(b)]
    url = first.save_counts()
    assert url.endswith("tar/_streamdata.tokens.npz")
    again = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    assert again.counted_shards == 0
    assert [s for b in again for s in _delivered(b)] == want
    # a changed shard (its size: a local file has no ETag) is counted again, the others not
    _write_tar(tmp_path / "tar" / "part-1.tar", [(f"n{k:02d}", {"npy": _npy(np.arange(10) + 5000)})
                                                 for k in range(30)])
    changed = sd.TokenDataset(spec, seq_len=4, batch_size=2, **kw)
    assert changed.counted_shards == 1 and changed.num_tokens == first.num_tokens - 40 + 300
    assert sd.TokenDataset(spec, seq_len=4, counts=None, **kw).counted_shards == len(DOCS)
    with pytest.raises(sd.SpecError, match="no token counts at .*elsewhere.npz: write them there"):
        sd.TokenDataset(spec, seq_len=4, counts=str(tmp_path / "elsewhere.npz"), **kw)
    assert changed.save_counts(str(tmp_path / "elsewhere.npz")) == str(tmp_path / "elsewhere.npz")
    assert sd.TokenDataset(spec, seq_len=4, counts=str(tmp_path / "elsewhere.npz"), **kw).counted_shards == 0
    (tmp_path / "tar" / "_streamdata.tokens.npz").write_bytes(b"PK not really")
    with pytest.raises(sd.FormatError, match="_streamdata.tokens.npz is not a usable token counts file"):
        sd.TokenDataset(spec, seq_len=4, **kw)


def test_a_tar_corpus_on_s3_with_kept_counts(s3_bucket, tmp_path):
    """Over S3 (ETags): the local epoch's sequences on 2 ranks x 2 workers; the counts kept
    beside the shards are read by the next constructor instead of the shards."""
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    spec, kw, _ = _corpus(tmp_path, "tar")
    for path in sorted((tmp_path / "tar").iterdir()):
        fs.pipe_file(f"{bucket}/tok/{path.name}", path.read_bytes())
    opts = dict(seq_len=7, batch_size=2, shuffle=True, seed=1, eos_id=EOS, **kw)
    local = sorted(tuple(s) for b in sd.TokenDataset(spec, **opts) for s in b["input_ids"].tolist())
    remote = sd.TokenDataset(f"s3://{bucket}/tok/", storage_options=server.storage_options, **opts)
    assert remote.counted_shards == len(DOCS)
    assert remote.save_counts() == f"s3://{bucket}/tok/_streamdata.tokens.npz"
    again = sd.TokenDataset(f"s3://{bucket}/tok/", storage_options=server.storage_options, **opts)
    assert again.counted_shards == 0
    per_rank = _epoch(again, 2, 2)
    assert len({len(b) for b in per_rank}) == 1
    assert sorted(tuple(s) for r in per_rank for b in r for s in b["input_ids"].tolist()) == local


def test_the_index_command_keeps_a_tar_corpus_counts(tmp_path, capsys):
    from streamdata.cli import main

    spec, kw, _ = _corpus(tmp_path, "tar")
    assert main(["index", spec, "--tokens", "npy", "--quiet"]) == 0
    out = capsys.readouterr().out
    total = sum(map(sum, DOCS))
    assert f"_streamdata.tokens.npz: {total} tokens in 5 shards ({len(DOCS)} counted now)" in out
    ds = sd.TokenDataset(spec, seq_len=4, **kw)
    assert ds.counted_shards == 0 and ds.num_tokens == total


def test_a_tar_of_empty_samples_still_has_its_documents(tmp_path):
    """A shard whose samples hold no tokens still puts each one's bos/eos in the stream."""
    _write_tar(tmp_path / "a.tar", [("k0", {"npy": _npy(np.zeros(0, np.int32))}),
                                    ("k1", {"npy": _npy(np.zeros(0, np.int32))})])
    _write_tar(tmp_path / "b.tar", [("k2", {"npy": _npy(np.array([7, 8], np.int32))})])
    ds = sd.TokenDataset(str(tmp_path) + "/", seq_len=4, field="npy", bos_id=1, eos_id=2, partial="pad")
    assert [b["input_ids"].tolist() for b in ds] == [[1, 2, 1, 2], [1, 7, 8, 2]]


# ---- the one pass: what every dataset's pass gives, tokens too ------------------------------


LAYOUTS = ["bin", "idx", "parquet", "tar"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_persistent_worker_queues_the_next_epoch_in_the_same_prefetcher(tmp_path, layout):
    """NEXT-EPOCH-EARLY: the pass a token dataset runs is the one every dataset runs, so a
    persistent worker's next epoch is queued behind the current one (the same plan, adopted); the
    epochs are the ones a loader without it reads (its requests: ``tests/datasets/test_next_epoch.py``)."""
    spec, kw, _ = _corpus(tmp_path, layout)

    def epochs(early: bool) -> tuple[list, object]:
        ds = sd.TokenDataset(spec, seq_len=8, batch_size=3, shuffle=True, seed=2, **kw)
        loader = sd.loader(ds, num_workers=2, persistent_workers=True)
        ds.early_next_epoch = early
        with loader:
            got = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                got.append([row.tolist() for b in loader for row in b["input_ids"]])
        return got, ds

    early, ds = epochs(True)
    late, _ = epochs(False)
    assert early == late and early[0] != early[1]
    tokens = [sorted(t for row in epoch for t in row) for epoch in early]
    assert tokens[0] == tokens[1] == tokens[2]  # (partial="drop": the epoch's last partial sequence aside)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_pass_s_stage_timings_and_a_collate_fn(tmp_path, layout):
    """Stage timings (``loader.metrics()``: the readers' waits for bytes, packing and batching) and a
    caller's ``collate_fn`` work for tokens as for every dataset."""
    spec, kw, _ = _corpus(tmp_path, layout)
    ds = sd.TokenDataset(spec, seq_len=8, batch_size=3, collate_fn=lambda rows: len(rows), **kw)
    assert set(ds) and all(isinstance(b, int) and 1 <= b <= 3 for b in ds)  # the collate_fn's batches
    ds = sd.TokenDataset(spec, seq_len=8, **kw)
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        steps = sum(1 for _ in loader)
        metrics = loader.metrics()
    assert steps == len(loader) and metrics["steps"] == steps
    assert metrics["requests"] > 0 and metrics["samples"] == ds.num_sequences
    assert metrics["stage.wait_bytes_s"] > 0 and metrics["stage.collate_s"] > 0, metrics


@pytest.mark.parametrize("layout", ["parquet", "tar"])
def test_a_tokens_json_beside_other_layouts_is_not_read_as_their_dtype(tmp_path, layout):
    """The ``tokens.json`` that names a flat ``.bin``'s dtype says nothing about Parquet or tar."""
    spec, kw, docs = _corpus(tmp_path, layout)
    (tmp_path / layout / "tokens.json").write_text('{"dtype": "uint16"}')
    ds = sd.TokenDataset(spec, seq_len=8, **kw)
    assert ds.layout == layout and ds.num_tokens == sum(len(d) for file in docs for d in file)
