"""Multi-turn environments: an environment that answers each model turn with the next user turn.

Why a second kind of environment beside TRL's tool environments: a game, a user simulator or a tutor
does not wait to be called as a tool; it reads what the model said and replies, until it says the
episode is over. That is the Gym-like shape SkyRL-gym and Tunix use (``reset`` then ``step(action)``
returning an observation, a reward and a done flag). We keep TRL's ``environment_factory`` and add one
rule, so one option selects both kinds:

- **An environment class that defines ``step`` is a multi-turn environment.** ``step`` is never a tool
  (TRL's other public methods still are, so a game may also offer tools). ``reset(**row)`` is TRL's:
  its text is appended to the prompt.
- After a model turn **without** tool calls, the loop calls ``step(text)`` with the turn's text (the
  parsed assistant content; special tokens dropped). It returns one of:
  ``str`` (the next user turn), ``None`` (the episode is over), or a tuple
  ``(user_text | None, reward | None, done)``. ``done`` true, or no text, ends the episode.
- The reply is tokenised through the chat template as a user turn and the next assistant header
  (``rl/chat_turns.user_turn_ids``), appended to the model's tokens as sampled; its tokens are masked
  out of the loss as tool results are.
- ``step`` may be ``async def``. Each call runs under ``tool_timeout`` on the pool the tools use, every
  row's step at once; one that raises or does not return in time ends that row's episode, is logged
  with the row, and is counted (``tools/environment_failures``).
- The episode's reward: ``get_reward()`` when the class defines it (TRL's rule), else the sum of the
  rewards ``step`` returned (``None`` when it returned none), a reward named after the class, weight 1.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from scaletrain.user_calls import DeadlineExceeded, call_with_deadline, invoke

logger = logging.getLogger("scaletrain")

#: the method that makes an environment class multi-turn
STEP = "step"


def is_multi_turn(environment: Any) -> bool:
    """Whether ``environment`` (an instance or a class) replies to model turns: its class defines ``step``."""
    kind = environment if isinstance(environment, type) else type(environment)
    return callable(getattr(kind, STEP, None))


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one ``step`` call said: the next user turn (``None``: none), its reward, whether the episode is over,
    and whether the call failed (raised or timed out; the episode ends)."""

    text: str | None
    reward: float | None
    done: bool
    failed: bool = False


def read_step(value: Any, what: str) -> StepResult:
    """``step``'s return value as a :class:`StepResult`; ValueError naming ``what`` for any other shape."""
    if value is None:
        return StepResult(None, None, True)
    if isinstance(value, str):
        return StepResult(value, None, False)
    if isinstance(value, tuple) and len(value) == 3:
        text, reward, done = value
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{what} returned a user turn of type {type(text).__name__}; return text or None")
        number = None if reward is None else float(reward)
        if number is not None and not math.isfinite(number):
            raise ValueError(f"{what} returned the reward {number}; return a finite number or None")
        return StepResult(text, number, bool(done) or text is None)
    raise ValueError(f"{what} returned {type(value).__name__}; return the next user turn (str), None to end, or "
                     f"(user_text | None, reward | None, done)")


def _one(environment: Any, text: str, row: int, timeout: float) -> StepResult:
    what = f"environment {type(environment).__name__}.step (row {row})"
    try:
        return read_step(call_with_deadline(invoke, getattr(environment, STEP), text, timeout=timeout, what=what),
                         what)
    except DeadlineExceeded as err:
        logger.warning("%s (objective.tool_timeout): the episode ends", err)
    except Exception as err:  # the environment's fault, not the model's: the episode ends, counted
        logger.warning("%s raised %s: %s; the episode ends", what, type(err).__name__, err)
    return StepResult(None, None, True, failed=True)


def step_jobs(requests: Sequence[tuple[int, Any, str]], timeout: float) -> list[tuple[int, Callable[[], StepResult]]]:
    """``(row, environment, text)`` requests as ``(row, job)`` pairs for :func:`~scaletrain.user_calls.concurrently`,
    each job one ``step`` call bounded by ``timeout`` that never raises."""
    return [(row, functools.partial(_one, env, text, row, timeout)) for row, env, text in requests]


def episode_return(rewards: Sequence[float | None]) -> float | None:
    """An episode's reward from its ``step`` rewards: their sum, ``None`` when ``step`` gave none."""
    given = [r for r in rewards if r is not None]
    return float(sum(given)) if given else None
