"""The rollout engines this tree has, for tests that hold every engine to the RolloutEngine contract.

Why a table: the guarantees that do not depend on how an engine schedules (rows in request order, a row's
tokens and log-probs independent of its neighbours and of which slot ran it, greedy equal to transformers)
are written once against :class:`~scaletrain.generation.RolloutEngine` and run for each engine here. Today's
:class:`~scaletrain.generation.StaticBatchEngine` is always present; the continuous-batching engine joins
as soon as ``scaletrain.generation`` exports ``ContinuousBatchEngine``, built with as few decode slots as it
takes (:data:`FEW_SLOTS`) so that in these tests later rows run in slots that earlier rows used and freed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import scaletrain.generation as generation
from scaletrain.generation import SamplingParams, StaticBatchEngine

#: the continuous engine's slots in these tests: fewer than the rows of a batch, so slots are reused
FEW_SLOTS = 2

EngineFactory = Callable[[SamplingParams], Any]


def _continuous(cls: Any) -> EngineFactory:
    takes = inspect.signature(cls).parameters
    slots = {k: FEW_SLOTS for k in ("slots", "num_slots") if k in takes}
    return lambda sampling: cls(sampling, **slots)


def rollout_engines() -> dict[str, EngineFactory]:
    """Engine name -> ``factory(sampling)`` for every engine this tree has."""
    engines: dict[str, EngineFactory] = {"static": StaticBatchEngine}
    continuous = getattr(generation, "ContinuousBatchEngine", None)
    if continuous is not None:
        engines["continuous"] = _continuous(continuous)
    return engines


def tiny_mla(seed: int = 3, layers: int = 2) -> Any:
    """A float32 DeepSeek-V3 of ``layers`` layers (a dense layer, then MoE; vocab 128) on one device: multi-head
    latent attention with a low-rank query, whose continuous-engine pages hold the compressed latent."""
    from preference_testing import one_device_mesh
    from scaletrain.models import create_sharded_model
    from scaletrain.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8,
                              max_position_embeddings=64, eos_token_id=1, pad_token_id=0)
    return create_sharded_model(DeepseekV3ForCausalLM, config, seed=seed, mesh=one_device_mesh())[0]


#: the parameter list of tests parametrised over the engines
ENGINE_NAMES: list[str] = list(rollout_engines())

#: (engine, model_type) pairs known not to decode yet, each with why: their tests are strict xfails, so
#: the pair's test fails (and this entry must go) the day the engine handles the family
KNOWN_GAPS: dict[tuple[str, str], str] = {}
