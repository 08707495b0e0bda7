"""Multi-turn rollouts on a real tiny model: a row's turns are keyed by the row (every engine takes the ids its rows
are keyed by), and the overlapped loop (rows that are not waiting on their environment keep decoding) gives the
turn-by-turn loop's episodes.

The model is a random one-layer Llama over the byte-level chat tokenizer of ``agentic_testing``; it writes no
tool calls, so the rows' work between turns is a multi-turn environment's ``step`` (it runs on the same thread
pool, under the same timeout, through the same loop as tool calls). A third of the vocabulary stops a turn, so
turns are a few tokens long and the user turns between them fit ``max_completion_length``.

Tolerances: ids, masks, messages and figures must be equal; log-probabilities within 2e-6, the continuous engine
tests' tolerance for a row decoded beside other neighbours (both loops run the same programs, shaped alike).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from agentic_testing import chatml_tokenizer, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")

TEMPLATE = ("{% for m in messages %}<{{ m.role[0] }}>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")  # short user turns: the trajectories stay short
CAP = 64
LP_TOL = 2e-6
ROWS = 6


class Talk:
    """Replies "Go on." to ``replies`` model turns, then ends the episode (reward 1 a reply). ``wait``: an event its
    first ``step`` waits for (up to the tool timeout) before replying; ``opens``: an event its second ``step``
    sets. ``log`` records (name, step) as each step returns."""

    def __init__(self, name, replies, log, wait=None, opens=None):
        self.name, self.replies, self.log, self.wait, self.opens, self.said = name, replies, log, wait, opens, 0

    def step(self, action):
        self.said += 1
        if self.said == 1 and self.wait is not None:
            self.wait.wait(60.0)
        if self.said == 2 and self.opens is not None:
            self.opens.set()
        self.log.append((self.name, self.said))
        if self.said > self.replies:
            return None
        return "Go on.", 1.0, False


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_position_embeddings=512)


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer(template=TEMPLATE)


def sampling(temperature):
    from scaletrain.generation import SamplingParams

    return SamplingParams(max_completion_length=CAP, temperature=temperature,
                          stop_token_ids=(256, *range(0, 256, 3)), pad_token_id=257)


def rollout(model, tok, replies, *, overlap=True, gated=False, temperature=1.0, keep_pages=True, cache_pages=None,
            stats=None):
    """The multi-turn rollout on the continuous engine of ``ROWS`` prompts (one sample each) whose row ``r`` talks
    ``replies[r]`` turns;
    ``gated``: row 0's first step waits until row 1's second step (only an overlapped run gets there in time);
    ``keep_pages``, ``cache_pages``: the engine's; ``stats``: a dict the engine's stats are copied into."""
    from scaletrain.generation.continuous import ContinuousBatchEngine
    from scaletrain.rl.agent_engine import MultiTurnEngine
    from scaletrain.rl.chat_turns import prompt_ids
    from scaletrain.rl.tools import Toolbox

    log = []
    gate = threading.Event() if gated else None
    envs = [Talk(r, n, log, wait=gate if r == 0 else None, opens=gate if r == 1 else None)
            for r, n in enumerate(replies)]
    inner = ContinuousBatchEngine(sampling(temperature), slots=4, page_size=16, decode_steps=8,
                                  keep_pages=keep_pages, cache_pages=cache_pages)
    multi = MultiTurnEngine(inner, tok, lambda n: [], "text", tool_timeout=60.0, overlap=overlap)
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"row {r}: talk."}], None) for r in range(ROWS)]
    out = multi.generate(model, prompts, seed=5, step=2, toolboxes=[Toolbox([], env) for env in envs])
    if stats is not None:
        stats.update(inner.stats)
    return multi.last_episodes, out, log


def same_episode(a, b):
    assert a.completion_ids == b.completion_ids and a.tool_mask == b.tool_mask and a.messages == b.messages
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=LP_TOL)
    for field in ("turns", "environment_steps", "environment_failures", "environment_rewards", "environment_tokens",
                  "tool_calls", "tool_failures", "done"):
        assert getattr(a, field) == getattr(b, field), field


def test_static_engine_keys_a_row_by_the_id_it_is_given_not_by_its_place_in_the_call(model):
    """``generate(..., rows=)``: prompts 4 and 1 sampled alone, keyed as rows 4 and 1, equal rows 4 and 1 of the call
    that samples all six (their places differ: 0 and 1 against 4 and 1). The continuous engine's keys: the next
    test (its turns of one row, alone or among others)."""
    from scaletrain.generation import StaticBatchEngine

    inner = StaticBatchEngine(dataclasses.replace(sampling(1.0), max_completion_length=8))
    prompts = [[40 + r, 50, 60 + r] for r in range(ROWS)]
    every = inner.generate(model, prompts, seed=5, step=2)
    two = inner.generate(model, [prompts[4], prompts[1]], seed=5, step=2, rows=[4, 1])
    for key in ("completion_ids", "completion_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(two, key)), np.asarray(getattr(every, key))[[4, 1]])
    np.testing.assert_allclose(np.asarray(two.log_probs), np.asarray(every.log_probs)[[4, 1]], rtol=0, atol=LP_TOL)


@pytest.mark.parametrize("overlap", [False, True], ids=["turn-by-turn", "overlapped"])
def test_a_rows_turns_are_the_same_whether_the_other_rows_end_at_turn_one_or_go_on(model, tok, overlap):
    """Row 4 talks 3 turns; the rows before it end after their first turn in one rollout and talk 3 turns in the
    other, so row 4's place among the rows still going differs (0 or 4): its trajectory does not."""
    alone, _, _ = rollout(model, tok, [0, 0, 0, 0, 3, 0], overlap=overlap)
    among, _, _ = rollout(model, tok, [3, 3, 3, 3, 3, 3], overlap=overlap)
    assert alone[4].turns == 4 and among[0].turns == 4  # every reply was followed by a sampled turn
    assert alone[0].turns == 1
    same_episode(alone[4], among[4])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_overlapped_rollout_decodes_while_a_row_waits_and_equals_the_turn_by_turn_loop(model, tok, temperature):
    """Overlapped, row 0's first ``step`` blocks until row 1's second ``step`` has run: row 1 is sampled again
    while row 0 waits (turn by turn, that step would time out and be counted a failure). The episodes, the
    arrays and the figures (less the seconds waited) equal the turn-by-turn loop's on the same continuous engine."""
    from scaletrain.rl.multi_turn import tool_figures

    replies = [2, 2, 1, 0, 3, 1]
    overlapped, out, log = rollout(model, tok, replies, gated=True, temperature=temperature)
    stepwise, ref, _ = rollout(model, tok, replies, overlap=False, temperature=temperature)
    assert log.index((1, 2)) < log.index((0, 1))  # row 0's first step returned after row 1's second
    assert sum(e.environment_failures for e in overlapped) == 0
    assert [e.turns for e in overlapped] == [n + 1 for n in replies]
    for a, b in zip(overlapped, stepwise):
        same_episode(a, b)
    for key in ("completion_ids", "completion_mask", "tool_mask", "lengths", "truncated", "prompt_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(out, key)), np.asarray(getattr(ref, key)), err_msg=key)
    np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(ref.log_probs), rtol=0, atol=LP_TOL)
    figures, expected = tool_figures(overlapped), tool_figures(stepwise)
    figures.pop("tools/wait_seconds"), expected.pop("tools/wait_seconds")
    assert figures == expected


