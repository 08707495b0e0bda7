"""Preference data (DPO, IPO, ORPO, SimPO; KTO): checked rows -> token ids -> fixed-shape rows.

Why TRL's preparation, step for step: people check a preference run against TRL, and the
same dataset must give the same token ids and the same completion tokens, or the
log-probabilities (and every reward) differ before any formula does. TRL 1.16's
``DPOTrainer`` and ``KTOTrainer`` prepare a row so:

1. a text completion gets the tokenizer's eos token appended (unless it ends with it);
   conversations get their end of turn from the chat template;
2. the prompt is tokenized alone (conversations: through the chat template with the
   generation prompt) and together with each completion (``prompt + completion``, the
   messages concatenated for conversations); the completion starts where the two
   token lists diverge (for pairs, the earlier divergence of chosen and rejected), so a
   token merged across the boundary belongs to the completion;
3. ``prompt + completion`` is cut to ``max_length`` (``keep_start``: its start, TRL's
   default and a recipe's for these kinds; ``keep_end``: its end), and a row whose prompt
   alone fills ``max_length`` under ``keep_start`` is dropped (we name it as a bad row
   instead); the rows cut are counted in one WARNING line saying what they lose;
4. the loss covers the completion tokens only.

``data.max_prompt_length`` (TRL 1.16's DPO has none; earlier TRL's name) first cuts the
prompt to that many tokens, on ``truncation_mode``'s side. KTO's KL-estimate rows pair
each prompt with the completion of the row before it (the first with the last one's),
TRL's rotation by one, over each split.

Every sequence is right-padded to ``max_length`` (one compiled shape): ``*_segment_ids``
are 1 on real tokens and 0 on padding, ``*_loss_mask`` 1 on completion tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaletrain.data.chat_templates import apply_chat_template
from scaletrain.data.preference_rows import PairExample, UnpairedExample, iter_pairs, iter_unpaired
from scaletrain.data.records import BadRows
from scaletrain.data.splits import LMSplits, held_out_mask, split_by_mask
from scaletrain.data.table import FixedRows
from scaletrain.data.tokenizer import pad_id_of
from scaletrain.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

#: the keys a row of each kind is served under (``training.max_length`` = L)
PAIR_KEYS = ("chosen_input_ids", "chosen_segment_ids", "chosen_loss_mask",
             "rejected_input_ids", "rejected_segment_ids", "rejected_loss_mask")  # each [B, L]
#: served beside them, [B] float32, when the source has TRL's ``margin`` column (a reward model's loss reads it)
MARGIN_KEY = "margin"
UNPAIRED_KEYS = ("input_ids", "segment_ids", "loss_mask", "label",  # label: [B]
                 "kl_input_ids", "kl_segment_ids", "kl_loss_mask")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Encoded:
    """One example's tokens: the prompt and one completion per sequence (pairs: chosen, rejected).

    ``prompts`` gives each completion its own prompt tokens where they differ (TRL's ORPO/CPO
    preparation, :mod:`scaletrain.data.preference_legacy`); None: ``prompt`` for all.
    """

    prompt: list[int]
    completions: tuple[list[int], ...]
    label: bool | None
    origin: str
    row: int
    prompts: tuple[list[int], ...] | None = None
    margin: float | None = None  # a pair's ``margin`` column value (TRL's RewardTrainer), when the data has one

    def prompt_of(self, i: int) -> list[int]:
        """The prompt tokens before completion ``i``."""
        return self.prompt if self.prompts is None else self.prompts[i]


@dataclass(frozen=True)
class Refused:
    """A row the encoder cannot use, and why (sent to the bad-row policy in the main process)."""

    problem: str
    origin: str
    row: int


class PreferenceEncoder:
    """Tokenizes checked examples as TRL 1.16's trainers do; picklable for worker processes.

    Called on a chunk of examples, returns an :class:`Encoded` or a :class:`Refused` for each.
    """

    def __init__(self, tokenizer: Any, max_length: int, truncation_mode: str = "keep_start",
                 max_prompt_length: int | None = None):
        if max_length < 2:
            raise ConfigError(f"training.max_length must be >= 2 to have a completion token, got {max_length}")
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ConfigError(f"training.truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}")
        if max_prompt_length is not None and max_prompt_length >= max_length:
            raise ConfigError(f"data.max_prompt_length={max_prompt_length} must be below training.max_length="
                              f"{max_length}, or no completion token is left")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.max_prompt_length = max_prompt_length

    # ---- tokenizing, in batches of one form ------------------------------------------
    def _text_ids(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts)["input_ids"]] if texts else []

    def _chat_ids(self, conversations: list[Any], add_generation_prompt: bool) -> list[list[int]]:
        if not conversations:
            return []
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError("conversational preference rows need a chat template, and the tokenizer has none: use a "
                            "chat tokenizer or set data.chat_template to a Jinja template (text or a .jinja file)")
        out = apply_chat_template(self.tokenizer, conversations, tokenize=True, return_dict=True,
                                  add_generation_prompt=add_generation_prompt)
        return [list(ids) for ids in out["input_ids"]]

    def _eos_text(self) -> str:
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos:
            raise DataError("text preference data needs a tokenizer with an eos token (TRL appends it to every "
                            "completion); use a tokenizer that has one or conversational rows")
        return eos

    def _tokenize(self, prompts: list[Any], completions: list[list[Any]], conversational: bool
                  ) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Prompt ids and, per completion slot, prompt+completion ids of every example."""
        if conversational:
            return (self._chat_ids(prompts, True),
                    [self._chat_ids([p + c for p, c in zip(prompts, slot)], False) for slot in completions])
        eos = self._eos_text()
        with_eos = [[c if c.endswith(eos) else c + eos for c in slot] for slot in completions]
        return self._text_ids(prompts), [self._text_ids([p + c for p, c in zip(prompts, slot)]) for slot in with_eos]

    def _encode_group(self, examples: list[PairExample | UnpairedExample], conversational: bool
                      ) -> list[Encoded | Refused]:
        prompts = [e.prompt for e in examples]
        if isinstance(examples[0], PairExample):
            slots = [[e.chosen for e in examples], [e.rejected for e in examples]]  # type: ignore[union-attr]
        else:
            slots = [[e.completion for e in examples]]  # type: ignore[union-attr]
        prompt_ids, full_ids = self._tokenize(prompts, slots, conversational)
        out: list[Encoded | Refused] = []
        for i, e in enumerate(examples):
            fulls = [slot[i] for slot in full_ids]
            start = min(common_prefix_length(prompt_ids[i], f) for f in fulls)
            label = e.label if isinstance(e, UnpairedExample) else None
            margin = e.margin if isinstance(e, PairExample) else None
            out.append(self._check(Encoded(prompt_ids[i][:start], tuple(f[start:] for f in fulls), label,
                                           e.origin, e.row, margin=margin)))
        return out

    def _check(self, enc: Encoded) -> Encoded | Refused:
        """The row, or why the cut would leave it without a completion token."""
        if any(not c for c in enc.completions):
            return Refused("a completion has no token of its own after the prompt's (check the chat template)",
                           enc.origin, enc.row)
        prompt = len(self.cut_prompt(enc.prompt))
        if self.truncation_mode == "keep_start" and prompt >= self.max_length:
            return Refused(f"the prompt is {prompt} tokens, which fills training.max_length={self.max_length}: no "
                           "completion token would be left (raise training.max_length, set data.max_prompt_length "
                           "or shorten the prompt)", enc.origin, enc.row)
        return enc

    def __call__(self, examples: Sequence[PairExample | UnpairedExample]) -> list[Encoded | Refused]:
        """Encode a chunk (its text and conversational examples in one batch each), in order."""
        out: list[Encoded | Refused | None] = [None] * len(examples)
        for conversational in (False, True):
            where = [i for i, e in enumerate(examples) if e.conversational == conversational]
            if not where:
                continue
            group = [examples[i] for i in where]
            try:
                encoded = self._encode_group(group, conversational)
            except DataError:
                raise
            except Exception:  # a template that fails on one conversation: find it, name its row
                encoded = [self._encode_one(e, conversational) for e in group]
            for i, enc in zip(where, encoded):
                out[i] = enc
        return out  # type: ignore[return-value]

    def _encode_one(self, example: PairExample | UnpairedExample, conversational: bool) -> Encoded | Refused:
        try:
            return self._encode_group([example], conversational)[0]
        except DataError:
            raise
        except Exception as exc:
            return Refused(f"the chat template failed on this row: {exc}", example.origin, example.row)

    # ---- cutting to max_length ----------------------------------------------------------
    def cut_prompt(self, ids: list[int]) -> list[int]:
        """The prompt after ``max_prompt_length`` (its start or end, as ``truncation_mode`` says)."""
        n = self.max_prompt_length
        if n is None or len(ids) <= n:
            return ids
        return ids[:n] if self.truncation_mode == "keep_start" else ids[len(ids) - n:]

    def fit(self, prompt: list[int], completion: list[int]) -> tuple[list[int], list[int], bool]:
        """``(ids, loss_mask, truncated)`` of ``prompt + completion`` cut to ``max_length``."""
        prompt = self.cut_prompt(prompt)
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
        if len(ids) <= self.max_length:
            return ids, mask, False
        sl = slice(0, self.max_length) if self.truncation_mode == "keep_start" else slice(len(ids) - self.max_length,
                                                                                           None)
        return ids[sl], mask[sl], True

    def what_a_cut_loses(self) -> str:
        """What a sequence cut to ``max_length`` loses, for the warning that counts them."""
        if self.truncation_mode == "keep_end":
            return ("keep_end: each lost its start, the prompt's first tokens, so it trains on a completion to a "
                    "prompt it does not see whole")
        return "keep_start: the end of a completion is not trained on"


