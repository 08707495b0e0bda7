"""Multi-turn trajectories with tools equal TRL 1.16's, built by TRL's own tool loop on the same completions.

TRL's ``GRPOTrainer._tool_call_loop`` (with its ``_get_tool_suffix_ids``) is run as it is on a stand-in
holding what the loop reads (the tokenizer, the tools, the caps); its sampler, ``_generate_single_turn``,
returns scripted turns, and ours (``rl.multi_turn.run_episodes``) gets the same script: each row's turns
in order, whatever context it is asked after, with log-probabilities that differ per turn and row. The
rows cover a turn without calls, one call, calls over several iterations up to
``max_tool_calling_iterations``, two calls in one turn, a tool that raises, an unknown tool, a malformed call,
a tool result that would overflow ``max_completion_length`` (dropped: the row ends as it was), a later
turn cut at the cap, calls whose arguments are not a JSON object (a string, a list) and null arguments. Token ids, the tool mask, the log-probabilities (0 on tool tokens), the messages and
the call/failure counts must be equal; both the tokenizer's parser and our own Hermes parser are checked.
"""

from __future__ import annotations

import copy

import pytest

from agentic_testing import call, chatml_tokenizer, divide, echo, multiply

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")

CAP = 400
ITERATIONS = 2
END = "<|im_end|>"
# each row's model turns, in order (a row asks its tools between turns)
SCRIPT = [
    ["The answer is 12." + END],
    [call("multiply", a=3, b=4) + END, "It is 12." + END],
    [call("multiply", a=2, b=5) + END, call("multiply", a=10, b=3) + END, call("multiply", a=1, b=1) + END],
    ["Two at once\n" + call("multiply", a=2, b=2) + "\n" + call("divide", a=9, b=3) + END, "4 and 3." + END],
    [call("divide", a=1, b=0) + END, "Cannot." + END],
    [call("search", query="x") + END, "No search." + END],
    ['<tool_call>\n{"name": multiply}\n</tool_call>' + END],
    [call("echo", text="abcdefghij", times=50) + END, "never sampled" + END],
    [call("multiply", a=6, b=7) + END, "forty-two " * 45 + END],
    ['<tool_call>\n{"name": "multiply", "arguments": "a=2, b=3"}\n</tool_call>' + END, "Bad call." + END],
    ['<tool_call>\n{"name": "divide", "arguments": [9, 3]}\n</tool_call>' + END, "Bad call." + END],
    ['<tool_call>\n{"name": "echo", "arguments": null}\n</tool_call>' + END, "Bad call." + END],
]
BAD_ARGUMENTS = {9: ("multiply", "str"), 10: ("divide", "list")}  # row 11: null arguments are no arguments
TOOLS = [multiply, divide, echo]


