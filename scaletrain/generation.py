"""Text generation from a causal LM with a key/value cache (greedy or sampled).

Why this shape: one jitted function does the prefill and then a ``lax.while_loop``
of single-token decode steps over a cache of fixed size (prompt + new tokens), so a
prompt batch compiles once and every step reuses it; the loop stops as soon as
every row has produced an end-of-sequence token. Prompts of different lengths are
left-padded (``attention_mask`` marks the real tokens), so all rows write their new
token into the same cache slot and RoPE positions still count real tokens only.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sampling_problem(max_new_tokens: int, temperature: Any, top_k: int | None,
                     top_p: Any | None) -> tuple[str, str] | None:
    """The first sampling argument that cannot work, as (its name, what is wrong), or None.

    Checked before anything compiles: ``top_k=0`` or ``top_p=0`` would keep no token and a
    negative temperature would prefer the least likely ones. Traced values pass unchecked."""
    def known(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if max_new_tokens < 0:
        return "max_new_tokens", f"must be >= 0, got {max_new_tokens}"
    if known(temperature) and not (temperature >= 0 and math.isfinite(temperature)):
        return "temperature", f"must be >= 0 and finite (0: greedy), got {temperature}"
    if top_k is not None and top_k < 1:
        return "top_k", f"must be at least 1 (or unset: no top-k), got {top_k}"
    if top_p is not None and known(top_p) and not 0 < top_p <= 1:
        return "top_p", f"must be in (0, 1] (or unset: no top-p), got {top_p}"
    return None


def sample_token(
    logits: jax.Array, key: jax.Array, temperature: Any, top_k: int | None, top_p: Any | None
) -> jax.Array:
    """Pick one token per row of ``logits`` [B, V]: argmax at temperature 0, else sample.

    As transformers does it: divide by the temperature, keep the ``top_k`` largest
    logits, then the smallest set of tokens whose probability reaches ``top_p``.
    ``temperature`` and ``top_p`` may be traced values; whether to sample at all is
    decided by the caller (a Python ``temperature <= 0`` means greedy).
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1: the first has 0 before it
        cutoff = jnp.take_along_axis(sorted_logits, keep - 1, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


class _StaticModel:
    """Hashable stand-in for a GraphDef (whose config is not hashable) as a jit static argument.

    Two models with the same class, config and dtypes have equal graph
    definitions, so they share one compiled generation function.
    """

    def __init__(self, graphdef: Any, model: nnx.Module):
        self.graphdef = graphdef
        self.key = (
            type(model).__module__,
            type(model).__qualname__,
            json.dumps(model.config.to_dict(), sort_keys=True, default=str),
            str(getattr(model, "dtype", None)),
            str(getattr(model, "param_dtype", None)),
            str(getattr(model, "precision", None)),
            # a LoRA / QLoRA model's graph differs from its base's (adapters, quantised kernels)
            repr(getattr(model, "lora_config", None)),
        )

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StaticModel) and self.key == other.key


