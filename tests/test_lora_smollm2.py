"""examples/chat_lora.yaml on the real SmolLM2-135M-Instruct: trains, exports a PEFT adapter, peft answers.

Cut to fit the suite as test_finetune_pretrained's example is: 2 steps on the same 8
conversations (the last 32 tokens of each), so "the loss falls" compares one batch with
itself. The converted model folder is that test's cache (hf_testing.convert_smollm2).
"""

from __future__ import annotations

import json
import math
import os

import pytest
from data_helpers import CHAT_JSONL, REPO
from hf_testing import convert_smollm2, smollm2_missing_reason

from scaletrain.export import export_checkpoint
from scaletrain.recipe import Recipe
from scaletrain.run import run_training

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

EXAMPLE = str(REPO / "examples" / "chat_lora.yaml")


@pytest.mark.slow  # a 135M-parameter, 30-layer model: loading and compiling it dominate
def test_chat_lora_example_trains_and_peft_answers(tmp_path):
    """The example on a real base, its layers stacked (``model.scan_layers``: one layer body to compile,
    97 -> 36 s of this test; the unrolled LoRA path is test_lora's), exported to a folder PEFT answers from."""
    reason = smollm2_missing_reason()
    if reason:
        pytest.skip(reason)
    base = convert_smollm2()
    source = tmp_path / "chat.jsonl"
    with open(CHAT_JSONL) as f:
        source.write_text("".join(f.readlines()[:8]))
    run = tmp_path / "run"
    recipe = Recipe.load(EXAMPLE, [
        f"model.pretrained={base}", f"data.source={source}", "data.eval_fraction=0",
        f"training.output_dir={run}", "training.max_training_steps=2", "training.max_length=32",
        "training.warmup_steps=0", "training.log_steps=1", "training.do_eval=false", "training.progress_bar=false",
        "training.learning_rate=1e-3", "sample.max_new_tokens=0", "model.scan_layers=true",
    ])
    assert recipe.training.lora.base_model == base
    run_training(recipe)
    losses = [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"train"' in line]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0]  # one adapter update lowers the loss on this same batch
    # export (what `scaletrain export` does): the checkpoint's adapters onto the base it names
    folder = export_checkpoint(str(run), str(tmp_path / "adapter"))
    # PEFT's two files, and the record that lets the next export replace this folder (docs/hf.md)
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors", "scaletrain_export.json"]
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(base)
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), folder).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reply = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert tok.decode(reply, skip_special_tokens=True).strip()
