"""Multi-turn environments (``rl/env_steps.py``): the environment's reply to each model turn is the next user turn.

No model here: the turns come from a scripted sampler over the byte-level chat tokenizer of ``agentic_testing``
(row 0 answers right, row 1 always says ``x``), so what is checked is the loop itself: the trajectory is the
model's tokens as sampled with the chat template's user turns between them, masked out of the loss; an
episode ends when the environment says so, at ``max_turns`` or at ``max_completion_length``; ``step`` may be
``async``, the rows' steps and tools run at once, and a step that raises or hangs ends its own episode only.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentic_testing import call, chatml_tokenizer, multiply

pytestmark = pytest.mark.filterwarnings("ignore")

END = "<|im_end|>"


class Count:
    """Say the numbers: the environment asks for 1, 2, 3 in turn; each right answer scores 1; done after 3."""

    target = 3

    def reset(self, **row) -> str:
        self.asked = 1
        return " Say 1."

    def step(self, action: str):
        right = action.strip() == str(self.asked)
        if self.asked == self.target:
            return None, float(right), True
        self.asked += 1
        return f"Now say {self.asked}.", float(right), False


class Script:
    """The model's turns: row 0 answers what the last user turn asks, row 1 says ``x``; row 2 calls ``multiply``
    once, then answers. Log-probability -0.25 a token."""

    def __init__(self, tok, rows):
        self.tok, self.rows = tok, rows

    def turn(self, row, context):
        text = self.tok.decode(context)
        if row == 2 and "<tool_response>" not in text:
            answer = call("multiply", a=2, b=3)
        else:
            answer = text.rsplit("ay ", 1)[1].split(".")[0] if row % 3 == 0 else "x"
        ids = self.tok.encode(answer + END, add_special_tokens=False)
        return ids, [-0.25] * len(ids)

    def first(self, prompts):
        return [self.turn(r, p) for r, p in enumerate(prompts)]

    def sampler(self, prompts):
        def sample(contexts, budget, turn, rows):
            return [self.turn(self.rows.index(next(p for p in prompts if c[:len(p)] == p)), c)
                    for c in contexts]
        return sample


def episodes_of(envs, *, cap=400, max_turns=None, timeout=5.0, tools=()):
    from scaletrain.rl.chat_turns import prompt_ids
    from scaletrain.rl.multi_turn import Rules, run_episodes
    from scaletrain.rl.tools import Toolbox

    tok = chatml_tokenizer()
    boxes = [Toolbox(list(tools), env) for env in envs]
    prompts = []
    for r, box in enumerate(boxes):  # distinct prompts, so the sampler knows a context's row
        text = box.environment.reset() if box.environment is not None else ""
        prompts.append(prompt_ids(tok, [{"role": "user", "content": f"row {r}." + text}], box.tools))
    script = Script(tok, prompts)
    rules = Rules(tok, "hermes", cap, tool_timeout=timeout, max_turns=max_turns)
    out = run_episodes(prompts, script.first(prompts), script.sampler(prompts), boxes, rules)
    return tok, prompts, out


def test_environment_replies_are_template_user_turns_between_the_sampled_tokens_and_masked_out():
    from scaletrain.data.chat_templates import apply_chat_template
    from scaletrain.rl.chat_turns import user_turn_ids

    tok, prompts, (right, wrong) = episodes_of([Count(), Count()])
    assert [m["role"] for m in right.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in right.messages] == ["1", "Now say 2.", "2", "Now say 3.", "3"]
    assert right.environment_rewards == [1.0, 1.0, 1.0] and wrong.environment_rewards == [0.0, 0.0, 0.0]
    assert right.turns == 3 and right.environment_steps == 3 and right.done
    said = [tok.encode(t + END, add_special_tokens=False) for t in ("1", "2", "3")]
    asked = [user_turn_ids(tok, t) for t in ("Now say 2.", "Now say 3.")]
    assert right.completion_ids == said[0] + asked[0] + said[1] + asked[1] + said[2]  # token in, token out
    assert right.tool_mask == [1] * len(said[0]) + [0] * len(asked[0]) + [1] * len(said[1]) + \
        [0] * len(asked[1]) + [1] * len(said[2])
    assert [lp for lp, m in zip(right.log_probs, right.tool_mask) if m == 0] == [0.0] * (len(asked[0]) + len(asked[1]))
    assert right.tokens("environment") == len(asked[0]) + len(asked[1]) and right.tokens("tool") == 0
    # the ids are what the chat template writes for the whole conversation (less its newline after the last turn)
    whole = apply_chat_template(tok, [{"role": "user", "content": "row 0. Say 1."}, *right.messages],
                                tokenize=True, add_generation_prompt=False)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert whole[:len(prompts[0]) + len(right.completion_ids)] == prompts[0] + right.completion_ids


def test_max_turns_bounds_the_step_calls_and_drops_the_last_reply():
    _, _, (right, _) = episodes_of([Count(), Count()], max_turns=2)
    assert right.environment_steps == 2 and right.turns == 2 and right.environment_rewards == [1.0, 1.0]
    assert [m["role"] for m in right.messages] == ["assistant", "user", "assistant"]
    assert right.tool_mask[-1] == 1  # the completion ends with the model's own turn


def test_max_completion_length_counts_the_whole_multi_turn_trajectory():
    _, _, (free, _) = episodes_of([Count(), Count()])
    _, _, (cut, _) = episodes_of([Count(), Count()], cap=len(free.completion_ids) - 1)
    assert len(cut.completion_ids) == len(free.completion_ids) - 1
    assert cut.completion_ids == free.completion_ids[:-1]  # the last turn cut at the cap; the rest as without it
    first = len(free.messages[0]["content"]) + 1  # the first turn and its end token, one byte a token
    _, _, (short, _) = episodes_of([Count(), Count()], cap=first + 3)  # no room for the reply
    assert short.completion_ids == free.completion_ids[:first] and short.environment_steps == 1
    assert [m["role"] for m in short.messages] == ["assistant"]


class Gate:
    """Every row's ``step`` (async) and tool meet at one barrier: they pass only if they run at the same time."""

    def __init__(self, parties):
        self.barrier = threading.Barrier(parties, timeout=20)

    def met(self):
        self.barrier.wait()


