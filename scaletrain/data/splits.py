"""Offline stage of pre-training data: documents -> token pieces -> held-out split -> packed rows.

:func:`build_lm_splits` tokenizes the documents (streamed in chunks through the Rust
tokenizer, keeping only token arrays), appends eos, cuts them into pieces of
``max_length`` tokens, holds out a seeded random subset of *pieces* for evaluation (so
even a handful of long documents gives a real held-out set) and packs both splits into
fixed rows. Everything here runs once, before training; serving the rows as batches
is :mod:`scaletrain.data.loader`'s job.

The held-out rule (:func:`held_out_mask`) and :class:`LMSplits` live here because chat
SFT (:mod:`scaletrain.data.chat`) splits and returns its conversations the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from scaletrain.data.packing import PackedRows, pack_pieces
from scaletrain.data.tokenizer import pad_id_of, plain_backend
from scaletrain.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class LMSplits:
    """Packed train and eval rows plus what is needed to report bits per byte.

    Preference kinds put :class:`~scaletrain.data.table.FixedRows` in ``train`` and ``eval``
    (one pair or KTO row per row) and NaN in ``eval_bytes_per_token``.

    ``eval_bytes_per_token`` is the UTF-8 size of the text the eval targets cover
    divided by the number of eval targets (tokens whose predecessor is in the same
    segment), so ``bits_per_byte = mean_eval_loss_nats / ln(2) / eval_bytes_per_token``.
    It is NaN when there is no eval split.
    """

    train: PackedRows
    eval: PackedRows
    eval_bytes_per_token: float
    stats: dict[str, Any] = field(default_factory=dict)


def held_out_mask(n: int, eval_fraction: float, seed: int, too_few: Callable[[], str]) -> np.ndarray:
    """Which of ``n`` items (pieces, conversations) go to eval: a boolean mask drawn by ``seed``.

    ``round(eval_fraction * n)`` items are held out, at least one when ``eval_fraction > 0``
    and never all of them, so both splits are usable. One rule for pre-training and chat,
    so the same seed and fraction pick the same positions in either. Fewer than two
    items cannot be split: :class:`DataError` with the message ``too_few()`` (built only then).
    """
    n_eval = 0
    if eval_fraction > 0:
        if n < 2:
            raise DataError(too_few())
        n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    is_eval = np.zeros(n, dtype=bool)
    is_eval[np.random.default_rng(seed).choice(n, size=n_eval, replace=False)] = True
    return is_eval


def split_by_mask(items: Sequence[T], is_eval: np.ndarray) -> tuple[list[T], list[T]]:
    """``(train, eval)``: the items where ``is_eval`` is False, then those where it is True, in order."""
    train = [x for x, e in zip(items, is_eval) if not e]
    held = [x for x, e in zip(items, is_eval) if e]
    return train, held


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


def _check_lm_arguments(texts: Iterable[str], max_length: int, eval_fraction: float) -> None:
    """Fail before tokenizing anything on arguments that cannot give a split."""
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2 to have a next-token target, got {max_length}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if isinstance(texts, str):
        raise DataError("texts must be an iterable of documents, not one string")


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
    _check_lm_arguments(texts, max_length, eval_fraction)
    pad_id = pad_id_of(tokenizer)
    if getattr(tokenizer, "eos_token_id", None) is None:
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
        is_eval = held_out_mask(n, eval_fraction, seed, lambda: (
            f"{name} has only {sum(p.size for p in main.pieces)} tokens, one piece of max_length="
            f"{max_length}: too small to hold out an eval split; add text, lower max_length "
            "or set eval_fraction=0"
        ))
        train_pieces, eval_pieces = split_by_mask(main.pieces, is_eval)
        eval_piece_bytes = split_by_mask(main.target_bytes, is_eval)[1]

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
