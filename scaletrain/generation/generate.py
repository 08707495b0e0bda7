"""``generate()``: continue prompts from a model, host tokens out (the CLI's and the sample callbacks' call).

Why a thin layer over the rollout engine: there is one decode loop. ``generate`` runs
:func:`scaletrain.generation.engine.rollout` with one generation per prompt, seed as given and
step 0, and only reshapes its answer as the single-call API always did: the new tokens [B, N]
on the host, rows that stopped filled with the first stop id, and N cut to the last step any
row still needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from scaletrain.generation.buckets import as_rows
from scaletrain.generation.engine import SamplingParams, rollout, stop_ids
from scaletrain.generation.sampling import sampling_problem


def generate(
    model: nnx.Module,
    input_ids: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Any = None,
) -> np.ndarray:
    """Continue each prompt by up to ``max_new_tokens`` tokens; returns only the new tokens [B, N].

    ``input_ids`` is [B, T] (left-padded, with ``attention_mask`` 1 on real tokens),
    a single prompt [T], or a list of token lists of any lengths (padded here).
    ``temperature`` 0 is greedy decoding; otherwise tokens are sampled after
    ``top_k``/``top_p`` filtering, deterministically for a given ``seed``. After a
    row emits ``eos_token_id`` (an id or a list of ids) it is filled with the first
    eos id, and N is cut to the last step any row still needed. Run it inside
    ``jax.set_mesh(mesh)`` for a sharded model, or outside any mesh.
    """
    if problem := sampling_problem(max_new_tokens, temperature, top_k, top_p):
        raise ValueError(" ".join(problem))
    ids, mask = as_rows(input_ids, attention_mask)
    if max_new_tokens == 0:
        return np.zeros((ids.shape[0], 0), np.int32)
    stop = stop_ids(eos_token_id)
    greedy = temperature is None or float(temperature) <= 0.0
    sampling = SamplingParams(max_completion_length=int(max_new_tokens), temperature=0.0 if greedy else temperature,
                              top_k=top_k, top_p=top_p, stop_token_ids=stop, pad_token_id=stop[0] if stop else 0)
    out = rollout(model, ids, sampling, seed=seed, attention_mask=mask)
    return np.asarray(out.completion_ids)[:, : int(out.steps)]
