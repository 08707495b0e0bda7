#!/usr/bin/env python
"""How closely a student follows its teacher on held-out prompts: the figures of the distillation example.

Why a script of its own: the training log's ``loss`` is the reverse KL on the student's own samples of the
*training* prompts, which moves as the student changes what it samples; agreement has to be read on prompts
neither model trained on, the same tokens before and after, so this script fixes them: each held-out prompt
(through the chat template) is continued greedily by the teacher, and on those teacher tokens it reads

- ``token_agreement``: the share of completion positions where the student's most likely next token is the
  teacher's (the teacher's own greedy token), over all positions of all prompts;
- ``reverse_kl``: the per-token KL(student || teacher) over the whole vocabulary at those positions, averaged
  over positions (the divergence ``objective.type: distillation`` minimises, beta 1);
- ``greedy_match``: the share of prompts whose greedy student completion equals the teacher's token for token.

The models are any folder ``scaletrain generate`` reads (a model folder, a PEFT adapter folder, a training
run), so "before" is the base model's folder and "after" the distillation run. Prints one JSON line.

Usage (from the repository root)::

    python examples/distill/agreement.py --teacher runs/distill_teacher_smollm2/merged \
        --student runs/distill_smollm2 [--prompts examples/distill/heldout.jsonl] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.cli_hf import load_for_generation, read_prompts
from scaletrain.data.chat_templates import apply_chat_template
from scaletrain.generation import generate, stop_token_ids, until_stop


def completion_logprobs(model: Any, rows: list[list[int]], starts: list[int]) -> list[np.ndarray]:
    """Each row's next-token log-probabilities [len(row) - start, vocab] at the positions that predict its tokens
    from ``start`` on. Rows are right-padded to one length: under causal attention a pad after a token does not
    change that token's logits, so one forward serves all rows."""
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    with jax.set_mesh(mesh):
        logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids)).astype(jnp.float32), axis=-1))
    return [logp[i, start - 1: len(row) - 1] for i, (row, start) in enumerate(zip(rows, starts))]


def agreement(teacher_dir: str, student_dir: str, prompts_path: str, max_new_tokens: int) -> dict[str, Any]:
    """The three figures of the module docstring for ``student_dir`` against ``teacher_dir``."""
    teacher, tokenizer = load_for_generation(teacher_dir)
    student, _ = load_for_generation(student_dir)
    prompts = [list(apply_chat_template(tokenizer, p, add_generation_prompt=True, return_dict=True)["input_ids"])
               for p in read_prompts(prompts_path)]
    stop = stop_token_ids(tokenizer, teacher.config.eos_token_id)

    def greedy(model: Any) -> list[list[int]]:
        with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
            out = generate(model, prompts, max_new_tokens=max_new_tokens, eos_token_id=stop)
        # the reply and the stop token that ended it (when one did): the student should learn to stop too
        return [new[: len(until_stop(new, stop)) + 1][:max_new_tokens] for new in out.tolist()]

    taught = greedy(teacher)
    rows, starts = [p + c for p, c in zip(prompts, taught)], [len(p) for p in prompts]
    t_logp = completion_logprobs(teacher, rows, starts)
    s_logp = completion_logprobs(student, rows, starts)
    agree = np.concatenate([s.argmax(-1) == t.argmax(-1) for s, t in zip(s_logp, t_logp)])
    reverse_kl = np.concatenate([(np.exp(s) * (s - t)).sum(-1) for s, t in zip(s_logp, t_logp)])
    own = greedy(student)
    return {"student": student_dir, "teacher": teacher_dir, "prompts": len(prompts), "tokens": int(agree.size),
            "token_agreement": round(float(agree.mean()), 4), "reverse_kl": round(float(reverse_kl.mean()), 4),
            "greedy_match": round(float(np.mean([a == b for a, b in zip(own, taught)])), 4),
            "examples": [{"teacher": tokenizer.decode(until_stop(t, stop)), "student": tokenizer.decode(
                until_stop(s, stop))} for t, s in list(zip(taught, own))[:4]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", required=True, help="the teacher's model folder")
    parser.add_argument("--student", required=True, help="a model folder, adapter folder or training run")
    parser.add_argument("--prompts", default="examples/distill/heldout.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(agreement(args.teacher, args.student, args.prompts, args.max_new_tokens)))


if __name__ == "__main__":
    main()
