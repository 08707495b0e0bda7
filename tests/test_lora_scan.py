"""LoRA and QLoRA on a ``model.scan_layers`` stack: the unrolled model's adapters, value for value,
the same training, and PEFT's per-layer tensors in and out (the oracle: ``peft`` on the
transformers model the base was saved from, torch CPU, float32)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

import scaletrain as st
from scaletrain.errors import ConfigError
from scaletrain.export import export_checkpoint
from scaletrain.generation import generate
from scaletrain.peft.lora import LoRAConfig, apply_lora, merge_lora, split_trainable, trainable_count
from scaletrain.peft.adapter import load_peft_adapter
from scaletrain.models.registry import AutoModelForCausalLM
from hf_testing import hf_logits, hf_model, our_logits, rel_diff, save_hf, unstacked

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOL = 1e-4  # float32 parity, max |diff| / max |logit| (as test_hf_parity)
IDS = np.random.RandomState(0).randint(0, 128, (2, 24)).astype(np.int32)
LORA = dict(target_modules="all-linear", rank=4, train_norms=True)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_hf(hf_model("llama", num_hidden_layers=3), tmp_path_factory.mktemp("llama"))


def _load(base_dir, scan):
    return AutoModelForCausalLM.from_pretrained(base_dir, scan_layers=scan)


def _same(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))


def _stacked(tree, like):
    """``tree`` (unrolled layout) restacked into the structure of ``like`` (a stacked model's dict)."""
    layers = tree["model"]["layers"]
    stack = jax.tree.map(lambda *a: np.stack(a), *(layers[i] for i in sorted(layers)))
    out = {**tree, "model": {**tree["model"], "layers": {"stack": stack}}}
    assert jax.tree.structure(out) == jax.tree.structure(like)
    return out


def test_stacked_qlora_is_the_unrolled_one(base_dir):
    """QLoRA (NF4 codes quantised per layer): the stack holds the unrolled model's adapters (drawn per
    unrolled path) and frozen codes, value for value, counts the same, and with the same adapter
    values computes the same logits."""
    config = LoRAConfig(**LORA, quantize="nf4", block_size=16)
    flat, stacked = (apply_lora(_load(base_dir, scan), config) for scan in (False, True))
    _, flat_train, flat_frozen = split_trainable(flat)
    _, stack_train, stack_frozen = split_trainable(stacked)
    assert _same(unstacked(stack_train), flat_train)
    assert _same(unstacked(stack_frozen), flat_frozen)
    assert trainable_count(stacked) == trainable_count(flat)
    # B is zero at the start: give both the same nonzero adapters so that they take part
    leaves, treedef = jax.tree.flatten(flat_train)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    moved = jax.tree.unflatten(treedef, [np.asarray(x + 0.05 * jax.random.normal(k, x.shape))
                                         for x, k in zip(leaves, keys)])
    nnx.update(flat, moved)
    nnx.update(stacked, _stacked(moved, stack_train))
    ours = our_logits(stacked, IDS)
    assert rel_diff(ours, our_logits(flat, IDS)) < TOL
    assert rel_diff(ours, our_logits(_load(base_dir, True), IDS)) > 100 * TOL  # the adapters matter


def test_part_of_the_layers_is_refused_naming_the_key(base_dir):
    with pytest.raises(ConfigError, match=r"lora.target_modules=.*some layers only.*model.scan_layers"):
        apply_lora(_load(base_dir, True), LoRAConfig(target_modules=r".*\.1\.mlp\.(up|down)_proj"))


@pytest.fixture(scope="module")
def runs(base_dir, tmp_path_factory):
    """Three LoRA steps from the same base, unrolled and stacked: (output folder, trainer, result)."""
    out = {}
    for scan in (False, True):
        folder = tmp_path_factory.mktemp(f"lora-scan-{scan}")
        rng = np.random.default_rng(0)
        data = [{"input_ids": (rng.integers(0, 128) + np.arange(rng.integers(8, 16))) % 128} for _ in range(24)]
        args = st.TrainingArguments(output_dir=str(folder), total_batch_size=8, max_length=16, num_train_epochs=None,
                                    max_training_steps=3, learning_rate=1e-2, log_steps=1, save_steps=3,
                                    progress_bar=False, do_eval=False, report_to=(),
                                    lora=LoRAConfig(**LORA, base_model=base_dir))
        trainer = st.Trainer(args, model=_load(base_dir, scan), dataset_train=data)
        out[scan] = (str(folder), trainer, trainer.train())
    return out


def _losses(folder):
    lines = (json.loads(line) for line in open(f"{folder}/metrics.jsonl"))
    return [m["loss"] for m in lines if "loss" in m and "grad_norm" in m]


def test_training_the_stack_follows_the_unrolled_run(runs):
    want, got = _losses(runs[False][0]), _losses(runs[True][0])
    result = runs[True][2]
    assert len(got) == len(want) == 3
    # the same float32 arithmetic fused differently (scan body vs unrolled): a few ulps over 3 Adam steps
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the adapters themselves differ by a few 1e-6 where a gradient is ~0 (Adam's m/sqrt(v) turns its
    # rounding into up to lr per step); the function they compute is compared instead
    flat_model = runs[False][2].state.model
    assert rel_diff(our_logits(result.state.model, IDS), our_logits(flat_model, IDS)) < TOL


def test_stacked_run_exports_to_peft_and_back(runs, base_dir, tmp_path):
    """`scaletrain export` of the stacked run: PEFT's per-layer tensors (PEFT loads them and computes our
    logits), the merged model in transformers, the adapter back onto a stacked base, and generation
    with the adapter unmerged."""
    folder, _, result = runs[True]
    model = result.state.model
    ours = our_logits(model, IDS)
    adapter = export_checkpoint(folder, str(tmp_path / "adapter"))
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    theirs = hf_logits(peft.PeftModel.from_pretrained(base, adapter).eval(), IDS)
    assert rel_diff(ours, theirs) < TOL
    assert rel_diff(ours, our_logits(_load(base_dir, False), IDS)) > 100 * TOL  # the adapter matters
    merged_dir = export_checkpoint(folder, str(tmp_path / "merged"), merge=True)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert rel_diff(hf_logits(merged_hf, IDS), theirs) < TOL
    again = load_peft_adapter(_load(base_dir, True), adapter)
    assert rel_diff(our_logits(again, IDS), ours) < TOL
    prompt = IDS[:1, :8]
    merged = merge_lora(model)
    assert np.array_equal(generate(model, prompt, max_new_tokens=6), generate(merged, prompt, max_new_tokens=6))
