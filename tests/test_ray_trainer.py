"""RayDistributedTrainer without Ray: EasyDeL's API, the exact JSON round trip, train()'s priority."""

import doctest
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaletrain as st
from docs_testing import doc_blocks
from scaletrain.compat.easydel import RayDistributedConfig, RayDistributedTrainer, TrainerSetupError, codec
from scaletrain.data import bundled_tokenizer_path
from scaletrain.errors import ConfigError
from scaletrain import TaskType
from scaletrain.models import LlamaConfig, LlamaForCausalLM, MistralForCausalLM
from scaletrain.parallel import PartitionAxis

SMALL_SCALING = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
SMALL_FIXED = {"dtype": jnp.float32, "param_dtype": jnp.float32, "num_hidden_layers": 1, "vocab_size": 128,
               "max_position_embeddings": 32}


def small(**kw) -> RayDistributedTrainer:
    kw.setdefault("model_class", LlamaForCausalLM)
    return RayDistributedTrainer(bundled_tokenizer_path(), config_scaling_variables=dict(SMALL_SCALING),
                                 config_variables=dict(SMALL_FIXED), **kw)


def test_defaults_are_seed_000s():
    assert RayDistributedTrainer.CONFIG_SCALING_VARIABLES == {
        "hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 512,
        "num_attention_heads": 2, "num_key_value_heads": 1,
    }
    v = RayDistributedTrainer.CONFIG_VARIABLES
    assert v == {
        "dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "precision": jax.lax.Precision.DEFAULT, "seed": 654,
        "max_position_embeddings": 8192, "gradient_checkpointing": "none", "initializer_range": 0.02,
        "partition_axis": PartitionAxis(), "attn_mechanism": "auto", "attn_dtype": jnp.bfloat16,
        "attn_softmax_dtype": jnp.bfloat16, "sharding_axis_names": ("dp", "fsdp", "ep", "tp", "sp"),
        "sharding_axis_dims": (1, -1, 1, 1, 1), "sharding_dcn_axis_dims": (1, -1, 1, 1, 1),
    }
    t = RayDistributedTrainer("x", model_class=LlamaForCausalLM)
    assert t.config_variables == v and t.config_variables is not v  # a copy per trainer
    assert t.offload_backend == "cpu" and t.state_class is st.TrainState and t.trainer_module is st.Trainer
    # the defaults build a valid config (the seed's own keys; layers and vocab from the config class)
    cfg = t.create_config(1)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 2, 1)
    assert cfg.moe_intermediate_size == 512 and cfg.seed == 654 and cfg.attn_softmax_dtype == "bfloat16"


def test_constructor_resolution_rules(caplog):
    t = RayDistributedTrainer("x", model_class=MistralForCausalLM)
    assert (t.model_type, t.model_task, t.model_class) == ("mistral", TaskType.CAUSAL_LM, MistralForCausalLM)
    t = RayDistributedTrainer("x", model_type="qwen2", model_task="causal-language-model")
    assert t.model_class is st.Qwen2ForCausalLM and t.model_task is TaskType.CAUSAL_LM
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        t = RayDistributedTrainer("x", model_type="qwen2", model_task=TaskType.CAUSAL_LM,
                                  model_class=LlamaForCausalLM)
    assert t.model_class is LlamaForCausalLM and t.model_type == "llama"
    assert "Using model_class" in caplog.text
    with pytest.raises(AssertionError, match="If one of model_task or model_type is None, both must be None"):
        RayDistributedTrainer("x", model_type="llama")
    with pytest.raises(AssertionError, match="model_class must be provided when model_task/model_type are omitted"):
        RayDistributedTrainer("x")
    with pytest.raises(AssertionError, match="Could not resolve model class for gpt9/causal-language-model"):
        RayDistributedTrainer("x", model_type="gpt9", model_task=TaskType.CAUSAL_LM)
    with pytest.raises(ConfigError):  # the same errors are user errors for the CLI
        RayDistributedTrainer("x")
    assert issubclass(TrainerSetupError, AssertionError)


