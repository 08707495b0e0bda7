"""A run owns the checkpoints it writes, and a saved state is complete or refused (issue 16: 1, 5, 10, 13).

One signal-stopped run (module fixture) gives checkpoints 2 and 4; each test works on
its own copy of that run folder.
"""

import json
import os
import re
import shutil
import signal

import numpy as np
import pytest

import scaletrain as st
from scaletrain.errors import CheckpointError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.training.checkpoint import REPLACING_DIR, Checkpointer


# conftest's tiny_config_kwargs, which a module-scoped fixture cannot request
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 128, rng.integers(6, 20))} for _ in range(n)]


def _trainer(out, callbacks=(), **kw):
    cfg = LlamaConfig(**TINY, sharding_axis_dims=(1, 8, 1, 1, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    args = dict(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None,
                max_training_steps=6, learning_rate=1e-2, log_steps=3, save_steps=2, progress_bar=False,
                do_eval=False, report_to=())
    args.update(kw)
    return st.Trainer(st.TrainingArguments(**args), model=model, dataset_train=_data(), callbacks=callbacks)


class _SigtermAt(st.Callback):
    """Send SIGTERM to this process after step ``at`` and record every step's loss (read on the host)."""

    def __init__(self, at):
        self.at, self.losses = at, {}

    def post_step(self, trainer, step, metrics):
        self.losses[step] = metrics.host()["loss"]
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """Checkpoints 2 (periodic) and 4 (the SIGTERM stop); metrics logged at step 3 only."""
    out = tmp_path_factory.mktemp("stopped")
    term = _SigtermAt(3)  # StoppingRules sees the signal at the next step's check: the run stops after step 4
    trainer = _trainer(out, callbacks=[term])
    trainer.train()
    return out, trainer.summary, term.losses


def _copy(stopped_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(stopped_run[0], dst)
    return dst


def _corrupt_state(step_dir):
    """Overwrite the checkpoint's largest tensor-store file (under ``state/d``) with garbage."""
    files = [p for p in (step_dir / "state" / "d").rglob("*") if p.is_file()] or \
        [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    max(files, key=lambda p: p.stat().st_size).write_bytes(b"\x00garbage" * 20)


# ---- item 13 -------------------------------------------------------------------------------------


def test_signal_stop_summary_has_the_final_steps_loss(stopped_run):
    _, summary, losses = stopped_run
    assert "SIGTERM" in summary["stop_reason"] and summary["final_step"] == 4
    # the last logged step is 3; the summary reports step 4's own loss (the same float32 fetched twice)
    assert summary["final_train_loss_step"] == 4
    assert summary["final_train_loss"] == losses[4] != losses[3]


# ---- item 1 --------------------------------------------------------------------------------------


def test_resume_from_older_step_replaces_its_stale_and_broken_checkpoint(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    _corrupt_state(run / "checkpoints" / "4")
    # back to step 2 with another learning rate: step 4 is reached again with other weights;
    # step 3 is new but below the newest checkpoint (orbax alone would skip that save)
    redo = _trainer(run, learning_rate=5e-3, resume_from=str(run / "checkpoints" / "2"), exit_iteration=4,
                    save_steps=1)
    redo.train()
    assert redo.summary["checkpoint"] == str(run / "checkpoints" / "4")
    assert Checkpointer.for_run(str(run)).all_steps() == [2, 3, 4]
    assert not (run / "checkpoints" / REPLACING_DIR).exists()
    # checkpoint 4 now holds exactly what this run trained (before the fix: the broken old folder)
    check = _trainer(run, learning_rate=5e-3, max_training_steps=4, resume_if_possible=True)
    check.train()  # at the horizon: restores step 4 and re-summarises
    assert check.resumed_from == str(run / "checkpoints" / "4")
    assert check.summary["params_sha256"] == redo.summary["params_sha256"]
    assert check.summary["params_sha256"] != stopped_run[1]["params_sha256"]


# ---- item 5 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage,named", [
    ("data_without_train", r"data/metadata lacks the training data position \('train'\)"),
    ("no_data_item", r"data/metadata lacks the training data position \('train'\)"),
    ("no_state_item", r"train state folder state/ \(step, params, opt_state, rng\) is missing"),
])
def test_missing_piece_of_saved_state_is_named(stopped_run, tmp_path, damage, named):
    run = _copy(stopped_run, tmp_path)
    step_dir = run / "checkpoints" / "4"
    if damage == "data_without_train":
        (step_dir / "data" / "metadata").write_text(json.dumps({"other": 1}))  # valid JSON, no position
    elif damage == "no_data_item":
        shutil.rmtree(step_dir / "data")
    else:
        shutil.rmtree(step_dir / "state")
    with pytest.raises(CheckpointError, match=re.escape(str(step_dir)) + ".*" + named):
        _trainer(run, resume_if_possible=True).train()


# ---- item 10 -------------------------------------------------------------------------------------


def test_corrupt_tensor_names_it_and_an_earlier_checkpoint_that_works(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    _corrupt_state(run / "checkpoints" / "4")
    with pytest.raises(CheckpointError) as info:
        _trainer(run, resume_if_possible=True).train()
    message = str(info.value)
    assert message.startswith(f"checkpoint {run / 'checkpoints' / '4'} is damaged: cannot read tensor ")
    assert re.search(r"cannot read tensor (params|opt_state|rng|step)[\w.]*", message)
    assert "tensorstore_spec" not in message and len(message) < 1000
    suggested = re.search(r"training\.resume_from=(\S+)", message).group(1)
    assert suggested == str(run / "checkpoints" / "2") and "earlier checkpoints here: [2]" in message
    # the suggestion works: resume there and finish (step 4 is replaced on the way)
    resumed = _trainer(run, resume_from=suggested)
    resumed.train()
    assert resumed.summary["final_step"] == 6 and resumed.resumed_from == suggested
