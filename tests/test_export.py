"""Checkpoint -> Hugging Face export through the CLI, reloaded by transformers; plot."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import scaletrain as st
from scaletrain.errors import CheckpointError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.training.checkpoint import Checkpointer
from folder_testing import tree_hash

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


def test_checkpoint_is_restored_into_shapes_not_over_a_fresh_model(trained_run):
    """At no moment of the load does the device hold more than the checkpoint's parameters.

    Before, the full model and its optimizer state were initialised and the checkpoint was
    restored over them: twice the state alive at once; then the whole saved state (parameters,
    AdamW moments: three times the parameters) was restored, where export needs the parameters
    only. Device bytes are sampled at every JAX monitoring event during the load (tracing,
    orbax's read start and end...).
    """
    import jax
    from flax import nnx

    from scaletrain.export import load_checkpoint_model

    run, state = trained_run
    samples: list[int] = []

    def sample(*args, **kwargs):
        samples.append(sum(x.nbytes for x in jax.live_arrays()))

    mon = jax.monitoring
    listeners = [(mon.register_event_listener, mon.unregister_event_listener),
                 (mon.register_event_duration_secs_listener, mon.unregister_event_duration_listener),
                 (mon.register_scalar_listener, mon.unregister_scalar_listener)]
    before = sum(x.nbytes for x in jax.live_arrays())
    for register, _ in listeners:
        register(sample)
    try:
        model, _ = load_checkpoint_model(str(run), 4)
    finally:
        for _, unregister in listeners:
            unregister(sample)
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert samples, "no monitoring event fired during the load: nothing was measured"
    # with the optimizer state restored too: 3x params (2x the whole state before that)
    assert max(samples) - before <= 1.25 * params, (max(samples) - before, params)
    loaded = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.structure(loaded) == jax.tree.structure(state.params)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state.params)):
        assert got.sharding.spec == want.sharding.spec
        assert dict(got.sharding.mesh.shape) == dict(want.sharding.mesh.shape)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _drop_array_data(step_dir, prefix):
    """Delete every stored chunk of the arrays whose saved name starts with ``prefix`` (``opt_state.``).

    The state folder is one OCDBT key-value store (``<array>/.zarray`` and ``<array>/<chunk>``
    keys, packed into shared data files): deleting the keys in it is how one array's data goes
    missing while the others stay readable. Shapes (``.zarray``) stay, so only a read of the
    values can notice. Returns how many arrays lost their data.
    """
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"}).result()
    arrays = sorted({k.rsplit(b"/", 1)[0] for k in store.list().result() if k.startswith(prefix.encode())})
    txn = ts.Transaction()
    for array in arrays:  # chunk keys are digits and dots, sorting after ".zarray" and before ":"
        store.with_transaction(txn).delete_range(ts.KvStore.KeyRange(inclusive_min=array + b"/0",
                                                                     exclusive_max=array + b"/:"))
    txn.commit_async().result()
    return len(arrays)


def test_export_never_reads_the_optimizer_state(trained_run, tmp_path):
    """Loading for export reads the parameters only: with every optimizer moment's data gone from
    the checkpoint it still gives the trained parameters, while a resume of that checkpoint, which
    needs the moments, reports it damaged. Neither modifies the checkpoint."""
    import jax
    from flax import nnx

    from scaletrain.export import load_checkpoint_model

    run, state = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step_dir = copy / "checkpoints" / "4"
    assert _drop_array_data(step_dir, "opt_state.") >= 2 * len(jax.tree.leaves(state.params))  # mu and nu
    before = tree_hash(step_dir)
    model, _ = load_checkpoint_model(str(copy), 4)
    loaded = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.structure(loaded) == jax.tree.structure(state.params)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    checkpointer = Checkpointer(str(copy / "checkpoints"))
    try:
        with pytest.raises(CheckpointError, match=f"checkpoint {step_dir} is damaged: cannot read"):
            checkpointer.restore(4, state)  # what a resume calls
    finally:
        checkpointer.close()
    assert tree_hash(step_dir) == before


def test_export_of_a_damaged_or_mismatched_checkpoint_is_a_clear_error(trained_run, tmp_path):
    from scaletrain.export import load_checkpoint_model

    run, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with pytest.raises(CheckpointError, match=r"checkpoints/4 does not fit this model.*embed_tokens has shape"):
        load_checkpoint_model(str(copy), 4, config_overrides={"hidden_size": 64})
    step_dir = copy / "checkpoints" / "4"
    assert _drop_array_data(step_dir, "params.model.embed_tokens") == 1
    before = tree_hash(step_dir)
    with pytest.raises(CheckpointError, match=f"(?s)checkpoint {step_dir} is damaged: cannot read tensor "
                                              r"params\.model\.embed_tokens \(.*--checkpoint 2 .*checkpoints/2") as err:
        load_checkpoint_model(str(copy), 4)
    assert "TensorStore" not in str(err.value) and len(str(err.value)) < 1000  # the tensor, not its 60-line spec
    assert "resume_from" not in str(err.value)  # export loads, it does not resume
    assert tree_hash(step_dir) == before


def test_generate_on_a_damaged_checkpoint_names_it_and_another_to_pass(trained_run, tmp_path, capsys):
    """The message fits generate: the damaged checkpoint, and --checkpoint N of another one (not a
    resume); that option then generates from it."""
    from scaletrain.cli import main

    run, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _drop_array_data(copy / "checkpoints" / "4", "params.model.norm")
    assert main(["generate", str(copy), "--prompt", "1 2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {copy}/checkpoints/4 is damaged" in err and "load another checkpoint instead with " \
        "--checkpoint 2 (scaletrain generate or export" in err
    assert "resume_from" not in err and "Traceback" not in err
    assert main(["generate", str(copy), "--prompt", "1 2", "--max-new-tokens", "2", "--checkpoint", "2"]) == 0
    assert len(capsys.readouterr().out.split()) == 2


def test_a_saved_config_refused_by_a_newer_check_names_the_checkpoint(trained_run, tmp_path):
    """A checkpoint saved before a check that now refuses its config (a window of 0 tokens, once
    accepted) is one message naming the checkpoint and the field; the checkpoint is not touched."""
    from scaletrain.export import load_checkpoint_model

    run, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    meta_path = copy / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["config"]["sliding_window"] = 0
    meta_path.write_text(json.dumps(meta))
    before = tree_hash(copy / "checkpoints" / "4")
    with pytest.raises(CheckpointError, match=f"checkpoint {copy}/checkpoints/4: its saved configuration is not "
                                              r"valid: LlamaConfig\.sliding_window: must be at least 1 \(got 0\)"):
        load_checkpoint_model(str(copy), 4)
    assert tree_hash(copy / "checkpoints" / "4") == before


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