class _Sequences:
    """``[N, L]`` ids, segment ids and loss mask of one sequence per row, right-padded."""

    def __init__(self, n: int, length: int, pad_id: int):
        self.ids = np.full((n, length), pad_id, np.int32)
        self.segments = np.zeros((n, length), np.int32)
        self.mask = np.zeros((n, length), np.int32)
        self.truncated = 0
        self.tokens = 0

    def put(self, r: int, fitted: tuple[list[int], list[int], bool]) -> None:
        ids, mask, truncated = fitted
        k = len(ids)
        self.ids[r, :k] = ids
        self.segments[r, :k] = 1
        self.mask[r, :k] = mask
        self.truncated += truncated
        self.tokens += k

    def columns(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}input_ids": self.ids, f"{prefix}segment_ids": self.segments, f"{prefix}loss_mask": self.mask}


def pair_rows(encoded: Sequence[Encoded], encoder: PreferenceEncoder, pad_id: int) -> FixedRows:
    """The served rows of encoded pairs: ``chosen_*`` and ``rejected_*`` (:data:`PAIR_KEYS`)."""
    n, length = len(encoded), encoder.max_length
    chosen, rejected = _Sequences(n, length, pad_id), _Sequences(n, length, pad_id)
    cut: list[str] = []
    for r, e in enumerate(encoded):
        fitted = encoder.fit(e.prompt_of(0), e.completions[0]), encoder.fit(e.prompt_of(1), e.completions[1])
        chosen.put(r, fitted[0])
        rejected.put(r, fitted[1])
        if fitted[0][2] or fitted[1][2]:
            cut.append(f"{e.origin}: row {e.row}")
    stats = {"rows": n, "truncated": chosen.truncated + rejected.truncated, "tokens": chosen.tokens + rejected.tokens,
             **_cut_stats(cut)}
    margins = {}
    if any(e.margin is not None for e in encoded):  # the source has a margin column: every checked row has one
        margins = {MARGIN_KEY: np.asarray([e.margin for e in encoded], np.float32).reshape(n)}
    return FixedRows({**chosen.columns("chosen_"), **rejected.columns("rejected_"), **margins},
                     pad_values={"chosen_input_ids": pad_id, "rejected_input_ids": pad_id}, stats=stats)


