"""bench/rollout.py's two workloads and its cache arithmetic.

Why two workloads: a fixed-length one (random prompts, every row sampling exactly ``new`` tokens, no stop)
measures the decode step alone; the long-tailed one measures what RL actually runs: chat prompts whose
answers range from one word to a list that runs to the cap, so a static batch keeps decoding (and keeping
the cache of) rows that have long stopped. The chat prompts are ours, written to spread the answer lengths.

Cache bytes are counted, not sampled from the allocator: the key/value bytes of one token
(:func:`kv_bytes_per_token`) times the token slots each contender holds at its peak, against the tokens
the live rows actually need at the peak (:func:`live_peak_tokens`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

#: 32 requests whose answers run from one word to a list longer than any cap we use
CHAT_PROMPTS: tuple[str, ...] = (
    "Answer with one word: what colour is a ripe banana?",
    "One word only: the capital of France?",
    "Yes or no: is the sun a star?",
    "Reply with a single number: how many legs does a spider have?",
    "Give one word that rhymes with 'cat'.",
    "What is 7 times 8? Just the number.",
    "Name one planet in the solar system. One word.",
    "Which is larger, a mouse or an elephant? One word.",
    "In one short sentence, what is photosynthesis?",
    "Say hello to me in French, in one sentence.",
    "In one sentence: why is the sky blue?",
    "Give me a one-line motto for a bakery.",
    "What does a thermometer measure? Answer in one sentence.",
    "Describe a cat in exactly one sentence.",
    "Tell me a very short joke.",
    "In one sentence, what is gravity?",
    "Explain in a short paragraph how a bicycle works.",
    "Write a short paragraph about the ocean.",
    "Describe your ideal weekend in a few sentences.",
    "Explain what a computer program is to a child, in a paragraph.",
    "Write a short story about a lost dog, about five sentences long.",
    "Give three tips for studying well, with a sentence on each.",
    "Summarise the water cycle in a paragraph.",
    "Write a short letter thanking a friend for a gift.",
    "List 40 animals, one per line.",
    "Write a numbered list of 30 countries with their capitals.",
    "List 50 English words that start with the letter B.",
    "Write a numbered list of 25 healthy foods, with a short note on each.",
    "List the numbers from 1 to 100 written out in words.",
    "Write a long list of 40 ideas for a birthday party.",
    "List 30 famous scientists and what each is known for.",
    "Write a detailed step-by-step recipe for bread with at least 20 steps.",
)


def fixed_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids (8 to 40 tokens; ids above the special ones): the fixed-length
    workload, whose rows never stop early."""
    rs = np.random.RandomState(seed)
    return [rs.randint(16, vocab, rs.randint(8, 41)).tolist() for _ in range(count)]


def chat_prompts(model_dir: str, count: int) -> list[list[int]]:
    """The first ``count`` of :data:`CHAT_PROMPTS` (cycled) as the model's chat template encodes a user turn
    with the assistant's turn opened."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        out.append(list(ids["input_ids"]))
    return out


def random_stop_prompts(count: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """A long-tailed stand-in for random weights (``--tiny`` / ``--arch``): random prompts of 4 to 24 tokens
    whose rows stop on any of :func:`random_stop_ids`, so lengths fall off geometrically."""
    rs = np.random.RandomState(seed)
    return [rs.randint(16, vocab, rs.randint(4, 25)).tolist() for _ in range(count)]


def random_stop_ids(vocab: int, share: float = 1 / 16) -> tuple[int, ...]:
    """About ``share`` of the vocabulary (ids from 16 up): a near-uniform sampler stops after ~1/share tokens."""
    n = max(1, int(vocab * share))
    return tuple(range(16, 16 + n))


def has_chat_template(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a tokenizer with a chat template (the real model does; random weights do not)."""
    return os.path.isfile(os.path.join(model_dir, "tokenizer.json")) and (
        os.path.isfile(os.path.join(model_dir, "chat_template.jinja"))
        or "chat_template" in open(os.path.join(model_dir, "tokenizer_config.json")).read())


def kv_bytes_per_token(hf_config: Any, itemsize: int) -> int:
    """Key + value bytes one token occupies across every layer (an attention-only decoder)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return int(hf_config.num_hidden_layers * 2 * kv_heads * head_dim * itemsize)


def row_prompt_lengths(prompts: Sequence[Sequence[int]], generations: int) -> np.ndarray:
    """Each row's prompt length, rows in request order (prompt ``i``'s ``generations`` rows adjacent)."""
    return np.repeat(np.asarray([len(p) for p in prompts]), generations)


def live_peak_tokens(prompt_lengths: np.ndarray, lengths: np.ndarray, slots: int | None = None) -> int:
    """The most tokens the unfinished rows hold at once (each row's prompt and the tokens it has sampled).

    ``slots`` None: every row starts together (a static batch, ``generate``). Otherwise rows enter ``slots``
    decode slots first come first served, a row taking the slot the first finished one frees: the schedule
    of a continuous batch, replayed from the lengths it produced, one token per slot per step.
    """
    n = len(lengths)
    start = np.zeros(n, np.int64)
    if slots is not None and slots < n:
        ends = list(lengths[:slots].astype(np.int64))
        for r in range(slots, n):
            k = int(np.argmin(ends))  # the slot that frees first
            start[r] = ends[k]
            ends[k] = start[r] + int(lengths[r])
    stop = start + lengths.astype(np.int64)
    peak = 0
    for t in np.unique(np.concatenate([start, stop - 1])):  # the live set only grows at starts, peaks before ends
        live = (start <= t) & (t < stop)
        peak = max(peak, int(np.sum(prompt_lengths[live] + (t - start[live]) + 1)))
    return peak


def length_summary(lengths: np.ndarray, cap: int) -> dict[str, Any]:
    """Completion lengths in brief: fewest, median, most, how many ran to the cap, total tokens."""
    return {"min": int(lengths.min()), "median": float(np.median(lengths)), "max": int(lengths.max()),
            "at_cap": int(np.sum(lengths >= cap)), "tokens": int(lengths.sum())}
