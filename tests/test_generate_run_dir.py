"""``scaletrain generate`` pointed at a training run: its newest checkpoint, or one clear message."""

from __future__ import annotations

import numpy as np
import pytest

import scaletrain as st
from scaletrain.cli import main
from scaletrain.cli_hf import generate_main
from scaletrain.generation import generate, stop_token_ids
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 128, 16)} for _ in range(16)]
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      sharding_axis_dims=(1, -1, 1, 1, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=2, log_steps=1, progress_bar=False, report_to=(), do_eval=False)
    output = st.Trainer(args, model=model, dataset_train=data).train()
    return out, output.state


def test_generate_loads_the_runs_newest_checkpoint(trained_run):
    import jax

    run, state = trained_run
    text = generate_main(str(run), "5 9 3", max_new_tokens=6)
    model = state.model
    with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
        expected = generate(model, [[5, 9, 3]], max_new_tokens=6,
                            eos_token_id=stop_token_ids(None, model.config.eos_token_id))[0]
    assert text == " ".join(str(t) for t in expected.tolist())  # a run without a recipe: token ids in and out


def test_a_folder_that_is_neither_says_to_export(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "1 2"]) == 2
    err = capsys.readouterr().err
    assert "neither a Hugging Face model folder (no config.json) nor a training run" in err
    assert "scaletrain export RUN_DIR --out OUT" in err and "Traceback" not in err
    (tmp_path / "recipe.yaml").write_text("training: {}\n")  # a run that saved no checkpoint
    assert main(["generate", str(tmp_path), "--prompt", "1 2"]) == 2
    assert "is a training run with no complete checkpoint" in capsys.readouterr().err
