"""Qwen3.5's hybrid beyond the conformance row (its row: scaletrain/models/qwen3_5/__init__.py): packed documents
through the whole model, the released vision-language folders, and bad input as one line.

Tolerances: the packed check compares two forwards of the same program whose cross-document terms weigh zero
(masked attention, the delta rule's masked pairs); the triangular solve and the sharded sums still round
differently, measured 2e-6 of the largest logit, so 1e-5, while a document that leaked into the next would
move its logits by more than 1e-2 (the first documents' own logits differ by that). Against transformers:
:data:`hf_testing.TOL`.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.qwen3_5 import HYBRID_CONFORMANCE
from scaletrain.models.registry import AutoModelForCausalLM
from scaletrain.recipe import Recipe
from hf_testing import TINY, assert_logits_match, hf_logits, hf_model, our_logits, rel_diff, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[object, str]:
    """transformers' random tiny Qwen3.5 (3 linear layers, 1 full) and the folder it is saved in."""
    ref = hf_model("qwen3_5_text", seed=5, **HYBRID_CONFORMANCE)
    return ref, save_hf(ref, tmp_path_factory.mktemp("qwen3_5") / "hf")


def test_packed_document_logits_do_not_depend_on_the_document_before_it(hybrid) -> None:
    """Two rows that pack different first documents (23 tokens) before the same second one (17): the second
    document's logits are the same in both, so the recurrence and the convolution restarted at the boundary."""
    model = AutoModelForCausalLM.from_pretrained(hybrid[1])
    rs = np.random.RandomState(0)
    ids = rs.randint(0, 128, (2, 40)).astype(np.int32)
    ids[1, :23] = rs.randint(0, 128, 23)  # another first document
    ids[1, 23:] = ids[0, 23:]
    segments = np.concatenate([np.ones((2, 23)), 2 * np.ones((2, 17))], axis=1).astype(np.int32)
    positions = np.concatenate([np.arange(23), np.arange(17)])[None].repeat(2, 0).astype(np.int32)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(jax.tree.leaves(state)[0].sharding.mesh):
        logits = np.asarray(jax.jit(lambda s, i, g, p: nnx.merge(graphdef, s)(i, positions=p, segment_ids=g))(
            state, ids, segments, positions))
    assert rel_diff(logits[1, 23:], logits[0, 23:]) < 1e-5
    assert rel_diff(logits[1, :23], logits[0, :23]) > 1e-2  # the first documents do differ


def _vision_language_folder(root: str) -> tuple[object, str]:
    """A tiny Qwen3.5 vision-language model built by transformers (the released checkpoints' layout) and its folder."""
    text = {**TINY, **HYBRID_CONFORMANCE}
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    vl = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                  vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in vl.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return vl, save_hf(vl, os.path.join(root, "vl"))


