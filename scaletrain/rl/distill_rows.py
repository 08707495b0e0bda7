"""The rows a distillation step reads that the student did not sample: the dataset's completions, as a rollout.

Why a rollout: GKD's off-policy steps (``lmbda`` < 1) train on the dataset's own completions, and a test or a
user may hand fixed completions to ``DistillationTrainer`` through a rollout engine; laid out as the engine lays
out its samples (prompts left-padded, completions right-padded to ``max_completion_length``, one mask), the step
that follows is the same program whatever made the rows.

Completions come in TRL's formats: a ``completion`` column (text, tokenized without special tokens and ended with
the EOS token, as TRL's SFT prompt-completion rows; or assistant messages, the chat template's tokens after the
prompt's), or, for a ``prompt`` of messages with no ``completion`` column, its last assistant message (TRL's GKD
``messages`` rows): the prompt is then the messages before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.data.prompts import PromptRow, is_messages, tokenize_prompt
from scaletrain.errors import DataError


def split_last_reply(row: PromptRow, tokenizer: Any, max_prompt_length: int | None) -> PromptRow:
    """``row`` whose prompt is messages ending with an assistant message and which has no ``completion`` column:
    the prompt without that message (tokenized again) and the message as its ``completion``; else ``row``."""
    prompt = row.prompt
    if "completion" in row.columns or not is_messages(prompt) or prompt[-1].get("role") != "assistant":
        return row
    ids = tokenize_prompt(tokenizer, prompt[:-1])
    if max_prompt_length is not None:
        ids = ids[-max_prompt_length:]
    return PromptRow(tuple(ids), prompt[:-1], {**row.columns, "completion": prompt[-1:]})


def completion_ids(row: PromptRow, tokenizer: Any, eos_id: int, where: str) -> list[int]:
    """The token ids of ``row``'s dataset completion (see the module docstring); DataError naming ``where``."""
    completion = row.columns.get("completion")
    if isinstance(completion, str) and completion:
        return [int(i) for i in tokenizer(completion, add_special_tokens=False)["input_ids"]] + [eos_id]
    if is_messages(completion) and is_messages(row.prompt):
        from scaletrain.data.chat_templates import apply_chat_template

        full = apply_chat_template(tokenizer, [*row.prompt, *completion], tokenize=True)
        full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "keys") else full
        prefix = tokenize_prompt(tokenizer, row.prompt)
        if list(full[:len(prefix)]) != prefix:
            raise DataError(f"{where}: the chat template does not render the prompt as a prefix of prompt + "
                            "completion; give the completion as text")
        return [int(i) for i in full[len(prefix):]]
    raise DataError(f"{where}: no completion to train on off-policy (objective.lmbda < 1): give a 'completion' "
                    "column (text, or assistant messages after a messages prompt) or end the prompt's messages with "
                    "the assistant's reply; or set objective.lmbda: 1 (every step samples from the student)")


def with_completions(rows: Sequence[PromptRow], tokenizer: Any, eos_id: int,
                     max_prompt_length: int | None) -> tuple[list[PromptRow], list[list[int]]]:
    """``(rows, completions)``: each row as :func:`split_last_reply` leaves it, and its completion's ids."""
    out, completions = [], []
    for number, row in enumerate(rows, start=1):
        row = split_last_reply(row, tokenizer, max_prompt_length)
        out.append(row)
        completions.append(completion_ids(row, tokenizer, eos_id, f"dataset_train row {number}"))
    return out, completions


@dataclasses.dataclass(frozen=True)
class FixedRollout:
    """A rollout's host arrays (:class:`~scaletrain.generation.engine.Rollout`'s fields but ``steps``)."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    log_probs: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)


def fixed_rollout(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], width: int, pad_id: int,
                  stop_ids: Sequence[int]) -> FixedRollout:
    """Prompts left-padded to the longest, completions cut to ``width`` tokens and right-padded to it; a row is
    ``truncated`` when its last kept token is not a stop token (TRL's ``completions/clipped_ratio``)."""
    n, p = len(prompts), max(len(x) for x in prompts)
    prompt_ids = np.full((n, p), pad_id, np.int32)
    prompt_mask = np.zeros((n, p), np.int32)
    comp_ids = np.full((n, width), pad_id, np.int32)
    comp_mask = np.zeros((n, width), np.int32)
    lengths = np.zeros(n, np.int32)
    truncated = np.zeros(n, bool)
    for r, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[r, p - len(prompt):], prompt_mask[r, p - len(prompt):] = prompt, 1
        kept = list(completion)[:width]
        comp_ids[r, :len(kept)], comp_mask[r, :len(kept)] = kept, 1
        lengths[r] = len(kept)
        truncated[r] = not kept or kept[-1] not in stop_ids
    return FixedRollout(prompt_ids, prompt_mask, comp_ids, comp_mask, np.zeros((n, width), np.float32), lengths,
                        truncated)
