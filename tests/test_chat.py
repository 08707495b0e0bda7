"""Chat SFT data: assistant-only loss masks, truncation, packing, sharding and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import CHAT_JSONL, COUNTING_TEMPLATE, MARKED_TEMPLATE, PLAIN_TEMPLATE, smollm2_path, spans

from scaletrain.data import (
    ChatEncoder,
    build_chat_splits,
    bundled_tokenizer_path,
    encode_chat,
    load_processor,
    make_batch_iterator,
)
from scaletrain.compat.easydel.processing import extract_column_names, process_messages_data, process_sample_data
from scaletrain.errors import DataError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "5 times 4 is 20."},
]


@pytest.fixture(scope="module")
def smol():
    return load_processor(smollm2_path())


@pytest.fixture()
def bundled():
    return load_processor(bundled_tokenizer_path())


@pytest.fixture(scope="module")
def chats() -> list[list[dict]]:
    with open(CHAT_JSONL) as f:
        return [json.loads(line)["messages"] for line in f]


def _assistant_texts(messages, eot):
    return [m["content"] + eot for m in messages if m["role"] == "assistant"]


def _masked_pieces(tokenizer, out):
    return [tokenizer.decode(out["input_ids"][s:e].tolist()) for s, e in spans(out["loss_mask"])]


# --- masks ---------------------------------------------------------------------------------


def test_real_template_masks_exactly_the_assistant_turns(smol, chats):
    """SmolLM2's ChatML template has no generation markers; the mask is found by prefix rendering."""
    assert "{% generation %}" not in smol.chat_template
    for messages in [CONVERSATION, *chats[:40]]:
        out = encode_chat(smol, messages, max_length=4096)
        assert {k: v.dtype for k, v in out.items()} == {k: np.dtype(np.int32) for k in out}
        # the ids are exactly what the template + tokenizer give
        reference = smol.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert out["input_ids"].tolist() == list(reference)
        assert out["attention_mask"].tolist() == [1] * len(reference)
        # each masked run decodes to one assistant content followed by the end-of-turn token
        assert _masked_pieces(smol, out) == _assistant_texts(messages, "<|im_end|>")
        # and the rendered text around them is the template's
        rendered = smol.apply_chat_template(messages, tokenize=False)
        assert smol.decode(out["input_ids"].tolist()) == rendered


