"""Generation stops at the end of a reply: eos, or the chat template's end-of-turn token.

The end-of-run sample once printed ``42.\\nsystem\\n\\nuser\\nI'm``: the model had
emitted ``<|im_end|>`` and kept going, and decoding without special tokens hid it.
"""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import PLAIN_TEMPLATE, smollm2_path

from scaletrain.data import load_processor
from scaletrain.data.prepared import resolve_tokenizer_path
from scaletrain.generation import end_of_turn_id, generate, stop_token_ids
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.recipe import Recipe
from scaletrain.run import sample_text

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def bundled():
    return load_processor(resolve_tokenizer_path("bundled"))


def test_smollm2_stops_at_im_end():
    tok = load_processor(smollm2_path())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tok) == im_end
    assert stop_token_ids(tok, None) == [im_end]


def test_end_of_turn_differing_from_eos_is_added(bundled):
    # Qwen2-base style: eos <|endoftext|>, turns closed by <|im_end|>
    bundled.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    bundled.chat_template = CHATML
    im_end = bundled.convert_tokens_to_ids("<|im_end|>")
    assert bundled.eos_token_id != im_end
    assert stop_token_ids(bundled, 7) == [7, bundled.eos_token_id, im_end]


def test_plain_text_after_a_turn_is_not_an_end_of_turn(bundled):
    bundled.chat_template = PLAIN_TEMPLATE  # content, then <|endoftext|>: that is the eos itself
    assert end_of_turn_id(bundled) == bundled.eos_token_id
    bundled.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(bundled) is None  # a newline ends no reply
    bundled.chat_template = None
    assert stop_token_ids(bundled, None) == [bundled.eos_token_id]


def test_end_of_run_sample_stops_at_the_tokenizers_eos(bundled, tiny_config_kwargs):
    config = LlamaConfig(**{**tiny_config_kwargs, "vocab_size": 4096}, eos_token_id=None,
                         sharding_axis_dims=(1, -1, 1, 1, 1))
    model, mesh = create_sharded_model(LlamaForCausalLM, config)
    prompt = "hello"
    ids = bundled(prompt)["input_ids"]
    import jax

    with jax.set_mesh(mesh):
        free = generate(model, [ids], max_new_tokens=12)[0].tolist()  # no eos: all 12 tokens
    # make a token the random model emits mid-way the tokenizer's eos, one not seen before it
    k = next(i for i in range(2, len(free) - 2) if free[i] not in free[:i] and free[i] not in free[i + 1:])
    bundled.eos_token = bundled.convert_ids_to_tokens(free[k])
    assert bundled.eos_token_id == free[k]
    recipe = Recipe.from_dict({"sample": {"prompt": prompt, "max_new_tokens": 12, "temperature": 0.0}})
    text = sample_text(model, bundled, recipe)
    # the reply ends before the eos; the old sample went on to max_new_tokens
    assert text == prompt + bundled.decode(free[:k])
    assert len(bundled.decode(free[k + 1:])) > 0 and np.all(np.asarray(free[k + 1:]) != free[k])
