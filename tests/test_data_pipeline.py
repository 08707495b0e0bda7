"""Tests for scaletrain.data: bundled assets, packing, splits and the grain batch iterator."""

from __future__ import annotations

import json
import logging
import shutil
import time

import numpy as np
import pytest

from scaletrain.data import (
    PackedRows,
    build_lm_splits,
    bundled_tokenizer_path,
    first_fit,
    load_bundled_corpus,
    load_processor,
    make_batch_iterator,
    pack_documents,
    read_text_files,
    split_into_pieces,
    steps_per_epoch,
)
from scaletrain.errors import DataError, ScaletrainError


@pytest.fixture(scope="module")
def tokenizer():
    return load_processor(bundled_tokenizer_path())


@pytest.fixture(scope="module")
def plays() -> list[str]:
    return load_bundled_corpus()


def _segments(rows: PackedRows) -> list[np.ndarray]:
    """Every packed piece, read back from the rows through segment ids."""
    out = []
    for ids, seg in zip(rows.input_ids, rows.segment_ids):
        for s in range(1, int(seg.max()) + 1):
            out.append(ids[seg == s])
    return out


def _row_ids(n: int, max_length: int = 4) -> PackedRows:
    """Synthetic rows whose first token is the row number, to identify rows in batches."""
    ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], max_length, axis=1)
    seg = np.ones_like(ids)
    pos = np.broadcast_to(np.arange(max_length, dtype=np.int32), ids.shape).copy()
    return PackedRows(ids, seg, pos, pad_id=-1)


# --- bundled assets -------------------------------------------------------------------


def test_bundled_corpus_is_clean_plain_text(plays):
    assert len(plays) == 38
    assert sum(len(p) for p in plays) > 4_000_000
    hamlet = next(p for p in plays if p.startswith("Hamlet\n"))
    assert "HAMLET:\nTo be, or not to be: that is the question:" in hamlet
    for text in plays:
        assert "**" not in text and "_" not in text and "\\" not in text and "#" not in text
    with pytest.raises(DataError, match="no-such-corpus"):
        load_bundled_corpus("no-such-corpus")


def test_bundled_tokenizer_loads_offline_and_round_trips(tokenizer):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(bundled_tokenizer_path(), local_files_only=True)
    assert auto.is_fast and len(auto) == 4096
    assert auto.eos_token == "<|endoftext|>" and auto.pad_token == "<|pad|>"
    assert auto.eos_token_id != auto.pad_token_id
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?\n  naïve café — 東京 🎭\n"
    ids = auto(text, add_special_tokens=False)["input_ids"]
    assert auto.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # BPE merges actually compress
    assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_load_processor_errors_and_pad_fallback(tmp_path, caplog):
    with pytest.raises(DataError, match="nowhere"):
        load_processor(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty"):
        load_processor(str(tmp_path / "empty"))

    no_pad = tmp_path / "no_pad"
    shutil.copytree(bundled_tokenizer_path(), no_pad)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((no_pad / name).read_text())
        cfg.pop("pad_token")
        (no_pad / name).write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        tok = load_processor(str(no_pad))
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert "no pad token" in caplog.text


def test_read_text_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second file\nline two\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "sub" / "c.txt").write_text("\n  \nnested\n")
    (tmp_path / "blank.txt").write_text("   \n")
    assert read_text_files(str(tmp_path / "*.txt")) == ["first file\n", "second file\nline two\n"]
    assert read_text_files(str(tmp_path / "**" / "*.txt"), per_line=True) == [
        "first file", "second file", "line two", "nested",
    ]
    with pytest.raises(DataError, match="missing"):
        read_text_files(str(tmp_path / "missing" / "*.txt"))
    with pytest.raises(DataError, match="blank.txt"):
        read_text_files(str(tmp_path / "blank.txt"))
    assert issubclass(DataError, ScaletrainError)


# --- packing --------------------------------------------------------------------------


