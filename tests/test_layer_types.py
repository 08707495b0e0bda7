"""The shared per-layer mechanisms (models/common/layer_types.py, qk_norm.py, post_norm.py): what the
conformance rows of OLMo 2/3 and SmolLM3 do not show by themselves.

How layers group into kinds (type, window, RoPE), that a NoPE layer's rotation is exactly the identity,
that an unknown ``layer_types`` entry is refused in one line naming the file and the key (from a
config.json and from our own config), and that the q/k norm over all heads and the post-norm block
compute what transformers' OLMo 3 modules compute on the same weights.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.common.layer_types import FULL_ATTENTION, SLIDING_ATTENTION, kind_of, layer_kinds, layer_spec
from scaletrain.models.kernels.attention import apply_rope, rope_tables
from scaletrain.models.registry import AutoModelForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def _write_config(path, **config) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_layers_group_into_kinds_by_type_window_and_rope() -> None:
    """SmolLM3 with sliding NoPE layers: (full, RoPE) and (sliding, no RoPE) are two kinds; OLMo 3's default
    pattern puts every fourth layer in the full kind; a config without layer types is one kind."""
    from scaletrain.models.llama import LlamaConfig
    from scaletrain.models.olmo3 import Olmo3Config
    from scaletrain.models.smollm3 import SmolLM3Config

    smol = SmolLM3Config(**TINY, num_hidden_layers=8, use_sliding_window=True, sliding_window=16)
    assert smol.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert smol.layer_types == [FULL_ATTENTION] * 3 + [SLIDING_ATTENTION] + [FULL_ATTENTION] * 3 + [SLIDING_ATTENTION]
    kinds, index = layer_kinds(smol)
    assert index == [0, 0, 0, 1, 0, 0, 0, 1]
    assert [k.window for k in kinds] == [None, 16] and layer_spec(smol, 3).rope is None
    olmo = Olmo3Config(**TINY, num_hidden_layers=8, sliding_window=16)
    kinds, index = layer_kinds(olmo)
    assert index == [0, 0, 0, 1, 0, 0, 0, 1] and [k.window for k in kinds] == [16, None]
    assert layer_kinds(LlamaConfig(**TINY, num_hidden_layers=3))[1] == [0, 0, 0]


def test_nope_layer_rotation_is_exactly_the_identity() -> None:
    """A NoPE kind rotates by the angle 0: queries and keys come out bit for bit as they went in."""
    from scaletrain.models.smollm3 import SmolLM3Config

    config = SmolLM3Config(**TINY, num_hidden_layers=4)
    kind = kind_of(config, layer_spec(config, 3))
    x = jax.random.normal(jax.random.key(0), (2, 7, 4, config.head_dim)) * 100
    positions = jnp.broadcast_to(jnp.arange(7) * 1000, (2, 7))
    np.testing.assert_array_equal(np.asarray(apply_rope(x, rope_tables(positions, kind.inv_freq))), np.asarray(x))
    rope_kind = kind_of(config, layer_spec(config, 0))
    assert not np.array_equal(np.asarray(apply_rope(x, rope_tables(positions, rope_kind.inv_freq))), np.asarray(x))


@pytest.mark.parametrize("model_type, entry", [
    ("olmo3", "linear_attention"),  # a type transformers knows, which OLMo 3 does not have
    ("smollm3", "chunked_attention"),
    ("gemma3_text", "no_such_attention"),  # a type transformers itself would refuse over many lines
])
def test_unknown_layer_type_is_one_line_naming_the_file_and_key(model_type, entry, tmp_path) -> None:
    folder = _write_config(tmp_path / "m", model_type=model_type, **TINY, num_hidden_layers=2, sliding_window=8,
                           layer_types=[FULL_ATTENTION, entry])
    with pytest.raises(ConfigError) as info:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(os.path.join(folder, "config.json") + ": layer_types[1]")
    assert f"{entry!r} is not a layer type {model_type} builds" in message


def test_unknown_layer_type_in_our_config_is_one_line_naming_the_key() -> None:
    """A recipe's ``model:`` section or a direct construction: the same sentence, from the config class."""
    from scaletrain.models.olmo3 import Olmo3Config

    with pytest.raises(ConfigError) as info:
        Olmo3Config(**TINY, num_hidden_layers=2, layer_types=[SLIDING_ATTENTION, "global"])
    assert "\n" not in str(info.value) and "layer_types[1] 'global' is not a layer type olmo3 builds" in str(info.value)
    with pytest.raises(ConfigError, match="layer_types lists 1 layers but num_hidden_layers is 2"):
        Olmo3Config(**TINY, num_hidden_layers=2, layer_types=[FULL_ATTENTION])


def test_all_heads_qk_norm_and_post_norm_block_equal_transformers_olmo3_layer() -> None:
    """One OLMo 3 decoder layer of transformers and ours with its weights: q/k norms over the whole
    projection (not per head) and the norms after attention and the MLP, on a sliding layer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.olmo3 import modeling_olmo3 as hf

    from scaletrain.models.common.inputs import training_inputs
    from scaletrain.models.common.post_norm import PostNormDecoderLayer
    from scaletrain.models.olmo3 import Olmo3Config

    torch.manual_seed(0)
    hf_config = transformers.Olmo3Config(**TINY, num_hidden_layers=2, sliding_window=4, attention_bias=True,
                                         layer_types=[SLIDING_ATTENTION, FULL_ATTENTION])
    hf_config._attn_implementation = "eager"
    ref = hf.Olmo3DecoderLayer(hf_config, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    config = Olmo3Config(**TINY, num_hidden_layers=2, sliding_window=4, attention_bias=True,
                         layer_types=[SLIDING_ATTENTION, FULL_ATTENTION])
    ours = PostNormDecoderLayer(config, jnp.float32, jnp.float32, None, nnx.Rngs(0))
    weights = {k: v.numpy() for k, v in ref.state_dict().items()}
    for name, value in weights.items():
        *path, leaf = name.split(".")
        module = ours
        for part in path:
            module = getattr(module, part)
        target = {"weight": "kernel" if value.ndim == 2 else "weight", "bias": "bias"}[leaf]
        getattr(module, target)[...] = jnp.asarray(value.T if value.ndim == 2 else value)
    assert ours.self_attn.q_norm.weight[...].shape == (4 * 8,)  # over all heads, not head_dim

    x = np.random.RandomState(0).randn(2, 10, 32).astype(np.float32)
    kinds, _ = layer_kinds(config)
    prepared = training_inputs(config, kinds[:1], jnp.zeros((2, 10), jnp.int32), None, None, None)
    got, _, _ = ours(jnp.asarray(x), prepared.by_kind[0])
    rotary = hf.Olmo3RotaryEmbedding(hf_config)
    positions = torch.arange(10)[None].expand(2, 10)
    mask = torch.full((10, 10), float("-inf")).triu(1) + torch.full((10, 10), float("-inf")).tril(-4)
    with torch.no_grad():
        want = ref(torch.tensor(x), attention_mask=mask[None, None], position_ids=positions,
                   position_embeddings=rotary(torch.tensor(x), positions, SLIDING_ATTENTION)).numpy()
    diff = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    print(f"olmo3 layer: max rel diff {diff:.1e}")
    assert diff < 1e-5  # float32, same maths summed in other orders (measured ~1e-7)
