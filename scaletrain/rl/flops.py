"""The model FLOPs of a GRPO step, rollout and update apart, for ``rollout/mfu``, ``update/mfu`` and ``mfu``.

Why not the trainer's ``flops_per_token(max_length)``: a GRPO step is not a batch of ``max_length`` rows trained
at 6N FLOPs a token. It samples (a forward per token, no backward), may score the samples again (a forward), and
updates on rows of a prompt and its completion, each of its own length; with LoRA the frozen base gets no weight
gradient. So each part is counted from what it computes, on real tokens only (padding is not model work):

- a causal forward over a row of ``T`` tokens whose logits are read at ``L`` positions:
  ``2 (B + A) T + 4 W T (T + 1) / 2 + 2 H L``, with ``B`` the matmul parameters below the head (the embedding
  lookup is no matmul), ``A`` the LoRA adapters' parameters (0 without LoRA, and for a reference read with the
  adapters off), ``W`` = layers x query width (scores and the weighted sum: 2 x 2 x context x width a layer, token
  ``i`` seeing ``i`` keys) and ``H`` the head (vocab x hidden), applied only where a log-probability is read;
- the update: that forward, the input gradients (the same again for the matmuls, twice the attention's) and a
  weight gradient (2 per parameter and token) for the trained matmul parameters only: all of ``B`` and ``H`` in a
  full fine-tune, only ``A`` with LoRA. So a full fine-tune costs ``6 (B + H)``-like figures, LoRA about ``4 B``;
- the rollout: the prefill and decode of a completion of ``c`` tokens after a prompt of ``p`` are one causal
  forward over ``p + c - 1`` tokens (the last sampled token is never fed back) with logits at ``c`` positions.
  Each completion's prompt is counted: the engine prefills every row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenCost:
    """Parameter counts that set a token's FLOPs (see the module docstring for the letters)."""

    body: float  # B
    head: float  # H
    adapters: float  # A
    attention: float  # W
    lora: bool

    @classmethod
    def of(cls, config: Any, adapters: float, lora: bool) -> TokenCost:
        """From a model config's own count (:meth:`flops_per_token`: 6 x matmul parameters + 6 W x sequence), so a
        family's override (a mixture of experts' active parameters) carries over."""
        matmul = config.flops_per_token(0) / 6.0
        attention = (config.flops_per_token(1) - config.flops_per_token(0)) / 6.0
        head = float(config.vocab_size * config.hidden_size)
        return cls(body=matmul - head, head=head, adapters=float(adapters), attention=attention, lora=lora)


def _rows(tokens: Any, logits: Any) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(tokens, np.float64), np.asarray(logits, np.float64)


def forward_flops(cost: TokenCost, tokens: Any, logits: Any, adapters: bool = True) -> float:
    """One causal forward over rows of ``tokens`` real tokens each, logits read at ``logits`` positions each."""
    t, n = _rows(tokens, logits)
    body = cost.body + (cost.adapters if adapters else 0.0)
    return float(np.sum(2.0 * body * t + 2.0 * cost.attention * t * (t + 1) + 2.0 * cost.head * n))


def update_flops(cost: TokenCost, tokens: Any, logits: Any) -> float:
    """Forward and backward over the update's rows: the forward, the input gradients (the forward's matmuls again,
    the attention twice) and the weight gradients of the trained matmul parameters."""
    t, n = _rows(tokens, logits)
    forward = forward_flops(cost, t, n)
    inputs = forward + float(np.sum(2.0 * cost.attention * t * (t + 1)))
    trained_body, trained_head = (cost.adapters, 0.0) if cost.lora else (cost.body, cost.head)
    return forward + inputs + float(np.sum(2.0 * trained_body * t + 2.0 * trained_head * n))


def rollout_flops(cost: TokenCost, prompt_lengths: Any, completion_lengths: Any) -> float:
    """Sampling completions of ``completion_lengths`` tokens after prompts of ``prompt_lengths`` (one per row)."""
    p, c = _rows(prompt_lengths, completion_lengths)
    return forward_flops(cost, p + np.maximum(c, 1.0) - 1.0, c)


def adapter_parameters(params: Any) -> int:
    """The LoRA adapters' parameters among ``params`` (the ``lora_a`` / ``lora_b`` leaves)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(int(np.prod(np.shape(v))) for path, v in leaves
               if any(str(getattr(k, "key", getattr(k, "name", k))) in ("lora_a", "lora_b") for k in path))


class StepFlops:
    """The FLOPs a GRPO run's steps compute, as figures: ``rollout/*`` and ``update/*`` (TFLOP/s and MFU of each
    part over its own time) per step, and ``tokens_per_s`` / ``tflops`` / ``mfu`` over the steps between two logs
    (everything: rollouts, scoring forwards, updates, over the wall time between the logs)."""

    def __init__(self, cost: TokenCost, peak_per_device: float, devices: int):
        self.cost, self.peak = cost, peak_per_device * devices
        self.flops = self.tokens = 0.0  # since the last interval()

    def utilisation(self, flops: float, seconds: float, name: str) -> dict[str, float]:
        """``<name>/tflops`` and ``<name>/mfu`` of ``flops`` model FLOPs done in ``seconds``."""
        if seconds <= 0:
            return {}
        return {f"{name}/tflops": flops / seconds / 1e12, f"{name}/mfu": flops / seconds / self.peak}

    def rollout(self, prompt_lengths: Any, lengths: Any, seconds: float, *, scored: bool,
                reference: bool) -> tuple[dict[str, float], float, float]:
        """Count a rollout (sampling, the scoring forward when ``scored``, the reference's when ``reference``):
        its figures, and the FLOPs and tokens of one update on its rows."""
        p, c = _rows(prompt_lengths, lengths)
        sampled = rollout_flops(self.cost, p, c)
        self.flops += sampled + (forward_flops(self.cost, p + c, c) if scored else 0.0)
        if reference:  # another model of the same shape, or the base with its adapters off
            self.flops += forward_flops(self.cost, p + c, c, adapters=False)
        return self.utilisation(sampled, seconds, "rollout"), update_flops(self.cost, p + c, c), float(np.sum(p + c))

    def update(self, flops: float | None, tokens: float, seconds: float) -> dict[str, float]:
        """Count one update of ``flops`` (None: a rollout restored from a checkpoint, not counted); its figures."""
        if flops is None:
            return {}
        self.flops += flops
        self.tokens += tokens
        return self.utilisation(flops, seconds, "update")

    def interval(self, seconds: float) -> dict[str, float]:
        """``tokens_per_s`` (the tokens the updates read), ``tflops`` and ``mfu`` since the last call."""
        flops, tokens = self.flops, self.tokens
        self.flops = self.tokens = 0.0
        if seconds <= 0:
            return {"tokens_per_s": float("nan"), "tflops": float("nan"), "mfu": float("nan")}
        return {"tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12, "mfu": flops / seconds / self.peak}