def test_json_round_trip_is_exact(tmp_path):
    custom = PartitionAxis(batch_axis=("dp", "fsdp", "sp"), hidden_axis=("fsdp", "tp"), head_axis=None)
    variables = {
        "dtype": jnp.bfloat16, "param_dtype": jnp.float32, "attn_dtype": np.dtype("float16"),
        "precision": jax.lax.Precision.HIGHEST, "partition_axis": custom,
        "sharding_axis_dims": (1, 2, 1, 4, 1), "sharding_dcn_axis_dims": None,
        "nested": {"pair": (1, (2, "a")), "as_list": [1, (2, 3)], "precisions": (jax.lax.Precision.HIGH, None)},
        "task": TaskType.CAUSAL_LM, "gradient_checkpointing": "dots", "initializer_range": 0.5,
    }
    t = RayDistributedTrainer("some/dir", model_type="llama", model_task=TaskType.CAUSAL_LM,
                              config_scaling_variables={"hidden_size": 7}, config_variables=variables,
                              offload_backend="cpu", bucket_path=str(tmp_path / "bucket"))
    before = {k: v for k, v in t.config_variables.items()}
    path = tmp_path / "cfg.json"
    t.save_config(path)
    assert t.config_variables == before  # saving does not touch the trainer's dicts (the seed's did)
    raw = json.loads(path.read_text())
    assert raw["config_variables"]["precision"] == {"__precision__": "HIGHEST"}
    assert raw["config_variables"]["dtype"] == {"__dtype__": "bfloat16"}
    assert raw["model_task"] == "causal-language-model"
    back = RayDistributedTrainer.from_config(f"file://{path}")
    for key, value in t.config_variables.items():
        got = back.config_variables[key]
        assert got == value and type(got) is type(value), key
    assert back.config_variables["precision"] is jax.lax.Precision.HIGHEST
    assert back.config_variables["partition_axis"] == custom
    assert back.config_variables["nested"]["pair"] == (1, (2, "a"))
    assert type(back.config_variables["nested"]["as_list"]) is list
    assert back.config_variables["dtype"] is jnp.bfloat16 and back.config_variables["param_dtype"] is jnp.float32
    assert back.config_scaling_variables == t.config_scaling_variables
    assert (back.model_type, back.model_task, back.model_class) == ("llama", TaskType.CAUSAL_LM, LlamaForCausalLM)
    assert back.bucket_path == t.bucket_path and back.pretrained_model_name_or_path == "some/dir"
    # the pydantic config's hooks on their own
    cfg = RayDistributedConfig(pretrained_model_name_or_path="p", config_variables=dict(variables))
    cfg._saving_preprocess()
    json.dumps(cfg.model_dump(mode="json"))
    cfg._loading_postprocess()
    assert cfg.config_variables == variables
    with pytest.raises(ConfigError, match="config_variables.bad"):
        codec.encode({"bad": object()}, "config_variables")


def test_bucket_path_protocols(tmp_path):
    RayDistributedTrainer("x", model_class=LlamaForCausalLM, bucket_path=f"file://{tmp_path}")
    for url, package in (("gs://bucket/run", "gcsfs"), ("s3://bucket/run", "s3fs")):
        try:
            __import__(package)
        except ImportError:
            with pytest.raises(ConfigError, match=package):
                RayDistributedTrainer("x", model_class=LlamaForCausalLM, bucket_path=url)
    with pytest.raises(ConfigError, match="unknown storage protocol"):
        RayDistributedTrainer("x", model_class=LlamaForCausalLM, bucket_path="nosuchproto://x")


def test_processor_and_data_helpers(tmp_path):
    t = small()
    tok = t.processor
    assert t.processor is tok and tok.pad_token_id is not None
    out = t.process_sample_data("To be, or not to be", max_length=12, padding_side="left")
    assert out["input_ids"].shape == (12,) and out["attention_mask"].shape == (12,)
    assert out["attention_mask"][0] == 0 and out["attention_mask"][-1] == 1  # left padding
    out = t.process_sample_data("To be", max_length=12, padding_side="right")
    assert out["attention_mask"][0] == 1 and out["attention_mask"][-1] == 0
    # a copy of the bundled tokenizer with a chat template
    folder = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    chat = RayDistributedTrainer(str(folder), model_class=LlamaForCausalLM)
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there!"}]
    out = chat.process_messages_data(messages, max_length=24)
    assert out["input_ids"].shape == (24,)
    text = chat.processor.decode(out["input_ids"][out["attention_mask"] == 1])
    assert "user: Hello!" in text and "assistant: Hi there!" in text
    assert RayDistributedTrainer.extract_column_names([{"text": "a", "id": 1}]) == ["text", "id"]

    class WithColumns(list):
        column_names = ["input_ids"]

    assert RayDistributedTrainer.extract_column_names(WithColumns()) == ["input_ids"]
    assert RayDistributedTrainer.extract_column_names([]) is None


