"""Checkpoint -> Hugging Face export through the CLI, reloaded by transformers; plot."""

import os
import subprocess
import sys

import numpy as np
import pytest

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 128, 16)} for _ in range(32)]
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, sharding_axis_dims=(1, 2, 1, 4, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=4, log_steps=2, save_steps=2, progress_bar=False,
                                report_to=(), do_eval=False)
    trainer = st.Trainer(args, model=model, dataset_train=data)
    output = trainer.train()
    return out, output.state


def test_export_checkpoint_loads_in_transformers(trained_run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run, state = trained_run
    res = _cli("export", str(run), "--checkpoint", "4", "--out", str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr[-2000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ids = np.arange(12)[None] % 128
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(state.model(ids))
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() / scale < 1e-4
    # refuses to overwrite a folder it did not write
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep")
    res = _cli("export", str(run), "--out", str(tmp_path / "other"))
    assert res.returncode == 2 and (tmp_path / "other" / "precious.txt").read_text() == "keep"


def test_export_of_missing_step_is_a_clear_error(trained_run, tmp_path):
    run, _ = trained_run
    res = _cli("export", str(run), "--checkpoint", "3", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "step 3" in res.stderr and "Traceback" not in res.stderr


def test_plot_writes_png(trained_run):
    pytest.importorskip("matplotlib")
    run, _ = trained_run
    res = _cli("plot", str(run))
    assert res.returncode == 0, res.stderr[-2000:]
    png = run / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
