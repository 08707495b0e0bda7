"""Which token ids end a reply, and a reply cut at the first of them.

Why apart from the decode loop: the stop ids come from the tokenizer and its chat template
(host-side, once per run), while the loop only compares each new token with a fixed array of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_TURN_PROBE = "scaletrain-end-of-turn-probe"


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, or None.

    Why: a chat model ends its reply with the template's end-of-turn token, which is
    not always the tokenizer's eos (Qwen2 base: eos ``<|endoftext|>``, turn end
    ``<|im_end|>``; Llama 3: ``<|eot_id|>``). Rendering a probe conversation finds it
    for any template without a table of names. Only a special (added) token counts:
    a plain newline after the content is not an end of reply.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    import jinja2

    probe = [{"role": "user", "content": _TURN_PROBE}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None  # a template that refuses this conversation tells us nothing
    if not isinstance(text, str) or _TURN_PROBE not in text:
        return None
    suffix = text.rsplit(_TURN_PROBE, 1)[1].lstrip()
    ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.get_added_vocab().values())
    return int(ids[0]) if ids[0] in special else None


def stop_token_ids(tokenizer: Any | None, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Every id that ends a reply: ``eos_token_id`` (the model config's), the tokenizer's eos
    and the chat template's end-of-turn token, without repeats (first one first)."""
    found: list[int] = []
    candidates: list[Any] = [eos_token_id]
    if tokenizer is not None:
        candidates += [getattr(tokenizer, "eos_token_id", None), end_of_turn_id(tokenizer)]
    for value in candidates:
        for i in [] if value is None else ([value] if isinstance(value, int) else list(value)):
            if int(i) not in found:
                found.append(int(i))
    return found


def until_stop(tokens: Sequence[int], stop: Sequence[int]) -> list[int]:
    """``tokens`` up to (without) the first stop id: the reply itself, whether or not the
    tokenizer flags that id as special (``skip_special_tokens`` only drops flagged ones)."""
    tokens = [int(t) for t in tokens]
    cut = next((i for i, t in enumerate(tokens) if t in set(stop)), len(tokens))
    return tokens[:cut]
