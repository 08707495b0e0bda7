"""From raw documents to sharded, resumable batches for language-model training.

Two stages:

1. :func:`build_lm_splits` tokenizes the documents (streamed in chunks through the
   Rust tokenizer, keeping only token arrays), appends eos, cuts them into pieces of
   ``max_length`` tokens, holds out a
   seeded random subset of *pieces* for evaluation (so even a handful of long documents
   gives a real held-out set) and packs both splits into fixed rows.
2. :func:`make_batch_iterator` serves those rows with grain. Everything is index
   arithmetic on a ``MapDataset``, so the iterator's state is a single integer and
   resuming is O(1): no batches are replayed, unlike EasyDeL's loader.

Sharding contract: global batch ``b`` of epoch ``e`` is the fixed set of rows
``perm_e[b*G:(b+1)*G]``; process ``p`` of ``P`` receives the contiguous slice
``[p*G/P, (p+1)*G/P)`` of it. Hence the processes see disjoint rows, and their union
is the global batch a single process would see with ``process_count=1``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from scaletrain.data.collate import as_source, collate
from scaletrain.data.packing import PackedRows, pack_pieces
from scaletrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import grain

logger = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "segment_ids", "positions")


@dataclass(frozen=True)
class LMSplits:
    """Packed train and eval rows plus what is needed to report bits per byte.

    ``eval_bytes_per_token`` is the UTF-8 size of the text the eval targets cover
    divided by the number of eval targets (tokens whose predecessor is in the same
    segment), so ``bits_per_byte = mean_eval_loss_nats / ln(2) / eval_bytes_per_token``.
    It is NaN when there is no eval split.
    """

    train: PackedRows
    eval: PackedRows
    eval_bytes_per_token: float
    stats: dict[str, Any] = field(default_factory=dict)


class TextEncoder:
    """Tokenizes a chunk of documents into pieces of at most ``max_length`` tokens.

    Each document gets eos appended (when the tokenizer has one) and is cut into
    pieces; for every piece we also keep the UTF-8 size of the text its targets
    cover, so bits per byte can be reported without keeping the text. Picklable,
    so :func:`~scaletrain.data.workers.map_chunks` can run it in worker processes.
    """

    def __init__(self, tokenizer: Any, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.eos_id = getattr(tokenizer, "eos_token_id", None)

    def __call__(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        from scaletrain.data.tokenizer import plain_backend

        backend = plain_backend(self.tokenizer)
        if backend is None:  # a slow (pure Python) tokenizer
            ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            token_docs, encodings = [np.asarray(x, dtype=np.int32) for x in ids], None
        else:
            encodings = backend.encode_batch(list(texts), add_special_tokens=False)
            token_docs = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        pieces: list[np.ndarray] = []
        target_bytes: list[int] = []
        for d, ids in enumerate(token_docs):
            full = ids if self.eos_id is None else np.append(ids, np.int32(self.eos_id))
            enc = encodings[d] if encodings is not None else None
            for start in range(0, full.size, self.max_length):
                piece = full[start : start + self.max_length]
                pieces.append(piece)
                target_bytes.append(_target_bytes(texts[d], enc, self.tokenizer, ids, start, start + piece.size))
        return pieces, target_bytes


def _target_bytes(text: str, encoding: Any, tokenizer: Any, ids: np.ndarray, start: int, stop: int) -> int:
    """UTF-8 bytes covered by tokens ``start+1 .. stop-1`` of a document (the piece's targets).

    The first token of a piece is never a target; an appended eos covers no text.
    """
    last = min(stop, ids.size) - 1  # last real (non-eos) token of the piece
    if last <= start:
        return 0
    if encoding is None:
        return len(tokenizer.decode(ids[start + 1 : last + 1].tolist()).encode("utf-8"))
    begin = encoding.token_to_chars(start)[1]
    end = encoding.token_to_chars(last)[1]
    return len(text[begin:end].encode("utf-8"))


@dataclass
class _Pieces:
    pieces: list[np.ndarray] = field(default_factory=list)
    target_bytes: list[int] = field(default_factory=list)
    documents: int = 0


def _encode_texts(
    texts: Iterable[str], tokenizer: Any, max_length: int, chunk_size: int, num_workers: int
) -> _Pieces:
    """Stream ``texts`` through :class:`TextEncoder` chunk by chunk, keeping only tokens."""
    from scaletrain.data.workers import chunked, map_chunks

    out = _Pieces()

    def docs() -> Iterator[str]:
        for text in texts:
            if text and text.strip():
                out.documents += 1
                yield text

    # chunks of at most chunk_size documents and about 1M characters: the Rust encodings of a
    # chunk (~40 bytes per token) are the transient peak, so the chunk bounds it
    chunks = chunked(docs(), chunk_size, max_chars=1 << 20)
    for pieces, nbytes in map_chunks(TextEncoder(tokenizer, max_length), chunks, num_workers):
        out.pieces.extend(pieces)
        out.target_bytes.extend(nbytes)
    return out


def build_lm_splits(
    texts: Iterable[str],
    tokenizer: Any,
    max_length: int,
    eval_fraction: float = 0.05,
    seed: int = 0,
    *,
    eval_texts: Iterable[str] | None = None,
    name: str = "the corpus",
    chunk_size: int = 256,
    num_workers: int = 0,
) -> LMSplits:
    """Tokenize ``texts``, split them into train/eval pieces by ``seed`` and pack both.

    ``texts`` may be any iterable (a generator over a huge file): it is tokenized in
    chunks of ``chunk_size`` documents (in ``num_workers`` processes if > 0) and
    only token arrays are kept. Each document gets the tokenizer's eos appended and
    is cut into pieces of ``max_length`` tokens; ``eval_fraction`` of the pieces (at
    least one when > 0) are held out, unless ``eval_texts`` are given, which then
    form the whole eval split. The same inputs and seed always give the same rows.
    """
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2 to have a next-token target, got {max_length}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if isinstance(texts, str):
        raise DataError("texts must be an iterable of documents, not one string")
    eos_id = getattr(tokenizer, "eos_token_id", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = int(pad_id if pad_id is not None else (eos_id if eos_id is not None else 0))
    if eos_id is None:
        logger.warning("tokenizer has no eos token: documents are packed without a separator")

    t0 = time.perf_counter()
    main = _encode_texts(texts, tokenizer, max_length, chunk_size, num_workers)
    if main.documents == 0:
        raise DataError(f"{name} is empty: no non-blank documents to train on")
    n = len(main.pieces)
    if n == 0:
        raise DataError(f"{name} produced no tokens: the tokenizer returned nothing for every document")

    if eval_texts is not None:
        held = _encode_texts(eval_texts, tokenizer, max_length, chunk_size, num_workers)
        if not held.pieces:
            raise DataError("the eval source is empty: no non-blank documents to evaluate on")
        train_pieces, eval_pieces, eval_piece_bytes = main.pieces, held.pieces, held.target_bytes
    else:
        n_eval = 0
        if eval_fraction > 0:
            if n < 2:
                raise DataError(
                    f"{name} has only {sum(p.size for p in main.pieces)} tokens, one piece of max_length="
                    f"{max_length}: too small to hold out an eval split; add text, lower max_length "
                    "or set eval_fraction=0"
                )
            n_eval = min(n - 1, max(1, round(eval_fraction * n)))
        is_eval = np.zeros(n, dtype=bool)
        is_eval[np.random.default_rng(seed).choice(n, size=n_eval, replace=False)] = True
        train_pieces = [p for p, e in zip(main.pieces, is_eval) if not e]
        eval_pieces = [p for p, e in zip(main.pieces, is_eval) if e]
        eval_piece_bytes = [b for b, e in zip(main.target_bytes, is_eval) if e]

    train = pack_pieces(train_pieces, max_length, pad_id)
    evals = pack_pieces(eval_pieces, max_length, pad_id)
    t_total = time.perf_counter() - t0

    eval_targets = sum(p.size - 1 for p in eval_pieces)
    eval_bytes = int(sum(eval_piece_bytes))
    bytes_per_token = eval_bytes / eval_targets if eval_targets else float("nan")
    tokens = int(sum(p.size for p in main.pieces))
    stats: dict[str, Any] = {
        "kind": "pretrain",
        "documents": main.documents,
        "tokens": tokens,
        "pieces": n,
        "max_length": max_length,
        "train_rows": train.num_rows,
        "train_tokens": train.num_tokens,
        "train_packing_efficiency": train.packing_efficiency,
        "eval_rows": evals.num_rows,
        "eval_tokens": evals.num_tokens,
        "eval_packing_efficiency": evals.packing_efficiency,
        "eval_target_tokens": int(eval_targets),
        "eval_bytes": eval_bytes,
    }
    logger.info(
        "tokenized %d documents into %d tokens and packed them in %.2fs: %d train rows, %d eval rows of %d "
        "(packing efficiency %.3f)",
        main.documents, tokens, t_total, train.num_rows, evals.num_rows, max_length, train.packing_efficiency,
    )
    return LMSplits(train=train, eval=evals, eval_bytes_per_token=bytes_per_token, stats=stats)


def steps_per_epoch(rows: Any, global_batch_size: int, *, drop_remainder: bool = True) -> int:
    """Global batches in one pass over ``rows`` (the last partial one counts if not dropped)."""
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
    n = len(rows)
    return n // global_batch_size if drop_remainder else math.ceil(n / global_batch_size)


class _GatherRows:
    """Turns a batch of row indices into arrays; indices past the end are empty padding rows.

    ``tokens_only``: the batches hold no ``segment_ids``/``positions`` (rows that are
    each one unpadded sequence, and an iterator that never pads: see
    :attr:`PackedRows.single_segment`).
    """

    def __init__(self, rows: PackedRows, tokens_only: bool = False):
        self._rows = rows
        self._tokens_only = tokens_only

    def __call__(self, index: np.ndarray) -> dict[str, np.ndarray]:
        rows = self._rows
        index = np.asarray(index, dtype=np.int64)
        pad = index >= rows.num_rows
        take = np.where(pad, 0, index)
        out = {"input_ids": rows.input_ids[take]}
        if not self._tokens_only:
            out["segment_ids"] = rows.segment_ids[take]
            out["positions"] = rows.positions[take]
        if rows.loss_mask is not None:
            out["loss_mask"] = rows.loss_mask[take]
        if pad.any():
            out["input_ids"][pad] = rows.pad_id
            for key in out.keys() - {"input_ids"}:
                out[key][pad] = 0
        return out


class _GatherExamples:
    """Fetches examples by index from any random-access source and collates them.

    Indices past the end become empty rows (``segment_ids == 0``, no loss).
    """

    def __init__(self, source: Any, max_length: int, truncation_mode: str, collate_fn: Any):
        self._source = source
        self._max_length = max_length
        self._truncation_mode = truncation_mode
        self._collate_fn = collate_fn

    def __call__(self, index: np.ndarray) -> dict[str, np.ndarray]:
        n = len(self._source)
        examples = [self._source[int(i)] for i in index if i < n]
        if self._collate_fn is not None:
            return self._collate_fn(examples)
        return collate(examples, self._max_length, len(index), self._truncation_mode)  # type: ignore[arg-type]


def make_batch_iterator(
    rows: Any,
    global_batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    drop_remainder: bool = True,
    max_length: int | None = None,
    truncation_mode: str = "keep_end",
    collate_fn: Any = None,
) -> grain.DatasetIterator:
    """Iterator over this process's share of each global batch, as int32 numpy dicts.

    ``rows`` is :class:`PackedRows` (gathered vectorised) or any random-access
    dataset of example dicts (a list, a ``datasets.Dataset``, a ``grain.MapDataset``,
    a dict of columns), which is collated to ``max_length`` with ``truncation_mode``
    (or by ``collate_fn``). Each element is ``{"input_ids", "segment_ids",
    "positions"[, "loss_mask"]}`` of shape ``[global_batch_size // process_count, L]``;
    packed rows that are each one unpadded sequence (:attr:`PackedRows.single_segment`)
    give ``input_ids`` alone (plus ``loss_mask``) unless the iterator pads, and the model
    treats missing segments as plain causal attention.
    Epoch ``e`` uses its own permutation (grain reseeds its index shuffle with
    ``seed + e``); ``num_epochs=None`` repeats forever. With ``drop_remainder=False``
    the last global batch of an epoch is filled with padding rows (``segment_ids ==
    0``, no loss), so every process always gets the same shape; use that for
    evaluation.

    ``get_state()`` is ``{"next_index": k}`` after ``k`` batches and ``set_state``
    jumps there directly. A state is only meaningful for an iterator built with the
    same rows and arguments.
    """
    import grain

    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if isinstance(rows, PackedRows):
        gather: Any = _GatherRows(rows)  # tokens-only decided below, once the padding is known
    else:
        source = as_source(rows)
        if max_length is None and collate_fn is None:
            raise ConfigError("max_length is required to collate a dataset of examples")
        gather = _GatherExamples(source, max_length or 0, truncation_mode, collate_fn)
        rows = source
    num_rows = len(rows)
    if num_rows == 0:
        raise DataError("no rows to iterate over: the dataset is empty")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ConfigError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"number of processes ({process_count})"
        )
    if num_epochs is not None and num_epochs < 1:
        raise ConfigError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be in [0, 2**32), got {seed}")
    steps = steps_per_epoch(rows, global_batch_size, drop_remainder=drop_remainder)
    if steps == 0:
        raise DataError(
            f"the dataset has {num_rows} rows, fewer than one global batch of "
            f"{global_batch_size}; lower the batch size, add data, or use drop_remainder=False"
        )
    local_batch = global_batch_size // process_count

    # Every transformation below keeps grain's epoch in its index (index = epoch *
    # len + i), so `shuffle` sees the epoch and draws a new permutation for it.
    ds = grain.MapDataset.source(range(num_rows))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    used = steps * global_batch_size
    if used < num_rows:
        ds = ds[:used]
    elif used > num_rows:  # pad the last global batch with empty rows
        padding = grain.MapDataset.source(range(num_rows, used))
        ds = grain.MapDataset.concatenate([ds, padding])
    if isinstance(gather, _GatherRows) and used <= num_rows and rows.single_segment:
        gather = _GatherRows(rows, tokens_only=True)  # every batch has the same keys
    ds = ds.batch(local_batch, drop_remainder=True)  # P consecutive chunks form one global batch
    ds = ds[process_index::process_count]
    ds = ds.repeat(num_epochs)
    ds = ds.map(gather)
    # The rows are in memory: threads would only contend for the GIL.
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(ds.to_iter_dataset(read_options=read))