class AsyncCount(Count):
    gate: Gate

    async def step(self, action: str):
        await asyncio.sleep(0)
        if self.asked == 1:
            self.gate.met()
        return super().step(action)


class Broken(Count):
    def step(self, action: str):
        raise RuntimeError("the game crashed")


class Stuck(Count):
    async def step(self, action: str):
        await asyncio.sleep(30)


def test_async_steps_and_tools_of_different_rows_run_at_once_and_a_failing_step_ends_only_its_episode():
    gate = Gate(3)  # rows 0 and 1 (async steps) and row 2 (an async tool) in the same round

    async def multiply_later(a: int, b: int) -> int:
        """Multiply two integers, later.

        Args:
            a: The first factor.
            b: The second factor.
        """
        gate.met()
        return multiply(a, b)

    multiply_later.__name__ = "multiply"
    envs = [AsyncCount(), AsyncCount(), None, Broken(), Stuck()]
    for env in envs[:2]:
        env.gate = gate
    _, _, episodes = episodes_of(envs, timeout=2.0, tools=[multiply_later])
    right, wrong, tool, broken, stuck = episodes
    assert right.environment_rewards == [1.0, 1.0, 1.0] and wrong.environment_rewards == [0.0, 0.0, 0.0]
    assert tool.tool_calls == 1 and tool.tool_failures == 0 and tool.messages[1]["content"] == "6"
    for e in (broken, stuck):
        assert e.environment_failures == 1 and e.environment_rewards == [None] and e.turns == 1
        assert [m["role"] for m in e.messages] == ["assistant"]


def test_a_class_with_step_is_multi_turn_its_other_methods_are_tools_and_its_step_rewards_are_its_reward():
    from scaletrain.rl.agentic import Agentic
    from scaletrain.rl.env_steps import is_multi_turn, read_step
    from scaletrain.rl.tools import Toolbox

    class Tooled(Count):
        def hint(self, n: int) -> str:
            """A hint.

            Args:
                n: Which number.
            """
            return str(n)

    assert is_multi_turn(Tooled) and not is_multi_turn(object())
    assert list(Toolbox([], Tooled()).by_name) == ["hint"]
    assert read_step("go on", "s") == read_step(("go on", None, False), "s")
    assert read_step(None, "s").done and read_step(("last", 1, True), "s").done
    with pytest.raises(ValueError, match="step returned int"):
        read_step(3, "Count.step")
    (reward,) = Agentic.load([], Count).environment_rewards()
    envs = [Count(), Count(), object()]
    assert reward.name == "Count"
    assert reward.fn([], [], environments=envs, environment_rewards=[3.0, None, 1.0]) == [3.0, None, None]

    class Judged(Count):
        async def get_reward(self) -> float:
            return 0.5

    (judged,) = Agentic.load([], Judged).environment_rewards()
    assert judged.fn([], [], environments=[Judged()], environment_rewards=[3.0]) == [0.5]  # get_reward wins


def test_a_run_without_tools_reads_every_turn_as_text_whatever_its_chat_template():
    """A multi-turn environment with no tool methods, and no ``tools``: ``tool_call_format: auto`` needs no parser
    (SmolLM2's template says nothing of tool calls) and a turn that looks like a call is the model's text."""
    from scaletrain.errors import ConfigError
    from scaletrain.objectives.grpo_options import GRPOOptions
    from scaletrain.rl.agentic import agentic_engine
    from scaletrain.rl.tool_calls import parse_turn

    tok = chatml_tokenizer(response_schema=False)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    engine = agentic_engine(None, tok, GRPOOptions(environment_factory=Count), None)
    assert engine.fmt == "text"
    text = call("multiply", a=1, b=2)
    assert parse_turn(tok, tok.encode(text + END, add_special_tokens=False), engine.fmt) == {
        "role": "assistant", "content": text}
    with pytest.raises(ConfigError, match="tool_call_format"):
        agentic_engine(None, tok, GRPOOptions(environment_factory=Count, tools=[multiply]), None)
