"""KV-cache generation: equal to a cache-less greedy loop, sharded, sampling, stopping, the CLI helper."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from scaletrain.generation import generate, left_pad
from scaletrain.models.registry import AutoModelForCausalLM
from hf_testing import hf_model, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our model) for a tiny Mistral whose window (6) is shorter than prompt + output."""
    ref = hf_model("mistral", seed=1, sliding_window=6)
    model = AutoModelForCausalLM.from_pretrained(save_hf(ref, tmp_path_factory.mktemp("gen") / "hf"))
    return ref, model


def _prompts() -> tuple[np.ndarray, np.ndarray]:
    """Two left-padded prompts of 9 and 5 tokens (ids avoid 0-2, the special ids)."""
    rs = np.random.RandomState(0)
    return left_pad([list(rs.randint(3, 128, 9)), list(rs.randint(3, 128, 5))])


def _cacheless_greedy(model, ids: np.ndarray, mask: np.ndarray, steps: int) -> np.ndarray:
    """Reference: the full training forward each step, argmax at the last real position.

    The buffer has its final size from the start (future slots masked out; causal
    attention never looks at them), so the forward compiles once.
    """
    from flax import nnx

    b, p = ids.shape
    buf = np.zeros((b, p + steps), np.int32)
    buf_mask = np.zeros((b, p + steps), np.int32)
    buf[:, :p], buf_mask[:, :p] = ids, mask
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, x, m: nnx.merge(graphdef, state)(x, attention_mask=m))
    for i in range(steps):
        logits = np.asarray(forward(state, buf, buf_mask))
        buf[:, p + i] = logits[:, p + i - 1].argmax(-1)
        buf_mask[:, p + i] = 1
    return buf[:, p:]


def test_greedy_cache_equals_cacheless_loop(tiny) -> None:
    """Greedy with the cache equals the full forward each step; ragged token lists are left-padded the
    same way. (Greedy tokens equal to transformers' generate, for every family: test_families_conformance.)"""
    _, model = tiny
    ids, mask = _prompts()
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=NEW)
    assert ours.shape == (2, NEW)
    np.testing.assert_array_equal(ours, _cacheless_greedy(model, ids, mask, NEW))
    ragged = [list(ids[0][mask[0] == 1]), list(ids[1][mask[1] == 1])]
    np.testing.assert_array_equal(generate(model, ragged, max_new_tokens=NEW), ours)


def test_sharded_model_generates_the_same(tiny, tmp_path) -> None:
    ref, model = tiny
    sharded = AutoModelForCausalLM.from_pretrained(save_hf(ref, tmp_path / "hf"), sharding_axis_dims=(1, 2, 1, 4, 1))
    ids, mask = _prompts()
    with jax.set_mesh(jax.tree.leaves(sharded)[0].sharding.mesh):
        ours = generate(sharded, ids, attention_mask=mask, max_new_tokens=NEW)
    np.testing.assert_array_equal(ours, generate(model, ids, attention_mask=mask, max_new_tokens=NEW))


def test_sampling_is_deterministic_per_seed(tiny) -> None:
    _, model = tiny
    ids, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, temperature=1.0, top_p=0.95)
    a = generate(model, ids, seed=3, **kw)
    np.testing.assert_array_equal(a, generate(model, ids, seed=3, **kw))
    assert not np.array_equal(a, generate(model, ids, seed=4, **kw))
    assert a.min() >= 0 and a.max() < 128


def test_top_k_1_equals_greedy(tiny) -> None:
    _, model = tiny
    ids, mask = _prompts()
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=NEW)
    sampled = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=1.7, top_k=1, seed=5)
    np.testing.assert_array_equal(sampled, greedy)


def test_eos_stops_rows_and_fills(tiny) -> None:
    _, model = tiny
    ids, mask = _prompts()
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=NEW)
    eos = int(greedy[0, 3])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
    first = [int(np.argmax(row == eos)) if (row == eos).any() else NEW for row in greedy]
    assert out.shape[1] == min(NEW, max(f + 1 for f in first))  # stops once every row is done
    for row, f in enumerate(first):
        np.testing.assert_array_equal(out[row, : f + 1], greedy[row, : f + 1])
        assert (out[row, f + 1:] == eos).all()


def test_sample_token_filters() -> None:
    from scaletrain.generation import sample_token

    logits = jax.numpy.log(jax.numpy.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)

    def draw(top_k: int | None, top_p: float | None) -> set[int]:
        one = lambda k: sample_token(logits, k, 1.0, top_k, top_p)[0]  # noqa: E731
        return set(np.asarray(jax.jit(jax.vmap(one))(keys)).tolist())

    assert draw(top_k=2, top_p=None) == {0, 1}
    assert draw(top_k=None, top_p=0.7) == {0, 1}  # 0.5 < 0.7 so the second token is needed
    assert draw(top_k=None, top_p=0.45) == {0}  # the first token alone reaches 0.45


@pytest.mark.parametrize("argument,value,message", [
    ("top_k", 0, "top_k must be at least 1"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("temperature", -0.5, "temperature must be >= 0 and finite"),
    ("max_new_tokens", -1, "max_new_tokens must be >= 0"),
])
def test_sampling_arguments_that_keep_no_token_are_refused(tiny, capsys, argument, value, message) -> None:
    """``top_k=0`` or ``top_p=0`` would keep no token, a negative temperature prefers the least likely:
    ``generate`` refuses each by name, and ``scaletrain generate`` with one exit code and its flag,
    before any model is loaded (the folder does not exist)."""
    from scaletrain.cli import main

    _, model = tiny
    kwargs = {"max_new_tokens": 4, "temperature": 1.0, **{argument: value}}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        generate(model, [[3, 4, 5]], **kwargs)
    flag = "--" + argument.replace("_", "-")
    assert main(["generate", "/nonexistent-model", "--prompt", "hi", "--temperature", "1", flag, str(value)]) == 2
    assert f"scaletrain: error: {flag} {message.split(' ', 1)[1]}" in capsys.readouterr().err


def test_generate_main_with_tokenizer(tiny, tmp_path) -> None:
    """The CLI helper loads the folder and its tokenizer and returns decoded new text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from scaletrain.cli_hf import generate_main

    ref, _ = tiny
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    folder = save_hf(ref, tmp_path / "hf")
    tok.save_pretrained(folder)
    text = generate_main(folder, "w5 w9 w17 w3", max_new_tokens=8, temperature=0.0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    expected = generate(model, [[5, 9, 17, 3]], max_new_tokens=8, eos_token_id=2)[0]
    assert text == tok.decode(expected.tolist(), skip_special_tokens=True)


def test_generate_main_without_tokenizer_takes_ids(tiny, tmp_path) -> None:
    from scaletrain.cli_hf import generate_main
    from scaletrain.errors import ConfigError

    ref, model = tiny
    folder = save_hf(ref, tmp_path / "hf")
    expected = generate(model, [[5, 9, 17, 3]], max_new_tokens=6, eos_token_id=2)[0]
    assert generate_main(folder, "5 9 17 3", max_new_tokens=6) == " ".join(map(str, expected))
    with pytest.raises(ConfigError, match="no tokenizer"):
        generate_main(folder, "hello", max_new_tokens=2)
