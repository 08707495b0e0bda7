"""The contenders of bench/rollout.py, each one callable: ``run(prompts, generations, cap, stop_ids, seed) -> Call``.

Why one shape: both workloads and every engine are timed by the same loop, so a ratio is always two
calls of the same prompts, group size, temperature (1, no top-k / top-p) and cap.

- ``static``: scaletrain's :class:`~scaletrain.generation.StaticBatchEngine` (today's engine);
- ``continuous``: scaletrain's ``ContinuousBatchEngine`` where this tree has one (None otherwise);
- ``generate``: transformers' ``generate`` over the whole batch (each prompt's rows repeated);
- ``generate_batch``: transformers' continuous batching (``generate_batch``, a paged cache of our sizing:
  on the CPU its default takes 90 % of free memory, which is neither a fair peak nor fast to allocate).

Scaletrain's engines go through the :class:`~scaletrain.generation.RolloutEngine` interface on
``(graphdef, params)`` split once, as GRPO calls them; the tokens are read to the host inside the timing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollout_workload import kv_bytes_per_token

SCALETRAIN = ("static", "continuous")
TRANSFORMERS = ("generate", "generate_batch")
ALL = SCALETRAIN + TRANSFORMERS
#: transformers' continuous batching page size (tokens); its cache holds every row's prompt + cap (no preemption)
HF_PAGE = 32


@dataclasses.dataclass
class Call:
    """One timed call: wall and CPU seconds, each row's completion length (stop token included), and the
    key/value cache bytes it held at its peak (None where the contender does not say); ``used_bytes``: of
    those, the most its rows occupied at once, where it says (the continuous engine's pages in use);
    ``preemptions``: rows the continuous engine preempted because its page pool ran short."""

    wall_s: float
    cpu_s: float
    lengths: np.ndarray
    cache_bytes: int | None
    used_bytes: int | None = None
    preemptions: int | None = None


Run = Callable[[list[list[int]], int, int, tuple[int, ...], int], Call]


def _lengths(tokens: np.ndarray, stop_ids: tuple[int, ...]) -> np.ndarray:
    """Tokens up to and including each row's first stop id (the whole row where none)."""
    if not stop_ids:
        return np.full(tokens.shape[0], tokens.shape[1])
    hit = np.isin(tokens, stop_ids)
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, tokens.shape[1])


def continuous_engine_class() -> Any:
    """``scaletrain.generation.ContinuousBatchEngine`` where this tree has it, else None."""
    import scaletrain.generation as generation

    return getattr(generation, "ContinuousBatchEngine", None)


@functools.lru_cache(maxsize=1)
def _loaded(model_dir: str, dtype: str) -> tuple[Any, Any, Any, Any]:
    """scaletrain's model of ``model_dir`` (loaded once for every engine), its graph, parameters and mesh."""
    import jax
    from flax import nnx

    from scaletrain.models.registry import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    graphdef, params = nnx.split(model)
    return model, graphdef, params, jax.tree.leaves(params)[0].sharding.mesh


def scaletrain_engine(name: str, model_dir: str, dtype: str, slots: int) -> Run | None:
    """``run`` for scaletrain's engine ``name``, or None when this tree lacks it."""
    import jax

    from scaletrain.generation import SamplingParams, StaticBatchEngine, bucket, left_pad

    cls = StaticBatchEngine if name == "static" else continuous_engine_class()
    if cls is None:
        return None
    model, graphdef, params, mesh = _loaded(model_dir, dtype)
    per_token = kv_bytes_per_token(model.config, np.dtype(dtype).itemsize)
    takes = inspect.signature(cls).parameters
    extra = {k: slots for k in ("slots", "num_slots") if k in takes}

    made: dict[SamplingParams, Any] = {}  # one engine per sampling, reused by every call as a trainer reuses it

    def run(prompts: list[list[int]], generations: int, cap: int, stop_ids: tuple[int, ...], seed: int) -> Call:
        sampling = SamplingParams(max_completion_length=cap, temperature=1.0, stop_token_ids=stop_ids)
        if sampling not in made:
            made[sampling] = cls(sampling, **extra)
        engine = made[sampling]
        t0, c0 = time.perf_counter(), time.process_time()
        with jax.set_mesh(mesh):
            out = engine.generate((graphdef, params), prompts, num_generations=generations, seed=seed)
        lengths = np.asarray(out.lengths)
        np.asarray(out.completion_ids)  # the tokens in hand
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if name == "static":  # the cache its one program allocates: batch bucket x (prompt bucket + cap)
            padded = bucket(*left_pad(prompts), generations, 0, 1)
            cache = padded.input_ids.shape[0] * (padded.input_ids.shape[1] + cap) * per_token
        else:  # the page pool the engine allocated, where it reports it (``stats``)
            stats = getattr(engine, "stats", {})
            page = getattr(engine, "page_size", 0) * per_token
            cache, used = (stats.get(k) and stats[k] * page for k in ("num_pages", "peak_pages"))
            return Call(wall, cpu, lengths, cache, used, stats.get("preemptions"))
        return Call(wall, cpu, lengths, cache)

    return run


def transformers_contender(name: str, model_dir: str, dtype: str, device: str | None) -> Run:
    """``run`` for transformers' ``generate`` or ``generate_batch`` on ``device`` (default: cuda if torch sees one)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval().to(device)
    per_token = kv_bytes_per_token(model.config, torch.finfo(getattr(torch, dtype)).bits // 8)

    def run_generate(prompts: list[list[int]], generations: int, cap: int, stop_ids: tuple[int, ...],
                     seed: int) -> Call:
        from scaletrain.generation import left_pad

        ids, mask = left_pad([p for p in prompts for _ in range(generations)])
        torch.manual_seed(seed)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(torch.tensor(ids, dtype=torch.long, device=device),
                                 attention_mask=torch.tensor(mask, device=device), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=cap, pad_token_id=0,
                                 eos_token_id=list(stop_ids) or None, min_new_tokens=0 if stop_ids else cap)
            tokens = out[:, ids.shape[1]:].cpu().numpy()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        # its dynamic cache grows to every row x (padded prompt + the columns any row needed)
        return Call(wall, cpu, _lengths(tokens, stop_ids), ids.shape[0] * (ids.shape[1] + tokens.shape[1]) * per_token)

    def run_generate_batch(prompts: list[list[int]], generations: int, cap: int, stop_ids: tuple[int, ...],
                           seed: int) -> Call:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cap,
                                  pad_token_id=0, eos_token_id=list(stop_ids) or -1, num_return_sequences=generations)
        blocks = sum(math.ceil((len(p) + cap) / HF_PAGE) for p in prompts) * generations
        cb = ContinuousBatchingConfig(page_size=HF_PAGE, num_blocks=blocks, max_batch_tokens=max(256, 2 * HF_PAGE),
                                      seed=seed)
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                   progress_bar=False, warmup=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if len(out) != len(prompts) * generations or any(r.error for r in out.values()):
            raise RuntimeError(f"generate_batch returned {len(out)} of {len(prompts) * generations} requests")
        lengths = np.asarray([len(r.generated_tokens) for r in out.values()])
        return Call(wall, cpu, lengths, blocks * HF_PAGE * per_token)

    return run_generate if name == "generate" else run_generate_batch


def median_call(calls: Sequence[Call]) -> Call:
    """The call of median wall time (its own lengths and cache: a sampled workload differs per seed)."""
    ordered = sorted(calls, key=lambda c: c.wall_s)
    return ordered[(len(ordered) - 1) // 2]
