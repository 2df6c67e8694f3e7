"""``sd.TokenDataset``: pre-tokenized corpora packed into ``[batch, seq_len]`` blocks, exact and resumable.

Sources: flat ``.bin`` token arrays (``dtype=``, or a ``tokens.json`` beside them; nanoGPT),
``.bin`` + ``.idx`` pairs (Megatron; the ``.idx`` beside each ``.bin`` gives the dtype and the
documents), a Parquet list column of token ids (``column=``), and tar shards whose samples each
hold a 1-D integer ``.npy`` (``field=``; WebDataset style). Token counts come from metadata,
read once on rank 0 (LIST-ONCE): the listing's ``.bin`` sizes, the ``.idx`` files, the Parquet
footers (a list column's value count less its null count, per row group); a tar shard has no
such metadata, so the constructor's counting pass reads each shard once per job, each rank a
share of the shards (COUNT-SHARED in ``catalog.tokens``; its samples' ``.npy`` headers and byte
offsets). The epoch's stream is cut into whole sequences
before readers get spans of them (TOKENS-ONCE in ``epoch.tokens``), so a reader's position is
a number of sequences: resume (same or another world) is ``resume``'s, exact to the token.

A unit is one ``.bin`` file (read in byte ranges: only the tokens of the reader's span), one
Parquet row group (its token column chunk) or one tar shard (read in byte ranges: only the
samples of the reader's span, from the counting pass's offsets). Loss masks (fine-tuning data)
are read with their tokens: a ``.bin``'s ``NAME.mask.bin`` in the same byte spans (a read of
its own after each token read: ``TokenMask``), a Parquet column's in the same item; batches
then carry ``labels`` (``batch.tokens``). See docs/tokens.md.

``shuffle="sequences"`` shuffles the sequences themselves, in two levels that keep reads ranged:
blocks of consecutive sequences (``block_bytes`` each, one ranged read) in a seeded order across
the whole corpus (``epoch.tokens.with_blocks``), then, in each reader, the sequences of windows
of ``window_blocks`` of its blocks put out in a seeded permutation (BLOCK-SHUFFLE in
``epoch.blocks``: the order is a function of the plan and the position, so the position is
still the sequences delivered).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamdata.batch.batches import batches
from streamdata.batch.tokens import pack
from streamdata.catalog.footers import with_sizes
from streamdata.catalog.specs import Spec
from streamdata.catalog.tokens import mask_shards, sidecar_dtype
from streamdata.datasets.passes import Batching, Read, ReaderPass
from streamdata.datasets.sharded import ShardedDataset
from streamdata.datasets.token_layouts import FlatBin, MegatronIdx, ParquetColumn, TarNpy, TokenLayout
from streamdata.epoch import blocks
from streamdata.epoch.plan import SampleSlice, Segment, Span
from streamdata.epoch.resume import Stage, resume_span
from streamdata.epoch.state import fingerprint
from streamdata.epoch.tokens import (
    SequencePlan,
    best_fit_plan,
    fit_plan,
    sequence_plan,
    token_reads,
    unit_tokens,
    with_blocks,
)
from streamdata.errors import SpecError
from streamdata.fetch.prefetcher import FetchItem, ItemReader
from streamdata.formats.tokens import MASK_SUFFIX, token_dtype
from streamdata.metrics import StageClock
from streamdata.policy import ErrorPolicy
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["TokenDataset", "TokenMask", "TokenUnit"]

PARTIAL = ("drop", "pad")
PACKING = ("concat", "fit", "best_fit")
SHUFFLES = (False, True, "sequences")
BLOCK_BYTES = 4 * 2**20  # shuffle="sequences": a block's tokens, one ranged read (ORDER-NOT-IO: fixed)
WINDOW_BLOCKS = 4  # shuffle="sequences": blocks whose sequences a reader permutes together


@dataclass(frozen=True)
class TokenUnit:
    """One unit of a token corpus: a ``.bin`` file (``index`` -1) or a Parquet row group;
    ``docs`` documents from global document ``first_doc`` on, ``tokens`` raw tokens."""

    url: str
    size: int
    index: int
    docs: int
    tokens: int
    first_doc: int
    i: int  # its place in the dataset's units


@dataclass(frozen=True)
class TokenMask:
    """The loss mask of a ``.bin`` unit (``NAME.mask.bin``): a read of the same stream positions
    follows each read of the unit's tokens."""

    unit: TokenUnit