class Script:
    """The scripted sampler: row ``r``'s ``k``-th turn, with log-probability ``-(r + 1) / 100 - k / 1000`` a token."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.turn = [0] * len(SCRIPT)

    def next(self, row):
        k = self.turn[row]
        self.turn[row] += 1
        ids = self.tok.encode(SCRIPT[row][k], add_special_tokens=False)
        return ids, [-(row + 1) / 100 - k / 1000] * len(ids)


def row_of(heads, context):
    """The row a context belongs to: every row has the same prompt, so rows differ by their first turn."""
    return next(r for r, head in enumerate(heads) if list(context[:len(head)]) == head)


def trl_trajectories(tok, prompt_ids):
    import types

    import trl.trainer.grpo_trainer as grpo
    from trl.chat_template_utils import parse_response

    script = Script(tok)
    first = [script.next(r) for r in range(len(SCRIPT))]
    heads = [prompt_ids[r] + list(first[r][0]) for r in range(len(SCRIPT))]

    class Loop:  # what TRL's loop reads of its trainer, TRL's own two methods, and the scripted sampler
        _tool_call_loop = grpo.GRPOTrainer._tool_call_loop
        _get_tool_suffix_ids = grpo.GRPOTrainer._get_tool_suffix_ids

        def _generate_single_turn(self, contexts, images, fields, num_generations=1, has_tool_images=False):
            turns = [script.next(row_of(heads, c)) for c in contexts]
            return [t[0] for t in turns], [t[1] for t in turns]

    loop = Loop()
    loop.__dict__.update(
        processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=None, chat_template_kwargs={},
        tools=TOOLS, environment_factories=None, use_vllm=False, max_completion_length=CAP,
        max_tool_calling_iterations=ITERATIONS,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096)),
        _sync_tool_dicts=[{t.__name__: t for t in TOOLS} for _ in SCRIPT], _async_tool_dicts=[{} for _ in SCRIPT])
    prompts = [[{"role": "user", "content": "q"}] for _ in SCRIPT]
    completion_ids = [list(f[0]) for f in first]
    completions = [[parse_response(tok, ids, prefix=prompt_ids[r], tools=TOOLS)]
                   for r, ids in enumerate(completion_ids)]
    logprobs = [list(f[1]) for f in first]
    mask, completions, completion_ids, logprobs, calls, failures, _ = loop._tool_call_loop(
        prompts, [list(p) for p in prompt_ids], completion_ids, completions, logprobs, None, {})
    return completion_ids, mask, logprobs, completions, calls, failures


def our_trajectories(tok, prompt_ids, fmt):
    from scaletrain.rl.multi_turn import Rules, run_episodes
    from scaletrain.rl.tools import Toolbox

    script = Script(tok)
    first = [script.next(r) for r in range(len(SCRIPT))]
    heads = [prompt_ids[r] + first[r][0] for r in range(len(SCRIPT))]

    def sample(contexts, budget, turn, rows):
        return [script.next(row_of(heads, c)) for c in contexts]

    rules = Rules(tok, fmt, CAP, max_tool_calling_iterations=ITERATIONS, max_model_len=4096)
    return run_episodes(prompt_ids, first, sample, [Toolbox(TOOLS) for _ in SCRIPT], rules)


@pytest.fixture(scope="module")
def both():
    from scaletrain.rl.chat_turns import prompt_ids as render

    tok = chatml_tokenizer()
    prompt = render(tok, [{"role": "user", "content": "q"}], TOOLS)
    prompt_ids = [list(prompt) for _ in SCRIPT]
    return tok, prompt_ids, trl_trajectories(tok, copy.deepcopy(prompt_ids))


@pytest.mark.parametrize("fmt", ["tokenizer", "hermes"])
def test_tool_trajectories_equal_trl_tool_call_loop(both, fmt):
    tok, prompt_ids, (ids, mask, logprobs, completions, calls, failures) = both
    episodes = our_trajectories(tok, prompt_ids, fmt)
    for r, e in enumerate(episodes):
        assert e.completion_ids == ids[r], f"row {r}: token ids"
        assert e.tool_mask == mask[r], f"row {r}: tool mask"
        assert e.log_probs == pytest.approx(logprobs[r], abs=0), f"row {r}: log-probs"
        assert len(e.completion_ids) <= CAP
        assert e.messages == completions[r], f"row {r}: messages"
    assert sum(e.tool_calls for e in episodes) == calls
    assert sum(e.tool_failures for e in episodes) == failures
    # the cases the script is about happened: an overflowing result dropped, a turn cut at the cap, the limit
    assert episodes[7].tool_mask == [1] * len(episodes[7].completion_ids)  # echo's result did not fit
    assert len(episodes[8].completion_ids) == CAP and not episodes[8].completion_ids[-1] == tok.eos_token_id
    assert episodes[2].turns == 3 and "tool_calls" in episodes[2].messages[-1]  # stopped by the iteration limit
    assert failures == 2 + len(BAD_ARGUMENTS) + 1  # row 11's echo() called without its arguments
    assert episodes[4].failed_tools == ["divide"] and episodes[5].failed_tools == ["search"]
    assert 0 in episodes[1].tool_mask and episodes[1].log_probs[episodes[1].tool_mask.index(0)] == 0.0


def test_a_call_whose_arguments_are_not_an_object_fails_with_trls_error_text_naming_the_tool(both):
    """TRL calls ``tool(**arguments)``: arguments written as a string or a list fail with Python's TypeError text,
    which names the tool; ours give the model the same text (not an internal one) and count a failure. Null
    arguments are no arguments, as TRL's parser reads them."""
    import agentic_testing

    tok, prompt_ids, (ids, _, _, completions, _, _) = both
    episodes = our_trajectories(tok, prompt_ids, "hermes")
    for row, (name, kind) in BAD_ARGUMENTS.items():
        bad = "a=2, b=3" if kind == "str" else [9, 3]
        with pytest.raises(TypeError) as python:
            getattr(agentic_testing, name)(**bad)
        expected = str({"error": str(python.value)})
        assert f"agentic_testing.{name}() argument after ** must be a mapping, not {kind}" in expected
        assert episodes[row].messages[1] == {"role": "tool", "name": name, "content": expected}
        assert episodes[row].failed_tools == [name] and episodes[row].tool_failures == 1
        assert completions[row][1]["content"] == expected  # TRL's loop gave the model the same text
        assert episodes[row].completion_ids == ids[row]
    assert episodes[11].messages[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert "echo() missing 2 required positional arguments" in episodes[11].messages[1]["content"]
    assert episodes[11].messages == completions[11]
