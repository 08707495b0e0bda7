"""Helpers of the evaluation tests: a tiny random HF Llama with the bundled tokenizer, and local lm-eval tasks.

The tasks are what a user of an offline cluster writes: YAMLs with ``dataset_path: json`` over
JSON files on disk (nothing from the hub), one of each request type lm-eval has.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_testing import hf_model

MC_DOCS = [
    {"question": "The cat sat on the", "choices": [" mat", " moon", " sea"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "ROMEO. What light through yonder", "choices": [" window breaks", " door", " sky falls"],
     "answer": 0},
    {"question": "", "choices": ["Once upon a time", "Zebra"], "answer": 1},
    {"question": "The king said ", "choices": ["yes", "no", "maybe so"], "answer": 2},
    {"question": "A rose by any other name would smell as", "choices": [" sweet", " bad"], "answer": 0},
]
GEN_DOCS = [{"prompt": p, "target": t} for p, t in [
    ("To be, or not to be:", " that"), ("Friends, Romans,", " countrymen"), ("Now is the winter", " of"),
    ("All the world", "'s a stage"), ("Once more unto the", " breach")]]
TEXT_DOCS = [{"page": "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."},
             {"page": "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date."}]


def task_yamls(folder: Path) -> Path:
    """Three local tasks in ``folder/tasks``: ``st_mc`` (multiple choice), ``st_gen`` (generate_until, stop
    sequences) and ``st_text`` (loglikelihood_rolling); their data as JSON files beside them."""
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS), ("text", TEXT_DOCS)):
        (tasks / f"{name}.json").write_text(json.dumps(docs))

    def data(name: str) -> str:
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / (name + '.json')}\n"
                "test_split: test\n")

    (tasks / "st_mc.yaml").write_text(
        "task: st_mc\n" + data("mc") + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "st_gen.yaml").write_text(
        "task: st_gen\n" + data("gen") + "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\n"
        "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    (tasks / "st_text.yaml").write_text(
        "task: st_text\n" + data("text") + "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{page}}\"\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return tasks


def tiny_hf_folder(folder: Path, max_positions: int = 256) -> Path:
    """A random transformers Llama sized to the bundled tokenizer (4096 ids), saved with that tokenizer."""
    from scaletrain.data import load_processor, resolve_tokenizer_path

    tokenizer = load_processor(resolve_tokenizer_path("bundled"))
    model = hf_model("llama", seed=3, vocab_size=len(tokenizer), max_position_embeddings=max_positions,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
