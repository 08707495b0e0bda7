"""Data sources: every format gives the same rows, streams, and names the file/row/column on bad data."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from data_helpers import PLAIN_TEMPLATE

from scaletrain.data import (
    BadRows,
    build_datasets,
    build_lm_splits,
    bundled_tokenizer_path,
    iter_source,
    iter_texts,
    load_processor,
)
from scaletrain.data import splits as splits_module
from scaletrain.data.config import DataSection
from scaletrain.errors import ConfigError, DataError
from scaletrain.recipe import Recipe

TEXTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be: that is the question.",
    "MACBETH:\nIs this a dagger which I see before me?",
    "PUCK:\nLord, what fools these mortals be!",
    "PROSPERO:\nWe are such stuff as dreams are made on.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_processor(bundled_tokenizer_path())


def _texts(source, column="text", **kw):
    return [r.value for r in iter_source(source, column, **kw)]


def _write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _write_parquet(path, columns, row_group_size=2):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


# --- every format, same documents ---------------------------------------------------------------


def test_text_files_per_file_and_per_line(tmp_path):
    for i, t in enumerate(TEXTS[:3]):
        (tmp_path / f"doc{i}.txt").write_text(t)
    (tmp_path / "blank.txt").write_text("  \n")
    assert [t for t in _texts(str(tmp_path / "*.txt")) if t.strip()] == TEXTS[:3]
    lines = tmp_path / "lines.txt"
    lines.write_text("first line\n\n  \nsecond line\r\nthird\n")
    rows = list(iter_source(str(lines), "text", per_line=True))
    assert [(r.value, r.row) for r in rows] == [("first line", 1), ("second line", 4), ("third", 5)]


def test_all_formats_give_identical_rows(tmp_path, tokenizer):
    import datasets

    rows = [{"id": i, "text": t} for i, t in enumerate(TEXTS)]
    sources = {
        "jsonl": _write_jsonl(tmp_path / "d.jsonl", rows),
        "jsonl.gz": _write_jsonl(tmp_path / "d.jsonl.gz", rows, gz=True),
        "parquet": _write_parquet(tmp_path / "d.parquet", {"id": list(range(6)), "text": TEXTS}),
        "hf_dataset": datasets.Dataset.from_list(rows),
        "hf_iterable": datasets.Dataset.from_list(rows).to_iterable_dataset(),
        "python": (r for r in rows),
    }
    import pyarrow as pa
    import pyarrow.csv as pc

    pc.write_csv(pa.table({"id": list(range(6)), "text": TEXTS}), tmp_path / "d.csv")
    sources["csv"] = str(tmp_path / "d.csv")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    sources["hf_disk"] = str(tmp_path / "disk")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    sources["hf_disk_dict"] = str(tmp_path / "dict")
    for t in TEXTS:
        (tmp_path / f"{TEXTS.index(t)}.txt").write_text(t)
    sources["text_glob"] = str(tmp_path / "*.txt")

    reference = build_lm_splits(TEXTS, tokenizer, 32, eval_fraction=0.2, seed=0)
    for name, source in sources.items():
        got = [r.value for r in iter_source(source, "text", batch_size=2)]
        assert got == TEXTS, name
        again = source if not name == "python" else (r for r in rows)
        splits = build_lm_splits(iter_texts(iter_source(again, "text"), BadRows()), tokenizer, 32,
                                 eval_fraction=0.2, seed=0)
        assert np.array_equal(splits.train.input_ids, reference.train.input_ids), name
        assert np.array_equal(splits.eval.input_ids, reference.eval.input_ids), name
    # row numbers point at lines / rows
    assert [r.row for r in iter_source(sources["parquet"], "text", batch_size=4)] == [1, 2, 3, 4, 5, 6]


def test_csv_with_quoted_newlines_and_tsv(tmp_path):
    (tmp_path / "q.csv").write_text('text,n\n"line one\nline two",1\nplain,2\n')
    assert _texts(str(tmp_path / "q.csv")) == ["line one\nline two", "plain"]
    (tmp_path / "t.tsv").write_text("n\ttext\n1\ttab separated\n")
    assert _texts(str(tmp_path / "t.tsv")) == ["tab separated"]


def test_large_input_streams_in_chunks(monkeypatch, tokenizer):
    """The corpus is pulled chunk by chunk while tokenizing, never read up front."""
    pulled = 0

    def documents():
        nonlocal pulled
        for i in range(1000):
            pulled += 1
            yield f"document number {i} " * 3

    seen_at_call: list[int] = []
    original = splits_module.TextEncoder.__call__

    def spy(self, texts):
        seen_at_call.append(pulled)
        return original(self, texts)

    monkeypatch.setattr(splits_module.TextEncoder, "__call__", spy)
    splits = build_lm_splits(documents(), tokenizer, 64, eval_fraction=0.0, chunk_size=100)
    assert splits.stats["documents"] == 1000
    assert seen_at_call == [100 * (i + 1) for i in range(10)]  # chunk k is encoded after 100k pulls


def test_workers_give_the_same_rows(tokenizer):
    texts = [f"{t} {i}" for i in range(40) for t in TEXTS]
    one = build_lm_splits(texts, tokenizer, 64, eval_fraction=0.1, seed=0, chunk_size=50)
    two = build_lm_splits(texts, tokenizer, 64, eval_fraction=0.1, seed=0, chunk_size=50, num_workers=2)
    assert np.array_equal(one.train.input_ids, two.train.input_ids)
    assert one.stats == two.stats and one.eval_bytes_per_token == two.eval_bytes_per_token


# --- bad data -------------------------------------------------------------------------------------


def test_missing_file_and_column_name_the_path(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        _texts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no files match"):
        _texts(str(tmp_path / "*.jsonl"))
    path = _write_jsonl(tmp_path / "d.jsonl", [{"body": "x", "id": 1}])
    with pytest.raises(DataError, match=r"d\.jsonl \(line 1\): no column 'text'; the columns present are \['body', 'id'\]"):
        _texts(path)
    pq = _write_parquet(tmp_path / "d.parquet", {"body": ["x"]})
    with pytest.raises(DataError, match=r"d\.parquet: no column 'text'; the columns present are \['body'\]"):
        _texts(pq)
    (tmp_path / "d.csv").write_text("body\nx\n")
    with pytest.raises(DataError, match=r"d\.csv: no column 'text'.*\['body'\]"):
        _texts(str(tmp_path / "d.csv"))
    (tmp_path / "d.unknown").write_text("x")
    with pytest.raises(DataError, match="cannot tell the format of .*d.unknown"):
        _texts(str(tmp_path / "d.unknown"))


def test_wrong_type_rows_name_file_and_row_or_are_skipped(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"text": 42}, "{not json", {"text": "also fine"}])
    with pytest.raises(DataError, match=r"d\.jsonl: row 2: expected text, got int 42"):
        list(iter_texts(iter_source(path, "text"), BadRows()))
    bad = BadRows(skip=True)
    assert list(iter_texts(iter_source(path, "text"), bad)) == ["fine", "also fine"]
    assert bad.count == 2 and "row 3: not valid JSON" in bad.examples[1]

    pq = _write_parquet(tmp_path / "d.parquet", {"text": ["a", None, "b"]})
    with pytest.raises(DataError, match=r"d\.parquet: row 2: expected text, got NoneType"):
        list(iter_texts(iter_source(pq, "text"), BadRows()))

    data = DataSection(source=path, eval_fraction=0.0, skip_bad_rows=True)
    splits = build_datasets(data, tokenizer, max_length=16)
    assert splits.stats["bad_rows_skipped"] == 2 and splits.stats["documents"] == 2


def test_empty_dataset(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"data.source '.*empty\.jsonl' is empty"):
        build_datasets(DataSection(source=str(empty)), tokenizer, max_length=16)
    chat = DataSection(source=str(empty), kind="chat", chat_template=PLAIN_TEMPLATE)
    with pytest.raises(DataError, match="is empty: no conversations"):
        build_datasets(chat, tokenizer, max_length=16)


def test_chat_bad_rows_name_row_and_role(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [good, good, {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
            {"messages": "not a list"}, good]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    data = DataSection(source=path, kind="chat", chat_template=PLAIN_TEMPLATE, eval_fraction=0.0)
    with pytest.raises(DataError, match=r"chat\.jsonl: row 3: message 1 has unknown role 'bot'; known roles"):
        build_datasets(data, tokenizer, max_length=64)
    skipping = data.model_copy(update={"skip_bad_rows": True})
    splits = build_datasets(skipping, tokenizer, max_length=64)
    assert splits.stats["bad_rows_skipped"] == 2 and splits.stats["conversations"] == 3
    assert splits.train.loss_mask is not None
    text = DataSection(source=str(tmp_path / "x.txt"), kind="chat")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="chat data needs a 'messages' column"):
        build_datasets(text, tokenizer, max_length=64)


def test_chat_from_parquet_and_csv(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.csv as pc

    conversations = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(6)]
    _write_parquet(tmp_path / "c.parquet", {"messages": conversations})
    pc.write_csv(pa.table({"messages": [json.dumps(c) for c in conversations]}), tmp_path / "c.csv")
    results = []
    for name in ("c.parquet", "c.csv"):
        data = DataSection(source=str(tmp_path / name), kind="chat", chat_template=PLAIN_TEMPLATE, eval_fraction=0.0)
        results.append(build_datasets(data, tokenizer, max_length=64))
    assert np.array_equal(results[0].train.input_ids, results[1].train.input_ids)
    assert np.array_equal(results[0].train.loss_mask, results[1].train.loss_mask)


def test_eval_source_and_max_documents(tmp_path, tokenizer):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in TEXTS])
    held = _write_jsonl(tmp_path / "eval.jsonl", [{"text": "A held out line of verse."}])
    splits = build_datasets(DataSection(source=train, eval_source=held, max_documents=4), tokenizer, max_length=32)
    assert splits.stats["documents"] == 4
    assert splits.eval.num_rows == 1 and splits.eval_bytes_per_token > 0
    decoded = tokenizer.decode(splits.eval.input_ids[0][splits.eval.segment_ids[0] > 0].tolist())
    assert decoded.startswith("A held out line of verse.")


def test_data_section_rejects_unknown_and_bad_keys():
    with pytest.raises(ConfigError, match="data.sourse: unknown key"):
        Recipe.from_dict({"data": {"sourse": "x"}})
    with pytest.raises(ConfigError, match="data.kind"):
        Recipe.from_dict({"data": {"kind": "instruct"}})
    with pytest.raises(ConfigError, match="data.format"):
        Recipe.from_dict({"data": {"format": "xml"}})
    recipe = Recipe.from_dict({"data": {"kind": "chat", "source": "x.jsonl", "allow_split": True}})
    assert recipe.data.kind == "chat" and recipe.data.allow_split
