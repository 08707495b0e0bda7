"""LoRA: starts equal to its base, trains only adapters, counts like PEFT, resumes exactly, exports to PEFT.

The oracle for counts and exports is ``peft`` itself on the transformers model the
base was saved from (torch CPU, float32). Random adapters on every family, loaded by peft,
are checked in test_families_conformance.py.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import scaletrain as st
from scaletrain.cli import main
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.export import export_checkpoint
from scaletrain.generation import generate
from scaletrain.peft.lora import LoRAConfig, apply_lora, merge_lora, split_trainable, trainable_count
from scaletrain.peft.adapter import load_peft_adapter, save_peft_adapter
from scaletrain.models.registry import AutoModelForCausalLM
from scaletrain.training.checkpoint import Checkpointer
from hf_testing import hf_logits, hf_model, our_logits, rel_diff, save_hf

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOL = 1e-4  # float32 parity, max |diff| / max |logit| (as test_hf_parity)
IDS = np.random.RandomState(0).randint(0, 128, (2, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random transformers Llama saved once; every test loads its own copy of the weights."""
    return save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"))


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": (rng.integers(0, 128) + np.arange(rng.integers(8, 16))) % 128} for _ in range(n)]


def _trainer(out, base_dir, lora, **kw):
    args = dict(output_dir=str(out), total_batch_size=8, max_length=16, num_train_epochs=None, max_training_steps=4,
                learning_rate=1e-2, log_steps=1, save_steps=2, progress_bar=False, do_eval=False, report_to=(),
                lora=lora)
    args.update(kw)
    return st.Trainer(st.TrainingArguments(**args), model=AutoModelForCausalLM.from_pretrained(base_dir),
                      dataset_train=_data())


def _peft_model(base_dir, **lora_kwargs):
    return peft.get_peft_model(transformers_model(base_dir), peft.LoraConfig(**lora_kwargs))


def transformers_model(base_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


TARGETS = {
    "attention-names": (dict(target_modules=["q_proj", "v_proj"]), dict(target_modules=["q_proj", "v_proj"])),
    "all-linear-rslora": (dict(target_modules="all-linear", rank=4, rslora=True),
                          dict(target_modules="all-linear", r=4, use_rslora=True)),
    "regex": (dict(target_modules=r".*\.1\.mlp\.(up|down)_proj"), dict(target_modules=r".*\.1\.mlp\.(up|down)_proj")),
}


def test_starts_equal_to_base_and_counts_like_peft(llama_dir):
    base = our_logits(AutoModelForCausalLM.from_pretrained(llama_dir), IDS)
    for ours, theirs in TARGETS.values():
        model = apply_lora(AutoModelForCausalLM.from_pretrained(llama_dir), LoRAConfig(**ours))
        # B starts at zero: x W + s * (x A) 0 adds an exact zero to every output
        assert np.array_equal(our_logits(model, IDS), base), ours
        assert trainable_count(model) == _peft_model(llama_dir, **theirs).get_nb_trainable_parameters()[0], ours
    norms = apply_lora(AutoModelForCausalLM.from_pretrained(llama_dir), LoRAConfig(train_norms=True))
    expected = _peft_model(llama_dir, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           modules_to_save=["input_layernorm", "post_attention_layernorm", "norm"])
    assert trainable_count(norms) == expected.get_nb_trainable_parameters()[0]


def test_bad_targets_name_the_key(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    with pytest.raises(ConfigError, match="target_modules.*matches no linear layer.*q_proj"):
        apply_lora(model, LoRAConfig(target_modules=["qproj"]))
    with pytest.raises(ConfigError, match="lm_head"):
        apply_lora(model, LoRAConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="dropout"):
        st.TrainingArguments(lora={"dropout": 0.1})


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    """A 4-step LoRA run (checkpoints at 2 and 4): the state before and after."""
    out = tmp_path_factory.mktemp("lora-run")
    trainer = _trainer(out, llama_dir, LoRAConfig(target_modules="all-linear", base_model=llama_dir))
    before = jax.tree.map(np.asarray, (trainer.model_state.params, trainer.model_state.frozen))
    result = trainer.train()
    return out, trainer, before, result.state


def test_step_changes_only_adapters_and_optimizer_holds_only_them(trained):
    _, trainer, (params0, frozen0), state = trained
    frozen1 = jax.tree.map(np.asarray, state.frozen)
    assert jax.tree.all(jax.tree.map(np.array_equal, frozen0, frozen1))  # the base did not move
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), params0, state.params)
    assert all(jax.tree.leaves(changed))  # every adapter matrix (B from zero, A through B) moved
    keys = {str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert keys == {"lora_a", "lora_b"}
    # Adam's two moments exist for the adapters alone
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * trainable_count(state.model)
    assert state.params is not None and trainer.summary["final_step"] == 4


def test_checkpoint_holds_adapters_and_resume_is_exact(trained, llama_dir, tmp_path):
    out, trainer, _, _ = trained
    saved = Checkpointer.for_run(str(out)).read_meta(4)
    assert saved["lora"]["base_model"] == llama_dir and len(saved["lora"]["base_sha256"]) == 64
    # stop at step 2, resume: the adapters end bit-identical to the uninterrupted run's
    first = _trainer(tmp_path, llama_dir, LoRAConfig(target_modules="all-linear", base_model=llama_dir),
                     exit_iteration=2)
    first.train()
    resumed = _trainer(tmp_path, llama_dir, LoRAConfig(target_modules="all-linear", base_model=llama_dir),
                       resume_if_possible=True)
    resumed.train()
    assert resumed.resumed_from.endswith("/2")
    assert resumed.summary["params_sha256"] == trainer.summary["params_sha256"]
    # another base: refused, naming the base the checkpoint needs
    other = save_hf(hf_model("llama", seed=1), tmp_path / "other")
    with pytest.raises(CheckpointError, match=f"base {llama_dir}.*differs"):
        _trainer(tmp_path, other, LoRAConfig(target_modules="all-linear", base_model=other),
                 resume_if_possible=True, max_training_steps=6).train()


def test_peft_export_merge_and_import_agree_with_peft(trained, llama_dir, tmp_path):
    _, _, _, state = trained
    model = state.model
    ours = our_logits(model, IDS)
    folder = save_peft_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(transformers_model(llama_dir), folder).eval()
    theirs = hf_logits(loaded, IDS)
    assert rel_diff(ours, theirs) < TOL
    assert rel_diff(ours, hf_logits(transformers_model(llama_dir), IDS)) > 100 * TOL  # the adapter matters
    merged_dir = merge_lora(model).save_pretrained(str(tmp_path / "merged"))
    assert rel_diff(hf_logits(transformers_model(merged_dir), IDS), theirs) < TOL
    # import: the PEFT folder onto a fresh base continues from the same function
    again = load_peft_adapter(AutoModelForCausalLM.from_pretrained(llama_dir), folder)
    assert rel_diff(our_logits(again, IDS), ours) < TOL
    _, trainable, _ = split_trainable(again)
    assert jax.tree.structure(trainable) == jax.tree.structure(state.params)


def test_run_exports_adapter_or_merged_and_generates_unmerged(trained, tmp_path):
    """`scaletrain export` on a LoRA run: a PEFT folder, or with --merge the full model; generation
    with the adapter unmerged gives the merged model's tokens."""
    out, _, _, state = trained
    folder = export_checkpoint(str(out), str(tmp_path / "adapter"))
    assert json.load(open(f"{folder}/adapter_config.json"))["target_modules"] == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    merged_dir = export_checkpoint(str(out), str(tmp_path / "merged"), merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert rel_diff(our_logits(merged, IDS), our_logits(state.model, IDS)) < TOL
    prompt = IDS[:1, :8]
    assert np.array_equal(generate(state.model, prompt, max_new_tokens=6), generate(merged, prompt, max_new_tokens=6))


def _generated(capsys, folder, *extra):
    assert main(["generate", str(folder), "--prompt", "5 9 3 7", "--max-new-tokens", "8", *extra]) == 0
    return capsys.readouterr().out


def test_generate_on_the_exported_adapter_gives_the_runs_tokens(trained, llama_dir, tmp_path, capsys):
    """`scaletrain generate` on the adapter folder `scaletrain export` wrote loads the base that
    adapter_config.json names and applies the adapter unmerged: the tokens of generate on the run."""
    out, _, _, _ = trained
    folder = export_checkpoint(str(out), str(tmp_path / "adapter"))
    from_adapter = _generated(capsys, folder)
    assert from_adapter == _generated(capsys, out) and len(from_adapter.split()) == 8
    assert from_adapter.endswith(" ".join(from_adapter.split()) + "\n")  # ids, then one final newline
    assert from_adapter != _generated(capsys, llama_dir)  # the adapter was applied
    # a base that is not a local folder: one message naming the file and the field
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "someone/a-hub-model"}))
    assert main(["generate", folder, "--prompt", "5 9"]) == 2
    err = capsys.readouterr().err
    assert f"{config_path}: base_model_name_or_path 'someone/a-hub-model' is not a local" in err
    assert main(["generate", folder, "--prompt", "5 9", "--checkpoint", "2"]) == 2
    assert "not a training run; drop --checkpoint" in capsys.readouterr().err


