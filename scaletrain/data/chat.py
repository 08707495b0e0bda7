"""Chat fine-tuning data: conversations -> token ids + a loss mask over the assistant turns.

Why we find the assistant tokens ourselves: most chat templates in the wild (SmolLM2,
Llama 3, Mistral, ...) have no ``{% generation %}`` markers, so ``transformers``
cannot return an assistant mask for them. For every assistant message ``i`` we render
the conversation up to ``i`` with the generation prompt (``P``) and up to and
including ``i`` (``Q``). When the template is prefix-stable (``P`` is a prefix of
``Q``, ``Q`` of the full text), the assistant turn is the text between ``len(P)`` and
``len(Q)``; we keep it up to the first special token after the message content (the
end-of-turn token, e.g. ``<|im_end|>``), so the model learns to stop but not the
newline the template writes between turns. Character spans become token masks
through the tokenizer's offsets. Templates that rewrite earlier turns fall back to
locating each message's content in order; templates *with* generation markers are
trusted as they are.

Conversations longer than ``max_length`` are truncated (``keep_end`` keeps the most
recent turns, ``keep_start`` the first) and never split across rows unless
``allow_split`` is set; one that has no assistant token left is dropped and counted.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from scaletrain.data.chat_templates import apply_chat_template
from scaletrain.data.packing import pack_pieces
from scaletrain.data.records import Messages, check_messages
from scaletrain.data.splits import LMSplits, held_out_mask, split_by_mask
from scaletrain.data.tokenizer import pad_id_of
from scaletrain.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

TruncationMode = Literal["keep_end", "keep_start"]
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class ChatCounts:
    """What happened to the conversations of one chunk (summed over chunks)."""

    conversations: int = 0
    truncated: int = 0
    split: int = 0
    no_targets: int = 0
    fallback_spans: int = 0

    def add(self, other: ChatCounts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ChatChunk:
    """Encoded samples of a chunk, grouped by conversation (a split one has several)."""

    samples: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)
    counts: ChatCounts = field(default_factory=ChatCounts)


class ChatEncoder:
    """Encodes conversations with a tokenizer's chat template; picklable for worker processes."""

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        *,
        assistant_only_loss: bool = True,
        truncation_mode: TruncationMode = "keep_end",
        allow_split: bool = False,
        chat_template: str | None = None,
    ):
        if max_length < 2:
            raise ConfigError(f"max_length must be >= 2 to have a next-token target, got {max_length}")
        if truncation_mode not in ("keep_end", "keep_start"):
            raise ConfigError(f"truncation_mode must be 'keep_end' or 'keep_start', got {truncation_mode!r}")
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            raise DataError("chat data needs a fast tokenizer (one with a tokenizer.json) for character offsets")
        try:
            template = tokenizer.get_chat_template(chat_template)
        except ValueError:
            raise DataError(
                "the tokenizer has no chat template, which chat data needs: use a chat tokenizer or set "
                "data.chat_template to a Jinja template (text or a .jinja file)"
            ) from None
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.assistant_only_loss = assistant_only_loss
        self.truncation_mode = truncation_mode
        self.allow_split = allow_split
        self.template = template
        self.has_generation_markers = bool(_GENERATION_MARKER.search(template))
        specials = set(tokenizer.all_special_tokens)
        specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
        specials.discard("")
        self._special = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) if specials else None
        )

    # ---- rendering ----------------------------------------------------------------
    def render(self, conversations: Sequence[Messages], add_generation_prompt: bool = False) -> list[str]:
        """The template's text for each conversation (one batched ``apply_chat_template`` call)."""
        return apply_chat_template(  # a template the sandbox refuses: one DataError naming the template
            self.tokenizer, list(conversations), chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _render_or_fail(self, messages: Messages, origin: str, row: int) -> str:
        try:
            return self.render([messages])[0]
        except DataError:
            raise
        except Exception as exc:  # jinja2 raises TemplateError, templates raise their own exceptions
            raise DataError(f"{origin}: row {row}: the chat template failed on this conversation: {exc}") from None

    def _end_of_turn(self, text: str, content_end: int, window_end: int) -> int:
        """End of the first special token in ``text[content_end:window_end]``, or -1."""
        if self._special is None:
            return -1
        m = self._special.search(text, content_end, window_end)
        return m.end() if m else -1

    def assistant_spans(self, text: str, messages: Messages, origin: str = "<messages>", row: int = 1
                        ) -> tuple[list[tuple[int, int]], bool]:
        """Character spans of the assistant turns in ``text`` (the rendered conversation).

        Returns the spans and whether the slower content search had to be used.
        """
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return [], False
        try:
            full = self.render([messages[: i + 1] for i in turns])
            prompts = self.render([messages[:i] for i in turns], add_generation_prompt=True)
        except DataError:
            raise
        except Exception:
            full = prompts = []
        if full and all(text.startswith(q) and q.startswith(p) for p, q in zip(prompts, full)):
            spans = []
            for i, p, q in zip(turns, prompts, full):
                start, content = len(p), messages[i]["content"]
                found = q.find(content, start) if content else start
                if found >= 0:
                    end = self._end_of_turn(q, found + len(content), len(q))
                    spans.append((start, end if end >= 0 else len(q)))
                else:  # the template transformed the content: end at its last special token
                    ends = [m.end() for m in self._special.finditer(q, start)] if self._special else []
                    spans.append((start, ends[-1] if ends else len(q)))
            return spans, False
        return self._search_spans(text, messages, origin, row), True

    def _search_spans(self, text: str, messages: Messages, origin: str, row: int) -> list[tuple[int, int]]:
        """Fallback: find each message's content in order; an assistant span runs to its end-of-turn."""
        positions = []
        cursor = 0
        for k, m in enumerate(messages):
            content = m["content"]
            pos = text.find(content, cursor) if content else cursor
            if pos < 0:
                raise DataError(
                    f"{origin}: row {row}: message {k} ({m['role']}) does not appear verbatim in the rendered "
                    "chat template, so its tokens cannot be located; use a template with {% generation %} "
                    "markers or set data.assistant_only_loss: false"
                )
            positions.append((pos, pos + len(content)))
            cursor = pos + len(content)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, content_end = positions[k]
            limit = positions[k + 1][0] if k + 1 < len(messages) else len(text)
            end = self._end_of_turn(text, content_end, limit)
            spans.append((start, end if end >= 0 else content_end))
        return spans

    # ---- encoding -------------------------------------------------------------------
    def encode_full(self, messages: Messages, origin: str = "<messages>", row: int = 1
                    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """Untruncated ``(input_ids, loss_mask, used_fallback)`` of one conversation."""
        return self._encode_many([(messages, origin, row)])[0]

    def _encode_many(self, items: Sequence[tuple[Messages, str, int]]) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        from scaletrain.data.tokenizer import plain_backend

        if self.has_generation_markers and self.assistant_only_loss:
            return [self._encode_with_markers(m, origin, row) for m, origin, row in items]
        texts = [self._render_or_fail(m, origin, row) for m, origin, row in items]
        encodings = plain_backend(self.tokenizer).encode_batch(texts, add_special_tokens=False)
        out = []
        for (messages, origin, row), text, enc in zip(items, texts, encodings):
            ids = np.asarray(enc.ids, dtype=np.int32)
            if not self.assistant_only_loss:
                out.append((ids, np.ones_like(ids), False))
                continue
            spans, fallback = self.assistant_spans(text, messages, origin, row)
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(ids.size, dtype=bool)
            nonempty = offsets[:, 1] > offsets[:, 0]
            for s, e in spans:
                mask |= nonempty & (offsets[:, 0] < e) & (offsets[:, 1] > s)
            out.append((ids, mask.astype(np.int32), fallback))
        return out

    def _encode_with_markers(self, messages: Messages, origin: str, row: int) -> tuple[np.ndarray, np.ndarray, bool]:
        try:
            enc = apply_chat_template(
                self.tokenizer, messages, chat_template=self.template, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{origin}: row {row}: the chat template failed on this conversation: {exc}") from None
        ids = np.asarray(enc["input_ids"], dtype=np.int32).reshape(-1)
        mask = np.asarray(enc["assistant_masks"], dtype=np.int32).reshape(-1)
        return ids, mask, False

    def fit(self, ids: np.ndarray, mask: np.ndarray) -> tuple[list[tuple[np.ndarray, np.ndarray]], bool, bool]:
        """Cut to ``max_length``: truncate (or split with ``allow_split``). Returns pieces, truncated, split."""
        n, length = ids.size, self.max_length
        if n <= length:
            return [(ids, mask)], False, False
        if self.allow_split:
            return [(ids[s : s + length], mask[s : s + length]) for s in range(0, n, length)], False, True
        sl = slice(n - length, n) if self.truncation_mode == "keep_end" else slice(0, length)
        return [(ids[sl], mask[sl])], True, False

    def __call__(self, items: Sequence[tuple[Messages, str, int]]) -> ChatChunk:
        """Encode a chunk of ``(messages, origin, row)``; drops pieces without any target token."""
        chunk = ChatChunk()
        for ids, mask, fallback in self._encode_many(items):
            pieces, truncated, split = self.fit(ids, mask)
            kept = [(i, m) for i, m in pieces if i.size >= 2 and m[1:].any()]
            c = chunk.counts
            c.conversations += 1
            c.truncated += truncated
            c.split += split
            c.fallback_spans += fallback
            if kept:
                chunk.samples.append(kept)
            else:
                c.no_targets += 1
        return chunk


def encode_chat(
    tokenizer: Any,
    messages: Any,
    max_length: int,
    assistant_only_loss: bool = True,
    truncation_mode: TruncationMode = "keep_end",
    *,
    chat_template: str | None = None,
) -> dict[str, np.ndarray]:
    """One conversation through the tokenizer's chat template, unpadded, at most ``max_length`` tokens.

    Returns int32 arrays ``input_ids``, ``attention_mask`` (all ones) and
    ``loss_mask``: 1 exactly on the assistant turns' tokens (their content and the
    end-of-turn token the template writes after it) with ``assistant_only_loss``,
    else 1 everywhere. A longer conversation keeps its end or its start
    (``truncation_mode``). Bad messages (unknown role, non-string content) raise
    :class:`DataError`.
    """
    try:
        checked = check_messages(messages)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    encoder = ChatEncoder(tokenizer, max_length, assistant_only_loss=assistant_only_loss,
                          truncation_mode=truncation_mode, chat_template=chat_template)
    ids, mask, _ = encoder.encode_full(checked)
    (ids, mask), = encoder.fit(ids, mask)[0]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": mask.astype(np.int32)}


def build_chat_splits(
    conversations: Iterable[tuple[Messages, str, int]],
    tokenizer: Any,
    max_length: int,
    eval_fraction: float = 0.05,
    seed: int = 0,
    *,
    eval_conversations: Iterable[tuple[Messages, str, int]] | None = None,
    assistant_only_loss: bool = True,
    truncation_mode: TruncationMode = "keep_end",
    allow_split: bool = False,
    chat_template: str | None = None,
    name: str = "the chat data",
    chunk_size: int = 256,
    num_workers: int = 0,
) -> LMSplits:
    """Encode ``(messages, origin, row)`` triples and pack them into train/eval rows with a loss mask.

    Streams: conversations are encoded in chunks of ``chunk_size`` (in
    ``num_workers`` processes if > 0) and only token arrays are kept. ``eval_fraction``
    of the conversations (seeded) are held out, unless ``eval_conversations`` are
    given. Each conversation is one segment of a packed row (several with
    ``allow_split``), so attention and positions restart per conversation.
    """
    from scaletrain.data.workers import chunked, map_chunks

    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    encoder = ChatEncoder(tokenizer, max_length, assistant_only_loss=assistant_only_loss,
                          truncation_mode=truncation_mode, allow_split=allow_split, chat_template=chat_template)
    t0 = time.perf_counter()

    def encode(items: Iterable[tuple[Messages, str, int]]) -> tuple[list[list[tuple[np.ndarray, np.ndarray]]], ChatCounts]:
        groups: list[list[tuple[np.ndarray, np.ndarray]]] = []
        counts = ChatCounts()
        for chunk in map_chunks(encoder, chunked(items, chunk_size), num_workers):
            groups.extend(chunk.samples)
            counts.add(chunk.counts)
        return groups, counts

    groups, counts = encode(conversations)
    if counts.conversations == 0:
        raise DataError(f"{name} is empty: no conversations to train on")
    if not groups:
        raise DataError(
            f"{name}: none of its {counts.conversations} conversations has an assistant token to learn "
            f"(within max_length={max_length} after {truncation_mode} truncation)"
        )
    if eval_conversations is not None:
        eval_groups, eval_counts = encode(eval_conversations)
        if not eval_groups:
            raise DataError("the eval source has no conversation with an assistant token")
        train_groups = groups
    else:
        eval_counts = ChatCounts()
        is_eval = held_out_mask(len(groups), eval_fraction, seed, lambda: (
            f"{name} has a single usable conversation: too few to hold out an eval "
            "split; add data or set eval_fraction=0"
        ))
        train_groups, eval_groups = split_by_mask(groups, is_eval)

    pad_id = pad_id_of(tokenizer)

    def pack(group_list: list[list[tuple[np.ndarray, np.ndarray]]]) -> Any:
        samples = [s for g in group_list for s in g]
        return pack_pieces([s[0] for s in samples], max_length, pad_id, loss_masks=[s[1] for s in samples])

    train, evals = pack(train_groups), pack(eval_groups)
    seconds = time.perf_counter() - t0
    samples = sum(len(g) for g in groups)
    tokens = sum(s[0].size for g in groups for s in g)
    stats: dict[str, Any] = {
        "kind": "chat",
        "conversations": counts.conversations,
        "samples": samples,
        "tokens": int(tokens),
        "truncated": counts.truncated,
        "split": counts.split,
        "dropped_no_assistant_tokens": counts.no_targets,
        "located_by_search": counts.fallback_spans,
        "max_length": max_length,
        "train_rows": train.num_rows,
        "train_tokens": train.num_tokens,
        "train_loss_tokens": train.num_loss_tokens,
        "train_packing_efficiency": train.packing_efficiency,
        "eval_rows": evals.num_rows,
        "eval_tokens": evals.num_tokens,
        "eval_loss_tokens": evals.num_loss_tokens,
        "eval_packing_efficiency": evals.packing_efficiency,
    }
    if eval_conversations is not None:
        stats["eval_conversations"] = eval_counts.conversations
    if counts.no_targets:
        logger.warning("%d conversations have no assistant token within max_length=%d and were dropped",
                       counts.no_targets, max_length)
    logger.info(
        "encoded %d conversations into %d tokens (%d truncated, %d split) and packed them in %.2fs: "
        "%d train rows, %d eval rows of %d (packing efficiency %.3f, %.1f%% of tokens are targets)",
        counts.conversations, tokens, counts.truncated, counts.split, seconds, train.num_rows, evals.num_rows,
        max_length, train.packing_efficiency, 100.0 * train.num_loss_tokens / max(train.num_tokens, 1),
    )
    return LMSplits(train=train, eval=evals, eval_bytes_per_token=float("nan"), stats=stats)