def unpaired_rows(encoded: Sequence[Encoded], encoder: PreferenceEncoder, pad_id: int) -> FixedRows:
    """The served rows of encoded KTO rows (:data:`UNPAIRED_KEYS`); row i's KL completion is row i-1's."""
    n, length = len(encoded), encoder.max_length
    main, kl = _Sequences(n, length, pad_id), _Sequences(n, length, pad_id)
    cut: list[str] = []
    for r, e in enumerate(encoded):
        fitted = encoder.fit(e.prompt, e.completions[0])
        main.put(r, fitted)
        kl.put(r, encoder.fit(e.prompt, encoded[r - 1].completions[0]))  # r = 0 takes the last row's
        if fitted[2]:
            cut.append(f"{e.origin}: row {e.row}")
    labels = np.asarray([bool(e.label) for e in encoded], np.int32).reshape(n)
    stats = {"rows": n, "desirable": int(labels.sum()), "truncated": main.truncated, "tokens": main.tokens,
             **_cut_stats(cut)}
    return FixedRows({**main.columns(""), "label": labels, **kl.columns("kl_")},
                     pad_values={"input_ids": pad_id, "kl_input_ids": pad_id}, stats=stats)


def _cut_stats(cut: list[str]) -> dict[str, Any]:
    """``rows_cut`` (rows with a sequence cut to ``max_length``) and the first such row, for the warning."""
    return {"rows_cut": len(cut), **({"first_row_cut": cut[0]} if cut else {})}


