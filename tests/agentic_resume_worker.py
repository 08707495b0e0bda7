"""A tiny GRPO run whose episodes have tool turns and environment turns, used as a subprocess by the resume test.

Usage: python agentic_resume_worker.py OUT TOKENIZER_FOLDER [KILL_AT_STEP | PORT:RANK]
Each row plays :class:`Echoes`, a multi-turn environment seeded by ``(seed, step, row)`` that replies twice and
scores each reply's length, and offers one tool (``look``). The turns are the tiny random model's, sampled
by the static engine under the multi-turn loop, except that every other row's first turn is a scripted
``look`` call (a random model writes no tool call); the sampled turns stop early, as many byte tokens stop
them. With KILL_AT_STEP the process sends itself SIGKILL after that step, its checkpoint written. At the
end it writes the parameters' digest to ``OUT/params_sha256``. With PORT:RANK it is process RANK of two
(``jax.distributed`` on 127.0.0.1:PORT). Every ``step`` and ``look`` call appends its episode's seed to
``OUT-calls/<process index>.txt``, so the test sees which process ran which row's calls. The tokenizer is
``agentic_testing``'s, saved by the test (loading it here spares each process TRL's import).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from agentic_testing import VOCAB, call
from resume_worker import KillAt

END = "<|im_end|>"
CALLS = sys.argv[1] + "-calls"


class Echoes:
    """Replies twice with a text drawn from the episode's seed; each reply scores the model's turn length mod 3."""

    def reset(self, seed: int, **row) -> str:
        self.seed = self.episode = seed
        return f" Seed {seed % 97}."

    def _note(self) -> None:
        import jax

        with open(os.path.join(CALLS, f"{jax.process_index()}.txt"), "a") as f:
            f.write(f"{self.episode}\n")

    def step(self, text: str):
        self._note()
        reward = float(len(text) % 3)
        self.seed = (self.seed * 31 + len(text)) % 997
        return (None, reward, True) if self.seed % 4 == 0 else (f"Echo {self.seed}.", reward, False)

    def look(self, n: int) -> str:
        """Look at the seed.

        Args:
            n: How far.
        """
        self._note()
        return str(self.seed % (n + 2))


@dataclasses.dataclass(frozen=True)
class FirstCalls:
    """The static engine's rollout at ``sampling``, with every other row's first turn (a context with one assistant
    header) replaced by a scripted ``look`` call, log-probability -1 a token."""

    sampling: object
    tokenizer: object

    def generate(self, state, prompts, *, num_generations=1, seed=0, step=0, rows=None):
        import jax.numpy as jnp

        from scaletrain.generation import StaticBatchEngine

        out = StaticBatchEngine(self.sampling).generate(state, prompts, num_generations=num_generations, seed=seed,
                                                        step=step, rows=rows)
        if self.tokenizer.decode(list(prompts[0])).count("<|im_start|>assistant") != 1:
            return out  # a later turn: sampled as it is
        from scaletrain.rl.process_rows import read_whole

        ids, mask, lps, lengths, truncated = (np.array(read_whole(x)) for x in (
            out.completion_ids, out.completion_mask, out.log_probs, out.lengths, out.truncated))
        script = self.tokenizer.encode(call("look", n=1) + END, add_special_tokens=False)[:ids.shape[1]]
        for r in range(0, len(ids), 2):
            ids[r], mask[r], lps[r] = self.sampling.pad_token_id, 0, 0.0
            ids[r, :len(script)], mask[r, :len(script)], lps[r, :len(script)] = script, 1, -1.0
            lengths[r], truncated[r] = len(script), False
        return out._replace(completion_ids=jnp.asarray(ids), completion_mask=jnp.asarray(mask),
                            log_probs=jnp.asarray(lps), lengths=jnp.asarray(lengths),
                            truncated=jnp.asarray(truncated), steps=jnp.asarray(int(lengths.max()), jnp.int32))


def main() -> None:
    import scaletrain as st
    from scaletrain.generation import SamplingParams
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.rl.agent_engine import MultiTurnEngine
    from scaletrain.rl.trainer import GRPOTrainer
    from scaletrain.training import params_sha256

    from transformers import PreTrainedTokenizerFast

    out, tok = sys.argv[1], PreTrainedTokenizerFast.from_pretrained(sys.argv[2])
    last = sys.argv[3] if len(sys.argv) > 3 else ""
    kill_at = int(last) if last.isdigit() else None
    if ":" in last:
        import jax

        port, rank = last.split(":")
        jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(rank), initialization_timeout=120)
    os.makedirs(CALLS, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=256, pad_token_id=257, bos_token_id=None)
    model = create_sharded_model(LlamaForCausalLM, config, seed=0)[0]
    stops = (256, *range(97, 123))  # end of turn, and every lower-case letter: the sampled turns stay short
    sampling = SamplingParams(max_completion_length=160, temperature=1.0, stop_token_ids=stops, pad_token_id=257)
    engine = MultiTurnEngine(FirstCalls(sampling, tok), tok, lambda n: [], "hermes",
                             max_tool_calling_iterations=1, tool_timeout=30.0, max_turns=3)
    args = st.TrainingArguments(output_dir=out, total_batch_size=8, max_length=64, learning_rate=1e-2,
                                scheduler="constant", max_training_steps=4, save_steps=2, log_steps=1,
                                resume_if_possible=True, save_at_end=False, progress_bar=False, report_to=(), seed=0)
    trainer = GRPOTrainer(arguments=args, model=model, tokenizer=tok, environment_factory=Echoes,
                          options={"num_generations": 4, "max_completion_length": 160, "log_completions_steps": 1},
                          dataset_train=[{"prompt": [{"role": "user", "content": q}]} for q in ("go", "start")],
                          rollout_engine=engine, callbacks=[KillAt(kill_at)] if kill_at else [])
    done = trainer.train()
    digest = params_sha256(done.state.params)
    import jax

    if jax.process_index() == 0:
        with open(os.path.join(out, "params_sha256"), "w") as f:
            f.write(digest)


if __name__ == "__main__":
    main()
