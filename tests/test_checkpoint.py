"""Checkpoints, exact resume after SIGKILL, stopping rules, NaN handling, TensorBoard."""

import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

import scaletrain as st
from scaletrain.errors import CheckpointError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.training.checkpoint import Checkpointer
from folder_testing import tree_hash
from scaletrain.training.stopping import NonFiniteLossError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "resume_worker.py")


def _worker(out, accum, rows, steps, kill_at=None):
    cmd = [sys.executable, WORKER, str(out), str(accum), str(rows), str(steps)]
    if kill_at:
        cmd.append(str(kill_at))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})


def _losses(out):
    """Loss per logged step; a resumed run's later line for a step wins."""
    by_step = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            by_step[rec["step"]] = rec["loss"]
    return by_step


@pytest.mark.slow
# the plain case (no accumulation, one epoch) is tests/test_chaos.py's kill -9 round
@pytest.mark.parametrize("accum,rows,steps", [(2, 64, 9), (1, 24, 8)], ids=["grad-accum-2", "across-epochs"])
def test_sigkill_and_resume_is_bitwise_identical(tmp_path, accum, rows, steps):
    ref = _worker(tmp_path / "ref", accum, rows, steps)
    assert ref.returncode == 0, ref.stderr[-2000:]
    kill_at = random.Random(accum * 100 + rows).randint(3, steps - 2)
    killed = _worker(tmp_path / "run", accum, rows, steps, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL
    resumed = _worker(tmp_path / "run", accum, rows, steps)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    assert summary["params_sha256"] == ref_summary["params_sha256"]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")


# ---------------------------------------------------------------------------- in-process


def _data(n=48, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, rng.integers(6, 20))} for _ in range(n)]


def _trainer(out, dims=(1, 8, 1, 1, 1), hidden=32, callbacks=(), data=None, **kw):
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, sharding_axis_dims=dims)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    args = dict(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None,
                max_training_steps=6, learning_rate=1e-2, log_steps=1, progress_bar=False, do_eval=False,
                report_to=())
    args.update(kw)
    return st.Trainer(st.TrainingArguments(**args), model=model, dataset_train=data or _data(),
                      callbacks=callbacks)


@pytest.mark.parametrize(
    "rule,value,stop_step",
    [("exit_iteration", 3, 3), ("exit_iteration_this_run", 2, 2), ("training_time_limit", "0.2s", 1)],
)
def test_stopping_rules_save_and_resume(tmp_path, rule, value, stop_step):
    trainer = _trainer(tmp_path, **{rule: value})
    trainer.train()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == stop_step
    assert rule.split("_")[0] in summary["stop_reason"] or "limit" in summary["stop_reason"]
    assert Checkpointer.for_run(str(tmp_path)).all_steps() == [stop_step]
    # resuming without the rule finishes the horizon
    resumed = _trainer(tmp_path, resume_if_possible=True)
    resumed.train()
    assert resumed.summary["final_step"] == 6 and resumed.resumed_from.endswith(f"/{stop_step}")


def test_kill_switch_and_sigterm(tmp_path):
    switch = tmp_path / "STOP"

    class Touch(st.Callback):
        def post_step(self, trainer, step, metrics):
            if step == 2:
                switch.write_text("")

    trainer = _trainer(tmp_path / "a", kill_switch_path=str(switch), callbacks=[Touch()])
    trainer.train()
    assert trainer.summary["final_step"] == 3 and "kill switch" in trainer.summary["stop_reason"]

    class Term(st.Callback):
        def post_step(self, trainer, step, metrics):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tmp_path / "b", callbacks=[Term()])
    trainer.train()
    assert trainer.summary["final_step"] == 4 and "SIGTERM" in trainer.summary["stop_reason"]
    assert Checkpointer.for_run(str(tmp_path / "b")).all_steps() == [4]


