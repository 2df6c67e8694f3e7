"""Token chunks -> fixed-length sequences: the packer of ``sd.TokenDataset``.

The reader's chunks (a unit's token range, with the document each token belongs to) arrive in
stream order; every ``width`` tokens make one sequence, a dict of NumPy rows that
``batches`` copies into ``[B, width]`` shared-memory tensors. At a ``flush`` (the end of a run
of sequences: ``epoch.tokens.TokenRead``) what is left is the epoch's final partial sequence,
padded with ``pad_id`` to ``width`` (TOKENS-ONCE in ``epoch.tokens``).

With ``documents=True`` each sequence also holds, per token, ``doc_ids`` (0, 1, ... within the
sequence; padding is a document of its own) and ``position_ids`` (the position in that piece of
its document, from 0 at each document start and at the sequence start), and ``cu_seqlens``:
the cumulative lengths of its documents, ``[0, n1, n1+n2, ..., width]``, followed by ``width``
repeated up to ``width + 1`` entries (a fixed shape that batches; ``varlen_cu_seqlens`` turns a
batch's into the one vector a variable-length attention kernel takes).

With ``labels=True`` (chunks that carry a loss mask) each sequence also holds ``labels``: its
``input_ids`` where the mask is 1, else ``-100``, and ``-100`` at padding and at the first token
of each document after the sequence's start (no token is learnt from another document's
context). Unshifted, as a Hugging Face causal LM takes them (it shifts inside): position ``i``'s
label is the target of the prediction made at ``i - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

__all__ = ["IGNORE", "pack", "varlen_cu_seqlens"]

# (tokens, document keys or None, flush), and with labels the tokens' loss mask (1: learn it)
Chunk = tuple[np.ndarray, np.ndarray | None, bool] | tuple[np.ndarray, np.ndarray | None, bool, np.ndarray]

IGNORE = -100  # a label no loss counts (PyTorch's cross_entropy ``ignore_index``, Hugging Face's)


def pack(chunks: Iterable[Chunk], width: int, *, pad_id: int = 0, documents: bool = False,
         padded: Callable[[int], None] | None = None, lengths: Iterable[int] | None = None,
         labels: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Sequences of ``width`` tokens from ``chunks``; ``padded(n)`` is told of each padding.
    ``lengths``: how many tokens each sequence takes before its padding (packing "fit",
    ``epoch.tokens.fit_plan``), else ``width``. ``labels``: each chunk's fourth item is its
    tokens' loss mask, and each sequence has ``labels`` (the module's docstring)."""
    tokens = np.empty(width, np.int64)
    keys = np.empty(width, np.int64)
    mask = np.zeros(width, np.uint8)
    targets = iter(lengths) if lengths is not None else None
    fill, target = 0, width if targets is None else int(next(targets, width))
    keyed = documents or labels

    def padded_sequence() -> dict[str, np.ndarray]:
        tokens[fill:] = pad_id
        keys[fill:] = -1  # padding: a document of its own
        mask[fill:] = 0
        if padded is not None and fill < width:
            padded(width - fill)
        out = _sequence(tokens, keys, documents)
        if labels:
            out["labels"] = _labels(tokens, keys, mask)
        return out

    for chunk, chunk_keys, flush, *rest in chunks:
        chunk_mask = rest[0] if labels else None
        at = 0
        while at < len(chunk):
            take = min(target - fill, len(chunk) - at)
            tokens[fill:fill + take] = chunk[at:at + take]
            if keyed and chunk_keys is not None:
                keys[fill:fill + take] = chunk_keys[at:at + take]
            if chunk_mask is not None:
                mask[fill:fill + take] = chunk_mask[at:at + take]
            fill += take
            at += take
            if fill == target:
                yield padded_sequence()
                fill = 0
                target = width if targets is None else int(next(targets, width))
        if flush and fill:
            yield padded_sequence()
            fill = 0


def _labels(tokens: np.ndarray, keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``tokens`` where ``mask`` is 1, else IGNORE; IGNORE too where a document starts after the
    sequence's first token (its prediction would come from another document)."""
    out = np.where(mask.astype(bool), tokens, IGNORE)
    out[1:][keys[1:] != keys[:-1]] = IGNORE
    return out


def _sequence(tokens: np.ndarray, keys: np.ndarray, documents: bool) -> dict[str, np.ndarray]:
    out = {"input_ids": tokens.copy()}
    if documents:
        width = len(tokens)
        change = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        starts = np.concatenate([[0], change]).astype(np.int64)
        doc_ids = np.zeros(width, np.int64)
        doc_ids[change] = 1
        doc_ids = np.cumsum(doc_ids)
        out["doc_ids"] = doc_ids
        out["position_ids"] = np.arange(width, dtype=np.int64) - starts[doc_ids]
        cu = np.full(width + 1, width, np.int32)
        cu[:len(starts)] = starts
        out["cu_seqlens"] = cu
    return out


def varlen_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A batch's ``cu_seqlens`` (``[B, width + 1]``, as ``pack`` fills them) as the one int32
    vector over the flattened ``[B * width]`` tokens that variable-length attention kernels take
    (``flash_attn_varlen_func``'s ``cu_seqlens_q``/``_k``): each row offset by the rows before
    it, the repeats dropped."""
    rows, width = cu_seqlens.shape[0], cu_seqlens.shape[1] - 1
    offset = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * width
    flat = (cu_seqlens.to(torch.int64) + offset).flatten()
    return torch.unique_consecutive(flat).to(torch.int32)

