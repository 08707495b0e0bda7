"""A sampled turn read as an assistant message: its text and the tool calls it asks for.

Why the tokenizer's own format first: a chat model writes tool calls in the syntax its template taught it
(Qwen3's and Hermes' ``<tool_call>{json}</tool_call>``, Llama 3.x's bare JSON, ...). transformers reads that
syntax from the tokenizer's ``response_template`` (or its older ``response_schema``), the same parser TRL
1.16 calls, so where the tokenizer has one (``tool_call_format: auto``) we use it and parse what TRL parses.
Where it has none, a recipe names the format (``objective.tool_call_format``): ``hermes`` (the
``<tool_call>`` JSON blocks), ``llama3_json`` (one JSON object ``{"name", "parameters"}`` as the whole turn);
``auto`` on a tokenizer without a parser picks ``hermes`` when the chat template writes ``<tool_call>``.

A turn that does not parse is plain text with no calls (TRL's fallback), never an error: a model that
writes a broken call learns from its reward.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from scaletrain.rl.tools import ToolCall

FORMATS = ("auto", "tokenizer", "hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.S)


def has_parser(tokenizer: Any) -> bool:
    """Whether transformers can parse ``tokenizer``'s responses (a ``response_template`` or ``response_schema``)."""
    return any(getattr(tokenizer, k, None) is not None for k in ("response_template", "response_schema"))


def resolve_format(tokenizer: Any, fmt: str = "auto") -> str:
    """The format ``fmt`` means for ``tokenizer``; ValueError naming ``tool_call_format`` when none applies."""
    if fmt not in FORMATS:
        raise ValueError(f"tool_call_format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "tokenizer" and not has_parser(tokenizer):
        raise ValueError("tool_call_format='tokenizer' but the tokenizer has no response_template / response_schema; "
                         "set objective.tool_call_format to hermes or llama3_json")
    if fmt != "auto":
        return fmt
    if has_parser(tokenizer):
        return "tokenizer"
    if "<tool_call>" in str(getattr(tokenizer, "chat_template", "") or ""):
        return "hermes"
    raise ValueError("the tokenizer says nothing of how its model writes tool calls (no response_template, and its "
                     "chat template does not write <tool_call>); set objective.tool_call_format to hermes or "
                     "llama3_json")


def _strip_end(text: str, tokenizer: Any) -> str:
    eos = getattr(tokenizer, "eos_token", None)
    return text.removesuffix(eos) if eos else text


def _json_calls(blocks: Sequence[str], key: str) -> list[dict[str, Any]] | None:
    calls = []
    for block in blocks:
        value = json.loads(block)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get(key)
        calls.append({"type": "function", "function": {"name": value["name"], "arguments": {} if args is None
                                                       else args}})
    return calls


def _parse_text(text: str, fmt: str) -> dict[str, Any]:
    """``{"role": "assistant", "content", "tool_calls"?}`` of a decoded turn in ``fmt`` (hermes / llama3_json; ``text``:
    a run without tools, where every turn is plain text)."""
    if fmt == "text":
        return {"role": "assistant", "content": text}
    if fmt == "hermes":
        blocks = _HERMES.findall(text)
        if not blocks:
            return {"role": "assistant", "content": text}
        calls = _json_calls(blocks, "arguments")
        if calls is None:
            raise ValueError("a tool call without a name")
        return {"role": "assistant", "content": text[:text.index("<tool_call>")].rstrip("\n"), "tool_calls": calls}
    stripped = text.strip()
    if not stripped.startswith("{"):
        return {"role": "assistant", "content": text}
    calls = _json_calls([stripped], "parameters")
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": "", "tool_calls": calls}


def parse_turn(tokenizer: Any, ids: Sequence[int], fmt: str, prefix: Sequence[int] | None = None,
               tools: Sequence[Callable[..., Any]] | None = None) -> dict[str, Any]:
    """The assistant message of a sampled turn ``ids`` (``prefix``: the context it was sampled after, which the
    tokenizer's parser may read; ``tools``: the callables the arguments are typed by). Malformed: plain text."""
    try:
        if fmt == "tokenizer":
            parsed = _tokenizer_parse(tokenizer, list(ids), prefix, tools)
        else:
            parsed = _parse_text(_strip_end(tokenizer.decode(list(ids), skip_special_tokens=False), tokenizer), fmt)
        if isinstance(parsed.get("content"), str):
            parsed["content"] = _strip_end(parsed["content"], tokenizer)
        if not parsed.get("content"):
            parsed["content"] = ""
        _check_calls(parsed.get("tool_calls"))
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}
    return parsed


def _tokenizer_parse(tokenizer: Any, ids: list[int], prefix: Sequence[int] | None,
                     tools: Sequence[Callable[..., Any]] | None) -> dict[str, Any]:
    """transformers' own parser; ``prefix`` and ``tools`` given where this transformers takes them."""
    parsed = None
    if prefix is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=list(prefix), tools=list(tools) if tools else None)
        except TypeError:  # a transformers whose parse_response takes no tools=
            parsed = tokenizer.parse_response(ids, prefix=list(prefix))
    else:
        parsed = tokenizer.parse_response(ids)
    if parsed is None:
        raise ValueError("nothing parsed")
    return dict(parsed)


def _check_calls(calls: Any) -> None:
    """ValueError unless ``calls`` is None or a list of well-formed function calls. Arguments absent or null are
    ``{}``; any other arguments that are not an object are kept, and the call fails as it runs (TRL's rules)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call is not a dict")
        body = call["function"] if "function" in call else call
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ValueError("a tool call without a name")
        if body.get("arguments") is None:
            body["arguments"] = {}


def tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The calls of a parsed assistant ``message`` (none: ``[]``)."""
    out = []
    for call in message.get("tool_calls") or []:
        body = call.get("function", call)
        arguments = body.get("arguments")
        out.append(ToolCall(name=body.get("name", "unknown"), arguments={} if arguments is None else arguments,
                            kind=call.get("type", "function")))
    return out
