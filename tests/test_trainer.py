"""The Trainer end to end on small data: plan, metrics, evaluation, summary, callbacks."""

import json
import math

import numpy as np
import pytest

import scaletrain as st
from scaletrain.errors import ConfigError, DataError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model


def _data(n=64, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    # a learnable pattern: each row counts upward from a random start
    return [{"input_ids": (rng.integers(0, vocab) + np.arange(rng.integers(8, 24))) % vocab} for _ in range(n)]


def _trainer(tmp_path, kw, callbacks=(), **args):
    cfg = LlamaConfig(**kw, sharding_axis_dims=(1, 2, 1, 4, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    defaults = dict(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                    max_training_steps=12, learning_rate=1e-2, warmup_steps=2, log_steps=4,
                    evaluation_steps=6, progress_bar=False)
    arguments = st.TrainingArguments(**{**defaults, **args})
    return st.Trainer(arguments, model=model, dataset_train=_data(), dataset_eval=_data(16, seed=1),
                      callbacks=callbacks, eval_bytes_per_token=2.0)


class Recorder(st.Callback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith(("pre_", "post_")):
            return lambda trainer, *a: object.__getattribute__(self, "events").append(name)
        return object.__getattribute__(self, name)


def test_train_logs_evaluates_and_summarises(tmp_path, tiny_config_kwargs):
    rec = Recorder()
    trainer = _trainer(tmp_path, tiny_config_kwargs, callbacks=[rec])
    out = trainer.train()
    assert isinstance(out, st.TrainerOutput)
    assert int(out.state.step) == 12
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    evals = [r for r in lines if r["split"] == "eval"]
    assert [r["step"] for r in train] == [4, 8, 12]
    assert [r["step"] for r in evals] == [6, 12]
    for key in ("loss", "accuracy", "perplexity", "learning_rate", "grad_norm", "tokens_per_s", "tflops", "mfu"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert train[-1]["loss"] < train[0]["loss"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 12
    assert summary["final_eval_bits_per_byte"] == pytest.approx(summary["final_eval_loss"] / math.log(2) / 2.0)
    assert len(summary["params_sha256"]) == 64
    assert rec.events[:2] == ["pre_init", "post_init"]
    assert rec.events.count("pre_step") == 12 and rec.events.count("post_step") == 12
    assert rec.events.count("pre_evaluate") == 2 and rec.events[-1] == "post_train"


def test_identical_runs_give_identical_params(tmp_path, tiny_config_kwargs):
    a = _trainer(tmp_path / "a", tiny_config_kwargs, max_training_steps=4, do_eval=False)
    a.train()
    b = _trainer(tmp_path / "b", tiny_config_kwargs, max_training_steps=4, do_eval=False)
    b.train()
    assert a.summary["params_sha256"] == b.summary["params_sha256"]


def test_eval_generator_and_evaluate_agree(tmp_path, tiny_config_kwargs):
    trainer = _trainer(tmp_path, tiny_config_kwargs)
    steps = list(trainer.eval(trainer.model_state))
    assert [s["eval_step"] for s in steps] == [1, 2]
    full = trainer.evaluate(trainer.model_state)
    assert steps[-1]["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-5)


def test_hooks_are_overridable(tmp_path, tiny_config_kwargs):
    seen = []

    class Hooked(st.Trainer):
        def on_step_start(self, state, step):
            seen.append(("start", step))
            return state

        def on_step_end(self, state, metrics, step):
            seen.append(("end", step))
            return state, metrics

    cfg = LlamaConfig(**tiny_config_kwargs)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16,
                                max_training_steps=2, progress_bar=False, do_eval=False)
    Hooked(args, model=model, dataset_train=_data()).train()
    assert seen == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]


def test_exception_in_callback_propagates(tmp_path, tiny_config_kwargs):
    class Boom(st.Callback):
        def post_step(self, trainer, step, metrics):
            raise TypeError("boom")

    trainer = _trainer(tmp_path, tiny_config_kwargs, callbacks=[Boom()])
    with pytest.raises(TypeError, match="boom"):
        trainer.train()


def test_epochs_set_the_horizon(tmp_path, tiny_config_kwargs):
    trainer = _trainer(tmp_path, tiny_config_kwargs, num_train_epochs=2, max_training_steps=None)
    assert trainer.steps_per_epoch == 8 and trainer.max_training_steps == 16


def test_user_errors(tmp_path, tiny_config_kwargs):
    with pytest.raises(ConfigError, match="training.total_batch_size"):
        _trainer(tmp_path, tiny_config_kwargs, total_batch_size=7)
    with pytest.raises(ConfigError, match="training.dtype is bfloat16"):
        _trainer(tmp_path, tiny_config_kwargs, dtype="bfloat16")
    cfg = LlamaConfig(**tiny_config_kwargs)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, max_training_steps=2)
    with pytest.raises(DataError, match="fewer than"):
        st.Trainer(args, model=model, dataset_train=_data(4))
    with pytest.raises(DataError, match="empty"):
        st.Trainer(args, model=model, dataset_train=[])


def test_arguments_name_bad_keys():
    with pytest.raises(ConfigError, match="training.learning_rat: unknown key"):
        st.TrainingArguments.from_dict({"learning_rat": 1.0})
    with pytest.raises(ConfigError, match="training.total_batch_size"):
        st.TrainingArguments.from_dict({"total_batch_size": "many"})
    with pytest.raises(ConfigError, match="divisible"):
        st.TrainingArguments.from_dict({"total_batch_size": 8, "gradient_accumulation_steps": 3})


def test_grad_norms_weight_stats_and_memory_are_logged(tmp_path, tiny_config_kwargs):
    trainer = _trainer(tmp_path, tiny_config_kwargs, max_training_steps=4, log_grad_norms=True,
                       log_weight_stats=True, do_eval=False)
    trainer.train()
    rec = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert {"grad_norm/embed_tokens", "grad_norm/layer_0", "grad_norm/layer_1", "grad_norm/norm"} <= rec.keys()
    assert "weight_norm/lm_head" in rec and rec["host_peak_rss_mb"] > 0
    # the per-group norms compose the global norm
    total = math.sqrt(sum(v * v for k, v in rec.items() if k.startswith("grad_norm/")))
    assert total == pytest.approx(rec["grad_norm"], rel=1e-4)


def test_preview_generation_is_logged(tmp_path, tiny_config_kwargs):
    from scaletrain.data import bundled_tokenizer_path, load_processor

    tok = load_processor(bundled_tokenizer_path())
    kw = {**tiny_config_kwargs, "vocab_size": 4096}
    cfg = LlamaConfig(**kw)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=2, generate_steps=2, generate_prompts=("ROMEO.",),
                                generate_max_new_tokens=5, progress_bar=False, do_eval=False, report_to=())
    st.Trainer(args, model=model, dataset_train=_data(vocab=4096), tokenizer=tok).train()
    samples = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in samples if r["split"] == "sample"]
    assert len(samples) == 1 and samples[0]["text"].startswith("ROMEO.") and samples[0]["step"] == 2


def test_workers_report_to_ray_at_checkpoints_only(tmp_path, tiny_config_kwargs, monkeypatch):
    """A Ray worker's ``ray.train.report`` (a barrier that waits for Ray's controller to poll)
    comes at checkpoint steps, the same on every rank, with the newest train record; never at
    each log step. The trainer is real; only Ray's report is caught."""
    ray_train = pytest.importorskip("ray.train")
    from scaletrain.launch.ray.worker_callbacks import report_callback

    sent = []
    monkeypatch.setattr(ray_train, "report", lambda metrics, **kw: sent.append((metrics, kw)))
    _trainer(tmp_path, tiny_config_kwargs, callbacks=[report_callback()], log_steps=1, save_steps=5).train()
    logged = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "train"}
    assert sorted(logged) == list(range(1, 13))
    assert [m["checkpoint_step"] for m, _ in sent] == [5, 10, 12]
    for metrics, kw in sent:
        assert kw == {}  # metrics only: checkpoints stay orbax's
        assert metrics["step"] == metrics["checkpoint_step"]
        assert metrics["loss"] == logged[metrics["step"]]["loss"]
