"""Multi-turn rollouts: the model calls tools, reads their results and goes on, token in and token out.

Why a loop above the engine rather than inside it: a turn is a rollout of the engine (any
:class:`~scaletrain.generation.interface.RolloutEngine`), and what happens between turns is host work on user
code (parse the calls, run the tools, render their results). This module holds the episode on the host, the
per-row rules (:class:`Rules`) and the turn-by-turn loop (:func:`run_episodes`); ``rl/overlap.py`` runs the same
rules in one continuous-engine run, and ``rl/agent_engine.MultiTurnEngine`` is the engine the trainer asks.

One rollout, TRL 1.16's ``_tool_call_loop`` step for step (the parity test runs TRL's on the same
completions and tools):

1. Sample the first turn of every row (``num_generations`` per prompt, as a single-turn rollout).
2. Parse each turn (``rl/tool_calls.py``); rows with tool calls run them (``rl/tools.py``: every row's
   calls at once, each under ``tool_timeout``; a failure gives the model its error text). A row whose
   turn calls nothing and whose environment is multi-turn (``rl/env_steps.py``) has its ``step`` called
   with the turn's text, at the same time as the tools; its reply is the next user turn, or the end.
3. The results' ids (``rl/chat_turns.py``: the chat template's rendering of the tool messages, or of the
   user turn, and the next assistant header) are appended to the row's ids. If that would make the
   completion longer than ``max_completion_length`` (or reach the model's positions), they are dropped
   and the row ends with its completion as it is.
4. Sample the next turn of the rows still going, from their whole ids (no re-tokenisation); cut it so
   the completion stays within ``max_completion_length``. Back to 2: a row runs at most
   ``max_tool_calling_iterations`` tool rounds (TRL's loop count, per row) and ``max_turns`` ``step``
   calls (the reply to the last is dropped).

The completion of a row is everything after its prompt: its model turns as sampled and the tool
results and user turns between them. ``tool_mask`` is 1 on the model's tokens and 0 on the others', the sampler's
log-probabilities are 0 on those tokens, and the trainer's loss mask is ``completion_mask *
tool_mask`` (and so is the sampler-vs-trainer gap's). A row is truncated when its last token is not a
stop token (TRL's rule on the whole trajectory).

Determinism: a row's every token is a function of ``(seed, step, row, turn, position)`` only, never of which
other rows are still going: the first turn is the engine's (``(seed, step, row, position)``), and turn ``k``
draws with the seed :func:`turn_seed` ``(seed, k)`` and the row's own id (the engine's ``rows=``), so a resumed run
replays the same episodes and a row's episode is the same whatever its neighbours do.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.rl.chat_turns import tool_result_ids, user_turn_ids
from scaletrain.rl.env_steps import StepResult, is_multi_turn, step_jobs
from scaletrain.rl.process_rows import OwnedCalls
from scaletrain.rl.tool_calls import parse_turn, tool_calls
from scaletrain.rl.tools import DEFAULT_TOOL_TIMEOUT, Toolbox, call_jobs
from scaletrain.user_calls import concurrently

#: a turn's sampled ids and their log-probabilities, one pair per context
Turns = list[tuple[list[int], list[float]]]
#: ``sample(contexts, budget, turn, rows) -> Turns``: turn ``turn`` of at most ``budget`` tokens after each context,
#: the context of request row ``rows[i]``
TurnSampler = Callable[[Sequence[Sequence[int]], int, int, Sequence[int]], Turns]


def turn_seed(seed: int, turn: int) -> int:
    """The seed turn ``turn`` of a rollout at ``seed`` draws with (turn 0: ``seed`` itself, the engine's)."""
    return int(seed) if turn == 0 else (int(seed) * 1_000_003 + int(turn)) % (1 << 32)


class Trajectories(NamedTuple):
    """A multi-turn rollout: :class:`~scaletrain.generation.interface.Rollout`'s arrays plus ``tool_mask`` [B, N]
    (1 on the model's tokens, 0 on what tools wrote; 1 on padding, which ``completion_mask`` already hides)."""

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    steps: jax.Array
    tool_mask: jax.Array


@dataclasses.dataclass
class Episode:
    """One row's trajectory on the host: its prompt and completion ids, the mask and log-probs, its messages
    (the assistant turns as parsed, the tool messages, a multi-turn environment's user turns), and its figures."""

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    log_probs: list[float]
    messages: list[dict[str, Any]]
    tool_calls: int = 0
    tool_failures: int = 0
    failed_tools: list[str] = dataclasses.field(default_factory=list)
    turns: int = 1
    tool_seconds: float = 0.0
    tool_rounds: int = 0
    environment_tokens: int = 0
    environment_steps: int = 0
    environment_failures: int = 0
    environment_rewards: list[float | None] = dataclasses.field(default_factory=list)
    done: bool = False

    def tokens(self, source: str) -> int:
        """Completion tokens written by ``source``: ``"model"``, ``"tool"`` or ``"environment"``."""
        model = int(sum(self.tool_mask))
        if source == "model":
            return model
        return self.environment_tokens if source == "environment" else len(self.tool_mask) - model - \
            self.environment_tokens


@dataclasses.dataclass(frozen=True)
class Rules:
    """What bounds a rollout's episodes (module docstring): the tokenizer and tool-call ``fmt`` that read and render
    turns, ``max_completion_length`` over the whole trajectory, ``max_tool_calling_iterations`` (None: no limit),
    the model's ``max_model_len``, ``tool_timeout`` per call or ``step``, ``max_turns`` ``step`` calls."""

    tokenizer: Any
    fmt: str
    max_completion_length: int
    max_tool_calling_iterations: int | None = None
    max_model_len: int | None = None
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT
    max_turns: int | None = None

    def wants(self, e: Episode, box: Toolbox) -> str | None:
        """What follows ``e``'s last turn: ``"tools"`` (it calls tools and may run another round),
        ``"environment"`` (no calls, and its multi-turn environment has not ended it), or None (it is over)."""
        if tool_calls(e.messages[-1]):
            limit = self.max_tool_calling_iterations
            return "tools" if limit is None or e.tool_rounds < limit else None
        if e.done or box.environment is None or not is_multi_turn(box.environment):
            return None
        return "environment" if self.max_turns is None or e.environment_steps < self.max_turns else None

    def first(self, prompt: Sequence[int], ids: Sequence[int], lps: Sequence[float], box: Toolbox) -> Episode:
        """A row's episode after its first turn ``ids`` (log-probabilities ``lps``)."""
        return Episode(list(prompt), list(ids), [1] * len(ids), list(lps),
                       [parse_turn(self.tokenizer, ids, self.fmt, prefix=prompt, tools=box.tools)])

    def follow(self, e: Episode, kind: str, outcome: Any) -> list[int] | None:
        """Record what a row's tools or environment gave back (``kind``: :meth:`wants`'s) and give the context its
        next turn is sampled after; None: the episode ends (ended by the environment, or the results would overflow
        ``max_completion_length`` or the model's positions: they are dropped, TRL's rule)."""
        before = len(e.messages)
        new = _appended(e, outcome, self.tokenizer, self.max_turns)
        if new is None:
            return None
        context = e.prompt_ids + e.completion_ids + new
        if len(context) - len(e.prompt_ids) > self.max_completion_length or (
                self.max_model_len is not None and len(context) >= self.max_model_len):
            del e.messages[before:]
            return None
        e.environment_tokens += len(new) if kind == "environment" else 0
        return context

    def room(self, e: Episode, context: Sequence[int]) -> int:
        """How many tokens the turn sampled after ``context`` may keep: what is left of ``max_completion_length``."""
        return self.max_completion_length - (len(context) - len(e.prompt_ids))

    def take(self, e: Episode, context: Sequence[int], ids: Sequence[int], lps: Sequence[float],
             box: Toolbox) -> str | None:
        """Append the turn sampled after ``context`` (cut to :meth:`room`) to ``e``; what follows it (:meth:`wants`)."""
        room = self.room(e, context)
        ids, lps = list(ids)[:room], list(lps)[:room]
        appended = len(context) - len(e.prompt_ids) - len(e.completion_ids)
        e.tool_mask += [0] * appended + [1] * len(ids)
        e.log_probs += [0.0] * appended + lps
        e.completion_ids = list(context[len(e.prompt_ids):]) + ids
        if not ids:
            return None
        e.turns += 1
        e.messages.append(parse_turn(self.tokenizer, ids, self.fmt, prefix=context, tools=box.tools))
        return self.wants(e, box)


def follow_row(row: int, kind: str, e: Episode, box: Toolbox, timeout: float) -> Any:
    """Run what row ``row`` wants after its last turn: its tool calls, all at once (``[ToolResult]``), or its
    environment's ``step`` (:class:`StepResult`); each call bounded by ``timeout``, never raising."""
    return _follow({row: kind}, {row: e}, {row: box}, timeout)[row]


def _follow(pending: Mapping[int, str], episodes: Any, toolboxes: Any, timeout: float) -> dict[int, Any]:
    """Run, all at once, the tool calls and environment steps that ``pending`` (row -> what it wants) asks for
    (``episodes`` and ``toolboxes`` indexed by row); ``{row: [ToolResult] | StepResult}``."""
    calls = call_jobs([(i, toolboxes[i], tool_calls(episodes[i].messages[-1]))
                       for i, kind in pending.items() if kind == "tools"], timeout)
    steps = step_jobs([(i, toolboxes[i].environment, str(episodes[i].messages[-1].get("content") or ""))
                       for i, kind in pending.items() if kind == "environment"], timeout)
    out: dict[int, Any] = {i: [] for i, kind in pending.items() if kind == "tools"}
    jobs = calls + steps
    for (row, _), value in zip(jobs, concurrently([job for _, job in jobs])):
        if isinstance(value, StepResult):
            out[row] = value
        else:
            out[row].append(value)
    return out


def _appended(e: Episode, outcome: Any, tokenizer: Any, max_turns: int | None) -> list[int] | None:
    """Record a row's tool results or environment reply on ``e`` and give the ids they append (None: the episode
    ends here; a step's reward is kept even then)."""
    if isinstance(outcome, StepResult):
        e.environment_steps += 1
        e.environment_failures += int(outcome.failed)
        e.environment_rewards.append(outcome.reward)
        e.done = outcome.done or outcome.text is None
        if e.done or (max_turns is not None and e.environment_steps >= max_turns):
            return None
        e.messages.append({"role": "user", "content": outcome.text})
        return user_turn_ids(tokenizer, str(outcome.text))
    e.tool_rounds += 1
    e.tool_calls += len(outcome)
    e.tool_failures += sum(r.failed for r in outcome)
    e.failed_tools += [r.name for r in outcome if r.failed]
    messages = [{"role": "tool", "name": r.name, "content": r.content} for r in outcome]
    e.messages += messages
    return tool_result_ids(tokenizer, messages)


def run_episodes(prompts: Sequence[Sequence[int]], first: Turns, sample: TurnSampler, toolboxes: Sequence[Toolbox],
                 rules: Rules, *, calls: OwnedCalls | None = None) -> list[Episode]:
    """Every row's episode, turn by turn (see the module docstring), from its prompt ids, its first sampled turn and
    its tools (and its multi-turn environment, ``rl/env_steps.py``), bounded by ``rules`` (the overlapped loop's
    too). ``calls``: on several processes, the rows whose calls this process runs; the others' outcomes come from
    their owners."""
    episodes = [rules.first(p, ids, lps, box) for p, (ids, lps), box in zip(prompts, first, toolboxes)]
    pending = {i: w for i, e in enumerate(episodes) if (w := rules.wants(e, toolboxes[i]))}
    turn = 0
    while pending:
        start = time.perf_counter()
        outcomes = _follow(pending if calls is None else calls.mine(pending), episodes, toolboxes, rules.tool_timeout)
        if calls is not None:  # every process takes every row's outcome, so all build the same contexts
            outcomes = calls.share(outcomes)
        waited = time.perf_counter() - start
        contexts, kept = [], []
        for i in pending:
            episodes[i].tool_seconds += waited
            context = rules.follow(episodes[i], pending[i], outcomes[i])
            if context is not None:
                contexts.append(context)
                kept.append(i)
        if not kept:
            break
        turn += 1
        budget = max(rules.room(episodes[i], c) for c, i in zip(contexts, kept))
        turns = sample(contexts, max(budget, 1), turn, kept)
        pending = {}
        for i, context, (ids, lps) in zip(kept, contexts, turns):
            if wants := rules.take(episodes[i], context, ids, lps, toolboxes[i]):
                pending[i] = wants
    return episodes


def to_arrays(episodes: Sequence[Episode], width: int, pad_id: int, stop_ids: Sequence[int]) -> Trajectories:
    """The episodes as a rollout's arrays: prompts left-padded, completions right-padded to ``width``."""
    b = len(episodes)
    p = max(len(e.prompt_ids) for e in episodes)
    prompt_ids, prompt_mask = np.full((b, p), pad_id, np.int32), np.zeros((b, p), np.int32)
    comp, mask = np.full((b, width), pad_id, np.int32), np.zeros((b, width), np.int32)
    tool_mask, logps = np.ones((b, width), np.int32), np.zeros((b, width), np.float32)
    ends = set(int(s) for s in stop_ids) | {int(pad_id)}
    truncated = np.zeros(b, bool)
    for r, e in enumerate(episodes):
        n = len(e.completion_ids)
        prompt_ids[r, p - len(e.prompt_ids):] = e.prompt_ids
        prompt_mask[r, p - len(e.prompt_ids):] = 1
        comp[r, :n], mask[r, :n], tool_mask[r, :n], logps[r, :n] = e.completion_ids, 1, e.tool_mask, e.log_probs
        truncated[r] = n == 0 or e.completion_ids[-1] not in ends
    lengths = mask.sum(axis=1).astype(np.int32)
    return Trajectories(*(jnp.asarray(x) for x in (prompt_ids, prompt_mask, comp, mask, logps, lengths, truncated)),
                        jnp.asarray(int(lengths.max(initial=0)), jnp.int32), jnp.asarray(tool_mask))


def tool_figures(episodes: Sequence[Episode]) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (calls per row) and ``tools/failure_frequency`` (failures per call), plus
    turns per episode, completion tokens by source (model, tool, environment), the environment steps that failed
    and the seconds rows waited on tools and environments."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    failures = sum(e.tool_failures for e in episodes)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns_per_episode": sum(e.turns for e in episodes) / n,
            "tools/model_tokens": float(sum(e.tokens("model") for e in episodes)),
            "tools/tool_tokens": float(sum(e.tokens("tool") for e in episodes)),
            "tools/environment_tokens": float(sum(e.tokens("environment") for e in episodes)),
            "tools/environment_failures": float(sum(e.environment_failures for e in episodes)),
            "tools/wait_seconds": float(max((e.tool_seconds for e in episodes), default=0.0))}


def episode_record(e: Episode) -> Mapping[str, Any]:
    """An episode as ``completions.jsonl`` shows it: its turns (who wrote what), its tool figures and, with a
    multi-turn environment, the rewards its ``step`` calls gave."""
    record = {"turns": e.messages, "tool_calls": e.tool_calls, "tool_failures": e.tool_failures,
              "failed_tools": e.failed_tools}
    if e.environment_steps:
        record.update(environment_rewards=e.environment_rewards, environment_failures=e.environment_failures)
    return record
