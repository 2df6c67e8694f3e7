"""The token plan (``epoch.tokens``), pure: an epoch's stream cut into whole sequences and spans of
them mapped back to unit token ranges cover the stream exactly once (TOKENS-ONCE), whatever the
world; a unit's stream positions map to the raw tokens they need."""

from __future__ import annotations

import numpy as np
import pytest

from streamdata.epoch.plan import reader_span
from streamdata.epoch.tokens import augmented, raw_range, sequence_plan, token_reads
from streamdata.epoch.world import World
from tests.helpers import random_documents


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [False, True])
def test_spans_of_sequences_cover_the_stream_once(seed, pad):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 60, rng.integers(1, 9))
    width = int(rng.integers(1, 17))
    plan = sequence_plan(tokens, width, pad=pad, seed=seed, epoch=1, shuffle=True)
    total = int(tokens.sum())
    assert plan.tokens == total and plan.sequences == total // width + (1 if pad and total % width else 0)
    assert plan.dropped == (0 if pad else total % width)
    starts = np.concatenate([[0], plan.ends[:-1]]) if len(plan.ends) else plan.ends
    where = {int(u): int(s) for u, s in zip(plan.order, starts, strict=True)}  # unit -> stream start
    for ranks, workers in [(1, 0), (2, 2), (3, 1)]:
        covered = []
        for rank in range(ranks):
            for worker in range(max(workers, 1)):
                world = World(rank, ranks, worker, max(workers, 1))
                span = reader_span([plan.sequences], world, batch_size=2)
                reads = token_reads(plan, span.segments[:len(span.segments) - (1 if span.pad else 0)]
                                    if span.pad else span.segments)
                covered += [p for r in reads for p in range(where[r.unit] + r.start, where[r.unit] + r.stop)]
                assert not reads or reads[-1].flush
        assert sorted(covered) == list(range(min(total, plan.sequences * width)))


def test_raw_range_and_augmented_agree_with_a_built_stream():
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = rng.integers(0, 6, rng.integers(1, 6))
        bos, eos = bool(rng.integers(2)), bool(rng.integers(2))
        raw = np.arange(100, 100 + lengths.sum())
        stream, docs, at = [], [], 0
        for d, n in enumerate(lengths):
            piece = [*([1] if bos else []), *raw[at:at + n].tolist(), *([2] if eos else [])]
            stream += piece
            docs += [d] * len(piece)
            at += n
        a, b = sorted(rng.integers(0, len(stream) + 1, 2))
        if a == b:
            continue
        lo, hi = raw_range(lengths, a, b, bos, eos)
        assert hi - lo == sum(1 for t in stream[a:b] if t >= 100)  # only the raw tokens it needs
        out, doc = augmented(lengths, a, b, raw[lo:hi], lo, 1 if bos else None, 2 if eos else None)
        assert out.tolist() == stream[a:b] and doc.tolist() == docs[a:b]


@pytest.mark.parametrize("seed", range(8))
def test_fit_plan_cuts_only_documents_longer_than_a_sequence(seed):
    from streamdata.epoch.tokens import fit_plan

    docs, width, specials, tokens = random_documents(np.random.default_rng(seed), 6, 12)
    plan = fit_plan(tokens, docs, width, specials, seed=seed, epoch=0, shuffle=True)
    bounds = plan.bounds.tolist()
    assert bounds[0] == 0 and bounds[-1] == sum(tokens) and plan.dropped == 0
    assert all(0 < b - a <= width for a, b in zip(bounds, bounds[1:], strict=False))
    at = 0
    for u in plan.order:
        for n in docs[u] + specials:
            if n <= width:  # (a longer one is cut into pieces of at most width: checked above)
                assert not [b for b in bounds if at < b < at + n], "a document that fits was cut"
            at += int(n)
    assert plan.lengths(0, plan.sequences).sum() == sum(tokens)
