"""EasyDeL's, eformer's and Hugging Face's names: accepted with their meaning, or refused with a hint."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaletrain import AttentionMechanisms, EasyDeLGradientCheckPointers, PartitionAxis, TrainingArguments
from scaletrain.compat.easydel.ray_config import RayDistributedConfig
from scaletrain.errors import ConfigError
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.recipe import Recipe
from scaletrain.training.optim import make_optimizer, parameter_path

# what EasyDeL writes for eformer's PartitionAxis() (its __dict__ after JSON: tuples became lists)
EFORMER_DEFAULT = {
    "data_parallel_axis": "dp", "fully_sharded_data_parallel_axis": "fsdp", "tensor_parallel_axis": "tp",
    "sequence_parallel_axis": "sp", "expert_parallel_axis": "ep", "batch_axis": ["fsdp", "dp"],
    "sequence_axis": "sp", "query_sequence_axis": "sp", "head_axis": "tp", "kv_head_axis": "tp",
    "key_sequence_axis": "sp", "hidden_state_axis": "tp", "mlp_intermediate_axis": "tp", "vocab_axis": "tp",
    "expert_axis": "ep", "expert_gate_axis": None, "attention_dim_axis": None, "attention_kv_dim_axis": None,
    "bias_head_sequence_axis": None, "bias_key_sequence_axis": None, "decode_batch_axis": ["fsdp", "dp"],
    "decode_query_sequence_axis": None, "decode_head_axis": "tp", "decode_kv_head_axis": "tp",
    "decode_key_sequence_axis": "sp", "decode_attention_dim_axis": None, "decode_attention_kv_dim_axis": None,
}


def test_partition_axis_takes_eformer_fields_and_saves_a_dict_eformer_reads():
    pa = PartitionAxis(**EFORMER_DEFAULT)
    assert pa.batch_axis == ("fsdp", "dp") and pa.logical_rules()["batch"] == ("fsdp", "dp")
    # the saved dict is eformer's own: same keys (no hidden_axis at its default), same values
    assert json.loads(json.dumps(pa.model_dump())) == EFORMER_DEFAULT
    # fields left out derive from the mesh-axis names, as in eformer; decode axes follow train axes
    renamed = PartitionAxis(tensor_parallel_axis="model", head_axis=None)
    assert (renamed.mlp_intermediate_axis, renamed.vocab_axis, renamed.head_axis) == ("model", "model", None)
    assert (renamed.decode_head_axis, renamed.decode_kv_head_axis) == (None, "model")
    assert PartitionAxis(mlp_axis=None).logical_rules()["mlp"] is None  # our former name still works
    custom = PartitionAxis(hidden_axis=("fsdp", "tp"), decode_query_sequence_axis="sp")
    assert PartitionAxis(**custom.model_dump()) == custom  # kept-but-unused fields round-trip too
    assert "hidden_axis" not in PartitionAxis().model_dump() and "hidden_axis" in custom.model_dump()
    with pytest.raises(ConfigError, match=r"PartitionAxis.hiden_axis: unknown key; did you mean 'hidden_axis'.*"
                                          r"valid keys: attention_dim_axis"):
        PartitionAxis(hiden_axis="fsdp")
    with pytest.raises(ConfigError, match=r"mesh.partition_axis.decode_bach_axis: unknown key; did you mean "
                                          r"'decode_batch_axis'"):
        Recipe.from_dict({"mesh": {"partition_axis": {"decode_bach_axis": "dp"}}})


def test_model_config_json_with_eformer_fields_round_trips(tmp_path):
    saved = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "vocab_size": 128, "partition_axis": EFORMER_DEFAULT, "attn_mechanism": "vanilla",
             "gradient_checkpointing": "", "use_scan_mlp": False}
    config = LlamaConfig.from_dict(saved)
    assert config.partition_axis == PartitionAxis(**EFORMER_DEFAULT) and config.gradient_checkpointing == "none"
    path = tmp_path / "config.json"
    config.save(path)
    again = LlamaConfig.from_dict(json.loads(path.read_text()))
    assert again == config and json.loads(path.read_text())["partition_axis"] == EFORMER_DEFAULT


def test_ray_config_saved_by_easydel_loads_and_round_trips(tmp_path):
    # EasyDeL's _saving_preprocess: dtypes as "bf16", Precision as its number, tuples as lists
    easydel = {"pretrained_model_name_or_path": "m", "model_task": "causal-language-model", "model_type": "llama",
               "offload_backend": None, "config_scaling_variables": {"hidden_size": 256},
               "config_variables": {"dtype": "bf16", "param_dtype": "fp32", "precision": 0, "seed": 654,
                                    "partition_axis": EFORMER_DEFAULT, "attn_mechanism": "vanilla",
                                    "gradient_checkpointing": "", "sharding_axis_dims": [1, -1, 1, 1, 1]}}
    path = tmp_path / "easydel.json"
    path.write_text(json.dumps(easydel))
    cfg = RayDistributedConfig.read(path)
    v = cfg.config_variables
    assert v["dtype"] is jnp.bfloat16 and v["param_dtype"] is jnp.float32
    assert v["precision"] is jax.lax.Precision.DEFAULT and v["sharding_axis_dims"] == (1, -1, 1, 1, 1)
    assert v["partition_axis"] == PartitionAxis(**EFORMER_DEFAULT)
    # ours: saved and read back equal, types included; enums stay enums
    v.update(attn_mechanism=AttentionMechanisms.FLASH, gradient_checkpointing=EasyDeLGradientCheckPointers.SELECTIVE)
    cfg.write(tmp_path / "ours.json")
    raw = json.loads((tmp_path / "ours.json").read_text())
    assert raw["config_variables"]["partition_axis"] == EFORMER_DEFAULT  # what EasyDeL's PartitionAxis(**d) reads
    assert raw["config_variables"]["attn_mechanism"] == "flash"
    back = RayDistributedConfig.read(tmp_path / "ours.json").config_variables
    assert back == v and all(type(back[k]) is type(v[k]) for k in v)


def test_training_arguments_take_easydel_and_hf_names():
    # EasyDeL's RayDistributedTrainer documentation's resume example, with only the import changed
    args = TrainingArguments(resume_if_possible=True, save_directory="./checkpoints", total_steps=10000,
                             batch_size=8, learning_rate=1e-4)
    assert (args.output_dir, args.max_training_steps, args.total_batch_size) == ("./checkpoints", 10000, 8)
    saved = args.model_dump()
    assert "save_directory" not in saved and TrainingArguments(**saved) == args  # saved under our names
    easy = TrainingArguments(max_sequence_length=64, use_wandb=True, wandb_entity="team", do_last_save=False,
                             scheduler=None, use_grain=True, shuffle_train_dataset=False, frozen_parameters="embed")
    assert (easy.max_length, easy.report_to, easy.save_at_end, easy.scheduler) == (
        64, ("tensorboard", "wandb"), False, "constant")
    hf = TrainingArguments(max_steps=5, logging_steps=2, max_grad_norm=0.5, lr_scheduler_type="cosine",
                           eval_steps=3, adam_beta2=0.99, report_to="none")
    assert (hf.max_training_steps, hf.log_steps, hf.clip_grad, hf.scheduler, hf.learning_rate_end) == (
        5, 2, 0.5, "cosine", 0.0)  # HF's cosine decays to 0
    assert (hf.evaluation_steps, hf.beta2, hf.report_to) == (3, 0.99, ())
    refused = {
        "per_device_train_batch_size": r"did you mean total_batch_size\? \(the global batch: per-device batch × devices",
        "warmup_ratio": r"did you mean warmup_steps\?", "bf16": r"did you mean dtype='bfloat16'",
        "learnig_rate": r"unknown key; did you mean 'learning_rate'", "max_stpes": "did you mean 'max_steps'",
        "use_grain": "only True here",
    }
    for key, message in refused.items():
        value = False if key == "use_grain" else 1
        with pytest.raises(ConfigError, match=f"TrainingArguments.{key}: .*{message}"):
            TrainingArguments(**{key: value})
    with pytest.raises(ConfigError, match="give 'max_steps' or 'max_training_steps', not both"):
        TrainingArguments(max_steps=1, max_training_steps=2)
    with pytest.raises(ConfigError, match=r"training.per_device_train_batch_size: not supported"):
        TrainingArguments.from_dict({"per_device_train_batch_size": 4})
    recipe = Recipe.from_dict({"training": {"save_directory": "/tmp/run", "max_steps": 3}})
    assert (recipe.training.output_dir, recipe.training.max_training_steps) == ("/tmp/run", 3)
    with pytest.raises(ConfigError, match=r"training.logging_stpes: unknown key; did you mean 'logging_steps'"):
        Recipe.from_dict({"training": {"logging_stpes": 3}})


def test_attention_and_remat_names_run_what_they_say_or_are_refused():
    kw = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=128)
    runs = {AttentionMechanisms.AUTO: "auto", AttentionMechanisms.FLASH: "auto", "flash_attn2": "auto",
            AttentionMechanisms.CUDNN: "cudnn", AttentionMechanisms.VANILLA: "vanilla", "blockwise": "vanilla"}
    for name, kernel in runs.items():
        assert LlamaConfig(**kw, attn_mechanism=name).attn_mechanism == kernel
    for name in ("bogus", AttentionMechanisms.RING, AttentionMechanisms.SPLASH):
        with pytest.raises(ConfigError, match=r"attn_mechanism: .* use one of \['auto', 'blockwise'"):
            LlamaConfig(**kw, attn_mechanism=name)
    remat = {EasyDeLGradientCheckPointers.NONE: "none", EasyDeLGradientCheckPointers.NOTHING_SAVEABLE: "full",
             EasyDeLGradientCheckPointers.SELECTIVE: "dots_with_no_batch_dims",
             EasyDeLGradientCheckPointers.CHECKPOINT_DOTS: "dots", True: "full", "dots": "dots"}
    for name, policy in remat.items():
        assert LlamaConfig(**kw, gradient_checkpointing=name).gradient_checkpointing == policy
    with pytest.raises(ConfigError, match="gradient_checkpointing: 'save_only_these_names' is not supported"):
        LlamaConfig(**kw, gradient_checkpointing=EasyDeLGradientCheckPointers.SAVE_ONLY_THESE_NAMES)


def test_frozen_parameters_are_not_updated_and_left_out_of_clipping():
    params = {"model": {"embed_tokens": jnp.ones((4, 3)), "layers": {0: {"q_proj": {"kernel": jnp.ones((3, 3))}}}},
              "lm_head": {"kernel": jnp.ones((3, 4))}}
    assert parameter_path(jax.tree_util.tree_leaves_with_path(params)[1][0]) == "model/embed_tokens"
    grads = jax.tree.map(lambda p: jnp.full_like(p, 100.0), params)
    schedule = optax.constant_schedule(0.1)

    def step(**kw):
        tx = make_optimizer(TrainingArguments(max_training_steps=1, optimizer="sgd", weight_decay=0.1,
                                              clip_grad=1.0, **kw), schedule)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    frozen = step(frozen_parameters=r"embed_tokens|layers/\d+/q_proj")
    np.testing.assert_array_equal(frozen["model"]["embed_tokens"], params["model"]["embed_tokens"])
    np.testing.assert_array_equal(frozen["model"]["layers"][0]["q_proj"]["kernel"], 1.0)
    # the head is trained, clipped by its own gradient norm only: with the others' zero
    # gradients (and no decay on them) plain SGD gives the same update
    zero_others = {"model": jax.tree.map(jnp.zeros_like, grads["model"]), "lm_head": grads["lm_head"]}
    tx = make_optimizer(TrainingArguments(max_training_steps=1, optimizer="sgd", weight_decay=0.1,
                                          clip_grad=1.0), schedule)
    expected = optax.apply_updates(params, tx.update(zero_others, tx.init(params), params)[0])
    np.testing.assert_allclose(frozen["lm_head"]["kernel"], expected["lm_head"]["kernel"], rtol=1e-6)  # float32 rounding
    assert not np.allclose(frozen["lm_head"]["kernel"], 1.0)


def test_task_type_members_and_plain_task_strings_name_the_same_registry_entry():
    """The core registry keys tasks by plain strings; EasyDeL's TaskType (compat) is accepted wherever one is."""
    import scaletrain
    from scaletrain.compat.easydel import enums
    from scaletrain.models.llama import LlamaModel
    from scaletrain.models.registry import get_modules_by_type, model_class_identity

    assert (scaletrain.TaskType, scaletrain.AttentionMechanisms, scaletrain.EasyDeLGradientCheckPointers) == (
        enums.TaskType, enums.AttentionMechanisms, enums.EasyDeLGradientCheckPointers)
    for member in enums.TaskType:
        assert member == member.value  # a str enum: its value is the core's task string
    assert get_modules_by_type("llama", enums.TaskType.BASE_MODULE) == get_modules_by_type("llama", "base-module")
    identity = model_class_identity(LlamaModel)
    assert identity == ("llama", "base-module") and type(identity[1]) is str
    with pytest.raises(ConfigError, match=r"unknown task_type 'bogus'; known: \['causal-language-model'"):
        get_modules_by_type("llama", "bogus")
