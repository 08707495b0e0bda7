"""Preference data kinds: the same token ids and masks as TRL 1.16's own preparation, bad rows named by
row, every source format, and the batches the loader and the Trainer serve (keys, shapes, sharding)."""

import json

import numpy as np
import pytest
from data_helpers import PLAIN_TEMPLATE, smollm2_path

from scaletrain.data import build_datasets, bundled_tokenizer_path, load_processor, make_batch_iterator
from scaletrain.data.config import DataSection
from scaletrain.data.preference import PAIR_KEYS, UNPAIRED_KEYS, Encoded, PreferenceEncoder, unpaired_rows
from scaletrain.errors import ConfigError, DataError

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}

TEXT_PAIRS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
    {"prompt": "2+2=", "chosen": "4", "rejected": "5"},  # no space: prompt and completion tokens may merge
    {"prompt": "Hello", "chosen": "world", "rejected": " there, friend"},
    {"prompt": "Say yes.", "chosen": " Yes.<|im_end|>", "rejected": " No."},  # already ends with eos
    {"prompt": "List three colours of the rainbow, separated by commas, in order:",
     "chosen": " red, orange, yellow, green, blue, indigo and violet are all of them.", "rejected": " black."},
]
CHAT_PAIRS = [
    {"prompt": [SYSTEM, {"role": "user", "content": "What is 3 times 4?"}],
     "chosen": [{"role": "assistant", "content": "It is 12."}],
     "rejected": [{"role": "assistant", "content": "It is 7."}]},
    {"prompt": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Another one, in one word."}],
     "chosen": [{"role": "assistant", "content": "Banana."}],
     "rejected": [{"role": "assistant", "content": "I like to eat many different things every single day."}]},
    {"prompt": [{"role": "user", "content": "Spell cat backwards."}],
     "chosen": [{"role": "assistant", "content": "tac"}], "rejected": [{"role": "assistant", "content": "act"}]},
]
KTO_ROWS = [
    {"prompt": "The sky is", "completion": " blue.", "label": True},
    {"prompt": "2+2=", "completion": "5", "label": False},
    {"prompt": "Water boils at", "completion": " 100 degrees Celsius at sea level.", "label": True},
    {"prompt": "x", "completion": "y", "label": False},  # merges across the boundary
]


@pytest.fixture(scope="module")
def smol():
    return load_processor(smollm2_path())