def test_pack_documents_keeps_every_token_once_in_order():
    rng = np.random.default_rng(0)
    max_length = 16
    lengths = [int(n) for n in rng.integers(1, 50, size=60)] + [16, 32, 15]
    # Token values encode (document, index), so any loss, duplicate or reorder shows.
    docs = [np.arange(n, dtype=np.int32) + 1000 * (d + 1) for d, n in enumerate(lengths)]
    rows = pack_documents(docs, max_length, eos_id=None)

    assert rows.input_ids.shape == rows.segment_ids.shape == rows.positions.shape
    assert rows.input_ids.shape[1] == max_length
    assert {a.dtype for a in (rows.input_ids, rows.segment_ids, rows.positions)} == {np.dtype(np.int32)}
    for seg, pos in zip(rows.segment_ids, rows.positions):
        k = int(seg.max())
        used = seg > 0
        assert used.any()
        # Segments 1..k are contiguous runs in order, padding only at the end.
        expected = np.concatenate([np.full(np.sum(seg == s), s) for s in range(1, k + 1)])
        assert np.array_equal(seg[used], expected) and not used[used.sum():].any()
        for s in range(1, k + 1):
            assert np.array_equal(pos[seg == s], np.arange(np.sum(seg == s)))
        assert not pos[~used].any()

    pieces = _segments(rows)
    assert all(1 <= p.size <= max_length for p in pieces)
    assert all(np.all(np.diff(p) == 1) for p in pieces)  # consecutive tokens of one document
    flat = np.sort(np.concatenate(pieces))
    assert np.array_equal(flat, np.sort(np.concatenate(docs)))  # each token exactly once
    assert rows.num_tokens == sum(lengths)
    assert rows.packing_efficiency == pytest.approx(sum(lengths) / rows.input_ids.size)
    assert rows.packing_efficiency > 0.9


def test_pack_documents_appends_eos_and_is_first_fit():
    docs = [np.array([1, 2, 3, 4, 5]), np.array([10, 11, 12]), np.array([20]), np.array([], dtype=np.int32)]
    rows = pack_documents(docs, 4, eos_id=99, pad_id=7)
    # pieces: [1 2 3 4] [5 99] [10 11 12 99] [20 99] [99]; [20 99] fits next to [5 99].
    assert rows.input_ids.tolist() == [[1, 2, 3, 4], [5, 99, 20, 99], [10, 11, 12, 99], [99, 7, 7, 7]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]
    assert rows.num_segments == 5 and rows.packing_efficiency == 13 / 16
    pieces = split_into_pieces(docs, 4, eos_id=99)
    assert np.array_equal(np.concatenate(pieces), [1, 2, 3, 4, 5, 99, 10, 11, 12, 99, 20, 99, 99])
    assert first_fit([3, 3, 1, 2, 1, 4], 4).tolist() == [0, 1, 0, 2, 1, 3]
    empty = pack_documents([], 8, eos_id=None)
    assert empty.input_ids.shape == (0, 8) and empty.packing_efficiency == 0.0


# --- splits ---------------------------------------------------------------------------


def test_build_lm_splits_is_deterministic_and_disjoint(tokenizer, plays):
    texts = plays[:3]
    a = build_lm_splits(texts, tokenizer, max_length=128, eval_fraction=0.1, seed=0)
    b = build_lm_splits(texts, tokenizer, max_length=128, eval_fraction=0.1, seed=0)
    c = build_lm_splits(texts, tokenizer, max_length=128, eval_fraction=0.1, seed=1)
    for x, y in ((a.train, b.train), (a.eval, b.eval)):
        for key in ("input_ids", "segment_ids", "positions"):
            assert np.array_equal(getattr(x, key), getattr(y, key))
    assert a.stats == b.stats and a.eval_bytes_per_token == b.eval_bytes_per_token
    assert not np.array_equal(a.eval.input_ids, c.eval.input_ids)

    eos = tokenizer.eos_token_id
    s = a.stats
    assert s["documents"] == 3 and s["train_tokens"] + s["eval_tokens"] == s["tokens"]
    assert s["eval_rows"] >= 1 and s["eval_tokens"] == pytest.approx(0.1 * s["tokens"], rel=0.2)
    train_pieces = {p.tobytes() for p in _segments(a.train)}
    eval_pieces = [p.tobytes() for p in _segments(a.eval)]
    assert not train_pieces.intersection(eval_pieces)
    assert int(np.sum(a.train.input_ids[a.train.segment_ids > 0] == eos)) + int(
        np.sum(a.eval.input_ids[a.eval.segment_ids > 0] == eos)) == 3
    all_ids = np.concatenate([tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts])
    assert s["tokens"] == all_ids.size


