"""GRPO steps whose rows call tools: the tool tokens are read but not trained, faults are counted, the run goes on.

The trainer runs as it is (``GRPOTrainer(tools=...)``, a tiny random Llama over the byte-level chat tokenizer
of ``agentic_testing``); the turns come from a scripted engine (a random tiny model writes no tool calls),
which writes a call in each row's first turn and an answer after the tool results: row ``r`` of a group
calls ``multiply`` (ok), ``divide`` by 0 (raises) or ``slow`` (sleeps past ``tool_timeout``). The real
engine under the multi-turn loop is checked on its own (the first turn is the single-turn rollout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest

from agentic_testing import call, chatml_tokenizer, divide, multiply, tiny_llama

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")

END = "<|im_end|>"


def slow(seconds: int) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


CALLS = [call("multiply", a=3, b=4), call("divide", a=1, b=0), call("slow", seconds=30), call("multiply", a=2, b=2)]


@dataclasses.dataclass(frozen=True)
class ScriptedTurns:
    """A rollout engine whose turns are written, not sampled: a tool call first (``CALLS[row % 4]``), then an
    answer once the context holds a tool response. Log-probabilities -0.5 a token."""

    sampling: object
    tokenizer: object

    def generate(self, state, prompts, *, num_generations=1, seed=0, step=0, rows=None):
        import jax.numpy as jnp

        from scaletrain.generation.interface import Rollout

        rows = [list(p) for p in prompts for _ in range(num_generations)]
        n, width = len(rows), self.sampling.max_completion_length
        turns = []
        for r, ctx in enumerate(rows):
            text = self.tokenizer.decode(ctx)
            answer = "the tool said " + text.rsplit("<tool_response>\n", 1)[1][:8] if "<tool_response>" in text \
                else CALLS[r % 4]
            turns.append(self.tokenizer.encode(answer + END, add_special_tokens=False)[:width])
        p = max(map(len, rows))
        pids = np.full((n, p), self.sampling.pad_token_id, np.int32)
        pmask = np.zeros((n, p), np.int32)
        ids = np.full((n, width), self.sampling.pad_token_id, np.int32)
        mask = np.zeros((n, width), np.int32)
        for r, (ctx, t) in enumerate(zip(rows, turns)):
            pids[r, p - len(ctx):], pmask[r, p - len(ctx):] = ctx, 1
            ids[r, :len(t)], mask[r, :len(t)] = t, 1
        lengths = mask.sum(1)
        return Rollout(jnp.asarray(pids), jnp.asarray(pmask), jnp.asarray(ids), jnp.asarray(mask),
                       jnp.asarray(-0.5 * mask, jnp.float32), jnp.asarray(lengths), jnp.asarray(lengths == width),
                       jnp.asarray(int(lengths.max())))


def tool_reward(prompts, completions, **columns):
    """1 when the episode's tool call succeeded (a tool message without an error)."""
    return [float(any(m["role"] == "tool" and "error" not in m["content"] for m in c)) for c in completions]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import scaletrain as st
    from scaletrain.generation import SamplingParams
    from scaletrain.rl.agent_engine import MultiTurnEngine
    from scaletrain.rl.trainer import GRPOTrainer

    root = tmp_path_factory.mktemp("multi_turn")
    tok = chatml_tokenizer()
    args = st.TrainingArguments(output_dir=str(root / "run"), total_batch_size=8, max_length=64,
                                learning_rate=1e-2, scheduler="constant", max_training_steps=2, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    sampling = SamplingParams(max_completion_length=320, temperature=1.0, stop_token_ids=(256,), pad_token_id=257)
    engine = MultiTurnEngine(ScriptedTurns(sampling, tok), tok, lambda n: [], "tokenizer",
                             max_tool_calling_iterations=2, tool_timeout=1.0)
    trainer = GRPOTrainer(arguments=args, model=tiny_llama(), tokenizer=tok, reward_funcs=[tool_reward],
                          options={"num_generations": 4, "max_completion_length": 320, "log_completions_steps": 1},
                          tools=[multiply, divide, slow], dataset_train=[
                              {"prompt": [{"role": "user", "content": q}]} for q in ("what is 3*4", "1/0?")],
                          rollout_engine=engine)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    with open(root / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("split") == "train"]
    with open(root / "run" / "completions.jsonl") as f:
        shown = [json.loads(line) for line in f]
    return trainer, engine, records, shown, seconds


def test_tool_failures_and_timeouts_are_counted_and_the_step_finishes(run):
    trainer, engine, records, shown, seconds = run
    assert len(records) == 2
    for r in records:
        assert r["tools/call_frequency"] == 1.0  # one call a row, TRL's calls per row
        assert r["tools/failure_frequency"] == 0.5  # divide raised, slow timed out: 2 of each 4 rows
        assert r["tools/turns_per_episode"] == 2.0
        assert r["reward"] == pytest.approx(0.5)
    e = engine.last_episodes
    assert [x.failed_tools for x in e[:4]] == [[], ["divide"], ["slow"], []]
    assert "did not return within 1 s" in e[2].messages[1]["content"] and "row 2" in e[2].messages[1]["content"]
    assert "division by zero" in e[1].messages[1]["content"]
    assert seconds < 30 * 2  # the 30 s sleep was not waited for (a bound, not a timing: each step gives up at 1 s)


def test_tool_tokens_are_read_but_not_trained(run):
    trainer, engine, records, shown, _ = run
    e = engine.last_episodes[0]
    model_mean = np.mean([x.tokens("model") for x in engine.last_episodes])  # the last step's rows
    model, tool = e.tokens("model"), e.tokens("tool")
    assert model > 0 and tool > 0 and model + tool == len(e.completion_ids)
    from scaletrain.rl.tools import Toolbox

    out = engine.generate(trainer.model_state, [e.prompt_ids], seed=0, step=2,
                          toolboxes=[Toolbox([multiply, divide, slow])])
    mask, tool_mask = np.asarray(out.completion_mask)[0], np.asarray(out.tool_mask)[0]
    assert int(mask.sum()) == len(e.completion_ids) and int((mask * tool_mask).sum()) == model
    assert np.all(np.asarray(out.log_probs)[0][(mask == 1) & (tool_mask == 0)] == 0.0)
    assert records[-1]["completions/mean_length"] == pytest.approx(model_mean)  # TRL counts the model's tokens


def test_completions_jsonl_shows_each_episode_as_its_turns(run):
    _, _, _, shown, _ = run
    turns = shown[0]["completion"]["turns"]
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    assert turns[0]["tool_calls"][0]["function"]["name"] == "multiply" and turns[1]["content"] == "12"


def test_multi_turn_first_turn_is_the_engines_single_turn_rollout():
    from scaletrain.generation import SamplingParams, StaticBatchEngine
    from scaletrain.rl.agent_engine import MultiTurnEngine
    from scaletrain.rl.tools import Toolbox

    tok = chatml_tokenizer()
    model = tiny_llama()
    inner = StaticBatchEngine(SamplingParams(max_completion_length=8, temperature=1.0, stop_token_ids=(256,),
                                             pad_token_id=257))
    prompts = [tok.encode("hello there", add_special_tokens=False), tok.encode("hi", add_special_tokens=False)]
    single = inner.generate(model, prompts, num_generations=2, seed=3, step=1)
    multi = MultiTurnEngine(inner, tok, lambda n: [Toolbox([multiply]) for _ in range(n)], "hermes").generate(
        model, prompts, num_generations=2, seed=3, step=1)
    lengths = np.asarray(single.lengths)
    assert np.array_equal(np.asarray(multi.lengths), lengths)
    for key in ("completion_ids", "completion_mask", "log_probs"):
        a, b = np.asarray(getattr(single, key)), np.asarray(getattr(multi, key))
        for r, n in enumerate(lengths):
            assert np.array_equal(a[r, :n], b[r, :n]), key
    assert np.all(np.asarray(multi.tool_mask) == 1)  # no call in a random model's 8 tokens: all the model's


class Guess:
    """A tiny environment: a hidden number drawn from the row's seed; ``guess`` is its one tool."""

    def reset(self, seed: int, target_hint: str = "", **row) -> str:
        self.number, self.hit = seed % 10, False
        return f" (hint: {target_hint})"

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: The guess.
        """
        self.hit = number == self.number
        return "yes" if self.hit else "no"

    def get_reward(self) -> float:
        return float(self.hit)


def test_environments_are_fresh_per_row_seeded_by_seed_step_row_and_reward_by_class_name():
    from scaletrain.data.prompts import PromptRow
    from scaletrain.rl.agentic import Agentic, episode_seed

    tok = chatml_tokenizer()
    agentic = Agentic.load([], Guess)
    rows = [PromptRow((1,), [{"role": "user", "content": "guess"}], {"target_hint": "small"})]
    boxes, ids = agentic.start(rows, 3, tok, seed=7, step=2)
    again, _ = agentic.start(rows, 3, tok, seed=7, step=2)
    assert len({id(b.environment) for b in boxes}) == 3 and list(boxes[0].by_name) == ["guess"]
    assert [b.environment.number for b in boxes] == [b.environment.number for b in again]
    assert [b.environment.number for b in boxes] == [episode_seed(7, 2, r) % 10 for r in range(3)]
    assert "(hint: small)" in tok.decode(ids[0]) and '"name": "guess"' in tok.decode(ids[0])
    boxes[1].by_name["guess"](boxes[1].environment.number)
    (reward,) = agentic.environment_rewards()
    assert reward.name == "Guess"
    assert reward.fn([], [], environments=[b.environment for b in boxes]) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("name", ["agentic_tools_smollm2", "agentic_game_smollm2"])
def test_agentic_example_recipe_parses_and_runs_one_step_on_a_tiny_model(name, tmp_path):
    """Each agentic example recipe as shipped (its data, template, environment and rewards; examples/) loads and
    runs one GRPO step, on a tiny random Llama over the byte-level chat tokenizer instead of SmolLM2 (the real
    runs are in docs/agentic.md), with its environment's reward logged."""
    import pathlib

    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    repo = pathlib.Path(__file__).resolve().parents[1]
    chatml_tokenizer(str(tmp_path / "tok"))
    recipe = Recipe.load(str(repo / "examples" / f"{name}.yaml"), [
        "model.pretrained=null", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=1024",
        f"tokenizer.path={tmp_path / 'tok'}", f"training.output_dir={tmp_path / 'run'}", "training.max_length=512",
        "training.max_training_steps=1", "training.total_batch_size=8", "training.progress_bar=false",
        "training.save_at_end=false", "objective.max_completion_length=4", "objective.num_generations=2",
    ])
    old = os.getcwd()
    os.chdir(repo)  # the recipe names its files from the repository root, as its comment says to run it
    try:
        run_training(recipe)
    finally:
        os.chdir(old)
    (record,) = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r.get("split") == "train"]
    env = {"agentic_tools_smollm2": "Calculator", "agentic_game_smollm2": "GuessTheNumber"}[name]
    assert record["step"] == 1 and np.isfinite(record["loss"]) and f"rewards/{env}/mean" in record