@functools.partial(jax.jit, static_argnames=("static", "max_new_tokens", "greedy", "top_k", "use_top_p"))
def _generate_jit(
    state: Any,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    key: jax.Array,
    eos_ids: jax.Array,
    *,
    static: _StaticModel,
    max_new_tokens: int,
    greedy: bool,
    top_k: int | None,
    use_top_p: bool,
) -> tuple[jax.Array, jax.Array]:
    """Prefill then decode; returns (new tokens [B, max_new_tokens], number of steps taken)."""
    model = nnx.merge(static.graphdef, state)
    b, p = input_ids.shape
    total = p + max_new_tokens
    fill = eos_ids[0] if eos_ids.shape[0] else jnp.int32(0)
    mask = attention_mask.astype(jnp.int32)
    kv_valid = jnp.zeros((b, total), bool).at[:, :p].set(mask.astype(bool))
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    hidden, cache = model.forward_with_cache(input_ids, positions, model.init_cache(b, total), jnp.int32(0), kv_valid)
    logits = model.compute_logits(hidden[:, -1])
    next_pos = jnp.sum(mask, axis=1).astype(jnp.int32)

    def pick(logits: jax.Array, step: jax.Array) -> jax.Array:
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        sub = jax.random.fold_in(key, step)
        return sample_token(logits, sub, temperature, top_k, top_p if use_top_p else None).astype(jnp.int32)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        step, _, _, _, _, _, done = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        step, logits, cache, kv_valid, next_pos, out, done = carry
        tok = jnp.where(done, fill, pick(logits, step))
        out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], step, axis=1)
        done = done | jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        slot = p + step
        kv_valid = jax.lax.dynamic_update_slice_in_dim(kv_valid, jnp.ones((b, 1), bool), slot, axis=1)
        hidden, cache = model.forward_with_cache(tok[:, None], next_pos[:, None], cache, slot, kv_valid)
        return step + 1, model.compute_logits(hidden[:, 0]), cache, kv_valid, next_pos + 1, out, done

    out = jnp.full((b, max_new_tokens), fill, jnp.int32)
    carry = (jnp.int32(0), logits, cache, kv_valid, next_pos, out, jnp.zeros((b,), bool))
    step, _, _, _, _, out, _ = jax.lax.while_loop(cond, body, carry)
    return out, step


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to one length: ``(input_ids, attention_mask)``, both [B, T] int32."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    t = max(len(p) for p in prompts)
    ids = np.full((len(prompts), t), pad_id, np.int32)
    mask = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = p
        mask[i, t - len(p):] = 1
    return ids, mask


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
    ragged = (
        attention_mask is None
        and isinstance(input_ids, (list, tuple))
        and input_ids
        and isinstance(input_ids[0], (list, tuple, np.ndarray))
    )
    if ragged:
        ids, mask = left_pad(input_ids)
    else:
        ids = np.atleast_2d(np.asarray(input_ids, np.int32))
        mask = np.ones_like(ids) if attention_mask is None else np.atleast_2d(np.asarray(attention_mask, np.int32))
    if ids.shape != mask.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} differ in shape")
    if max_new_tokens == 0:
        return np.zeros((ids.shape[0], 0), np.int32)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    graphdef, state = nnx.split(model)
    greedy = temperature is None or float(temperature) <= 0.0
    out, steps = _generate_jit(
        state,
        jnp.asarray(ids),
        jnp.asarray(mask),
        jnp.float32(1.0 if greedy else temperature),
        jnp.float32(1.0 if top_p is None else top_p),
        jax.random.key(seed),
        jnp.asarray(eos, jnp.int32).reshape(-1),
        static=_StaticModel(graphdef, model),
        max_new_tokens=int(max_new_tokens),
        greedy=greedy,
        top_k=None if greedy or top_k is None else int(top_k),
        use_top_p=not greedy and top_p is not None,
    )
    return np.asarray(out)[:, : int(steps)]


_TURN_PROBE = "scaletrain-end-of-turn-probe"


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, or None.

    Why: a chat model ends its reply with the template's end-of-turn token, which is
    not always the tokenizer's eos (Qwen2 base: eos ``<|endoftext|>``, turn end
    ``<|im_end|>``; Llama 3: ``<|eot_id|>``). Rendering a probe conversation finds it
    for any template without a table of names. Only a special (added) token counts:
    a plain newline after the content is not an end of reply.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    import jinja2

    probe = [{"role": "user", "content": _TURN_PROBE}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None  # a template that refuses this conversation tells us nothing
    if not isinstance(text, str) or _TURN_PROBE not in text:
        return None
    suffix = text.rsplit(_TURN_PROBE, 1)[1].lstrip()
    ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.get_added_vocab().values())
    return int(ids[0]) if ids[0] in special else None


def stop_token_ids(tokenizer: Any | None, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Every id that ends a reply: ``eos_token_id`` (the model config's), the tokenizer's eos
    and the chat template's end-of-turn token, without repeats (first one first)."""
    found: list[int] = []
    candidates: list[Any] = [eos_token_id]
    if tokenizer is not None:
        candidates += [getattr(tokenizer, "eos_token_id", None), end_of_turn_id(tokenizer)]
    for value in candidates:
        for i in [] if value is None else ([value] if isinstance(value, int) else list(value)):
            if int(i) not in found:
                found.append(int(i))
    return found


def until_stop(tokens: Sequence[int], stop: Sequence[int]) -> list[int]:
    """``tokens`` up to (without) the first stop id: the reply itself, whether or not the
    tokenizer flags that id as special (``skip_special_tokens`` only drops flagged ones)."""
    tokens = [int(t) for t in tokens]
    cut = next((i for i, t in enumerate(tokens) if t in set(stop)), len(tokens))
    return tokens[:cut]
