"""sd.TokenDataset(shuffle="sequences"): the sequences' order shuffled by blocks across the corpus
and by windows inside each reader. One flat .bin's first sequences come from all over the file;
every token in exactly one sequence per epoch over simulated ranks x real DataLoader workers
(flat .bin, .bin + .idx with documents and packing "fit", tar of .npy); equal steps and an exact
``len()``; epochs differ, a seed repeats; resume exact to the token on the same world and from
2 x 2 to 3 x 1 and 1 x 0; reads stay one ranged read per block; what cannot be exact is refused."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

import streamdata as sd
from streamdata.epoch.state import merge_states
from streamdata.formats.tokens import idx_bytes
from tests.helpers import npy_tar, rank_env, saved_state, take

SEQ_LEN = 15  # width 16 with targets=True
LENGTHS = [[700, 3, 0, 1200], [2500], [90, 40, 410, 5, 5, 300], [1800, 260]]  # documents per file
EOS = 900_001


def _files(tmp_path, layout: str) -> tuple[str, dict]:
    """Files whose tokens are their global positions (each token unique)."""
    root = tmp_path / layout
    root.mkdir()
    at = 0
    for i, lengths in enumerate(LENGTHS):
        docs = [np.arange(at + sum(lengths[:k]), at + sum(lengths[:k + 1])) for k in range(len(lengths))]
        at += sum(lengths)
        if layout == "tar":
            (root / f"part-{i}.tar").write_bytes(npy_tar(docs, np.uint32, "d"))
            continue
        dtype = np.int32 if layout == "idx" else np.uint32  # (Megatron's types: int32 past 65500)
        np.concatenate(docs).astype(dtype).tofile(root / f"part-{i}.bin")
        if layout == "idx":
            (root / f"part-{i}.idx").write_bytes(idx_bytes(lengths, dtype))
    kw = {"bin": {"dtype": "uint32"}, "idx": {"idx": True}, "tar": {"field": "npy"}}[layout]
    return str(root) + "/", kw


def _one_bin(tmp_path, tokens: int = 400_000) -> str:
    path = tmp_path / "train.bin"
    np.arange(tokens, dtype=np.uint32).tofile(path)
    return str(path)


def _spearman(x, y) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _rows(batches) -> list[tuple]:
    return [tuple(r) for b in batches for r in b["input_ids"].tolist()]


def _epoch(ds, world_size: int, num_workers: int) -> list[list[dict]]:
    per_rank = []
    for rank in range(world_size):
        with rank_env(rank, world_size), sd.loader(ds, num_workers=num_workers) as loader:
            assert len(loader) == ds.steps(num_workers=num_workers)
            per_rank.append([{k: v.clone() for k, v in b.items()} for b in loader])
            assert len(per_rank[-1]) == len(loader), "len() is not the batches yielded"
    return per_rank


def test_a_single_bin_s_first_sequences_come_from_all_over_it(tmp_path):
    """Blocks of 64 sequences of 16 tokens, windows of 16 blocks (the first window holds the first
    1,000 sequences, as the default 4 MiB blocks' does for sequences of 1,024 uint16 tokens): rank
    correlation between delivery order and place in the file near 0, blocks from all over it."""
    spec = _one_bin(tmp_path)
    ds = sd.TokenDataset(spec, seq_len=SEQ_LEN, targets=True, dtype="uint32", shuffle="sequences",
                         block_bytes=64 * 16 * 4, window_blocks=16, seed=3)
    assert ds.block_sequences == 64 and ds.block_window() == 1024
    starts = [int(s["input_ids"][0]) for s in take(iter(ds), 1000)]
    assert abs(_spearman(np.arange(1000), starts)) < 0.1
    tenths = np.histogram(starts, bins=10, range=(0, 400_000))[0]
    assert (tenths > 0).sum() >= 6  # 16 blocks of the file's 391
    sequential = sd.TokenDataset(spec, seq_len=SEQ_LEN, targets=True, dtype="uint32", shuffle=True)
    assert [int(s["input_ids"][0]) for s in take(iter(sequential), 1000)] == list(range(0, 16_000, 16))


@pytest.mark.parametrize("world_size,num_workers",
                         [(1, 0), (2, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_every_token_once_over_ranks_and_workers(tmp_path, world_size, num_workers):
    spec = _one_bin(tmp_path, 30_003)
    ds = sd.TokenDataset(spec, seq_len=SEQ_LEN, batch_size=4, targets=True, dtype="uint32",
                         shuffle="sequences", block_bytes=20 * 16 * 4, window_blocks=4, partial="pad",
                         pad_id=-1)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        per_rank = _epoch(ds, world_size, num_workers)
        assert len({len(b) for b in per_rank}) == 1, [len(b) for b in per_rank]
        rows = _rows(b for batches in per_rank for b in batches)
        tokens = sorted(t for r in rows for t in r if t != -1)
        assert tokens == list(range(30_003)), "a token lost or twice"
        orders.append([r[0] for r in rows])
    assert orders[0] != orders[1], "two epochs in the same order"


@pytest.mark.parametrize("layout,options", [
    ("bin", {}),
    ("idx", {"eos_id": EOS, "documents": True}),
    ("idx", {"packing": "fit", "documents": True}),
    ("tar", {"eos_id": EOS}),
])
def test_every_sequence_of_the_stream_once_in_another_order(tmp_path, layout, options):
    """The shuffled epoch holds the sequences the unshuffled stream of the same units' order
    holds, each once (so every token once), in another order; documents' fields follow their
    sequence."""
    spec, kw = _files(tmp_path, layout)
    common = {"seq_len": SEQ_LEN, "batch_size": 3, "seed": 5, **kw, **options}
    shuffled = sd.TokenDataset(spec, shuffle="sequences", block_bytes=8 * 16 * 4, window_blocks=3, **common)
    stream = sd.TokenDataset(spec, shuffle=True, **common)  # the same units' order, sequences in order
    assert shuffled.num_sequences == stream.num_sequences
    want = _rows(stream)
    per_rank = _epoch(shuffled, 2, 2)
    got = _rows(b for batches in per_rank for b in batches)
    assert collections.Counter(got) == collections.Counter(want)
    assert got != want
    if options.get("documents"):
        fields = {tuple(r): {k: b[k][i].tolist() for k in b} for b in stream for i, r in
                  enumerate(b["input_ids"].tolist())}
        for batches in per_rank:
            for b in batches:
                for i, r in enumerate(b["input_ids"].tolist()):
                    assert {k: b[k][i].tolist() for k in b} == fields[tuple(r)]


def test_the_same_seed_the_same_order(tmp_path):
    spec = _one_bin(tmp_path, 50_000)
    make = lambda seed: sd.TokenDataset(spec, seq_len=SEQ_LEN, batch_size=None, dtype="uint32",  # noqa: E731
                                        shuffle="sequences", block_bytes=4096, seed=seed)
    first = [int(s["input_ids"][0]) for s in make(1)]
    assert first == [int(s["input_ids"][0]) for s in make(1)]
    assert first != [int(s["input_ids"][0]) for s in make(2)]
    assert sorted(first) == list(range(0, 50_000 // 15 * 15, 15))


def _make(spec: str, **kw):
    return sd.TokenDataset(spec, seq_len=SEQ_LEN, batch_size=2, targets=True, dtype="uint32",
                           shuffle="sequences", block_bytes=10 * 16 * 4, window_blocks=3, seed=9,
                           partial="pad", pad_id=0, **kw)


@pytest.mark.parametrize("new", [(3, 1), pytest.param((2, 2), marks=pytest.mark.slow), (1, 0)])
def test_resume_from_2x2_is_exact_to_the_token(tmp_path, new):
    """2 ranks x 2 workers stop at a seeded step; the state restarts on 3 x 1, 2 x 2 and 1 x 0:
    every sequence of the epoch once, equal steps after, ``len()`` the steps before and after (at
    least a whole epoch's on the new world: tests/test_lengths.py)."""
    spec = _one_bin(tmp_path, 8_011)
    everything = _rows(_make(spec))
    stop = int(np.random.default_rng(11).integers(5, 30))
    before, state = saved_state(lambda: _make(spec), stop, lambda b: _rows([b]))
    after, steps = [], []
    world_size, workers = new
    for rank in range(world_size):
        with rank_env(rank, world_size):
            whole = len(sd.loader(_make(spec), num_workers=workers))
            with sd.loader(_make(spec), num_workers=workers) as loader:
                loader.load_state_dict(state)
                n = len(loader)
                batches = list(loader)
        steps.append(len(batches))
        assert n == max(whole, stop + len(batches)), (n, whole, stop, len(batches))
        if new == (2, 2):
            assert stop + len(batches) == whole
        after += _rows(batches)
    assert len(set(steps)) == 1, steps
    got, want = collections.Counter(before + after), collections.Counter(everything)
    assert not got - want, "delivered twice"
    assert not want - got, "lost"


def test_the_same_world_continues_the_same_order(tmp_path):
    """A state saved anywhere in a window restores the very order: head + rest = the epoch."""
    spec = _one_bin(tmp_path, 9_001)
    full = _rows(_make(spec))
    for stop in (0, 1, 7, 16, 40):
        ds = _make(spec)
        it = iter(ds)
        head = _rows(take(it, stop))
        state = json.loads(json.dumps(ds.state_dict()))
        it.close()
        assert state["shuffle"] == f"block:{ds.block_window()}"
        again = _make(spec)
        again.load_state_dict(state)
        assert head + _rows(again) == full
        if stop:
            assert again.counts["resumed.reread"] > 0 or (2 * stop) % ds.block_window() == 0


def test_reads_are_one_ranged_read_per_block(tmp_path):
    """Each block of the reader's span is one byte range of the file (two where the span's edge or
    a window cuts it), blocks from all over the file."""
    spec = _one_bin(tmp_path)
    ds = sd.TokenDataset(spec, seq_len=SEQ_LEN, targets=True, dtype="uint32", shuffle="sequences",
                         block_bytes=100 * 16 * 4, window_blocks=4)
    with rank_env(1, 3):
        p = ds.reader_pass(None)
        items = [ds.fetch_segment(r.unit, *r.part) for r in p.reads]
    ranges = [r for item in items for r in item.ranges]
    fetched = sum(e - s for s, e in ranges)
    assert fetched == 4 * sum(r.part.stop - r.part.start for r in p.reads)
    blocks = -(-ds.num_sequences // ds.block_sequences)
    assert len(ranges) <= -(-blocks // 3) + 2
    assert max(e - s for s, e in ranges) == ds.block_sequences * 16 * 4
    spread = sorted(s for s, _ in ranges)
    assert spread[0] < 400_000 * 4 / 4 and spread[-1] > 400_000 * 4 * 3 / 4


def test_what_cannot_be_exact_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3]], pa.list_(pa.int32()))}), tmp_path / "a.parquet")
    with pytest.raises(sd.SpecError, match="row groups are read whole"):
        sd.TokenDataset(str(tmp_path / "a.parquet"), seq_len=4, column="tokens", shuffle="sequences")
    spec = _one_bin(tmp_path, 1000)
    with pytest.raises(sd.SpecError, match="shuffle='sequences'"):
        sd.TokenDataset(spec, seq_len=4, dtype="uint32", shuffle=True, block_bytes=1024)
    with pytest.raises(sd.SpecError, match="window_blocks must be a positive int"):
        sd.TokenDataset(spec, seq_len=4, dtype="uint32", shuffle="sequences", window_blocks=0)
    with pytest.raises(sd.SpecError, match="'sequences'"):
        sd.TokenDataset(spec, seq_len=4, dtype="uint32", shuffle="block")
    ordered = sd.TokenDataset(spec, seq_len=4, batch_size=2, dtype="uint32", shuffle=True)
    shuffled = sd.TokenDataset(spec, seq_len=4, batch_size=2, dtype="uint32", shuffle="sequences",
                               block_bytes=64)
    it = iter(ordered)
    next(it)
    state = ordered.state_dict()
    it.close()
    with pytest.raises(sd.SpecError):
        shuffled.load_state_dict(state)
    other = sd.TokenDataset(spec, seq_len=4, batch_size=2, dtype="uint32", shuffle="sequences",
                            block_bytes=128)
    with pytest.raises(sd.SpecError):
        other.load_state_dict(shuffled.state_dict())