def test_create_config_model_and_state():
    t = small()
    cfg = t.create_config(scaling_index=3)
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (48, 96, 6, 3)
    dumped = cfg.model_dump()
    assert not {"dtype", "param_dtype", "precision"} & set(dumped)  # go to the module, not the config
    with pytest.raises(ConfigError, match="scaling_index"):
        t.create_config(0)
    lazy = t.create_model(cfg, dtype=jnp.float32, param_dtype=jnp.float32, lazy=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx_params(lazy)))
    with pytest.raises(ConfigError, match="lazy"):
        t.convert_model_to_state(lazy)
    model = t.create_model_from_config(scaling_index=1)
    assert model.dtype == jnp.float32 and model.precision == jax.lax.Precision.DEFAULT
    state = t.convert_model_to_state(model)
    assert isinstance(state, st.TrainState) and int(state.step) == 0
    assert state.num_params == t.create_config(1).num_params
    assert t._get_offload_device().platform == "cpu"
    text = repr(t)
    assert text.startswith("RayDistributedTrainer(") and "model_type : llama" in text and str(t) == text


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


class RecordingTrainer:
    """A trainer_module that records which state it was given instead of training."""

    def __init__(self, arguments, dataset_train, dataset_eval, data_collator, model_state, **kw):
        self.arguments, self.state = arguments, model_state

    def train(self):
        return self


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                max_training_steps=2, log_steps=1, progress_bar=False, report_to=(), do_eval=False)
    return st.TrainingArguments(**{**base, **kw})


def _digest(state):
    from scaletrain.training.state import params_sha256

    return params_sha256(state.params)


@pytest.mark.slow
def test_train_priority_state_model_bucket_new(tmp_path):
    rows = [{"input_ids": np.arange(10) % 128}] * 16
    t = small(trainer_module=RecordingTrainer)
    model = t.create_model_from_config(1)
    state = t.convert_model_to_state(t.create_model_from_config(2))
    # 1. state beats model
    assert t.train(1, _args(tmp_path), rows, model=model, state=state).state is state
    # 2. model beats bucket and new
    got = t.train(1, _args(tmp_path), rows, model=model).state
    assert _digest(got) == _digest(t.convert_model_to_state(model))
    # 4. nothing given: a new model at the scaling index
    got = t.train(2, _args(tmp_path), rows).state
    assert got.model.config.hidden_size == 32
    # 3. a training checkpoint at bucket_path (a run's checkpoint, saved by a real Trainer)
    run = tmp_path / "run"
    saved = st.Trainer(_args(run), model=model, dataset_train=rows)
    saved.save_checkpoint(saved.model_state)
    saved.checkpoint_manager.wait()
    bucket = small(trainer_module=RecordingTrainer, bucket_path=f"file://{run}")
    bucket.config_variables["sharding_axis_dims"] = (1, 2, 1, 4, 1)
    got = bucket.train(4, _args(tmp_path / "b"), rows).state
    assert _digest(got) == _digest(saved.model_state)
    assert got.model.config.hidden_size == 16  # the checkpoint's architecture, not scaling_index 4
    assert got.model.config.sharding_axis_dims == (1, 2, 1, 4, 1)  # this trainer's runtime keys (another mesh)
    # ... and a Hugging Face folder at a remote URL (fsspec's in-memory filesystem stands in for gs://)
    import fsspec

    hf = tmp_path / "hf"
    st.save_hf_checkpoint(saved.model_state.model, str(hf))
    fsspec.filesystem("memory").put(str(hf), "/bucket/hf", recursive=True)
    remote = small(trainer_module=RecordingTrainer, bucket_path="memory://bucket/hf")
    got = remote.train(1, _args(tmp_path / "c"), rows).state
    assert _digest(got) == _digest(saved.model_state)
    assert (tmp_path / "c" / "bucket_cache" / "bucket_hf" / "config.json").exists()  # copied under output_dir
    # dtypes follow the model unless the arguments set them
    assert got.model.dtype == jnp.float32
    bf16 = small(trainer_module=RecordingTrainer)
    bf16.config_variables.update(dtype=jnp.bfloat16)
    assert bf16.train(1, _args(tmp_path), rows).arguments.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype"):
        small().train(1, _args(tmp_path / "d", dtype="bfloat16"), rows)  # explicit conflict, real Trainer


def test_module_docstring_example_runs():
    import scaletrain.compat.easydel.ray_trainer as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_docs_api_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(doc_blocks("docs/distributed.md")["api"], {})
    assert (tmp_path / "trainer.json").exists()


def test_import_does_not_pull_ray():
    import subprocess
    import sys

    code = "import scaletrain.compat.easydel, scaletrain.launch.ray, scaletrain.sweep, sys; print('ray' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert out.stdout.split() == ["False", "False"], out.stderr
