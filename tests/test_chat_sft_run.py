"""End to end: chat SFT through ``scaletrain.run.run_training``, the example recipe, vocab checks."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from data_helpers import CHAT_JSONL, PLAIN_TEMPLATE, REPO, smollm2_path, spans

from scaletrain.errors import DataError
from scaletrain.recipe import Recipe
from scaletrain.run import build_model, load_datasets, load_tokenizer, run_training


def _chat_recipe(tmp_path, n_conversations=64, model=None, **training):
    source = tmp_path / "chat.jsonl"
    with open(CHAT_JSONL) as f, open(source, "w") as out:
        out.writelines(f.readlines()[:n_conversations])
    return Recipe.from_dict({
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, **(model or {})},
        "data": {"source": str(source), "kind": "chat", "chat_template": PLAIN_TEMPLATE, "eval_fraction": 0.1},
        "tokenizer": {"path": "bundled"},
        "training": {"output_dir": str(tmp_path / "run"), "total_batch_size": 8, "max_length": 256,
                     "num_train_epochs": None, "max_training_steps": 6, "learning_rate": 1e-2, "log_steps": 1,
                     "progress_bar": False, "max_evaluation_steps": 2, **training},
    })


def test_chat_sft_run_trains_on_assistant_tokens_only(tmp_path):
    recipe = _chat_recipe(tmp_path)
    tokenizer = load_tokenizer(recipe)
    splits = load_datasets(recipe, tokenizer)
    rows = splits.train
    with open(CHAT_JSONL) as f:
        answers = {m["content"] + "<|endoftext|>" for line in f for m in json.loads(line)["messages"]
                   if m["role"] == "assistant"}
    # a target is a token in the same segment as its predecessor with loss_mask set
    target = np.zeros_like(rows.loss_mask)
    target[:, 1:] = (rows.segment_ids[:, 1:] == rows.segment_ids[:, :-1]) & (rows.segment_ids[:, 1:] > 0)
    target &= rows.loss_mask
    pieces = [tokenizer.decode(ids[s:e].tolist()) for ids, t in zip(rows.input_ids, target) for s, e in spans(t)]
    assert len(pieces) >= splits.stats["samples"] * 0.9
    assert all(p in answers or any(a.endswith(p) for a in answers) for p in pieces)
    assert sum(p in answers for p in pieces) > 0.9 * len(pieces)

    summary = run_training(recipe)
    out = recipe.training.output_dir
    assert summary["final_step"] == 6 and math.isfinite(summary["final_train_loss"])
    assert math.isfinite(summary["final_eval_loss"])
    losses = [r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    stats = json.load(open(os.path.join(out, "data_stats.json")))
    assert stats["kind"] == "chat" and stats["train_loss_tokens"] == rows.num_loss_tokens


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    small = _chat_recipe(tmp_path, model={"vocab_size": 1024})
    with pytest.raises(DataError, match=r"tokenizer 'bundled' has 4096 tokens but model.vocab_size is 1024"):
        build_model(small, load_tokenizer(small))


def test_example_chat_recipe_builds_with_the_real_tokenizer(monkeypatch):
    path = smollm2_path()
    monkeypatch.setenv("SCALETRAIN_CACHE", os.path.dirname(os.path.dirname(path)))
    monkeypatch.chdir(REPO)
    recipe = Recipe.load(str(REPO / "examples" / "chat_sft.yaml"), ["training.output_dir=/dev/null/unused"])
    tokenizer = load_tokenizer(recipe)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    from scaletrain.data import build_datasets

    splits = build_datasets(recipe.data, tokenizer, max_length=recipe.training.max_length, seed=0)
    s = splits.stats
    assert s["conversations"] == 160 and s["dropped_no_assistant_tokens"] == 0 and s["located_by_search"] == 0
    assert s["train_packing_efficiency"] > 0.85 and s["train_rows"] >= recipe.training.total_batch_size
