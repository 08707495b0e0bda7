"""``scaletrain generate --prompts FILE``: several prompts, the model loaded once, batched through the engine.

A tiny random Llama exported as an HF folder with a whitespace word tokenizer (and a chat
template for the conversational rows). Greedy decoding gives each prompt what it gets alone
(a row's tokens do not depend on its neighbours or its padding), so every answer of the
batched call must equal ``scaletrain generate --prompt`` on that prompt, text for text.
"""

from __future__ import annotations

import json

import pytest
from preference_testing import export, tiny_llama, word_tokenizer

import scaletrain.generation as generation
from scaletrain.cli import main
from scaletrain.cli_hf import generate_main
from scaletrain.models.registry import AutoModelForCausalLM

TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}" \
           "{% if add_generation_prompt %}assistant {% endif %}"
PROMPTS = ["what is two plus three", "say hello", "the sky colour", "count to four please now", "name a fruit"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = export(tiny_llama(seed=5, layers=1), str(tmp_path_factory.mktemp("gen") / "hf"))
    tokenizer = word_tokenizer(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _run(capsys, argv):
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_a_prompts_file_loads_the_model_once_and_answers_each_prompt_as_alone(folder, tmp_path, capsys, monkeypatch):
    """Five prompts in batches of two: one model load, three engine calls of 2, 2 and 1 rows, the answers in
    file order, each equal to the one-prompt command's."""
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n\n" + "\n".join(PROMPTS[3:]) + "\n")
    loads, calls = [], []
    load, generate = AutoModelForCausalLM.from_pretrained, generation.generate
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        staticmethod(lambda *a, **k: loads.append(a) or load(*a, **k)))
    monkeypatch.setattr(generation, "generate", lambda model, ids, **k: calls.append(len(ids)) or generate(
        model, ids, **k))
    rows = _run(capsys, ["generate", folder, "--prompts", str(tmp_path / "prompts.txt"), "--batch-size", "2",
                         "--max-new-tokens", "6"])
    assert len(loads) == 1 and calls == [2, 2, 1]
    assert [r["prompt"] for r in rows] == PROMPTS  # the blank line is no prompt
    monkeypatch.undo()
    alone = [generate_main(folder, p, max_new_tokens=6) for p in PROMPTS]
    assert [r["completion"] for r in rows] == alone
    assert any(alone)  # the model wrote something: the comparison is not of empty strings


def test_jsonl_rows_with_prompt_or_messages_go_through_the_chat_template(folder, tmp_path, capsys):
    """A ``messages`` row (and a ``prompt`` holding messages) is rendered by the chat template: its answer equals
    ``--chat --prompt`` on the same user turn; a text ``prompt`` row is plain text, as ``--prompt``."""
    turn = [{"role": "user", "content": "say hello"}]
    lines = [{"messages": turn}, {"prompt": turn}, {"prompt": "say hello"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = _run(capsys, ["generate", folder, "--prompts", str(tmp_path / "rows.jsonl"), "--max-new-tokens", "6"])
    chat = generate_main(folder, "say hello", max_new_tokens=6, chat=True)
    plain = generate_main(folder, "say hello", max_new_tokens=6)
    assert [r["completion"] for r in rows] == [chat, chat, plain] and chat != plain
    assert rows[0]["prompt"] == turn


@pytest.mark.parametrize("text,message", [
    ('{"prompt": "say hello"}\n{"text": "no prompt here"}\n', "rows.jsonl (line 2): give a 'prompt'"),
    ('{"prompt": "say hello"}\nnot json\n', "rows.jsonl (line 2): not valid JSON"),
    ("\n\n", "holds no prompt"),
])
def test_a_bad_prompts_file_is_one_line_naming_the_line(folder, tmp_path, capsys, text, message):
    (tmp_path / "rows.jsonl").write_text(text)
    assert main(["generate", folder, "--prompts", str(tmp_path / "rows.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
