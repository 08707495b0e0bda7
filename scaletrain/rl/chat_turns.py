"""Token ids of what the environment writes between two model turns, rendered by the chat template.

Why render only the new messages and never the conversation again (token-in/token-out): the model's
tokens must stay exactly as sampled, and re-tokenising the whole conversation after each turn can
split a sampled text into other tokens, or (templates that drop earlier turns' reasoning) change the
earlier turns. So the conversation's ids grow by concatenation: prompt ids, the turn as sampled, then
the ids of the tool results (or the environment's next user turn) and the next assistant header.

Those ids come from the chat template itself: render a short stand-in conversation that ends with an
assistant turn, once without and once with the new messages (and the generation prompt), and take the
difference. The stand-in ends at its last end-of-turn token (a template such as Qwen3's writes a newline
after it, which the model's own turn does not contain, its turn having stopped at the token). The
same construction as TRL 1.16's, so the trajectories agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scaletrain.data.chat_templates import apply_chat_template


def _ids(value: Any) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return [int(i) for i in value]


def appended_ids(tokenizer: Any, before: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]],
                 end_ids: Sequence[int] = ()) -> list[int]:
    """The ids the template writes for the ``new`` messages after the conversation ``before`` (which ends with an
    assistant turn) plus the next assistant header; ``before`` is cut at its last end-of-turn id (``end_ids``,
    default the tokenizer's EOS). ValueError when the template does not render ``before`` as a prefix."""
    prefix = _ids(apply_chat_template(tokenizer, list(before), add_generation_prompt=False, tokenize=True))
    full = _ids(apply_chat_template(tokenizer, list(before) + list(new), add_generation_prompt=True, tokenize=True))
    ends = set(end_ids) or {getattr(tokenizer, "eos_token_id", None)}
    cut = [i for i, t in enumerate(prefix) if t in ends]
    if cut:
        prefix = prefix[:cut[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders a conversation's start differently once a message follows it; "
                         "multi-turn rollouts need a prefix-preserving template (set data.chat_template)")
    return full[len(prefix):]


def tool_result_ids(tokenizer: Any, results: Sequence[dict[str, Any]]) -> list[int]:
    """The ids of ``results`` (``{"role": "tool", "name", "content"}`` messages, in call order) after an assistant
    turn that called ``results[0]``'s tool, through the next assistant header."""
    call = {"type": "function", "function": {"name": results[0]["name"], "arguments": {}}}
    before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return appended_ids(tokenizer, before, results)


def user_turn_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of an environment's reply ``text`` as the next user turn, after an assistant turn, through the next
    assistant header."""
    before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    return appended_ids(tokenizer, before, [{"role": "user", "content": text}])


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> list[int]:
    """A conversational prompt's ids with the tools' schemas in the template (``tools=None`` for none: some
    templates write tool boilerplate for an empty list), ending with the assistant header."""
    return _ids(apply_chat_template(tokenizer, list(messages), tools=list(tools) if tools else None,
                                    add_generation_prompt=True, tokenize=True))