@pytest.fixture(scope="module")
def bundled():
    """The bundled GPT-2-style tokenizer (no special tokens of its own) with a plain chat template set."""
    tokenizer = load_processor(bundled_tokenizer_path())
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def policies(smol):
    """A tiny random policy and reference for TRL's trainers (their data preparation is all we read)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(smol), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)


def _sequences(ids, attention, completion):
    """Per row: (real token ids, completion mask over them) of a right-padded [N, T] batch."""
    out = []
    for i in range(len(ids)):
        real = np.asarray(attention[i]) != 0
        out.append((np.asarray(ids[i])[real].tolist(), np.asarray(completion[i])[real].tolist()))
    return out


def _trl_dpo(policies, tokenizer, rows, tmp_path, max_length, mode="keep_start"):
    """TRL 1.16's DPOTrainer preparation and collation of ``rows``: ``[(chosen, rejected), ...]`` of kept rows."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=max_length, truncation_mode=mode, report_to=[],
                     use_cpu=True, per_device_train_batch_size=len(rows))
    trainer = DPOTrainer(model=policies[0], ref_model=policies[1], args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(rows))
    ds = trainer.train_dataset
    batch = trainer.data_collator([ds[i] for i in range(len(ds))])
    seqs = _sequences(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return list(zip(seqs[: len(ds)], seqs[len(ds):]))


def _trl_kto(policies, tokenizer, rows, tmp_path, max_length):
    """TRL 1.16's KTOTrainer preparation (KL rows rotated within one batch of all rows): per kept row
    ``(sequence, kl_sequence, label)``."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp_path / "trl"), max_length=max_length, report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(rows))
    trainer = KTOTrainer(model=policies[0], ref_model=policies[1], args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(rows))
    ds = trainer.train_dataset
    batch = trainer.data_collator([ds[i] for i in range(len(ds))])
    main = _sequences(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    kl = _sequences(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    return list(zip(main, kl, batch["label"].tolist()))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ours(tokenizer, source, max_length, mode="keep_start", kind="preference", **data):
    data = {"eval_fraction": 0.0, **data}
    return build_datasets(DataSection(source=source, kind=kind, **data), tokenizer, max_length=max_length,
                          truncation_mode=mode)


def _our_pairs(rows):
    c = rows.columns
    chosen = _sequences(c["chosen_input_ids"], c["chosen_segment_ids"], c["chosen_loss_mask"])
    rejected = _sequences(c["rejected_input_ids"], c["rejected_segment_ids"], c["rejected_loss_mask"])
    return list(zip(chosen, rejected))


IMPLICIT_TEXT = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in TEXT_PAIRS]
IMPLICIT_CHAT = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CHAT_PAIRS]
BUNDLED_TEXT = [{**r, "chosen": r["chosen"].replace("<|im_end|>", "<|endoftext|>")} for r in TEXT_PAIRS]


@pytest.mark.parametrize("tokenizer,rows,max_length,mode", [
    ("smol", TEXT_PAIRS, 64, "keep_start"),
    ("smol", CHAT_PAIRS, 128, "keep_start"),
    ("smol", IMPLICIT_TEXT, 64, "keep_start"),  # the prompt is the shared start of chosen and rejected
    ("smol", IMPLICIT_CHAT, 128, "keep_start"),  # ... their shared messages
    ("smol", TEXT_PAIRS, 16, "keep_start"),  # the long rows are cut to their start
    ("smol", TEXT_PAIRS, 12, "keep_end"),  # ... or to their end
    ("smol", CHAT_PAIRS, 48, "keep_end"),
    # a second tokenizer: byte-level BPE, eos <|endoftext|>, a chat template without role tokens
    ("bundled", BUNDLED_TEXT, 64, "keep_start"),
    ("bundled", CHAT_PAIRS, 128, "keep_start"),
], ids=["text", "chat", "implicit-text", "implicit-chat", "text-keep-start", "text-keep-end", "chat-keep-end",
        "bundled-text", "bundled-chat"])
def test_pairs_match_trl_dpo_preparation(request, policies, tmp_path, tokenizer, rows, max_length, mode):
    tokenizer = request.getfixturevalue(tokenizer)
    theirs = _trl_dpo(policies, tokenizer, rows, tmp_path, max_length, mode)
    ours = _ours(tokenizer, _write_jsonl(tmp_path / "pairs.jsonl", rows), max_length, mode)
    assert _our_pairs(ours.train) == theirs
    assert ours.stats["pairs"] == len(theirs) == len(rows)
    assert all(v.shape == (len(rows), max_length) for v in ours.train.columns.values())
    assert set(ours.train.keys()) == set(PAIR_KEYS)
    assert (ours.stats["train_truncated"] > 0) == (max_length < 64)


def _trl_orpo(policies, tokenizer, rows, tmp_path, max_length, trainer="orpo"):
    """TRL 1.16's ORPOTrainer (or CPOTrainer) prepared rows: ``[(chosen, rejected), ...]``, each
    ``(ids, completion mask)`` with the completion mask read from its labels."""
    from datasets import Dataset

    if trainer == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    args = Config(output_dir=str(tmp_path / "trl"), max_length=max_length, report_to=[], use_cpu=True,
                  per_device_train_batch_size=len(rows))
    ds = Trainer(model=policies[0], args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(rows)
                 ).train_dataset
    return [tuple((ex[f"{side}_input_ids"], [int(x != -100) for x in ex[f"{side}_labels"]])
                  for side in ("chosen", "rejected")) for ex in ds]


@pytest.mark.parametrize("rows,max_length,trainer", [
    (TEXT_PAIRS, 64, "orpo"), (CHAT_PAIRS, 128, "orpo"), (IMPLICIT_TEXT, 64, "orpo"), (IMPLICIT_CHAT, 128, "orpo"),
    (TEXT_PAIRS, 16, "orpo"), (TEXT_PAIRS, 64, "cpo"),
], ids=["text", "chat", "implicit-text", "implicit-chat", "text-cut", "cpo-text"])
def test_trl_orpo_preparation_matches_orpo_and_cpo_trainers(smol, policies, tmp_path, rows, max_length, trainer):
    """``data.preparation: trl_orpo``: TRL 1.16's ORPO/CPO trainers' older tokenization (bos before the prompt,
    the completion's end cut), which gives other ids than DPOTrainer's for SmolLM2 (its bos is <|im_start|>)."""
    theirs = _trl_orpo(policies, smol, rows, tmp_path, max_length, trainer)
    source = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    ours = _ours(smol, source, max_length, preparation="trl_orpo").train
    assert _our_pairs(ours) == theirs
    assert _our_pairs(ours) != _our_pairs(_ours(smol, source, max_length).train)
    assert set(ours.keys()) == set(PAIR_KEYS)


def test_trl_orpo_preparation_is_refused_for_kto_rows(smol, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.preparation: trl_orpo is for kind: preference"):
        _ours(smol, _write_jsonl(tmp_path / "kto.jsonl", KTO_ROWS), 64, kind="unpaired_preference",
              preparation="trl_orpo")


def test_prompt_filling_max_length_is_a_bad_row_trl_drops(smol, policies, tmp_path):
    """keep_start: TRL drops a row whose prompt alone fills max_length; we name it, or skip and count it."""
    rows = [*TEXT_PAIRS[:2], {"prompt": "one two three four five six seven eight nine ten eleven twelve",
                              "chosen": " thirteen", "rejected": " fourteen"}]
    source = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError, match=r"pairs\.jsonl: row 3: the prompt is \d+ tokens, which fills "
                                        r"training\.max_length=8"):
        _ours(smol, source, 8)
    skipped = _ours(smol, source, 8, skip_bad_rows=True)
    theirs = _trl_dpo(policies, smol, rows, tmp_path, 8)
    assert len(theirs) == 2 and skipped.stats["bad_rows_skipped"] == 1
    assert _our_pairs(skipped.train) == theirs
    assert _ours(smol, source, 8, "keep_end").stats["pairs"] == 3  # keep_end keeps every completion's end


def test_kto_rows_and_kl_rows_match_trl(smol, policies, tmp_path):
    chat = [{"prompt": r["prompt"], "completion": r["chosen"], "label": i % 2 == 0} for i, r in enumerate(CHAT_PAIRS)]
    for rows, max_length in ((KTO_ROWS, 64), (KTO_ROWS, 8), (chat, 128)):
        theirs = _trl_kto(policies, smol, rows, tmp_path, max_length)
        ours = _ours(smol, _write_jsonl(tmp_path / "kto.jsonl", rows), max_length, kind="unpaired_preference").train
        c = ours.columns
        assert set(c) == set(UNPAIRED_KEYS)
        main = _sequences(c["input_ids"], c["segment_ids"], c["loss_mask"])
        kl = _sequences(c["kl_input_ids"], c["kl_segment_ids"], c["kl_loss_mask"])
        assert list(zip(main, kl, c["label"].tolist())) == [(m, k, int(lab)) for m, k, lab in theirs]
        assert c["label"].shape == (len(rows),) and c["input_ids"].shape == (len(rows), max_length)


def test_max_prompt_length_cuts_the_prompt_on_the_truncation_side(smol, tmp_path):
    rows = [{"prompt": "one two three four five six", "chosen": " seven", "rejected": " eight"}]
    source = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    full = _ours(smol, source, 32).train
    prompt = full.columns["chosen_input_ids"][0][full.columns["chosen_loss_mask"][0] == 0]
    prompt = prompt[full.columns["chosen_segment_ids"][0][full.columns["chosen_loss_mask"][0] == 0] == 1]
    for mode, kept in (("keep_start", prompt[:3]), ("keep_end", prompt[-3:])):
        cut = _ours(smol, source, 32, mode, max_prompt_length=3).train.columns
        n = int(cut["chosen_segment_ids"][0].sum())
        assert cut["chosen_input_ids"][0][:3].tolist() == kept.tolist()
        assert cut["chosen_loss_mask"][0][:n].tolist() == [0, 0, 0] + [1] * (n - 3)
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length=32 must be below training\.max_length=32"):
        _ours(smol, source, 32, max_prompt_length=32)


BAD_PAIRS = [
    ({"prompt": "a", "chosen": " b"}, r"no column 'rejected'"),
    ({"prompt": "a", "chosen": "", "rejected": " c"}, r"chosen is empty"),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, r"chosen and rejected are the same"),
    ({"prompt": "a", "chosen": " b", "rejected": [{"role": "assistant", "content": "c"}]},
     r"chosen and rejected must both be text or both be message lists"),
    ({"prompt": "a", "chosen": None, "rejected": " c"}, r"chosen has no value"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": " b", "rejected": " c"},
     r"prompt must be text like chosen and rejected"),
    ({"prompt": "a", "chosen": [{"role": "robot", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]},
     r"chosen: message 0 has unknown role 'robot'"),
]


def test_a_margin_column_is_served_per_pair_and_a_bad_margin_is_named_by_its_row(smol, tmp_path):
    """TRL's optional ``margin`` column (RewardTrainer) is served as ``margin`` [B] float32 beside the pair keys;
    a value that is not a finite number is a bad row naming the column."""
    rows = [{**row, "margin": m} for row, m in zip(TEXT_PAIRS[:3], (0.5, "-1.25", 2))]
    served = _ours(smol, _write_jsonl(tmp_path / "m.jsonl", rows), 64).train.columns
    np.testing.assert_array_equal(served["margin"], np.float32([0.5, -1.25, 2.0]))
    assert "margin" not in _ours(smol, _write_jsonl(tmp_path / "plain.jsonl", TEXT_PAIRS[:3]), 64).train.columns
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*rows[:2], {**TEXT_PAIRS[3], "margin": "wide"}])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 3: margin must be a finite number"):
        _ours(smol, bad, 64)


@pytest.mark.parametrize("row,problem", BAD_PAIRS, ids=[p for _, p in BAD_PAIRS])
def test_every_bad_pair_is_named_by_its_row(smol, tmp_path, row, problem):
    source = _write_jsonl(tmp_path / "pairs.jsonl", [*TEXT_PAIRS[:2], row, TEXT_PAIRS[2]])
    with pytest.raises(DataError, match=r"pairs\.jsonl: row 3: " + problem):
        _ours(smol, source, 64)
    assert _ours(smol, source, 64, skip_bad_rows=True).stats["bad_rows_skipped"] == 1


@pytest.mark.parametrize("row,problem", [
    ({"prompt": "a", "completion": " b", "label": "maybe"}, r"label must be true \(desirable\) or false"),
    ({"prompt": "a", "completion": " ", "label": True}, r"completion is empty"),
    ({"prompt": "a", "label": True}, r"no column 'completion'"),
])
def test_bad_kto_rows_are_named(smol, tmp_path, row, problem):
    source = _write_jsonl(tmp_path / "kto.jsonl", [*KTO_ROWS[:2], row])
    with pytest.raises(DataError, match=r"kto\.jsonl: row 3: " + problem):
        _ours(smol, source, 64, kind="unpaired_preference")
    assert _ours(smol, source, 64, kind="unpaired_preference", skip_bad_rows=True).stats["rows"] == 2


def test_a_source_without_the_columns_names_them(smol, tmp_path):
    source = _write_jsonl(tmp_path / "pairs.jsonl", [{"question": "a", "good": " b", "bad": " c"}])
    with pytest.raises(DataError, match=r"no column 'chosen'.*data\.prompt_column / chosen_column / rejected_column"):
        _ours(smol, source, 64)
    renamed = _ours(smol, source, 64, prompt_column="question", chosen_column="good", rejected_column="bad")
    assert renamed.stats["pairs"] == 1


def test_every_source_format_gives_the_same_rows(smol, tmp_path):
    """JSONL, Parquet, CSV (messages as JSON text) and a save_to_disk folder: identical arrays."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    from datasets import Dataset

    for name, rows in (("text", TEXT_PAIRS), ("chat", CHAT_PAIRS)):
        reference = _ours(smol, _write_jsonl(tmp_path / f"{name}.jsonl", rows), 128).train.columns
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        cells = [{k: v if isinstance(v, str) else json.dumps(v) for k, v in r.items()} for r in rows]
        pacsv.write_csv(pa.Table.from_pylist(cells), tmp_path / f"{name}.csv")
        Dataset.from_list(rows).save_to_disk(str(tmp_path / f"{name}_hf"))
        for source in (f"{name}.parquet", f"{name}.csv", f"{name}_hf"):
            got = _ours(smol, str(tmp_path / source), 128).train.columns
            assert all(np.array_equal(got[k], reference[k]) for k in PAIR_KEYS), source


def test_held_out_split_and_eval_source(smol, tmp_path):
    rows = [{"prompt": f"Q{i}: what is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
            for i in range(20)]
    source = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    split = _ours(smol, source, 32, eval_fraction=0.25)
    assert (split.stats["train_rows"], split.stats["eval_rows"]) == (15, 5)
    assert split.eval.columns["chosen_input_ids"].shape == (5, 32)
    again = _ours(smol, source, 32, eval_fraction=0.25)
    assert np.array_equal(again.eval.columns["chosen_input_ids"], split.eval.columns["chosen_input_ids"])
    held = _ours(smol, source, 32, eval_source=_write_jsonl(tmp_path / "eval.jsonl", rows[:3]))
    assert (held.train.num_rows, held.eval.num_rows) == (20, 3)


def test_loader_serves_the_pair_keys_resumes_and_pads(smol, tmp_path):
    rows = [{"prompt": f"Q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(10)]
    train = _ours(smol, _write_jsonl(tmp_path / "pairs.jsonl", rows), 16).train
    it = make_batch_iterator(train, 4, seed=3, process_index=0, process_count=1)
    first = [next(it) for _ in range(2)]
    assert set(first[0]) == set(PAIR_KEYS) and all(v.shape == (4, 16) for v in first[0].values())
    state = it.get_state()
    expected = next(it)
    resumed = make_batch_iterator(train, 4, seed=3, process_index=0, process_count=1)
    resumed.set_state(state)
    got = next(resumed)
    assert all(np.array_equal(got[k], expected[k]) for k in PAIR_KEYS)
    evals = list(make_batch_iterator(train, 4, seed=0, shuffle=False, num_epochs=1, drop_remainder=False,
                                     process_index=0, process_count=1))
    last = evals[-1]  # 10 rows in batches of 4: two padding rows, no tokens, no targets
    assert len(evals) == 3 and not last["chosen_segment_ids"][2:].any() and not last["rejected_loss_mask"][2:].any()
    assert (last["chosen_input_ids"][2:] == smol.pad_token_id).all()
    whole = next(make_batch_iterator(train, 4, seed=3, process_index=0, process_count=1))
    halves = [next(make_batch_iterator(train, 4, seed=3, process_index=p, process_count=2)) for p in (0, 1)]
    assert all(np.array_equal(np.concatenate([h[k] for h in halves]), whole[k]) for k in PAIR_KEYS)


def test_worker_processes_give_the_same_rows(smol, tmp_path):
    source = _write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS + CHAT_PAIRS)  # text and conversations mixed
    one = _ours(smol, source, 64).train.columns
    two = _ours(smol, source, 64, num_workers=1).train.columns
    assert all(np.array_equal(one[k], two[k]) for k in PAIR_KEYS)


def test_trainer_shards_every_key_over_the_batch_axes(tmp_path, tiny_config_kwargs):
    """KTO rows through the Trainer on a dp x fsdp x sp mesh with gradient accumulation: [B, L] keys split
    over batch and sequence, the [B] label over the batch axes alone; one step runs (the language-model
    objective reads input_ids / segment_ids / loss_mask, the other keys ride along through accumulation)."""
    import jax
    from jax.sharding import PartitionSpec

    import scaletrain as st
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

    rng = np.random.default_rng(0)
    encoded = [Encoded(rng.integers(1, 100, rng.integers(1, 6)).tolist(), (rng.integers(1, 100, 5).tolist(),),
                       bool(i % 2), "<rows>", i + 1) for i in range(16)]
    rows = unpaired_rows(encoded, PreferenceEncoder(None, 16), pad_id=0)
    rows = rows.with_columns({"ref_logps": rng.normal(size=16).astype(np.float32)})  # a precomputed [B] value
    cfg = LlamaConfig(**tiny_config_kwargs, sharding_axis_dims=(2, 2, 1, 1, 2))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, max_training_steps=1,
                                gradient_accumulation_steps=2, progress_bar=False, num_train_epochs=None)
    trainer = st.Trainer(args, model=model, dataset_train=rows)
    batch = trainer.shard_batch(next(trainer.dataloader_train))
    assert set(batch) == {*UNPAIRED_KEYS, "ref_logps"}
    for key, value in batch.items():
        per_row = key in ("label", "ref_logps")
        want = PartitionSpec(("dp", "fsdp")) if per_row else PartitionSpec(("dp", "fsdp"), "sp")
        assert value.shape == ((8,) if per_row else (8, 16)), key
        assert value.sharding.spec == want, key
        assert len(value.sharding.device_set) == jax.device_count()
    state, metrics = trainer.sharded_training_step_function(trainer.current_state, batch)
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("preparation", ["trl_dpo", "trl_orpo"])
def test_conversations_need_a_chat_template_which_data_chat_template_gives(tmp_path, preparation):
    tokenizer = load_processor(bundled_tokenizer_path())  # no chat template of its own
    source = _write_jsonl(tmp_path / "chat.jsonl", CHAT_PAIRS)
    with pytest.raises(DataError, match=r"conversational preference rows need a chat template.*data\.chat_template"):
        _ours(tokenizer, source, 128, preparation=preparation)
    rows = _ours(tokenizer, source, 128, preparation=preparation, chat_template=PLAIN_TEMPLATE)
    assert rows.stats["pairs"] == 3 and tokenizer.chat_template == PLAIN_TEMPLATE