def _warn_of_cut_rows(stats: dict[str, Any], encoder: PreferenceEncoder, what: str) -> None:
    """One WARNING line counting the rows cut to ``max_length`` and saying what they lose (silent if none).

    Why a warning and not an INFO line: a cut row trains on something else than the row (under ``keep_end``
    a completion to a prompt without its start), and a user who checks figures against TRL's must know."""
    cut = stats.get("train_rows_cut", 0) + stats.get("eval_rows_cut", 0)
    if not cut:
        return
    first = stats.get("train_first_row_cut") or stats.get("eval_first_row_cut")
    total = stats.get("train_rows", 0) + stats.get("eval_rows", 0)
    logger.warning("training.max_length=%d cut %d of %d preference %s (%s; e.g. %s): raise training.max_length to "
                   "keep them whole", encoder.max_length, cut, total, what, encoder.what_a_cut_loses(), first)


def _encode_all(examples: Iterable[PairExample | UnpairedExample], encoder: PreferenceEncoder, bad: BadRows,
                num_workers: int, chunk_size: int, name: str, what: str) -> list[Encoded]:
    """Every usable example's tokens, in order; the refused ones go to ``bad`` (which raises unless it skips)."""
    from scaletrain.data.workers import chunked, map_chunks

    kept: list[Encoded] = []
    seen = 0
    for chunk in map_chunks(encoder, chunked(examples, chunk_size), num_workers):
        for enc in chunk:
            seen += 1
            if isinstance(enc, Refused):
                bad(enc.origin, enc.row, enc.problem)
            else:
                kept.append(enc)
    if not kept:
        raise DataError(f"{name} has no usable preference {what}" + (f" ({seen} were bad rows)" if seen else ""))
    return kept