@dataclass(frozen=True)
class TokenPass(ReaderPass):
    """A token reader's pass: its reads made from ``segments`` of the epoch's positions (in the
    order read: the span's, or the sequence shuffle's windows'), which say where runs of
    sequences end (``epoch.tokens.token_reads``)."""

    segments: tuple[Segment, ...] = ()


class TokenDataset(ShardedDataset):
    """Token ids packed into sequences of ``seq_len`` tokens (``seq_len + 1`` with
    ``targets=True``), yielded as ``{"input_ids": LongTensor[B, width]}`` batches of
    ``batch_size`` sequences (one ``[width]`` sequence at a time with ``batch_size=None``).

    The source: ``column=`` a Parquet list column of integer token ids (one row, one document);
    ``field=`` tar shards, each sample's ``field`` (e.g. ``"npy"``) a 1-D integer ``.npy`` (one
    sample, one document; counted by reading each shard once in the constructor, each rank a
    share, with a bar of rank 0's on stderr when it is a terminal or ``progress=True``;
    ``save_counts()`` keeps the counts for later jobs, which read them from ``counts``:
    ``"auto"``, beside the shards, or a URL, or ``None``: count always); else ``.bin`` files:
    ``dtype=`` flat token arrays (one file, one document), or, without ``dtype``, flat arrays of
    the dtype that a ``tokens.json`` (``{"dtype": "uint16"}``) beside them names, or else (or with
    ``idx=True``) Megatron ``.bin`` + ``.idx`` pairs. ``bos_id`` / ``eos_id``:
    inserted around every document. ``partial``: the epoch's final partial sequence is
    ``"drop"``-ped (its tokens counted in ``counts["tokens.dropped"]``) or ``"pad"``-ded with
    ``pad_id`` (``counts["tokens.padded"]``). ``documents=True`` adds ``doc_ids``,
    ``position_ids`` and ``cu_seqlens`` (``batch.tokens``); in a flat ``.bin``, ``sep_id`` (e.g.
    GPT-2's ``50256``) ends each document there. ``packing="fit"``: a document shorter than a
    sequence is never cut (``epoch.tokens.fit_plan``; sequences padded); ``packing="best_fit"``:
    no document is cut, documents packed by best fit (``epoch.tokens.best_fit_plan``; one longer
    than a sequence truncated, counted in ``counts["tokens.truncated"]``). ``loss_mask=True``
    reads a loss mask beside each ``.bin`` (``NAME.mask.bin``, a uint8 per token), ``mask_column=``
    (``"loss_mask"`` with ``loss_mask=True``) a Parquet list column of them beside ``column``:
    batches then carry ``labels`` (``batch.tokens``). ``shuffle=True`` shuffles the
    units' order per epoch (seeded); ``shuffle="sequences"`` also the sequences' order: blocks of
    consecutive sequences of about ``block_bytes`` (default 4 MiB, one ranged read each) in a
    seeded order across the corpus, and in each reader the sequences of ``window_blocks``
    (default 4) of its blocks at a time in a seeded permutation (not for a Parquet column, whose
    row groups are read whole); ``drop_last``, ``seed``, ``collate_fn``, ``map``, fetch and
    storage options as for the other sharded datasets (the same pass: ``sharded``). Every token
    of an epoch in exactly one sequence, every rank the same number of steps (TOKENS-ONCE,
    EQUAL-STEPS); ``state_dict`` is exact to the token.
    """

    def __init__(self, urls: Spec, seq_len: int, batch_size: int | None = None, *,
                 column: str | None = None, dtype: Any = None, idx: bool | None = None,
                 targets: bool = False, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int = 0, partial: str = "drop", documents: bool = False,
                 sep_id: int | None = None, packing: str = "concat", footer_bytes: int = 64 * 1024,
                 field: str | None = None, progress: bool | None = None, counts: str | None = "auto",
                 loss_mask: bool = False, mask_column: str | None = None,
                 block_bytes: int | None = None, window_blocks: int | None = None,
                 **options: Any) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise SpecError(f"seq_len must be a positive int, got {seq_len!r}")
        if partial not in PARTIAL:
            raise SpecError(f"partial must be 'drop' or 'pad', got {partial!r}")
        for name in ("shuffle_buffer", "shuffle_window"):
            if options.get(name) is not None:
                raise SpecError(f"TokenDataset takes no {name}: shuffle=True shuffles its units' order, "
                                "shuffle='sequences' the sequences' (block_bytes=, window_blocks=)")
        shuffle = options.get("shuffle", False)
        if not any(shuffle is x or (isinstance(x, str) and shuffle == x) for x in SHUFFLES):
            raise SpecError(f"TokenDataset: shuffle is False, True (the units' order) or 'sequences' (the "
                            f"sequences' order, in blocks), got {shuffle!r}")
        self.shuffle_sequences = shuffle == "sequences"
        if self.shuffle_sequences:
            options["shuffle"] = True  # (the units' order too; the blocks' order is the plan's)
            if column is not None:
                raise SpecError("shuffle='sequences' reads blocks of sequences in byte ranges; a Parquet "
                                "column's row groups are read whole: use shuffle=True (row groups' order) "
                                "or write smaller row groups")
        elif block_bytes is not None or window_blocks is not None:
            raise SpecError("block_bytes= and window_blocks= size the sequence shuffle: pass "
                            "shuffle='sequences'")
        for name, value in (("block_bytes", block_bytes), ("window_blocks", window_blocks)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.window_blocks = WINDOW_BLOCKS if window_blocks is None else window_blocks
        if options.get("on_error", "raise") != "raise":
            raise SpecError("TokenDataset reads every token of its plan: on_error must be 'raise' "
                            "(a skipped unit would break the epoch's token accounting)")
        if column is not None and (dtype is not None or idx or field is not None):
            raise SpecError("TokenDataset: column= reads Parquet; dtype= and idx= are for .bin files, "
                            "field= for tar shards")
        if field is not None and (dtype is not None or idx):
            raise SpecError("TokenDataset: field= reads tar shards (each sample's .npy gives its dtype); "
                            "dtype= and idx= are for .bin files")
        layout: TokenLayout
        if column is not None:
            layout = ParquetColumn(column, footer_bytes)
        elif field is not None:
            layout = TarNpy(field.lower(), counts, progress)  # (tar field names are read lower-case)
        elif idx or (idx is None and dtype is None):
            layout = MegatronIdx(None if dtype is None else token_dtype(dtype), sniffed=idx is None)
        else:
            layout = FlatBin(token_dtype(dtype))
        self.token_layout = layout  # how the corpus is found, fetched and read (``token_layouts``)
        self.suffixes = layout.suffixes
        self.column = column
        self.seq_len, self.width = seq_len, seq_len + int(bool(targets))
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, int(pad_id)
        self.specials = int(bos_id is not None) + int(eos_id is not None)
        self.partial, self.documents, self.footer_bytes = partial, bool(documents), footer_bytes
        if sep_id is not None and (column is not None or field is not None or idx):
            raise SpecError("sep_id marks documents in flat .bin files (dtype=); the .idx and Parquet rows "
                            "already say where documents end")
        self.sep_id = sep_id
        if packing not in PACKING:
            raise SpecError(f"packing must be 'concat', 'fit' or 'best_fit', got {packing!r}")
        if packing != "concat" and column is not None:
            raise SpecError(f"packing={packing!r} needs every document's length before reading: .bin + .idx "
                            "(or flat .bin, one document per file); a Parquet column's are known only "
                            "when its row groups are read")
        self.packing = packing
        if mask_column is not None and column is None:
            raise SpecError("mask_column= names a Parquet list column of loss masks beside column=; a .bin's "
                            f"loss mask is a NAME{MASK_SUFFIX} beside it (loss_mask=True)")
        if loss_mask and field is not None:
            raise SpecError("loss_mask=True reads a NAME.mask.bin beside each .bin, or a Parquet "
                            "mask_column=; tar shards of .npy hold no loss mask")
        self.mask_column = mask_column or ("loss_mask" if loss_mask and column is not None else None)
        self.loss_mask = bool(loss_mask) or mask_column is not None
        super().__init__(urls, batch_size=batch_size, shuffle_buffer=0, **options)
        # a .bin's loss mask is no token file (listed beside it, it is read with it, or not at all)
        listed = {s.url: s for s in self.shards if s.url.endswith(MASK_SUFFIX)}
        self.shards = [s for s in self.shards if not s.url.endswith(MASK_SUFFIX)]
        if not self.shards:
            raise SpecError(f"no token files but loss masks (*{MASK_SUFFIX}) in {urls!r}")
        self.shards = from_rank0(lambda: with_sizes(self.shards, self.storage_options, self.fetch_config))
        if isinstance(layout, MegatronIdx) and layout.sniffed and dtype is None:
            # no dtype=, no idx=: a tokens.json beside flat .bin files, else .idx files
            sidecar = sidecar_dtype(self.shards, self.storage_options, self.fetch_config)
            if sidecar is not None:
                self.token_layout = layout = FlatBin(sidecar)
        self._lengths: list[np.ndarray | None] = []  # documents' raw tokens per unit (None: read)
        self._fit: tuple[tuple, SequencePlan] | None = None  # packing "fit": the last epoch's plan
        self.units_: list[TokenUnit] = self._scan()
        self._masks: dict[str, Shard] = {}  # a .bin's loss mask, by the .bin's URL
        if self.loss_mask and self.token_layout.mask_apart:
            masks = mask_shards([u.url for u in self.units_], listed,
                                [u.tokens for u in self.units_], self.storage_options, self.fetch_config)
            self._masks = {u.url: m for u, m in zip(self.units_, masks, strict=True)}
        if sep_id is not None and not isinstance(layout, FlatBin):
            raise SpecError(f"sep_id marks documents in flat .bin files; {redact_url(self.shards[0].url)} "
                            "has a .idx, which already says where documents end")
        self._tokens = unit_tokens([u.docs for u in self.units_], [u.tokens for u in self.units_],
                                   self.specials)
        # shuffle="sequences": sequences per block, from the corpus's bytes per token (ORDER-NOT-IO)
        per_token = self.dtype.itemsize if self.dtype is not None else (
            sum(u.size for u in self.units_) / max(sum(u.tokens for u in self.units_), 1))
        self.block_sequences = max(1, int(self.block_bytes // max(self.width * per_token, 1)))

    # ---- what the metadata says ------------------------------------------------------------

    @property
    def layout(self) -> str:
        """The corpus's layout: ``"bin"``, ``"idx"``, ``"tar"`` or ``"parquet"``."""
        return self.token_layout.name

    @property
    def dtype(self) -> np.dtype | None:
        """The token dtype of ``.bin`` files (None for tar and Parquet: each array or column's own)."""
        return getattr(self.token_layout, "dtype", None)

    @property
    def counted_shards(self) -> int:
        """Tar shards the job's counting pass read, every rank's share (0 for other layouts)."""
        return getattr(self.token_layout, "counted_shards", 0)

    @property
    def counted_here(self) -> int:
        """Those this rank read (COUNT-SHARED, ``catalog.tokens``)."""
        return getattr(self.token_layout, "counted_here", 0)

    def _scan(self) -> list[TokenUnit]:
        """The units and their documents, as the layout's metadata gives them."""
        units: list[TokenUnit] = []
        docs = 0
        for u in self.token_layout.scan(self):
            empty = u.tokens == 0 and u.row_group < 0 and self.layout != "tar"
            if u.tokens + u.docs * self.specials == 0 or empty:
                continue  # nothing in the stream (an empty .bin holds no documents; a tar's empty samples do)
            units.append(TokenUnit(u.url, u.size, u.row_group, u.docs, u.tokens, docs, len(units)))
            self._lengths.append(u.lengths)
            docs += u.docs
        if not units:
            raise SpecError(f"no tokens in {len(self.shards)} objects, e.g. {redact_url(self.shards[0].url)}")
        return units

    def save_counts(self, url: str | None = None) -> str:
        """Keep a tar corpus's counts (what the constructor's counting pass found) at ``url``
        (default: ``_streamdata.tokens.npz`` in the shards' common directory), so that later
        constructors (``counts="auto"`` or that URL) read only shards that are new or changed
        (size or ETag); returns the URL written. Call it on one rank."""
        if not isinstance(self.token_layout, TarNpy):
            raise SpecError("save_counts keeps the counts of tar shards (field=); the other layouts' "
                            "counts are metadata already")
        return self.token_layout.save(self, url)

    # ---- what ShardedDataset asks ----------------------------------------------------------

    def units(self) -> Sequence[Any]:
        return self.units_

    def sample_counts(self) -> np.ndarray:
        """The epoch's samples: its sequences, as one unit (the stream, ``epoch.tokens``); what a
        Mix divides (a mix of token sources is a mix of sequences of the same width)."""
        return np.array([self.plan(0).sequences], dtype=np.int64)

    def block_window(self) -> int | None:
        """shuffle="sequences": the window in sequences (``window_blocks`` blocks); else None
        (shuffle=True orders units; sequences stay in stream order)."""
        if not (self.shuffle and self.shuffle_sequences):
            return None
        return self.window_blocks * self.block_sequences

    def state_key(self) -> tuple[str, str]:
        key = (self.seed, self.shuffle)
        if self._state_key is None or self._state_key[0] != key:
            blocked = [self.block_sequences] if self.block_window() else []  # (the window: the state's tag)
            fp = fingerprint(self.shards, [*self._tokens.tolist(), self.width, self.specials,
                                           PARTIAL.index(self.partial), PACKING.index(self.packing),
                                           *blocked],
                             seed=self.seed, shuffle=self.shuffle)
            self._state_key = (key, (fp, "samples"))
        return self._state_key[1]

    def plan(self, epoch: int | None = None) -> SequencePlan:
        """The epoch's stream and its sequences (``epoch.tokens``), in blocks in the epoch's order
        with shuffle="sequences"."""
        epoch = self.epoch if epoch is None else epoch
        if self.packing != "concat":  # (a walk over every document: kept for the epoch)
            key = (epoch, self.seed, self.shuffle)
            if self._fit is None or self._fit[0] != key:
                docs = [self.doc_lengths(u) for u in self.units_]
                packer = fit_plan if self.packing == "fit" else best_fit_plan
                self._fit = (key, packer(self._tokens, docs, self.width, self.specials, seed=self.seed,
                                         epoch=epoch, shuffle=self.shuffle))
            sp = self._fit[1]
        else:
            sp = sequence_plan(self._tokens, self.width, pad=self.partial == "pad", seed=self.seed,
                               epoch=epoch, shuffle=self.shuffle)
        if self.block_window() and sp.sequences:
            sp = with_blocks(sp, self.block_sequences, seed=self.seed, epoch=epoch)
        return sp

    @property
    def num_tokens(self) -> int:
        """Tokens in one epoch's stream (inserted ``bos``/``eos`` included)."""
        return int(self._tokens.sum())

    @property
    def num_sequences(self) -> int:
        """Sequences in one epoch, over every reader (``len()`` is this rank's batches: ``steps``)."""
        return self.plan().sequences

    def _plan_pass(self, epoch: int, batch_size: int | None, drop_last: bool,
                   stages: list[Stage] | None = None) -> ReaderPass:
        world = self.world()
        sp = self.plan(epoch)
        counts, window = sp.position_counts(), self.block_window()
        runs = blocks.block_runs(window, False, self.seed, epoch, self.window_blocks) if window else None

        def span_of(stages: list[Stage]) -> Span:
            return resume_span(counts, stages, world, seed=self.seed, epoch=epoch, shuffle=False,
                               batch_size=batch_size, drop_last=drop_last, undelivered=runs)

        span = span_of(stages or [])
        segments, windows = tuple(span.segments), None
        if window:  # the sequence shuffle's windows (BLOCK-SHUFFLE), from the one the position is in
            # pieces of one block each (the span's segments are cut at the blocks' edges): a window
            # gathers ``window_blocks`` blocks of the reader's span, each one ranged read
            cut, windows = blocks.resumed_reads(span, span_of, stages or [], world, window, False,
                                                seed=self.seed, epoch=epoch, tables=False,
                                                pieces=self.window_blocks)
            segments = tuple(cut)
        reads = [Read(self.units_[r.unit], SampleSlice(r.start, r.stop, int(self._tokens[r.unit])))
                 for r in token_reads(sp, segments)]
        return TokenPass(world, epoch, self._with_masks(reads), span, windows, segments)

    def _with_masks(self, reads: list[Read]) -> list[Read]:
        """Each read of a ``.bin``'s tokens followed by the read of their loss mask (``TokenMask``)."""
        if not self._masks:
            return reads
        return [x for r in reads for x in (r, Read(TokenMask(r.unit), r.part))]

    def mask_shard(self, unit: TokenUnit) -> Shard:
        """The loss mask beside ``unit``'s ``.bin`` (its size, and its ETag when listed)."""
        return self._masks[unit.url]

    def fetch_segment(self, unit: TokenUnit | TokenMask, start: int, stop: int, count: int) -> FetchItem:
        """The bytes stream positions ``[start, stop)`` of ``unit`` need (the layout's ranges)."""
        if isinstance(unit, TokenMask):
            return self.token_layout.fetch_mask(self, unit.unit, start, stop)
        return self.token_layout.fetch(self, unit, start, stop)

    def doc_lengths(self, unit: TokenUnit) -> np.ndarray:
        """The raw tokens of each of ``unit``'s documents (known before reading but in Parquet)."""
        lengths = self._lengths[unit.i]
        assert lengths is not None  # (a .bin's documents are known before reading)
        return lengths

    def read_tokens(self, unit: TokenUnit, start: int, stop: int, reader: ItemReader
                    ) -> tuple[np.ndarray, ...]:
        """Stream positions ``[start, stop)`` of ``unit``: tokens and global document numbers (and
        their loss mask, where it comes in the same item)."""
        if self.loss_mask and not self.token_layout.mask_apart:
            return self.token_layout.read_masked(self, unit, start, stop, reader)
        return self.token_layout.read(self, unit, start, stop, reader)

    def read_segment(self, unit: TokenUnit | TokenMask, start: int, stop: int, count: int,
                     reader: ItemReader) -> Iterator[Any]:
        """One record: stream positions ``[start, stop)`` of ``unit`` as ``(tokens, documents)``
        (``(tokens, documents, mask)`` for a Parquet loss mask); of a ``TokenMask``, the mask."""
        if isinstance(unit, TokenMask):
            yield self.token_layout.read_mask(self, unit.unit, start, stop, reader)
        else:
            yield self.read_tokens(unit, start, stop, reader)

    def read_unit(self, unit: TokenUnit, reader: ItemReader) -> Iterator[Any]:
        yield self.read_tokens(unit, 0, int(self._tokens[unit.i]), reader)

    # ---- the pass: the one every dataset runs, its records packed into sequences ---------------

    def _note_plan(self, p: ReaderPass) -> None:
        super()._note_plan(p)
        live = self._live
        start = live is not None and not live.before and not live.samples_before  # (not a resumed pass)
        if self.plan(p.epoch).dropped and p.world.slot == 0 and start:
            self._counters.add("tokens.dropped", self.plan(p.epoch).dropped)  # once per epoch, by reader 0
        if self.plan(p.epoch).truncated and p.world.slot == 0 and start:
            self._counters.add("tokens.truncated", self.plan(p.epoch).truncated)

    def stages(self, records: Iterator[Any], policy: ErrorPolicy, p: ReaderPass,
               batching: Batching) -> Iterator[Any]:
        """Token records (one per read, in the plan's order) -> sequences of ``width`` tokens
        (``batch.tokens.pack``; a run of sequences ends where the plan's reads say) -> ``map`` ->
        batches of the plan's sizes (EQUAL-STEPS)."""
        sp = self.plan(p.epoch)
        segments = p.segments if isinstance(p, TokenPass) else p.span.segments if p.span is not None else ()
        reads = token_reads(sp, segments)
        flushes = iter([r.flush for r in reads])
        chunks = self._chunks(records, flushes)
        lengths = None
        if (sp.bounds is not None or sp.pieces is not None) and p.span is not None:  # fit: sequences' lengths
            lengths = [int(n) for a, b in sp.stream_runs(segments) for n in sp.lengths(a, b)]
        seqs: Iterator[Any] = pack(chunks, self.width, pad_id=self.pad_id, documents=self.documents,
                                   padded=lambda n: self._counters.add("tokens.padded", n), lengths=lengths,
                                   labels=self.loss_mask)
        if batching.windows is not None:  # shuffle="sequences": each window's seeded permutation
            seqs = blocks.block_shuffled(seqs, batching.windows)
        if self._map is not None:
            seqs = policy.each(seqs, self._map, run=StageClock.MAP)
        if self._live is not None:
            seqs = self._live.count(seqs)  # sequences delivered: the position (state_dict)
        if batching.batch_size is None:
            return seqs
        return batches(seqs, batching.batch_size, collate_fn=batching.collate_fn,
                       drop_last=batching.drop_last, in_flight=batching.in_flight, sizes=batching.sizes,
                       left_out=self._left_out)

    def _chunks(self, records: Iterator[Any], flushes: Iterator[bool]) -> Iterator[tuple]:
        """The packer's chunks: each token record with its flush, and its loss mask (the record
        after it, for a ``.bin``'s ``TokenMask`` read; else in the record)."""
        if not self.loss_mask:
            return ((tokens, docs, next(flushes)) for tokens, docs in records)
        if not self._masks:
            return ((tokens, docs, next(flushes), mask) for tokens, docs, mask in records)
        return ((*tokens, next(flushes), mask) for tokens, mask in zip(records, records, strict=True))

    def __repr__(self) -> str:
        return (f"TokenDataset({len(self.units_)} units, e.g. {redact_url(self.units_[0].url)!r}, "
                f"{self.num_tokens} tokens, seq_len={self.seq_len}, batch_size={self.batch_size})")

