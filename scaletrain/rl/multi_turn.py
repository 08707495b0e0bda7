"""Multi-turn rollouts: the model calls tools, reads their results and goes on, token in and token out.

Why a loop above the engine rather than inside it: a turn is a rollout of the engine (any
:class:`~scaletrain.generation.interface.RolloutEngine`, today's static batch or a continuous-batching
one), and what happens between turns is host work on user code (parse the calls, run the tools,
render their results). So :class:`MultiTurnEngine` implements the same interface: the trainer asks it
for a rollout as it asks any engine, and gets the usual arrays plus ``tool_mask``.

One rollout, TRL 1.16's ``_tool_call_loop`` step for step (the parity test runs TRL's on the same
completions and tools):

1. Sample the first turn of every row (``num_generations`` per prompt, as a single-turn rollout).
2. Parse each turn (``rl/tool_calls.py``); rows with tool calls run them (``rl/tools.py``: every row's
   calls at once, each under ``tool_timeout``; a failure gives the model its error text).
3. The results' ids (``rl/chat_turns.py``: the chat template's rendering of the tool messages and the
   next assistant header) are appended to the row's ids. If that would make the completion longer than
   ``max_completion_length`` (or reach the model's positions), the results are dropped and the row ends
   with its completion as it is.
4. Sample the next turn of the rows still going, from their whole ids (no re-tokenisation); cut it so
   the completion stays within ``max_completion_length``. Back to 2, at most
   ``max_tool_calling_iterations`` times.

The completion of a row is everything after its prompt: its model turns as sampled and the tool
results between them. ``tool_mask`` is 1 on the model's tokens and 0 on the tools', the sampler's
log-probabilities are 0 on the tools' tokens, and the trainer's loss mask is ``completion_mask *
tool_mask`` (and so is the sampler-vs-trainer gap's). A row is truncated when its last token is not a
stop token (TRL's rule on the whole trajectory).

Determinism: the first turn is the engine's, a function of ``(seed, step, row, position)``; a later turn
``k`` samples at the seed ``(seed, k)`` over the rows still going, in row order, which the same
parameters make the same rows, so a resumed run replays the same episodes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.generation.interface import Rollout, RolloutEngine, SamplingParams
from scaletrain.rl.chat_turns import tool_result_ids
from scaletrain.rl.tool_calls import parse_turn, tool_calls
from scaletrain.rl.tools import DEFAULT_TOOL_TIMEOUT, Toolbox, run_calls

#: a turn's sampled ids and their log-probabilities, one pair per context
Turns = list[tuple[list[int], list[float]]]
#: ``sample(contexts, budget, turn) -> Turns``: one turn of at most ``budget`` tokens after each context
TurnSampler = Callable[[Sequence[Sequence[int]], int, int], Turns]


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
    (the assistant turns as parsed, the tool messages), and its figures."""

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

    def tokens(self, source: str) -> int:
        """Completion tokens written by ``source``: ``"model"`` or ``"tool"``."""
        model = int(sum(self.tool_mask))
        return model if source == "model" else len(self.tool_mask) - model


def run_episodes(prompts: Sequence[Sequence[int]], first: Turns, sample: TurnSampler, toolboxes: Sequence[Toolbox],
                 tokenizer: Any, *, fmt: str, max_completion_length: int, max_tool_calling_iterations: int | None,
                 max_model_len: int | None = None, tool_timeout: float = DEFAULT_TOOL_TIMEOUT) -> list[Episode]:
    """Every row's episode (see the module docstring), from its prompt ids, its first sampled turn and its tools."""
    episodes = [Episode(list(p), list(ids), [1] * len(ids), list(lps),
                        [parse_turn(tokenizer, ids, fmt, prefix=p, tools=box.tools)])
                for p, (ids, lps), box in zip(prompts, first, toolboxes)]
    going = [i for i, e in enumerate(episodes) if tool_calls(e.messages[-1])]
    limit = max_tool_calling_iterations if max_tool_calling_iterations is not None else float("inf")
    iteration = 0
    while going and iteration < limit:
        start = time.perf_counter()
        results = run_calls([(i, toolboxes[i], tool_calls(episodes[i].messages[-1])) for i in going], tool_timeout)
        waited = time.perf_counter() - start
        contexts, kept = [], []
        for i in going:
            e = episodes[i]
            e.tool_calls += len(results[i])
            e.tool_failures += sum(r.failed for r in results[i])
            e.failed_tools += [r.name for r in results[i] if r.failed]
            e.tool_seconds += waited
            messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results[i]]
            context = e.prompt_ids + e.completion_ids + tool_result_ids(tokenizer, messages)
            overlong = len(context) - len(e.prompt_ids) > max_completion_length or (
                max_model_len is not None and len(context) >= max_model_len)
            if overlong:  # the results are dropped: the row ends with its completion as it is
                continue
            e.messages += messages
            contexts.append(context)
            kept.append(i)
        if not kept:
            break
        budget = max(max_completion_length - (len(c) - len(episodes[i].prompt_ids)) for c, i in zip(contexts, kept))
        turns = sample(contexts, max(budget, 1), iteration + 1)
        going = []
        for i, context, (ids, lps) in zip(kept, contexts, turns):
            e = episodes[i]
            room = max_completion_length - (len(context) - len(e.prompt_ids))
            ids, lps = list(ids)[:room], list(lps)[:room]
            tool_len = len(context) - len(e.prompt_ids) - len(e.completion_ids)
            e.tool_mask += [0] * tool_len + [1] * len(ids)
            e.log_probs += [0.0] * tool_len + lps
            e.completion_ids = context[len(e.prompt_ids):] + ids
            if ids:
                e.turns += 1
                e.messages.append(parse_turn(tokenizer, ids, fmt, prefix=context, tools=toolboxes[i].tools))
                if tool_calls(e.messages[-1]):
                    going.append(i)
        iteration += 1
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


