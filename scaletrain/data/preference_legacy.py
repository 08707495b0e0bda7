"""Pairs prepared as TRL 1.16's ``ORPOTrainer`` and ``CPOTrainer`` prepare them (``data.preparation: trl_orpo``).

Why a second preparation: in TRL 1.16 those two trainers (still under ``trl.experimental``)
keep the older tokenization that ``DPOTrainer`` left behind, and it gives other token ids
for the same pair whenever the tokenizer has a bos token or merges tokens across the
prompt boundary. A SimPO or ORPO run checked against TRL needs TRL's ids, so:

1. a conversation is first rendered to text by the chat template: the prompt with the
   generation prompt (or continuing a final assistant turn), each completion as the text
   the full conversation adds after the prompt's longest shared start;
2. text is tokenized without special tokens; ``prompt + completion`` is tokenized whole
   and the prompt's share is the tokenized prompt's length, one token less if the last
   prompt token merged with the completion (each completion keeps its own prompt share;
   shares that differ by more than one token are a bad row);
3. the bos token is put before a prompt that does not start with it, the eos token id
   after a completion that does not end with it;
4. a sequence longer than ``max_length`` loses the end of its completion (the prompt is
   never cut; one that fills ``max_length`` is a bad row). ``training.truncation_mode``
   is not read; ``data.max_prompt_length`` still cuts each prompt share first.
"""

from __future__ import annotations

import functools
from itertools import takewhile
from typing import Any

from scaletrain.data.chat_templates import apply_chat_template
from scaletrain.data.preference import Encoded, PreferenceEncoder, Refused
from scaletrain.data.preference_rows import PairExample, UnpairedExample
from scaletrain.errors import DataError


def _shared_start(a: str, b: str) -> str:
    return "".join(x for x, _ in takewhile(lambda xy: xy[0] == xy[1], zip(a, b)))


class OrpoPairEncoder(PreferenceEncoder):
    """:class:`PreferenceEncoder` with TRL 1.16's ORPO/CPO row preparation (pairs only)."""

    def _render(self, example: PairExample) -> tuple[str, str, str]:
        """``(prompt, chosen, rejected)`` as text: conversations through the chat template."""
        if not example.conversational:
            return example.prompt, example.chosen, example.rejected  # type: ignore[return-value]
        last = example.prompt[-1]["role"] if example.prompt else None
        if last not in ("user", "tool", "assistant"):
            raise ValueError(f"the prompt's last message is {last!r}: it must be a user, tool or assistant turn")
        render = functools.partial(apply_chat_template, self.tokenizer)  # a sandbox refusal names the template
        prompt = render(example.prompt, tokenize=False, add_generation_prompt=last != "assistant",
                        continue_final_message=last == "assistant")
        full = [render(example.prompt + c, tokenize=False) for c in (example.chosen, example.rejected)]
        for text in full:
            prompt = _shared_start(prompt, text)
        return prompt, full[0][len(prompt):], full[1][len(prompt):]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _split(self, prompt: str, answer: str) -> tuple[list[int], list[int]]:
        """``(prompt share, answer ids)`` of ``prompt + answer`` tokenized whole."""
        full, alone = self._ids(prompt + answer), self._ids(prompt)
        start = len(alone)
        if alone != full[:start]:  # the last prompt token merged with the answer's first
            start -= 1
        return full[:start], full[start:]

    def _encode_pair(self, example: PairExample) -> Encoded | Refused:
        try:
            prompt, chosen, rejected = self._render(example)
        except ValueError as exc:
            return Refused(str(exc), example.origin, example.row)
        (chosen_prompt, chosen_ids), (rejected_prompt, rejected_ids) = self._split(prompt, chosen), \
            self._split(prompt, rejected)
        if (sum(a != b for a, b in zip(chosen_prompt, rejected_prompt)) > 1
                or abs(len(chosen_prompt) - len(rejected_prompt)) > 1):
            return Refused("chosen and rejected tokenize the prompt differently by more than its last token",
                           example.origin, example.row)
        bos, eos = getattr(self.tokenizer, "bos_token_id", None), self.tokenizer.eos_token_id
        prompts, answers = [], []
        for share, answer in ((chosen_prompt, chosen_ids), (rejected_prompt, rejected_ids)):
            if bos is not None and (not share or share[0] != bos):
                share = [bos, *share]
            if not answer or answer[-1] != eos:
                answer = [*answer, eos]
            prompts.append(share)
            answers.append(answer)
        return self._check(Encoded(prompts[0], tuple(answers), None, example.origin, example.row,
                                   prompts=tuple(prompts), margin=example.margin))

    def __call__(self, examples: Any) -> list[Encoded | Refused]:
        out: list[Encoded | Refused] = []
        for example in examples:
            if isinstance(example, UnpairedExample):
                raise TypeError("the trl_orpo preparation is for pairs; KTO rows are prepared as KTOTrainer does")
            if example.conversational and not getattr(self.tokenizer, "chat_template", None):
                self._chat_ids([example.prompt], True)  # raises the DataError that names data.chat_template
            try:
                out.append(self._encode_pair(example))
            except DataError:  # a template the sandbox refuses: the template's problem, not this row's
                raise
            except Exception as exc:  # a template that fails on this conversation
                out.append(Refused(f"the chat template failed on this row: {exc}", example.origin, example.row))
        return out

    def _check(self, enc: Encoded) -> Encoded | Refused:
        longest = max(len(self.cut_prompt(p)) for p in (enc.prompts or (enc.prompt,)))
        if longest >= self.max_length:
            return Refused(f"the prompt is {longest} tokens, which fills training.max_length={self.max_length}: no "
                           "completion token would be left (raise training.max_length, set data.max_prompt_length "
                           "or shorten the prompt)", enc.origin, enc.row)
        return enc

    def what_a_cut_loses(self) -> str:
        return "as TRL's ORPO/CPO trainers: the end of a completion is not trained on"

    def fit(self, prompt: list[int], completion: list[int]) -> tuple[list[int], list[int], bool]:
        """The completion's end is cut to make room; the prompt stays whole (after ``max_prompt_length``)."""
        prompt = self.cut_prompt(prompt)
        room = self.max_length - len(prompt)
        cut = completion[:room]
        return prompt + cut, [0] * len(prompt) + [1] * len(cut), len(cut) < len(completion)