def test_default_system_prompt_and_single_turn(smol):
    """Without a system message the template inserts its own; it is never a target."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    out = encode_chat(smol, messages, max_length=512)
    assert "SmolLM" in smol.decode(out["input_ids"].tolist())
    assert _masked_pieces(smol, out) == ["Hello!<|im_end|>"]
    everything = encode_chat(smol, messages, max_length=512, assistant_only_loss=False)
    assert everything["loss_mask"].tolist() == [1] * everything["input_ids"].size


def test_generation_markers_are_used_when_present(bundled, chats):
    for messages in chats[:20]:
        ours = encode_chat(bundled, messages, 4096, chat_template=MARKED_TEMPLATE)
        ref = bundled.apply_chat_template(messages, chat_template=MARKED_TEMPLATE, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert ours["input_ids"].tolist() == list(ref["input_ids"])
        assert ours["loss_mask"].tolist() == list(ref["assistant_masks"])
        # the plain template (no markers) gives the same mask by prefix rendering
        plain = encode_chat(bundled, messages, 4096, chat_template=PLAIN_TEMPLATE)
        assert plain["loss_mask"].tolist() == ours["loss_mask"].tolist()
        assert _masked_pieces(bundled, plain) == _assistant_texts(messages, "<|endoftext|>")


def test_template_that_is_not_prefix_stable_falls_back_to_search(bundled):
    encoder = ChatEncoder(bundled, 4096, chat_template=COUNTING_TEMPLATE)
    ids, mask, fallback = encoder.encode_full(CONVERSATION)
    assert fallback
    out = {"input_ids": ids, "loss_mask": mask}
    assert _masked_pieces(bundled, out) == _assistant_texts(CONVERSATION, "<|endoftext|>")


def test_unknown_role_and_bad_messages(bundled):
    bad = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]
    with pytest.raises(DataError, match="message 1 has unknown role 'bot'"):
        encode_chat(bundled, bad, 64, chat_template=PLAIN_TEMPLATE)
    with pytest.raises(DataError, match="content of type int"):
        encode_chat(bundled, [{"role": "user", "content": 3}], 64, chat_template=PLAIN_TEMPLATE)
    with pytest.raises(DataError, match="no chat template"):
        encode_chat(bundled, CONVERSATION, 64)


# --- truncation ------------------------------------------------------------------------------


def test_truncation_modes(smol):
    full = encode_chat(smol, CONVERSATION, 4096)
    n = full["input_ids"].size
    limit = n - 12
    end = encode_chat(smol, CONVERSATION, limit, truncation_mode="keep_end")
    start = encode_chat(smol, CONVERSATION, limit, truncation_mode="keep_start")
    for out in (end, start):
        assert all(v.size == limit for v in out.values())
    assert end["input_ids"].tolist() == full["input_ids"][-limit:].tolist()
    assert end["loss_mask"].tolist() == full["loss_mask"][-limit:].tolist()
    assert start["input_ids"].tolist() == full["input_ids"][:limit].tolist()
    assert start["loss_mask"].tolist() == full["loss_mask"][:limit].tolist()
    # keep_end keeps the last answer whole; keep_start loses it
    assert _masked_pieces(smol, end)[-1] == "5 times 4 is 20.<|im_end|>"
    assert "20" not in "".join(_masked_pieces(smol, start))


def test_long_conversations_are_never_split_unless_allowed(bundled):
    long_answer = " ".join(str(i) for i in range(200))
    chats = [
        ([{"role": "user", "content": "count"}, {"role": "assistant", "content": long_answer}], "mem", 1),
        (CONVERSATION, "mem", 2),
        ([{"role": "user", "content": "only a question"}], "mem", 3),
    ]
    kw = dict(eval_fraction=0.0, chat_template=PLAIN_TEMPLATE)
    kept = build_chat_splits(chats, bundled, 128, **kw)
    assert kept.stats["truncated"] == 1 and kept.stats["split"] == 0
    assert kept.stats["samples"] == 2 and kept.stats["dropped_no_assistant_tokens"] == 1
    split = build_chat_splits(chats, bundled, 128, allow_split=True, **kw)
    assert split.stats["split"] == 1 and split.stats["samples"] > 3
    assert split.stats["tokens"] > kept.stats["tokens"]
    # keep_start cuts the answer of the first conversation but keeps a target, keep_end keeps its end
    start = build_chat_splits(chats, bundled, 128, truncation_mode="keep_start", **kw)
    assert start.stats["samples"] == 2


# --- packing, sharding, resume -----------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_splits(chats):
    tokenizer = load_processor(bundled_tokenizer_path())
    items = [(m, "chat.jsonl", i + 1) for i, m in enumerate(chats)]
    return build_chat_splits(items, tokenizer, 256, eval_fraction=0.1, seed=0, chat_template=PLAIN_TEMPLATE), tokenizer


def test_chat_packing_keeps_conversations_apart(chat_splits, chats):
    splits, tokenizer = chat_splits
    rows = splits.train
    assert rows.loss_mask is not None and rows.loss_mask.shape == rows.input_ids.shape
    assert splits.stats["conversations"] == len(chats) == splits.stats["samples"]
    assert splits.stats["train_packing_efficiency"] == pytest.approx(rows.packing_efficiency)
    assert rows.packing_efficiency > 0.85  # short conversations fill the rows
    assert rows.num_rows < splits.stats["samples"]  # fewer rows than one-per-conversation padding
    seen = []
    for ids, seg, pos, lm in zip(rows.input_ids, rows.segment_ids, rows.positions, rows.loss_mask):
        assert np.all(lm[seg == 0] == 0) and np.all(ids[seg == 0] == rows.pad_id)
        real = seg[seg > 0]
        assert np.all(np.diff(real) >= 0)  # segments are contiguous runs, numbered in order
        for s in np.unique(real):
            where = np.flatnonzero(seg == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))
            assert pos[where].tolist() == list(range(where.size))  # positions restart per conversation
            seen.append(tokenizer.decode(ids[where].tolist()))
    train_and_eval = splits.stats["train_rows"] + splits.stats["eval_rows"]
    assert train_and_eval == rows.num_rows + splits.eval.num_rows
    rendered = {tokenizer.apply_chat_template(m, tokenize=False, chat_template=PLAIN_TEMPLATE) for m in chats}
    # every segment is one whole conversation, or the end of one (keep_end truncation)
    assert all(any(r.endswith(text) for r in rendered) for text in seen)
    assert 0 < sum(text not in rendered for text in seen) <= splits.stats["truncated"]
    # the loss counts only assistant tokens after the first token of a segment
    target = (rows.segment_ids[:, 1:] == rows.segment_ids[:, :-1]) & (rows.segment_ids[:, 1:] > 0)
    assert rows.num_loss_tokens == int(np.sum(target & (rows.loss_mask[:, 1:] > 0)))


def test_chat_rows_shard_across_processes(chat_splits):
    rows = chat_splits[0].train
    single = make_batch_iterator(rows, 8, seed=5, process_index=0, process_count=1, num_epochs=1)
    shards = [make_batch_iterator(rows, 8, seed=5, process_index=p, process_count=2, num_epochs=1) for p in range(2)]
    for _ in range(3):
        whole = next(single)
        parts = [next(s) for s in shards]
        assert set(whole) == {"input_ids", "segment_ids", "positions", "loss_mask"}
        for key in whole:
            assert np.array_equal(np.concatenate([p[key] for p in parts]), whole[key])
        a, b = (set(map(bytes, p["input_ids"])) for p in parts)
        assert not a & b


def test_chat_iterator_resumes_exactly_with_loss_mask(chat_splits):
    rows = chat_splits[0].train
    it = make_batch_iterator(rows, 4, seed=1, process_index=0, process_count=1)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    resumed = make_batch_iterator(rows, 4, seed=1, process_index=0, process_count=1)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        assert set(got) == set(want)
        for key in want:
            assert np.array_equal(got[key], want[key])


# --- EasyDeL RayDistributedTrainer's processing functions ------------------------------------


def test_process_sample_and_messages_data(smol):
    left = process_sample_data(smol, "hello world", 8)
    right = process_sample_data(smol, "hello world", 8, padding_side="right")
    n = int(left["attention_mask"].sum())
    assert isinstance(left["input_ids"], np.ndarray) and left["input_ids"].shape == (8,)
    assert left["attention_mask"].tolist() == [0] * (8 - n) + [1] * n
    assert right["attention_mask"].tolist() == [1] * n + [0] * (8 - n)
    assert left["input_ids"][-n:].tolist() == right["input_ids"][:n].tolist()
    assert process_sample_data(smol, "word " * 50, 8)["input_ids"].shape == (8,)  # truncated

    ref = smol.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    size = len(ref) + 5
    msg_left = process_messages_data(smol, CONVERSATION, size)
    msg_right = process_messages_data(smol, CONVERSATION, size, padding_side="right")
    assert msg_left["input_ids"].shape == (size,)
    assert msg_left["input_ids"][5:].tolist() == list(ref) and msg_left["attention_mask"][:5].sum() == 0
    assert msg_right["input_ids"][: len(ref)].tolist() == list(ref)
    assert process_messages_data(smol, CONVERSATION, 10)["input_ids"].tolist() == list(ref[:10])


def test_extract_column_names():
    import datasets

    assert extract_column_names(datasets.Dataset.from_dict({"a": [1], "b": [2]})) == ["a", "b"]
    assert extract_column_names([{"text": "x", "id": 1}]) == ["text", "id"]
    assert extract_column_names([]) is None


def test_docs_data_examples_run(monkeypatch):
    """Every Python example in docs/data.md runs (design rule: documented examples are tested)."""
    import os
    import re

    from data_helpers import REPO

    path = smollm2_path()
    monkeypatch.setenv("SCALETRAIN_CACHE", os.path.dirname(os.path.dirname(path)))
    monkeypatch.chdir(REPO)
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "data.md").read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/data.md", "exec"), {})


def test_unpacked_chat_examples_and_workers(bundled, chats):
    """encode_chat outputs also feed the loader unpacked (collated per row), and workers change nothing."""
    examples = [encode_chat(bundled, m, 256, chat_template=PLAIN_TEMPLATE) for m in chats[:16]]
    batch = next(make_batch_iterator(examples, 8, seed=0, max_length=256, shuffle=False,
                                     process_index=0, process_count=1))
    assert batch["loss_mask"].shape == (8, 256)
    for row, ex in enumerate(examples[:8]):
        n = ex["input_ids"].size
        assert batch["loss_mask"][row, :n].tolist() == ex["loss_mask"].tolist()
        assert batch["segment_ids"][row, :n].tolist() == [1] * n and batch["segment_ids"][row, n:].sum() == 0

    items = [(m, "chat.jsonl", i + 1) for i, m in enumerate(chats[:60])]
    one = build_chat_splits(items, bundled, 256, chat_template=PLAIN_TEMPLATE, chunk_size=16)
    two = build_chat_splits(items, bundled, 256, chat_template=PLAIN_TEMPLATE, chunk_size=16, num_workers=2)
    assert one.stats == two.stats
    for key in ("input_ids", "segment_ids", "positions", "loss_mask"):
        assert np.array_equal(getattr(one.train, key), getattr(two.train, key))
