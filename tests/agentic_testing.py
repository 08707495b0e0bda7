"""What the agentic (tool-calling) tests share: a byte-level chat tokenizer with Qwen2.5's tool template, and tools.

The tokenizer has one token per byte (256) plus ``<|im_start|>``, ``<|im_end|>`` (EOS) and ``<|endoftext|>``
(padding): any text round-trips, so a tool call written as text parses, and its vocabulary (259) fits a tiny
model. Its chat template is TRL's copy of Qwen2.5's (tools in the system turn, ``<tool_call>`` JSON, tool
results as ``<tool_response>`` user turns), which is prefix-preserving, and it carries the response template
transformers parses tool calls with, as TRL sets it (``add_response_schema``).
"""

from __future__ import annotations

import os
from typing import Any

VOCAB = 259


def chatml_tokenizer(folder: str | None = None, response_schema: bool = True, template: str | None = None) -> Any:
    """The byte-level chat tokenizer (saved to ``folder`` when given); ``template``: another chat template than
    Qwen2.5's (then neither TRL, a seconds-long import, nor its response schema)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    if template is not None:
        tok.chat_template = template
    else:
        from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

        tok.chat_template = qwen2_5_chat_template
        if response_schema:
            add_response_schema(tok)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        tok.save_pretrained(folder)
    return tok


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def echo(text: str, times: int) -> str:
    """Repeat a text.

    Args:
        text: What to repeat.
        times: How many times.
    """
    return text * times


def call(name: str, **arguments: Any) -> str:
    """A Hermes/Qwen tool call as the model writes it."""
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tiny_llama(max_position_embeddings: int = 2048) -> Any:
    """A one-layer random Llama over the tokenizer's vocabulary (eos 256, pad 257) on one device: what the agentic
    tests sample turns from."""
    from preference_testing import one_device_mesh
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, eos_token_id=256, pad_token_id=257,
                         bos_token_id=None)
    return create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
