"""Qwen3 and Gemma 3 (text): what the conformance suite does not check for them.

The chunked, soft-capped loss over Gemma's 262k vocabulary, Gemma's embedding scale in
bf16, the options we refuse, and each family's recipe in examples/ training on the
bundled corpus (Gemma's with remat). Logits, generation, packing, scanned layers, the
export round trip and LoRA against transformers are in test_families_conformance.py.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.errors import ConfigError
from scaletrain.models.registry import AutoModelForCausalLM
from conformance_testing import token_ids
from hf_testing import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_chunked_softcapped_loss_over_gemma_vocabulary() -> None:
    """Gemma 3's 262144-token vocabulary with a tiny hidden size and soft-capped logits: the chunked
    head + loss (value and its gradients for hidden states and head) equals whole logits + autodiff."""
    from scaletrain.objectives.fused_loss import fused_head_loss
    from scaletrain.objectives.loss import cross_entropy_sums

    rng = np.random.default_rng(0)
    vocab, cap = 262144, 3.0
    hidden = jnp.asarray(rng.normal(size=(2, 12, 8)), jnp.float32)
    embedding = jnp.asarray(rng.normal(size=(vocab, 8)), jnp.float32)  # tied: [V, H], as Gemma's head
    ids = jnp.asarray(rng.integers(0, vocab, (2, 12)))
    mask = jnp.ones((2, 11), jnp.float32)

    def whole(h, w):  # logits of a few units (|z| up to ~10), so the cap at 3 bends them
        return cross_entropy_sums(jnp.tanh(h @ w.T / cap) * cap, ids, mask).loss

    def chunked(h, w):  # 5: uneven chunks of 12 positions
        return fused_head_loss(h, w, ids, mask, jnp.float32, 5, transposed=True, softcap=cap)[0]

    value, grads = jax.jit(jax.value_and_grad(whole, argnums=(0, 1)))(hidden, embedding)
    fused_value, fused_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, embedding)
    assert float(fused_value) == pytest.approx(float(value), rel=1e-5)  # 22 log-sum-exps, float32
    for g, r in zip(fused_grads, grads, strict=True):  # float32 sums in another order
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6 * float(np.abs(r).max()))


def test_gemma_embedding_scale_is_cast_to_the_compute_dtype() -> None:
    """transformers multiplies by sqrt(hidden) cast to the weights' dtype: 55.5, not 55.4256, in bf16."""
    from flax import nnx

    from scaletrain.models.gemma3 import Gemma3ForCausalLM
    from scaletrain.models.gemma3 import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=4, hidden_size=3072, intermediate_size=8, num_hidden_layers=1,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    model = Gemma3ForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    table = model.model.embed_tokens[...].astype(jnp.bfloat16)
    expected = table[None] * jnp.asarray(55.5, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(model._embed(jnp.arange(4)[None]), np.float32),
                                  np.asarray(expected, np.float32))


def _write_config(path, **config) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


TINY_GEMMA = dict(model_type="gemma3_text", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)


@pytest.mark.parametrize("config, key", [
    (dict(TINY_GEMMA, attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(TINY_GEMMA, hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(TINY_GEMMA, use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(TINY_GEMMA, rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.full_attention: rope type 'yarn'"),
    (dict(TINY_GEMMA, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention: rope type 'linear'"),
    (dict(model_type="qwen3", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (dict(model_type="qwen3", num_hidden_layers=4, use_sliding_window=True, max_window_layers=2),
     "per-layer attention types"),
], ids=["attn-softcap", "activation", "bidirectional", "global-yarn", "local-scaling", "qwen3-dynamic",
        "qwen3-mixed-windows"])
def test_unsupported_options_fail_naming_the_key(config, key, tmp_path) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(_write_config(tmp_path / "m", **config))


def test_export_refuses_what_transformers_cannot_express() -> None:
    from scaletrain.models.llama.config import LlamaConfig
    from scaletrain.models.qwen3 import Qwen3Config
    from scaletrain.models.hf_config import config_to_hf

    with pytest.raises(ConfigError, match="'qwen3' with qk_norm=False"):
        config_to_hf(Qwen3Config(hidden_size=16, num_attention_heads=2, qk_norm=False), "float32")
    with pytest.raises(ConfigError, match="'llama' with qk_norm=True"):
        config_to_hf(LlamaConfig(hidden_size=16, num_attention_heads=2, qk_norm=True), "float32")


@pytest.mark.parametrize("example", ["qwen3", "gemma3"])
def test_example_recipe_trains_and_loss_falls(example, tmp_path) -> None:
    """The family's recipe in examples/, shrunk (sizes, steps, 3 plays), trains on the bundled corpus;
    `scaletrain export` of its checkpoint is a folder transformers loads as that family."""
    from scaletrain.export import export_checkpoint
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recipe = Recipe.load(os.path.join(root, "examples", f"{example}.yaml"), [
        f"training.output_dir={tmp_path / 'run'}", "training.max_training_steps=8", "training.log_steps=1",
        "training.warmup_steps=2", "training.evaluation_steps=null", "training.max_evaluation_steps=1",
        "training.max_length=64", "training.total_batch_size=8", "data.max_documents=3",
        "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.head_dim=32",
        "sample.max_new_tokens=0", "training.progress_bar=false", "training.do_eval=false",
        "training.report_to=[]",
        # Gemma with full remat (its own layer loop: per-layer masks and RoPE) and the chunked,
        # soft-capped head + loss in the train step
        *(["model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=16",
           "model.query_pre_attn_scalar=32", "model.gradient_checkpointing=full", "training.loss_chunk_size=16"]
          if example == "gemma3" else []),
    ])
    assert recipe.model.type == {"qwen3": "qwen3", "gemma3": "gemma3_text"}[example]
    summary = run_training(recipe)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line]
    assert summary["final_step"] == 8 and len(losses) == 8
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses  # from ~ln(4096) = 8.3 (0.5 lower by step 8)
    back = transformers.AutoModelForCausalLM.from_pretrained(export_checkpoint(str(tmp_path / "run"),
                                                                               str(tmp_path / "hf")))
    assert back.config.model_type == recipe.model.type and back.config.num_hidden_layers == 2
    assert np.isfinite(hf_logits(back.eval(), token_ids(1, 8))).all()