def test_vision_language_folder_loads_its_language_model_and_names_what_it_left_out(tmp_path, caplog) -> None:
    """A qwen3_5 folder loads as qwen3_5_text: the text logits of transformers' vision-language model on text
    alone, and one log line naming the vision tower's tensors it left out."""
    vl, folder = _vision_language_folder(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "qwen3_5_text"
    [line] = [r.getMessage() for r in caplog.records if "vision-language" in r.getMessage()]
    assert "model.visual" in line and "left out" in line and "\n" not in line
    ids = np.random.RandomState(1).randint(0, 128, (2, 24)).astype(np.int32)
    assert_logits_match("qwen3_5-vision-language", our_logits(model, ids), hf_logits(vl, ids))


def test_training_the_vision_tower_is_refused_naming_the_file_and_key(tmp_path) -> None:
    """A recipe that asks for the vision-language model itself (model.type qwen3_5) is refused naming the recipe
    file, then, as every recipe problem, one line naming the section and the type, saying what to train instead."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"type": "qwen3_5", "pretrained": str(tmp_path)}}))
    with pytest.raises(ConfigError) as refused:
        Recipe.load(str(path))
    where, problem = str(refused.value).split("\n")
    assert where.startswith(str(path))
    assert problem.startswith("model: model_type 'qwen3_5'") and "vision tower" in problem
    assert "use model_type 'qwen3_5_text'" in problem


def test_unknown_layer_types_entry_is_one_line_naming_the_file_and_key(hybrid, tmp_path) -> None:
    """A config.json whose layer_types names a kind Qwen3.5 does not build: one line with the file and the entry."""
    folder = tmp_path / "bad"
    folder.mkdir()
    raw = json.load(open(os.path.join(hybrid[1], "config.json")))
    raw["layer_types"][1] = "mamba"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as refused:
        AutoModelForCausalLM.from_pretrained(str(folder))
    message = str(refused.value)
    assert str(folder / "config.json") in message and "layer_types[1] 'mamba'" in message and "\n" not in message


def test_one_grpo_step_on_a_tiny_hybrid_samples_with_the_per_kind_cache_and_updates(tmp_path) -> None:
    """GRPOTrainer on a 4-layer Qwen3.5 hybrid: its rollout decodes through the per-layer-kind cache (KV for the
    full layer, recurrent + convolution state for the linear ones) and the sampler's log-probs are the trainer's
    forward's (float32, one device: up to summation order, 1e-5 as for Llama in test_grpo_trainer.py), the loss is
    finite and a non-zero gradient is applied."""
    import scaletrain as st
    from scaletrain.models import Qwen3_5ForCausalLM, Qwen3_5TextConfig, create_sharded_model
    from scaletrain.rl.trainer import GRPOTrainer
    from preference_testing import one_device_mesh, word_tokenizer

    tok = word_tokenizer(str(tmp_path / "tok"))
    config = Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               max_position_embeddings=64, eos_token_id=1, pad_token_id=0)
    model = create_sharded_model(Qwen3_5ForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=8, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=1, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    trainer = GRPOTrainer(arguments=args, model=model, tokenizer=tok,
                          options={"num_generations": 4, "max_completion_length": 6},
                          dataset_train=[{"prompt": p} for p in ("say yes", "the sky colour")],
                          reward_funcs=[lambda prompts, completions, **_: [float(len(c)) for c in completions]])
    trainer.train()
    [record] = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r.get("split") == "train"]
    assert np.isfinite(record["loss"]) and record["reward_std"] > 0
    assert record["rollout/logprob_diff_max"] <= 1e-5
    assert record["grad_norm"] > 0 and record["learning_rate"] > 0  # an update was applied


def test_sequence_parallel_is_refused_in_one_line_naming_the_mesh(hybrid, tmp_path) -> None:
    """The delta rule's state runs along the whole sequence, so sp > 1 is refused: by the recipe's preflight
    (before any data is read) naming mesh.axis_dims, and by the forward itself for a model loaded on such a
    mesh (the Python API), naming sharding_axis_dims."""
    from scaletrain.preflight import mesh_problems

    config = AutoModelForCausalLM.from_pretrained(hybrid[1]).config
    recipe = Recipe.from_dict({"model": {"type": "qwen3_5_text", "pretrained": hybrid[1]},
                               "mesh": {"axis_dims": [1, -1, 1, 1, 2]},
                               "training": {"total_batch_size": 8, "max_length": 16, "output_dir": str(tmp_path)}})
    problems = [p for p in mesh_problems(recipe, config) if "sp=2" in p]
    assert problems == ["mesh.axis_dims=[1, -1, 1, 1, 2] splits each sequence over sp=2, but qwen3_5_text's "
                        "linear-attention layers (Gated DeltaNet) need whole sequences; set sp to 1 and put the "
                        "devices on fsdp or dp"]
    model = AutoModelForCausalLM.from_pretrained(hybrid[1], sharding_axis_dims=(1, 4, 1, 1, 2))
    with pytest.raises(ConfigError) as refused:
        our_logits(model, np.ones((2, 8), np.int32))
    assert str(refused.value).startswith("sharding_axis_dims") and "set the sp axis to 1" in str(refused.value)
    assert "\n" not in str(refused.value)