def test_init_from_refuses_an_adapter_trained_on_another_base(llama_dir, tmp_path):
    """lora.init_from checks the adapter's recorded base: another architecture or other weights are
    refused naming lora.init_from and both bases; a copy of the base elsewhere is the same base."""
    import shutil

    from scaletrain.training.lora_state import with_lora

    lora = dict(target_modules=["q_proj", "v_proj"])
    adapter = save_peft_adapter(apply_lora(AutoModelForCausalLM.from_pretrained(llama_dir),
                                           LoRAConfig(**lora, base_model=llama_dir)), tmp_path / "adapter")

    def init_from(base):
        return with_lora(AutoModelForCausalLM.from_pretrained(base),
                         LoRAConfig(**lora, base_model=base, init_from=adapter))

    other = save_hf(hf_model("llama", seed=1), tmp_path / "other")
    with pytest.raises(ConfigError, match=f"lora.init_from={adapter}: the adapter was trained on the base "
                                          f"{llama_dir}, but this run's base is {other}: their weights differ "
                                          r"\(first at .*set base_model_name_or_path in .*adapter_config.json"):
        init_from(other)
    deeper = save_hf(hf_model("llama", num_hidden_layers=3), tmp_path / "deeper")
    with pytest.raises(ConfigError, match="architectures differ: num_hidden_layers 3 here, 2 in the adapter's base"):
        init_from(deeper)
    copy = shutil.copytree(llama_dir, tmp_path / "copy")
    assert rel_diff(our_logits(init_from(str(copy)), IDS), our_logits(init_from(llama_dir), IDS)) == 0
    # the override the message names: the adapter says it fits the other base
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": other}))
    init_from(other)
    # a hub name cannot be compared (no download): a warning, and the shapes are still checked at load
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": "a/hub"}))
    init_from(other)
    with pytest.raises(CheckpointError, match="does not fit this model's adapters"):
        init_from(deeper)
