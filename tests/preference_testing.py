"""Shared pieces of the preference tests: a word-level tokenizer built offline, text pairs, random tiny Llamas
exported to Hugging Face folders, and pair rows in the preference data kind's keys."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.models.hf import save_hf_checkpoint

WORDS = ("what is two plus three five six seven the sky colour blue green red say hello world goodbye name a "
         "fruit apple stone count to one four yes no maybe cat dog sits runs please now").split()
SPECIAL = ("<pad>", "</s>", "<unk>")

# prompt, chosen, rejected: ragged lengths (padding inside a batch) for DPO
RAGGED_PAIRS = [
    ("what is two plus three", " five", " six seven"),
    ("the sky colour", " blue", " green red red"),
    ("say hello", " hello world", " goodbye"),
    ("name a fruit", " apple", " stone stone"),
    ("count to four", " one two three four", " one"),
    ("is the cat a dog", " no", " yes maybe"),
    ("what is two plus two", " four", " five six"),
    ("the dog", " runs", " sits sits"),
]
# every prompt + completion the same number of words: TRL's ORPO and CPO average logits over their padded
# batch, which equals the per-token figure only where no row is padded
EVEN_PAIRS = [
    ("what is two plus", " four", " six"),
    ("the sky colour is", " blue", " red"),
    ("say hello to the", " world", " dog"),
    ("name a fruit please", " apple", " stone"),
    ("count to four now", " four", " one"),
    ("is the cat a", " cat", " dog"),
    ("two plus two is", " four", " five"),
    ("the dog runs to", " one", " yes"),
]


def word_tokenizer(folder: str, bos: bool = False) -> Any:
    """A whitespace word-level tokenizer with ``</s>`` as EOS and ``<pad>`` as padding, saved in ``folder``.

    ``bos``: with a ``<s>`` bos token after the words (the other ids unchanged), which the tokenizer never
    adds itself, as SmolLM2's: TRL's ORPO/CPO trainers put it before every prompt, its DPOTrainer does not."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*SPECIAL, *dict.fromkeys(WORDS), *(("<s>",) if bos else ())))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                  **({"bos_token": "<s>"} if bos else {}))
    tok.save_pretrained(folder)
    return tok


def one_device_mesh() -> Any:
    """A mesh of one device: these tests compare numbers, and one device compiles several times faster."""
    from scaletrain.parallel import create_mesh

    return create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])


def tiny_llama(seed: int, max_position_embeddings: int = 64, mesh: Any = None, layers: int = 2) -> Any:
    """A random float32 Llama (vocab 128), on ``mesh`` (default: one device)."""
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model, _ = create_sharded_model(LlamaForCausalLM, config, seed=seed, mesh=mesh or one_device_mesh())
    return model


def export(model: Any, folder: str) -> str:
    return save_hf_checkpoint(model, folder)


def torch_model(folder: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def pad_row(ids: list[int], completion: list[int], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, segment_ids, loss_mask)`` right-padded to ``length``."""
    n = len(ids)
    out = np.zeros((3, length), np.int32)
    out[0, :n], out[1, :n], out[2, :n] = ids, 1, completion
    return out[0], out[1], out[2]


def pair_row(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]], length: int) -> dict:
    """A row of the ``preference`` data kind from (ids, completion mask) of chosen and rejected."""
    row = {}
    for side, (ids, mask) in (("chosen", chosen), ("rejected", rejected)):
        row[f"{side}_input_ids"], row[f"{side}_segment_ids"], row[f"{side}_loss_mask"] = pad_row(ids, mask, length)
    return row


def stack_rows(rows: list[dict]) -> dict[str, np.ndarray]:
    """The collator of already-padded rows: one array per key."""
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}


def fixed_rows(rows: list[dict]) -> Any:
    """Already-padded rows as the preference data kinds serve them (a ``FixedRows`` table)."""
    from scaletrain.data.table import FixedRows

    return FixedRows(stack_rows(rows))


def first_train_record(output_dir: str) -> dict:
    import json

    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r.get("split") == "train")


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, jax.device_get(tree))


def hf_reward_model(folder: str, seed: int = 0) -> Any:
    """A random tiny transformers ``LlamaForSequenceClassification`` (``num_labels=1``, vocab 128) saved in
    ``folder`` with :func:`word_tokenizer` beside it; returns the tokenizer."""
    import torch
    import transformers

    tokenizer = word_tokenizer(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      num_labels=1, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return tokenizer