@pytest.mark.parametrize("world_size,num_workers", [(2, 2), (3, 0)])
def test_drop_last_gives_full_batches_everywhere(tmp_path, world_size, num_workers):
    spec = _one_bin(tmp_path, 30_000)
    ds = sd.TokenDataset(spec, seq_len=SEQ_LEN, batch_size=3, drop_last=True, dtype="uint32",
                         shuffle="sequences", block_bytes=7 * 15 * 4, window_blocks=3)
    per_rank = _epoch(ds, world_size, num_workers)
    assert len({len(b) for b in per_rank}) == 1
    assert all(tuple(b["input_ids"].shape) == (3, SEQ_LEN) for batches in per_rank for b in batches)
    seqs = _rows(b for batches in per_rank for b in batches)
    assert len(seqs) == len(set(seqs)) and all(s[0] % SEQ_LEN == 0 for s in seqs)
    assert len(seqs) + ds.counts["planned.left_out"] // world_size == ds.num_sequences


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1)])
def test_a_mix_of_shuffled_token_sources_resumes_exactly(tmp_path, old, new):
    """A Mix of two sequence-shuffled sources stopped on ``old`` simulated ranks, resumed on
    ``new``: each source's sequences at most once, and delivered + counted undelivered = the
    source's epoch (stop="first")."""
    for name, base in (("a", 0), ("b", 30000)):
        (tmp_path / name).mkdir()
        for i in range(3):
            (np.arange(2000) + base + i * 2000).astype(np.uint16).tofile(tmp_path / name / f"p{i}.bin")

    def make():
        return sd.Mix([sd.TokenDataset(str(tmp_path / name) + "/", seq_len=8, dtype="uint16", seed=seed,
                                       shuffle="sequences", block_bytes=5 * 16, window_blocks=3)
                       for name, seed in (("a", 0), ("b", 1))],
                      weights=[0.7, 0.3], seed=0, batch_size=4, stop="first")

    got, mixes, state = [], [], None
    for leg, ranks in enumerate([old, new]):
        states, steps = [], []
        for rank in range(ranks):
            with rank_env(rank, ranks):
                mixes.append(make())
                if state is not None:
                    mixes[-1].load_state_dict(state)
                it = iter(mixes[-1])
                batches = list(take(it, 7) if leg == 0 else it)
                steps.append(len(batches))
                got += _rows(batches)
                states.append(mixes[-1].state_dict())
                it.close()
        assert len(set(steps)) == 1, steps
        state = json.loads(json.dumps(merge_states(states)))
    assert len(got) == len(set(got)), "a sequence twice"
    assert [s[0] for s in got if s[0] < 30000] != sorted(s[0] for s in got if s[0] < 30000)
    for k in range(2):
        mine = sum((s[0] >= 30000) == bool(k) for s in got)
        assert mine + sum(m.counts[f"mix.undelivered.{k}"] for m in mixes) == 3 * 2000 // 8
