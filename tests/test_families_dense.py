"""Qwen3 and Gemma 3 (text) against transformers (torch CPU, float32) as the oracle.

Each case's reference model is built by transformers once (random weights, every
parameter randomised) and serves the checks: logits on a batch longer than the
sliding windows, the round trip HF -> scaletrain -> save_pretrained -> transformers,
and (one case per family) greedy generation of 16 tokens from left-padded prompts.
Then: the chunked, soft-capped loss over Gemma's 262k vocabulary, the options we refuse,
and each family's recipe in examples/ training on the bundled corpus (Gemma's with remat).
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
from hf_testing import (
    GEMMA3_LOCAL_GLOBAL,
    assert_greedy_generation_matches,
    assert_logits_match,
    hf_logits,
    hf_model,
    load_back_unchanged,
    our_logits,
    save_hf,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    # head_dim 24 != hidden 64 / 4 heads; untied head
    "qwen3-head-dim": ("qwen3", dict(head_dim=24)),
    # tied head, biases on all four projections
    "qwen3-tied-bias": ("qwen3", dict(tie_word_embeddings=True, attention_bias=True, head_dim=32)),
    # local, local, global: hf_testing.GEMMA3_LOCAL_GLOBAL says what each value checks
    "gemma3-local-global": ("gemma3_text", GEMMA3_LOCAL_GLOBAL),
    # explicit layer_types (global first), an untied head, no soft-capping, attention biases
    "gemma3-untied": ("gemma3_text", dict(
        layer_types=["full_attention", "sliding_attention"], sliding_window=6, tie_word_embeddings=False,
        attention_bias=True, head_dim=32, query_pre_attn_scalar=16)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, its saved folder, our model loaded from it), built once per case."""
    family, overrides = CASES[request.param]
    ref = hf_model(family, seed=3, **overrides)
    folder = save_hf(ref, tmp_path_factory.mktemp(request.param) / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == family
    return request.param, ref, folder, model


def _ids(batch: int = 2, length: int = 40) -> np.ndarray:
    return np.random.RandomState(0).randint(0, 128, (batch, length)).astype(np.int32)


def test_logits_match_transformers(case) -> None:
    name, ref, _, model = case
    ids = _ids()
    assert_logits_match(name, our_logits(model, ids), hf_logits(ref, ids))


@pytest.mark.parametrize("case", ["gemma3-local-global", "qwen3-head-dim"], indirect=True)
def test_greedy_generation_matches_transformers(case) -> None:
    """One case per family (compiling the decode loop is the cost): Gemma's with both kinds of layer."""
    _, ref, _, model = case
    assert_greedy_generation_matches(model, ref)


def test_round_trip_through_save_pretrained(case, tmp_path) -> None:
    _, ref, _, model = case
    out = model.save_pretrained(str(tmp_path / "export"), max_shard_size="40KB")
    assert len(set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"].values())) > 1
    back = load_back_unchanged(out, ref)
    ids = _ids()
    np.testing.assert_array_equal(hf_logits(back, ids), hf_logits(ref, ids))
    saved = json.load(open(os.path.join(out, "config.json")))
    assert saved["architectures"] == [type(ref).__name__]
    assert {k: saved[k] for k in ("model_type", "head_dim", "tie_word_embeddings")} == {
        k: ref.config.to_dict()[k] for k in ("model_type", "head_dim", "tie_word_embeddings")}


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
    from scaletrain.models.config import LlamaConfig
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
    assert np.isfinite(hf_logits(back.eval(), _ids(1, 8))).all()