def _turns(out: Rollout, keep: int | None = None) -> Turns:
    """A rollout's rows read to the host: each row's sampled ids and log-probabilities (its first ``keep`` rows)."""
    ids, lps, lengths = (np.asarray(jax.device_get(x)) for x in (out.completion_ids, out.log_probs, out.lengths))
    rows = range(len(lengths) if keep is None else keep)
    return [([int(t) for t in ids[r, :lengths[r]]], [float(x) for x in lps[r, :lengths[r]]]) for r in rows]


def with_budget(engine: RolloutEngine, budget: int) -> RolloutEngine:
    """``engine`` sampling at most ``budget`` tokens a turn (rounded up to a power of two, so a run compiles a few
    turn lengths, not one per budget), where its sampling can be replaced; else ``engine`` as it is."""
    cap = engine.sampling.max_completion_length
    new = min(cap, 1 << max(0, int(budget) - 1).bit_length())
    if new == cap or not dataclasses.is_dataclass(engine):
        return engine
    return dataclasses.replace(engine, sampling=dataclasses.replace(engine.sampling, max_completion_length=new))


@dataclasses.dataclass
class MultiTurnEngine:
    """A :class:`~scaletrain.generation.interface.RolloutEngine` whose rows call tools between turns (module docstring).

    ``inner``: the engine that samples each turn (its ``sampling`` caps the whole completion); ``tokenizer``: the
    chat template renders tool results; ``toolboxes(rows) -> [Toolbox]``: each row's tools for a rollout of
    ``rows`` rows (fresh environment instances, ``rl/episodes.py``); ``fmt``: the tool-call format
    (``rl/tool_calls.py``). ``last_episodes`` holds the last rollout's episodes (the trainer's figures and logs).
    """

    inner: RolloutEngine
    tokenizer: Any
    toolboxes: Callable[[int], Sequence[Toolbox]]
    fmt: str
    max_tool_calling_iterations: int | None = None
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT
    max_model_len: int | None = None
    last_episodes: list[Episode] = dataclasses.field(default_factory=list)

    @property
    def sampling(self) -> SamplingParams:
        return self.inner.sampling

    def generate(self, state: Any, prompts: Sequence[Sequence[int]], *, num_generations: int = 1, seed: int = 0,
                 step: int = 0, toolboxes: Sequence[Toolbox] | None = None) -> Trajectories:
        """The rollout of ``prompts`` with tools between turns; ``toolboxes`` (one per row) overrides
        ``self.toolboxes``. Reads each turn to the host (the tools need its text)."""
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        first = _turns(self.inner.generate(state, [list(p) for p in prompts], num_generations=num_generations,
                                           seed=seed, step=step))

        def sample(contexts: Sequence[Sequence[int]], budget: int, turn: int) -> Turns:
            engine = with_budget(self.inner, budget)
            turn_seed = (int(seed) * 1_000_003 + turn) % (1 << 32)
            return _turns(engine.generate(state, [list(c) for c in contexts], num_generations=1, seed=turn_seed,
                                          step=step))

        boxes = list(toolboxes) if toolboxes is not None else list(self.toolboxes(len(rows)))
        sampling = self.inner.sampling
        self.last_episodes = run_episodes(
            rows, first, sample, boxes, self.tokenizer, fmt=self.fmt,
            max_completion_length=sampling.max_completion_length,
            max_tool_calling_iterations=self.max_tool_calling_iterations, max_model_len=self.max_model_len,
            tool_timeout=self.tool_timeout)
        return to_arrays(self.last_episodes, sampling.max_completion_length, sampling.pad_token_id,
                         sampling.stop_token_ids)


def tool_figures(episodes: Sequence[Episode]) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (calls per row) and ``tools/failure_frequency`` (failures per call), plus
    turns per episode, completion tokens by source and the seconds rows waited on tools."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    failures = sum(e.tool_failures for e in episodes)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns_per_episode": sum(e.turns for e in episodes) / n,
            "tools/model_tokens": float(sum(e.tokens("model") for e in episodes)),
            "tools/tool_tokens": float(sum(e.tokens("tool") for e in episodes)),
            "tools/wait_seconds": float(max((e.tool_seconds for e in episodes), default=0.0))}


def episode_record(e: Episode) -> Mapping[str, Any]:
    """An episode as ``completions.jsonl`` shows it: its turns (who wrote what) and its tool figures."""
    return {"turns": e.messages, "tool_calls": e.tool_calls, "tool_failures": e.tool_failures,
            "failed_tools": e.failed_tools}
