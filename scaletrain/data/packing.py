"""Packing tokenized documents into fixed-length rows (pure numpy).

Why packing: padding every document to ``max_length`` wastes most of the compute on
short texts. We cut long documents into pieces of at most ``max_length`` tokens and
place the pieces first-fit into rows of exactly ``max_length``. Each piece keeps its
own ``segment_ids`` (1..k within a row, 0 for padding) and ``positions`` (restarting at
0), so attention and the loss never cross from one piece into another and a packed
batch computes the same thing as the unpacked pieces.

Why not grain's ``FirstFitPackIterDataset``: it packs a stream, so the number of rows
is only known after a full pass and the rows depend on its buffer size. Packing the
whole (in-memory) corpus up front gives a fixed, shuffleable array of rows, an exact
``steps_per_epoch`` and O(1) random access for resuming.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from scaletrain.errors import DataError


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Packed rows, each array of shape ``[num_rows, max_length]`` and dtype int32.

    ``input_ids`` holds ``pad_id`` where ``segment_ids == 0`` (padding).
    ``loss_mask`` is None for pre-training (every token after the first of a
    segment is a target) and, for chat SFT, 1 on the tokens that are targets
    (assistant turns) and 0 elsewhere, padding included.
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    pad_id: int = 0
    loss_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        arrays = {"segment_ids": self.segment_ids, "positions": self.positions, "loss_mask": self.loss_mask}
        for name, array in arrays.items():
            if array is not None and array.shape != shape:
                raise DataError(f"PackedRows.{name} has shape {array.shape}, input_ids has {shape}")

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding."""
        return int(np.count_nonzero(self.segment_ids))

    @property
    def num_segments(self) -> int:
        """Pieces packed into the rows (segments start where position is 0)."""
        return int(np.count_nonzero((self.positions == 0) & (self.segment_ids > 0)))

    @property
    def num_loss_tokens(self) -> int:
        """Target tokens: not the first of their segment and, with a loss mask, masked in."""
        seg = self.segment_ids
        target = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
        if self.loss_mask is not None:
            target &= self.loss_mask[:, 1:] != 0
        return int(np.count_nonzero(target))

    @property
    def packing_efficiency(self) -> float:
        """Fraction of the row slots holding real tokens (1.0 = no padding)."""
        size = self.segment_ids.size
        return self.num_tokens / size if size else 0.0

    @cached_property
    def single_segment(self) -> bool:
        """Every row is one unpadded sequence: segment 1 throughout, positions ``0..L-1``.

        Then attention is plain causal attention and the loss masks only the last
        position, so :func:`scaletrain.data.loader.make_batch_iterator` leaves
        ``segment_ids`` and ``positions`` out of the batches and the model builds no
        ``[B, 1, T, S]`` mask (on cuDNN a mask becomes a bias with its own gradient).
        One vectorised pass over the rows, the first time it is asked.
        """
        arange = np.arange(self.max_length, dtype=self.positions.dtype)
        return bool(np.all(self.segment_ids == 1) and np.all(self.positions == arange))

    def __len__(self) -> int:
        return self.num_rows


def split_into_pieces(
    token_docs: Iterable[np.ndarray], max_length: int, eos_id: int | None = None
) -> list[np.ndarray]:
    """Append ``eos_id`` (if given) to each document and cut it into pieces of <= ``max_length``.

    Empty documents are dropped (with ``eos_id`` they are one eos token and kept).
    The pieces are views into the (possibly eos-extended) documents, in order.
    """
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    pieces: list[np.ndarray] = []
    for doc in token_docs:
        tokens = np.asarray(doc, dtype=np.int32).reshape(-1)
        if eos_id is not None:
            tokens = np.append(tokens, np.int32(eos_id))
        for start in range(0, tokens.size, max_length):
            pieces.append(tokens[start : start + max_length])
    return pieces