def build_preference_splits(
    examples: Iterable[PairExample | UnpairedExample],
    tokenizer: Any,
    max_length: int,
    *,
    paired: bool = True,
    eval_fraction: float = 0.05,
    seed: int = 0,
    eval_examples: Iterable[PairExample | UnpairedExample] | None = None,
    truncation_mode: str = "keep_start",
    max_prompt_length: int | None = None,
    bad: BadRows | None = None,
    name: str = "the preference data",
    num_workers: int = 0,
    chunk_size: int = 256,
    encoder: PreferenceEncoder | None = None,
) -> LMSplits:
    """Encode checked examples and split them into train/eval :class:`FixedRows`.

    ``eval_fraction`` of the examples (seeded, :func:`held_out_mask`) are held out, unless
    ``eval_examples`` are given. Rows the cut would leave without a completion go to
    ``bad`` with their file and row (raised unless it skips). ``train`` and ``eval`` are
    served under :data:`PAIR_KEYS` (``paired``) or :data:`UNPAIRED_KEYS`. ``encoder``
    replaces TRL's DPO/KTO preparation (e.g. by the ORPO/CPO one; it carries the lengths).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
    bad = bad if bad is not None else BadRows()
    encoder = encoder or PreferenceEncoder(tokenizer, max_length, truncation_mode, max_prompt_length)
    t0 = time.perf_counter()
    what = "pairs" if paired else "rows"
    encoded = _encode_all(examples, encoder, bad, num_workers, chunk_size, name, what)
    if eval_examples is not None:
        held = _encode_all(eval_examples, encoder, bad, num_workers, chunk_size, "the eval source", what)
        train_enc = encoded
    else:
        is_eval = held_out_mask(len(encoded), eval_fraction, seed, lambda: (
            f"{name} has a single usable {what[:-1]}: too few to hold out an eval split; add data or set "
            "data.eval_fraction: 0"))
        train_enc, held = split_by_mask(encoded, is_eval)
    rows_of = pair_rows if paired else unpaired_rows
    pad_id = pad_id_of(tokenizer)
    train, evals = rows_of(train_enc, encoder, pad_id), rows_of(held, encoder, pad_id)
    stats: dict[str, Any] = {
        "kind": "preference" if paired else "unpaired_preference",
        what: len(encoded),
        "max_length": max_length,
        "truncation_mode": truncation_mode,
        "max_prompt_length": max_prompt_length,
        "prompt_tokens": int(sum(len(encoder.cut_prompt(e.prompt)) for e in encoded)),
        "completion_tokens": int(sum(len(c) for e in encoded for c in e.completions)),
        **{f"train_{k}": v for k, v in train.stats.items()},
        **{f"eval_{k}": v for k, v in evals.stats.items()},
    }
    logger.info("encoded %d preference %s in %.2fs: %d train rows, %d eval rows of %d tokens (%d sequences cut)",
                len(encoded), what, time.perf_counter() - t0, train.num_rows, evals.num_rows, max_length,
                stats["train_truncated"] + stats["eval_truncated"])
    _warn_of_cut_rows(stats, encoder, what)
    return LMSplits(train=train, eval=evals, eval_bytes_per_token=float("nan"), stats=stats)  # type: ignore[arg-type]


def build_preference(data: Any, rows: Any, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                     truncation_mode: str, paired: bool = True, encoder: PreferenceEncoder | None = None
                     ) -> LMSplits:
    """The ``preference`` / ``unpaired_preference`` data kinds' builder (``data.chat_template`` is already set
    on the tokenizer by :mod:`scaletrain.data.kinds`)."""
    read = iter_pairs if paired else iter_unpaired
    held = None if not data.eval_source else read(rows, data.eval_source, data.eval_split, data, bad)
    return build_preference_splits(
        read(rows, data.source, data.split, data, bad, data.max_documents), tokenizer, max_length,
        paired=paired, eval_fraction=data.eval_fraction, seed=seed, eval_examples=held,
        truncation_mode=truncation_mode, max_prompt_length=data.max_prompt_length, bad=bad,
        name=f"data.source {data.source!r}", num_workers=data.num_workers, encoder=encoder,
    )