def test_eval_bytes_per_token_matches_decoded_targets(tokenizer, plays):
    splits = build_lm_splits(plays[3:5], tokenizer, max_length=256, eval_fraction=0.2, seed=3)
    eos = tokenizer.eos_token_id
    total_bytes = total_targets = 0
    for piece in _segments(splits.eval):
        total_targets += piece.size - 1
        targets = [t for t in piece[1:].tolist() if t != eos]
        total_bytes += len(tokenizer.decode(targets).encode("utf-8"))
    assert splits.stats["eval_target_tokens"] == total_targets
    # Exact up to multi-byte characters cut at a piece boundary.
    assert splits.stats["eval_bytes"] == pytest.approx(total_bytes, abs=8)
    assert splits.eval_bytes_per_token == pytest.approx(total_bytes / total_targets, rel=1e-3)
    assert 2.0 < splits.eval_bytes_per_token < 5.0


def test_tiny_and_empty_corpora(tokenizer):
    for texts in ([], ["", "   \n"]):
        with pytest.raises(DataError, match="empty"):
            build_lm_splits(texts, tokenizer, max_length=64)
    with pytest.raises(DataError, match="eval_fraction=0"):
        build_lm_splits(["a few words"], tokenizer, max_length=64)
    only_train = build_lm_splits(["a few words"], tokenizer, max_length=64, eval_fraction=0.0)
    assert only_train.train.num_rows == 1 and only_train.eval.num_rows == 0
    assert np.isnan(only_train.eval_bytes_per_token)
    with pytest.raises(DataError, match="empty"):
        make_batch_iterator(only_train.eval, 1, seed=0, process_index=0, process_count=1)
    with pytest.raises(DataError, match="fewer than one global batch"):
        make_batch_iterator(only_train.train, 2, seed=0, process_index=0, process_count=1)


# --- batch iterator -------------------------------------------------------------------


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_iterator_shapes_and_dtypes(tokenizer, plays):
    splits = build_lm_splits(plays[:1], tokenizer, max_length=64, eval_fraction=0.05)
    it = make_batch_iterator(splits.train, 8, seed=0)  # process index/count from jax
    batch = next(it)
    assert set(batch) == {"input_ids", "segment_ids", "positions"}
    for value in batch.values():
        assert isinstance(value, np.ndarray) and value.shape == (8, 64) and value.dtype == np.int32
    it4 = make_batch_iterator(splits.train, 8, seed=0, process_index=1, process_count=4)
    assert next(it4)["input_ids"].shape == (2, 64)
    assert steps_per_epoch(splits.train, 8) == splits.train.num_rows // 8
    assert steps_per_epoch(splits.train, 8, drop_remainder=False) == -(-splits.train.num_rows // 8)


def test_processes_get_disjoint_shards_of_each_global_batch():
    rows = _row_ids(103)
    g, steps = 8, 103 // 8
    single = _take(make_batch_iterator(rows, g, seed=5, num_epochs=1, process_index=0, process_count=1), steps)
    shards = [
        list(make_batch_iterator(rows, g, seed=5, num_epochs=1, process_index=p, process_count=2))
        for p in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == steps
    seen: list[int] = []
    for step in range(steps):
        a, b = (shards[p][step]["input_ids"][:, 0] for p in range(2))
        assert a.shape == b.shape == (4,) and not set(a) & set(b)
        assert np.array_equal(np.concatenate([a, b]), single[step]["input_ids"][:, 0])
        seen.extend(a.tolist() + b.tolist())
    assert len(seen) == len(set(seen)) == steps * g  # one epoch, no row twice, remainder dropped


def test_each_epoch_is_reshuffled_and_covers_all_rows():
    rows = _row_ids(32)
    it = make_batch_iterator(rows, 8, seed=0, num_epochs=3, process_index=0, process_count=1)
    batches = [b["input_ids"][:, 0] for b in it]
    assert len(batches) == 12
    epochs = [np.concatenate(batches[4 * e : 4 * e + 4]) for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(32))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], np.arange(32))  # actually shuffled
    # Same seed, same order; another seed, another order; shuffle=False keeps row order.
    again = [b["input_ids"][:, 0] for b in make_batch_iterator(rows, 8, seed=0, num_epochs=1, process_index=0, process_count=1)]
    assert np.array_equal(np.concatenate(again), epochs[0])
    other = make_batch_iterator(rows, 8, seed=1, num_epochs=1, process_index=0, process_count=1)
    assert not np.array_equal(np.concatenate([b["input_ids"][:, 0] for b in other]), epochs[0])
    plain = make_batch_iterator(rows, 8, seed=0, shuffle=False, num_epochs=2, process_index=0, process_count=1)
    assert np.array_equal(np.concatenate([b["input_ids"][:, 0] for b in plain]), np.tile(np.arange(32), 2))