def first_fit(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Row index for each item: the lowest-numbered row with room for it (first-fit bin packing).

    Uses a max segment tree over the rows' free space, so each item costs O(log n)
    instead of scanning every open row; rows not yet used are simply rows with
    ``capacity`` free, so the first unused row is opened when nothing else fits.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.size)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(f"item lengths must be in [1, {capacity}]")
    size = 1 << max(0, (n - 1).bit_length())
    tree = [capacity] * (2 * size)  # a Python list: scalar access is much faster than numpy
    rows = np.empty(n, dtype=np.int64)
    for i, need in enumerate(lengths.tolist()):
        node = 1
        while node < size:  # descend to the leftmost leaf with free space >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        rows[i] = node - size
        tree[node] -= need
        node >>= 1
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node >>= 1
    return rows


def pack_pieces(
    pieces: Sequence[np.ndarray],
    max_length: int,
    pad_id: int = 0,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> PackedRows:
    """Pack pieces (each of 1..``max_length`` tokens) first-fit, in order, into rows.

    With ``loss_masks`` (one array per piece, same length) the rows carry a
    ``loss_mask`` placed exactly like the tokens.
    """
    lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
    if lengths.size and lengths.max() > max_length:
        raise DataError(f"a piece of {lengths.max()} tokens exceeds max_length={max_length}")
    if loss_masks is not None:
        if len(loss_masks) != len(pieces) or any(m.size != p.size for m, p in zip(loss_masks, pieces)):
            raise DataError("loss_masks must have one array per piece, each as long as its piece")
    keep = lengths > 0
    pieces = [p for p, k in zip(pieces, keep) if k]
    if loss_masks is not None:
        loss_masks = [m for m, k in zip(loss_masks, keep) if k]
    lengths = lengths[keep]
    rows = first_fit(lengths, max_length)
    num_rows = int(rows.max()) + 1 if rows.size else 0

    # Offset of each piece inside its row and its segment number (1-based), in
    # assignment order: a stable sort by row keeps the pieces' order within a row.
    order = np.argsort(rows, kind="stable")
    sorted_rows, sorted_len = rows[order], lengths[order]
    row_start = np.searchsorted(sorted_rows, sorted_rows, side="left")
    cum = np.cumsum(sorted_len) - sorted_len
    offsets_sorted = cum - cum[row_start]
    segments_sorted = np.arange(order.size) - row_start + 1
    offsets = np.empty_like(offsets_sorted)
    segments = np.empty_like(segments_sorted)
    offsets[order], segments[order] = offsets_sorted, segments_sorted

    input_ids = np.full((num_rows, max_length), pad_id, dtype=np.int32)
    segment_ids = np.zeros((num_rows, max_length), dtype=np.int32)
    positions = np.zeros((num_rows, max_length), dtype=np.int32)
    loss_mask = None if loss_masks is None else np.zeros((num_rows, max_length), dtype=np.int32)
    if lengths.size:
        total = int(lengths.sum())
        # per-token index arrays are the peak memory of packing: int32 when the rows allow it
        idx = np.int32 if num_rows * max_length < 2**31 else np.int64
        piece_start = (np.cumsum(lengths) - lengths).astype(idx)  # start of each piece in the flat stream
        within = np.arange(total, dtype=idx)
        within -= np.repeat(piece_start, lengths)  # position inside its piece
        dest = np.repeat((rows * max_length + offsets).astype(idx), lengths)
        dest += within
        input_ids.reshape(-1)[dest] = np.concatenate(pieces)
        segment_ids.reshape(-1)[dest] = np.repeat(segments.astype(np.int32), lengths)
        positions.reshape(-1)[dest] = within
        if loss_mask is not None:
            loss_mask.reshape(-1)[dest] = np.concatenate(loss_masks)
    return PackedRows(input_ids, segment_ids, positions, pad_id=int(pad_id), loss_mask=loss_mask)


def pack_documents(
    token_docs: Iterable[np.ndarray], max_length: int, eos_id: int | None, *, pad_id: int = 0
) -> PackedRows:
    """Pack tokenized documents into rows of exactly ``max_length`` tokens.

    ``eos_id`` (if not None) is appended to each document first, so the model learns
    where documents end. Documents longer than ``max_length`` are split into pieces
    of ``max_length`` (the last one shorter); pieces are packed first-fit in input
    order. Deterministic: the same input always gives the same rows.
    """
    return pack_pieces(split_into_pieces(token_docs, max_length, eos_id), max_length, pad_id)