def test_an_inner_engine_whose_generate_takes_no_rows_is_refused_in_one_line_naming_it():
    """A custom engine written before ``rows=`` joined the RolloutEngine interface is named when the multi-turn
    engine is built, not met as Python's TypeError half-way through a rollout."""
    from scaletrain.errors import ConfigError
    from scaletrain.rl.agent_engine import MultiTurnEngine

    class OldEngine:
        sampling = None

        def generate(self, state, prompts, *, num_generations=1, seed=0, step=0):
            raise AssertionError("never sampled")

    with pytest.raises(ConfigError, match=r"OldEngine.generate takes no rows=.*Sequence\[int\] \| None = None"):
        MultiTurnEngine(OldEngine(), None, lambda n: [], "hermes")

    class KeywordEngine(OldEngine):
        def generate(self, state, prompts, **options):
            raise AssertionError("never sampled")

    MultiTurnEngine(KeywordEngine(), None, lambda n: [], "hermes")  # **options may take rows=


@pytest.fixture(scope="module")
def reprefilled(model, tok):
    """The overlapped rollout of ``KEEP_REPLIES`` with every turn prefilled from scratch (kept pages off)."""
    stats = {}
    episodes, _, _ = rollout(model, tok, KEEP_REPLIES, keep_pages=False, stats=stats)
    return episodes, stats


KEEP_REPLIES = [2, 2, 1, 0, 3, 1]


@pytest.mark.parametrize("cache_pages", [None, 1], ids=["roomy-pool", "smallest-pool"])
def test_turns_prefilled_over_kept_pages_equal_turns_prefilled_from_scratch(model, tok, reprefilled, cache_pages):
    """A row that waits on its environment keeps its pages, and its next turn prefills only its new tokens over
    them: the episodes equal the rollout that prefills every turn whole (log-probs within ``LP_TOL``: the kept
    prefix's keys came from the prefill and decode programs, the new tokens' from a chunk over them, so sums run in
    another order; measured 4.8e-7). With the smallest pool (two rows at their longest), kept pages are given back
    to make room and those turns fall back to a whole prefill, to the same tokens; every page comes back."""
    stats = {}
    kept, _, _ = rollout(model, tok, KEEP_REPLIES, stats=stats, cache_pages=cache_pages)
    whole, plain = reprefilled
    for a, b in zip(kept, whole):
        same_episode(a, b)
    assert plain["prefills_resumed"] == plain["kept_prefix_tokens"] == 0
    assert stats["prefills_resumed"] > 0 and stats["kept_prefix_tokens"] > 0  # the prefix was not recomputed
    assert stats["prefills"] + stats["prefills_resumed"] == plain["prefills"]  # every turn prefilled once
    assert stats["pages_in_use"] == plain["pages_in_use"] == 0
    if cache_pages is not None:
        assert stats["num_pages"] < plain["num_pages"] and stats["kept_dropped"] > 0