def test_keep_remainder_pads_the_last_batch():
    rows = _row_ids(10)
    shards = [
        list(make_batch_iterator(rows, 4, seed=0, num_epochs=1, drop_remainder=False, process_index=p, process_count=2))
        for p in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == 3
    real = []
    for shard in shards:
        for batch in shard:
            assert batch["input_ids"].shape == (2, 4)
            keep = batch["segment_ids"][:, 0] > 0
            real.extend(batch["input_ids"][keep, 0].tolist())
            assert (batch["input_ids"][~keep] == -1).all() and not batch["positions"][~keep].any()
    assert sorted(real) == list(range(10))


def test_state_restore_is_exact_and_does_not_replay(tokenizer, plays):
    splits = build_lm_splits(plays[:1], tokenizer, max_length=64, eval_fraction=0.05)
    rows = splits.train
    kwargs = dict(seed=7, process_index=1, process_count=2)
    spe = steps_per_epoch(rows, 16)
    for k in (0, 3, spe - 1, spe + 2):  # including across an epoch boundary
        it = make_batch_iterator(rows, 16, **kwargs)
        _take(it, k)
        state = it.get_state()
        assert state == {"next_index": k}
        expected = _take(it, 4)
        restored = make_batch_iterator(rows, 16, **kwargs)
        restored.set_state(json.loads(json.dumps(state)))  # survives a JSON round trip
        for want, got in zip(expected, _take(restored, 4)):
            for key in want:
                assert np.array_equal(want[key], got[key])

    # O(1): jumping a billion steps ahead is immediate and equals the index arithmetic.
    far = make_batch_iterator(rows, 16, **kwargs)
    start = time.perf_counter()
    far.set_state({"next_index": 10**9})
    batch = next(far)
    assert time.perf_counter() - start < 1.0
    assert far.get_state() == {"next_index": 10**9 + 1}
    assert batch["input_ids"].shape == (8, 64)


def test_iterator_rejects_bad_arguments():
    from scaletrain.errors import ConfigError

    rows = _row_ids(16)
    with pytest.raises(ConfigError, match="multiple"):
        make_batch_iterator(rows, 6, seed=0, process_index=0, process_count=4)
    with pytest.raises(ConfigError, match="process_index"):
        make_batch_iterator(rows, 8, seed=0, process_index=2, process_count=2)
    with pytest.raises(ConfigError, match="num_epochs"):
        make_batch_iterator(rows, 8, seed=0, num_epochs=0, process_index=0, process_count=1)


def test_single_segment_rows_give_token_only_batches():
    """Rows that are each one unpadded sequence need no segment ids or positions: the model
    then runs plain causal attention. Any packing, padding, or a padded last batch keeps them."""
    rows = _row_ids(12)
    assert rows.single_segment
    batch = next(make_batch_iterator(rows, 4, seed=0, process_index=0, process_count=1))
    assert set(batch) == {"input_ids"}
    padded = next(make_batch_iterator(rows, 5, seed=0, drop_remainder=False, num_epochs=1,
                                      process_index=0, process_count=1))
    assert set(padded) == {"input_ids", "segment_ids", "positions"}  # the iterator pads its last batch

    two_docs = PackedRows(rows.input_ids, np.where(np.arange(4) < 2, 1, 2) * np.ones_like(rows.segment_ids),
                          np.tile(np.asarray([0, 1, 0, 1], np.int32), (12, 1)))
    with_padding = PackedRows(rows.input_ids, np.where(np.arange(4) < 3, 1, 0) * np.ones_like(rows.segment_ids),
                              rows.positions)
    shifted = PackedRows(rows.input_ids, rows.segment_ids, rows.positions + 1)
    for other in (two_docs, with_padding, shifted):
        assert not other.single_segment
        assert "segment_ids" in next(make_batch_iterator(other, 4, seed=0, process_index=0, process_count=1))
