"""A score head on any family's decoder: Hugging Face's ``*ForSequenceClassification`` with ``num_labels=1``.

Why one head for every family: a reward model (and a PPO value model) is the family's decoder with its
language-model head swapped for ``score``, a ``[hidden, 1]`` linear without bias, exactly as transformers
lays it out (``model.*`` + ``score.weight``), so a folder written here loads as
``AutoModelForSequenceClassification`` and one of transformers' loads here. :func:`sequence_classifier`
makes the class from a family's causal LM when the family registers (:mod:`scaletrain.models.common.family`),
so no family spells it.

A sequence's score is read at its last token that is not padding, as transformers reads it: the last
position whose id is not ``config.pad_token_id`` (and, here, that is inside the row's segments); when a
row's end token *is* the pad token (a tokenizer whose pad is its eos), that end token counts as padding
too, in both. :meth:`ScoreHead.token_scores` is the same head at every position (a value head's).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.common.dense import Dense
from scaletrain.models.task import SEQUENCE_CLASSIFICATION

Array = jax.Array
#: our name of the head's kernel, and the tensor transformers stores it as
SCORE_PARAM, SCORE_TENSOR = "score.kernel", "score.weight"


def last_token_index(input_ids: Array, valid: Array, pad_token_id: int | None) -> Array:
    """[B] int32: each row's last position that is ``valid`` and, with a pad id, not the pad token (0 when none is):
    transformers' ``(arange(T) * (ids != pad)).argmax(-1)``."""
    keep = valid if pad_token_id is None else valid & (input_ids != pad_token_id)
    positions = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(keep, positions, 0), axis=-1)


def pooled(per_token: Array, index: Array) -> Array:
    """``per_token`` [B, T, ...] at each row's ``index`` [B]: [B, ...]."""
    return jnp.take_along_axis(per_token, index.reshape(index.shape + (1,) * (per_token.ndim - 1)), axis=1)[:, 0]


class ScoreHead:
    """The mixin :func:`sequence_classifier` puts before a family's causal LM: ``score`` instead of ``lm_head``."""

    _model_task: ClassVar[str] = SEQUENCE_CLASSIFICATION
    num_labels: ClassVar[int] = 1

    def __init__(self, config: Any, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, precision: Any = None,
                 *, rngs: nnx.Rngs):
        super().__init__(config, dtype, param_dtype, precision, rngs=rngs)  # type: ignore[call-arg]
        self.lm_head = None  # never read: an abstract build drops it, a jitted init never computes it
        self.score = Dense(config.hidden_size, self.num_labels, ("embed", "norm"), use_bias=False, config=config,
                           dtype=self.dtype, param_dtype=self.param_dtype, precision=precision, rngs=rngs)

    def token_scores(self, hidden: Array) -> Array:
        """Float32 scores of final-norm hidden states [..., hidden] -> [...] (the head at every position)."""
        return self.score(hidden)[..., 0].astype(jnp.float32)

    def sequence_scores(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None,
                        attention_mask: Array | None = None) -> Array:
        """[B] float32: each row's score at its last non-padding token (see the module)."""
        hidden = self.hidden_states(input_ids, positions, segment_ids, attention_mask)  # type: ignore[attr-defined]
        if segment_ids is not None:
            valid = segment_ids != 0
        elif attention_mask is not None:
            valid = attention_mask.astype(bool)
        else:
            valid = jnp.ones(input_ids.shape, bool)
        index = last_token_index(input_ids, valid, self.config.pad_token_id)  # type: ignore[attr-defined]
        return self.token_scores(pooled(hidden, index))  # the head on [B, hidden]: [B]

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None,
                 attention_mask: Array | None = None) -> Array:
        """[B, 1] float32 scores: what transformers' ``*ForSequenceClassification`` returns as ``logits``."""
        return self.sequence_scores(input_ids, positions, segment_ids, attention_mask)[:, None]


def sequence_classifier(causal_lm: type) -> type:
    """The ``*ForSequenceClassification`` class of a family's causal LM (``LlamaForCausalLM`` ->
    ``LlamaForSequenceClassification``)."""
    name = causal_lm.__name__.replace("ForCausalLM", "") + "ForSequenceClassification"
    return type(name, (ScoreHead, causal_lm), {"__module__": causal_lm.__module__, "__qualname__": name,
                                               "__doc__": f"{causal_lm.__name__}'s decoder with a score head."})


def is_sequence_classifier(model_or_class: Any) -> bool:
    """Whether a module (or class) carries the score head rather than a language-model head."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return issubclass(cls, ScoreHead)


def hf_architecture(causal_architecture: str) -> str:
    """transformers' class name of the score-head model of a family whose causal LM is ``causal_architecture``."""
    return causal_architecture.replace("ForCausalLM", "") + "ForSequenceClassification"


def fresh_score(module_class: type, tensors: Any, targets: dict[str, Any], initializer_range: float,
                where: str) -> dict[str, Array]:
    """``{"score.kernel": a new head}`` when a score-head class loads a folder without ``score.weight`` (a causal
    LM's, as TRL's ``RewardTrainer`` starts from one): drawn from N(0, ``initializer_range``²) as transformers
    initialises it, from a fixed key, sharded like its target; else ``{}``."""
    if not is_sequence_classifier(module_class) or SCORE_TENSOR in tensors:
        return {}
    import logging

    logging.getLogger("scaletrain").warning("%s: no %s in the folder; the score head starts from N(0, %s^2)",
                                            where, SCORE_TENSOR, initializer_range)
    target = targets[SCORE_PARAM]
    draw = jax.jit(lambda key: (jax.random.normal(key, target.shape, jnp.float32) * initializer_range)
                   .astype(target.dtype), out_shardings=target.sharding)
    return {SCORE_PARAM: draw(jax.random.key(0))}


def value_head_std(hidden_size: int) -> float:
    """The standard deviation a fresh value head is drawn with: OpenRLHF's critic initialises its
    ``value_head`` from N(0, (1 / (hidden + 1))²), small enough that the first values are near 0."""
    return 1.0 / (hidden_size + 1)


def attach_value_head(model: Any, kernel: Any = None, seed: int = 0) -> Any:
    """``model`` (a causal LM) with a value head ``score`` beside its ``lm_head``: the token-score form of
    :class:`ScoreHead` (``[hidden, 1]``, no bias, HF's ``score.weight`` layout), trained with the policy (it is
    one more parameter of the module, so the optimizer, checkpoints and resume carry it). ``kernel`` [hidden, 1]
    (from a reward model's ``score.weight``, transposed) or, None, drawn by :func:`value_head_std` from ``seed``;
    replicated on the mesh the model lives on (it is ``hidden`` numbers)."""
    config = model.config
    head = Dense(config.hidden_size, 1, ("embed", "norm"), use_bias=False, config=config, dtype=model.dtype,
                 param_dtype=model.param_dtype, precision=None, rngs=nnx.Rngs(seed))
    if kernel is None:
        kernel = jax.random.normal(jax.random.key(seed), (config.hidden_size, 1), jnp.float32)
        kernel = kernel * value_head_std(config.hidden_size)
    mesh = next(leaf.sharding.mesh for leaf in jax.tree.leaves(nnx.state(model))
                if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    head.kernel.set_value(jax.device_put(jnp.asarray(kernel, model.param_dtype), replicated))
    model.score = head
    return model