def test_refuses_to_start_fresh_over_existing_checkpoints(tmp_path):
    _trainer(tmp_path, max_training_steps=2).train()
    before = tree_hash(tmp_path)
    with pytest.raises(CheckpointError, match="resume_if_possible"):
        _trainer(tmp_path).train()
    assert tree_hash(tmp_path) == before  # the refused start left every byte of the run as it was


def test_corrupt_checkpoint_is_reported_and_left_untouched(tmp_path):
    _trainer(tmp_path, max_training_steps=2).train()
    step_dir = tmp_path / "checkpoints" / "2"
    victim = next(p for p in sorted((step_dir / "state").rglob("*")) if p.is_file() and p.stat().st_size > 100)
    victim.write_bytes(b"\x00garbage" * 20)
    before = tree_hash(tmp_path)
    with pytest.raises(CheckpointError, match=str(step_dir)):
        _trainer(tmp_path, resume_if_possible=True).train()
    assert tree_hash(tmp_path) == before


def test_shape_mismatch_names_the_checkpoint_and_tensor(tmp_path):
    _trainer(tmp_path, max_training_steps=2).train()
    before = tree_hash(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoints/2 does not fit this model.*embed_tokens has shape"):
        _trainer(tmp_path, hidden=64, resume_if_possible=True).train()
    assert tree_hash(tmp_path) == before


def test_save_total_limit_only_deletes_its_own(tmp_path):
    _trainer(tmp_path, max_training_steps=4, save_steps=2).train()
    assert Checkpointer.for_run(str(tmp_path)).all_steps() == [2, 4]
    _trainer(tmp_path, max_training_steps=10, save_steps=2, save_total_limit=2, resume_if_possible=True).train()
    # steps 2 and 4 belong to the first run; this run keeps its newest two of 6, 8, 10
    assert Checkpointer.for_run(str(tmp_path)).all_steps() == [2, 4, 8, 10]


def test_partial_checkpoint_is_ignored(tmp_path):
    _trainer(tmp_path, max_training_steps=2).train()
    partial = tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_bytes(b"half")
    assert Checkpointer.for_run(str(tmp_path)).latest_step() == 2
    resumed = _trainer(tmp_path, resume_if_possible=True)
    resumed.train()
    assert resumed.resumed_from.endswith("/2") and partial.exists()


def test_resume_onto_another_mesh(tmp_path):
    first = _trainer(tmp_path, dims=(1, 8, 1, 1, 1), max_training_steps=2)
    first.train()
    saved = first.summary["params_sha256"]
    other = _trainer(tmp_path, dims=(1, 4, 1, 2, 1), max_training_steps=2, resume_if_possible=True)
    other.train()  # already at the horizon: restores and re-summarises
    assert other.summary["params_sha256"] == saved
    q = other.model_state.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == __import__("jax").sharding.PartitionSpec("fsdp", "tp")


def _poisoned_data():
    data = _data(48)
    data[5] = {"input_ids": np.array([1, 2, 500, 3, 4])}  # id past the vocab: NaN embedding
    return data


def test_break_on_nan_stops_and_names_the_step(tmp_path):
    trainer = _trainer(tmp_path, data=_poisoned_data(), max_training_steps=12, save_steps=1)
    with pytest.raises(NonFiniteLossError, match=r"at step \d+"):
        trainer.train()
    params = trainer.current_state.params
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(params))


def test_skip_nonfinite_updates_and_count(tmp_path):
    trainer = _trainer(tmp_path, data=_poisoned_data(), max_training_steps=12, break_on_nan=False)
    trainer.train()
    assert trainer.summary["skipped_nonfinite_steps"] == 2  # the poisoned row, once per epoch
    assert np.isfinite(trainer.summary["final_train_loss"])


def test_tensorboard_reads_back_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _trainer(tmp_path, max_training_steps=4, log_steps=2, report_to=("tensorboard",))
    trainer.train()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    expected = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert losses.keys() == expected.keys()
    for step, value in expected.items():
        assert losses[step] == pytest.approx(value, rel=1e-6)
