"""Starting a run safely: one run per output_dir, user errors as one message, honest accuracy.

Issue 16, items 2, 7, 8, 9 (local part) and 11. Each test fails on the code before
the fix: a second run on a folder trained alongside the first; ``max_length`` above
the model's positions was accepted; tied logits counted as correct; a full disk, an
``output_dir`` that is a file or a truncated safetensors file escaped as tracebacks;
a failed start overwrote the last run's ``recipe.yaml``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import scaletrain as st
from folder_testing import tree_hash
from scaletrain.errors import CheckpointError, ConfigError, ScaletrainError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.recipe import Recipe
from scaletrain.training.run_lock import (
    LOCK_FILE,
    acquire_run_lock,
    adopt_run_lock,
    holds_run_lock,
    owner_alive,
    process_start_tick,
    release_run_lock,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a child that takes the lock with the library's own code, says so, and sleeps until killed
HOLDER = (
    "import sys, time\n"
    "from scaletrain.training.run_lock import acquire_run_lock\n"
    "acquire_run_lock(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def _data(n=32, vocab=128):
    rng = np.random.default_rng(0)
    return [{"input_ids": (rng.integers(0, vocab) + np.arange(16)) % vocab} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_model():
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      sharding_axis_dims=(1, -1, 1, 1, 1))
    return create_sharded_model(LlamaForCausalLM, cfg, seed=0)[0]


def _args(out, **kw):
    base = dict(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None,
                max_training_steps=1, progress_bar=False, save_at_end=False)
    return st.TrainingArguments(**{**base, **kw})


@pytest.fixture
def holder(tmp_path):
    """A live child process that holds the lock of ``tmp_path / 'run'`` (killed at the end)."""
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert child.stdout.readline().strip() == "locked"  # blocks until the child holds the lock
        yield out, child
    finally:
        child.kill()
        child.wait()


# ---- item 2: one run per output_dir ---------------------------------------------------
def test_second_trainer_and_cli_are_refused_while_a_run_holds_the_folder(holder, tiny_model):
    out, child = holder
    (out / "recipe.yaml").write_text("the running run's recipe\n")
    before = tree_hash(out)
    with pytest.raises(ConfigError) as err:
        st.Trainer(_args(out), model=tiny_model, dataset_train=_data())
    msg = str(err.value)
    assert str(out) in msg and f"pid {child.pid}" in msg and socket.gethostname() in msg
    assert not holds_run_lock(str(out))

    recipe = os.path.join(ROOT, "examples", "shakespeare.yaml")
    res = subprocess.run([sys.executable, "-m", "scaletrain", "train", recipe, f"training.output_dir={out}"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and f"pid {child.pid}" in res.stderr and "in use by another run" in res.stderr
    assert (out / "recipe.yaml").read_text() == "the running run's recipe\n"  # item 11: untouched
    assert tree_hash(out) == before  # every byte, the running run's lock record included
    assert sorted(os.listdir(out)) == [LOCK_FILE, "recipe.yaml"]  # the refused runs wrote nothing


def test_lock_of_a_process_killed_with_sigkill_is_taken_over(tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    assert child.stdout.readline().strip() == "locked"
    record = json.loads((out / LOCK_FILE).read_text())
    assert record["pid"] == child.pid and record["released"] is False
    assert owner_alive(record) is True
    child.send_signal(signal.SIGKILL)
    child.wait()
    # the dead owner's record is still there, unreleased; the kernel dropped its flock
    assert owner_alive(record) is False  # and where flock does not work, the record says so too
    lock = acquire_run_lock(str(out))
    try:
        mine = json.loads((out / LOCK_FILE).read_text())
        assert mine["pid"] == os.getpid() and mine["released"] is False
    finally:
        release_run_lock(lock)
    assert json.loads((out / LOCK_FILE).read_text())["released"] is True
    assert not holds_run_lock(str(out))


def test_a_worker_adopts_the_lock_its_launcher_holds_and_no_other(holder):
    """A Ray driver holds the lock; its workers adopt it by token (their own flock would be refused)."""
    out, child = holder
    token = json.loads((out / LOCK_FILE).read_text())["token"]
    with pytest.raises(ConfigError, match="launcher no longer holds"):
        adopt_run_lock(str(out), "a-token-of-another-launch")
    assert not holds_run_lock(str(out))
    lock = adopt_run_lock(str(out), token)
    try:
        assert acquire_run_lock(str(out)) is lock  # the Trainer and run_training hold it again, not refused
        release_run_lock(lock)
        assert holds_run_lock(str(out))
    finally:
        release_run_lock(lock)
    assert not holds_run_lock(str(out))
    record = json.loads((out / LOCK_FILE).read_text())
    assert record["pid"] == child.pid and record["token"] == token and record["released"] is False  # untouched
    child.kill()
    child.wait()
    with pytest.raises(ConfigError, match=f"launcher no longer holds .*pid {child.pid}"):
        adopt_run_lock(str(out), token)  # the driver died: its workers must not write on


def test_a_recycled_pid_is_not_the_owner():
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_tick": process_start_tick(os.getpid())}
    assert owner_alive(me) is True
    if me["start_tick"] is None:
        pytest.skip("no /proc here: a process's start time cannot be read")
    assert owner_alive({**me, "start_tick": str(int(me["start_tick"]) + 1)}) is False
    assert owner_alive({**me, "host": "another-host"}) is None  # cannot be known from here


# ---- item 7: max_length longer than the model's positions -------------------------------
def test_max_length_above_max_position_embeddings_is_refused(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"training.max_length=128 .*model.max_position_embeddings=64"):
        Recipe.from_dict({"model": {"max_position_embeddings": 64}, "training": {"max_length": 128}})
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"training.max_length=128 .*max_position_embeddings=64"):
        st.Trainer(_args(out, max_length=128), model=tiny_model, dataset_train=_data())
    assert not holds_run_lock(str(out))  # a refused start lets go of the folder
    assert not out.exists()  # and leaves nothing where there was nothing


# ---- item 8: accuracy ---------------------------------------------------------------------
def test_tied_logits_are_not_correct_predictions():
    from scaletrain.objectives.fused_loss import fused_head_loss
    from scaletrain.objectives.loss import token_sums

    targets = jnp.array([0, 3, 5, 7])
    ones = jnp.ones(4)
    assert float(token_sums(jnp.zeros((4, 16)), targets, ones).correct) == 0.0  # uniform: all ties
    logits = jnp.zeros((4, 16)).at[0, 0].set(1.0).at[1, 3].set(1.0).at[1, 9].set(1.0).at[2, 4].set(1.0)
    logits = logits.at[3, 7].set(jnp.nan)
    # row 0 strictly right; row 1 tied with 9; row 2 wrong; row 3 NaN
    assert float(token_sums(logits, targets, ones).correct) == 1.0
    # the fused head + loss (large vocabularies) uses the same rule: zero hidden states give uniform logits
    ids = jnp.array([[1, 2, 3, 4, 5]])
    _, sums = fused_head_loss(jnp.zeros((1, 5, 8)), jnp.ones((8, 32)), ids, jnp.ones((1, 4)), jnp.float32, 2)
    assert float(sums.tokens) == 4.0 and float(sums.correct) == 0.0


# ---- item 9: user errors as one message -------------------------------------------------------
def test_output_dir_that_is_a_file_is_one_message(tmp_path, tiny_model):
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"a-file is a file, not a folder"):
        st.Trainer(_args(path), model=tiny_model, dataset_train=_data())
    assert path.read_text() == "not a folder"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a 0o500 folder anyway: chmod cannot make it read-only")
def test_read_only_output_dir_is_one_message(tmp_path, tiny_model):
    out = tmp_path / "ro"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    out.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"ro is not writable"):
            st.Trainer(_args(out), model=tiny_model, dataset_train=_data())
    finally:
        out.chmod(0o700)
    assert (out / "summary.json").read_text() == "{}"


def test_truncated_safetensors_is_one_message(tmp_path, tiny_model):
    from scaletrain.models.hf import save_hf_checkpoint
    from scaletrain.models.registry import AutoModelForCausalLM

    folder = save_hf_checkpoint(tiny_model, tmp_path / "hf")
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a complete safetensors file.*truncated"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_disk_full_while_saving_is_one_message_and_keeps_saved_checkpoints(tmp_path):
    """A real refused write: RLIMIT_FSIZE makes the kernel fail any write past 4 KiB with EFBIG,
    the same failure (and the same orbax path) as ENOSPC, without a tiny filesystem to mount."""
    from scaletrain.training.checkpoint import Checkpointer

    big = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)  # 16 KiB, incompressible
    state = SimpleNamespace(step=jnp.array(1), params={"w": big}, opt_state={"m": big}, rng=jnp.zeros(2, jnp.uint32))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    ckpt.save(1, state, {"train": {"pos": 1}}, {"note": "complete"})
    ckpt.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError) as err:
            ckpt.save(2, state, {"train": {"pos": 2}}, {"note": "never complete"})
            ckpt.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(err.value)
    assert "File too large" in msg and str(tmp_path / "checkpoints") in msg and "[1] are intact" in msg
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [1]  # nothing saved was lost


# ---- item 11: a failed start keeps the last run's recipe.yaml --------------------------------
def test_failed_start_leaves_the_previous_recipe_yaml(tmp_path):
    from scaletrain.run import run_training

    out = tmp_path / "run"
    out.mkdir()
    (out / "recipe.yaml").write_text("previous: run\n")
    before = tree_hash(out)
    recipe = Recipe.from_dict({"training": {"output_dir": str(out)}, "tokenizer": {"path": str(tmp_path / "none")},
                               "model": {"max_position_embeddings": 512}})
    with pytest.raises(ScaletrainError):
        run_training(recipe)
    assert yaml.safe_load((out / "recipe.yaml").read_text()) == {"previous": "run"}
    assert tree_hash(out) == before  # no lock file left behind either
    assert not holds_run_lock(str(out))
