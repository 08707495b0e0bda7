"""Qwen3-Next's decoder: Qwen3.5-MoE's, with the linear-attention input projections fused as Qwen3-Next stores them.

Qwen3-Next's Gated DeltaNet projects the input with two linears: ``in_proj_qkvz`` and ``in_proj_ba``,
their outputs grouped by *key head*: for each of the ``linear_num_key_heads`` groups, its query
(``Dk``), key (``Dk``), its ``r = Hv / Hk`` value heads (``r * Dv``) and their gates ``z`` (``r * Dv``);
then per group its ``r`` betas and ``r`` decay inputs. Why we keep the fused weights rather than split
them into Qwen3.5's four projections on load: the checkpoint then maps one to one (each device reads
its own slice, an export writes the very tensors), a LoRA adapter on ``in_proj_qkvz`` is the PEFT
adapter transformers' model takes, and tensor parallelism over the fused output splits whole key-head
groups. :meth:`Qwen3NextGatedDeltaNet.project` regroups the outputs exactly as transformers'
``fix_query_key_value_ordering`` does, into the layout the shared mixer computes with.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.decoder import DecoderModel
from scaletrain.models.common.dense import Dense
from scaletrain.models.common.linear_attention import GatedDeltaNet
from scaletrain.models.qwen3_5_moe.model import Qwen3_5MoeDecoderLayer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextModel
from scaletrain.models.qwen3_next.config import Qwen3NextConfig

Array = jax.Array


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3-Next's two fused input projections (module docstring)."""

    def _projections(self, h: int, kw: dict[str, Any]) -> None:
        self.in_proj_qkvz = Dense(h, 2 * self.key_dim + 2 * self.value_dim, ("embed", "heads"), use_bias=False, **kw)
        self.in_proj_ba = Dense(h, 2 * self.num_v_heads, ("embed", "heads"), use_bias=False, **kw)

    def project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        b, t, _ = x.shape
        groups, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        per_key = self.num_v_heads // groups  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(b, t, groups, 2 * dk + 2 * per_key * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + per_key * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(b, t, groups, 2 * per_key)
        beta, a = ba[..., :per_key], ba[..., per_key:]
        qkv = jnp.concatenate([q.reshape(b, t, self.key_dim), k.reshape(b, t, self.key_dim),
                               v.reshape(b, t, self.value_dim)], axis=-1)
        return (qkv, z.reshape(b, t, self.num_v_heads, dv), beta.reshape(b, t, self.num_v_heads),
                a.reshape(b, t, self.num_v_heads))


class Qwen3NextDecoderLayer(Qwen3_5MoeDecoderLayer):
    """Qwen3.5-MoE's layer with Qwen3-Next's fused linear-attention projections."""

    linear_class: ClassVar[type[nnx.Module]] = Qwen3NextGatedDeltaNet


class Qwen3NextModel(Qwen3_5MoeTextModel):
    config_class: ClassVar[type[DecoderConfig]] = Qwen3NextConfig
    layer_class: ClassVar[type[nnx.Module]] = Qwen3NextDecoderLayer


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next with its head."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3NextConfig
    base_model_class: ClassVar[type[DecoderModel]] = Qwen3NextModel
