"""A chat template that Transformers' sandbox refuses is the template's problem, named as such, never a bad row.

The template below changes each message dict (``m.update``), which jinja2's immutable sandbox
refuses with a ``SecurityError`` on every conversation. It used to be reported as
"chat.jsonl: row 1: the chat template failed on this conversation" (and ``skip_bad_rows`` would
have skipped every row for it); now every data kind that renders conversations refuses it in one
message naming the template (``data.chat_template``'s file, or the tokenizer's folder) and the
sandbox, and ``scaletrain train`` exits 2 with that one line.
"""

from __future__ import annotations

import json

import pytest
import yaml
from data_helpers import PLAIN_TEMPLATE

from scaletrain.cli import main
from scaletrain.data import build_datasets, bundled_tokenizer_path, load_processor
from scaletrain.data.config import DataSection
from scaletrain.errors import DataError

LOOP = "{% for m in messages %}"
BLOCKED = LOOP + "{% set _ = m.update({'seen': 1}) %}" + PLAIN_TEMPLATE.split(LOOP)[1]
CHATS = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}."}]}
         for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")]
PAIRS = [{"prompt": [{"role": "user", "content": f"Say {w}."}], "chosen": [{"role": "assistant", "content": f"{w}."}],
          "rejected": [{"role": "assistant", "content": "No."}]} for w in ("one", "two", "three", "four")]
UNPAIRED = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in PAIRS]
PROMPTS = [{"prompt": p["prompt"]} for p in PAIRS]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_blocked_template_renders_without_the_sandbox_change():
    """The fixture is sound: without the ``m.update`` line it is the plain template that renders these rows."""
    tokenizer = load_processor(bundled_tokenizer_path())
    assert BLOCKED.replace("{% set _ = m.update({'seen': 1}) %}", "") == PLAIN_TEMPLATE
    assert "### user:\nSay one." in tokenizer.apply_chat_template(CHATS[0]["messages"], chat_template=PLAIN_TEMPLATE,
                                                                    tokenize=False)


def test_train_with_a_template_the_sandbox_refuses_is_one_line_naming_the_template_exit_2(tmp_path, capsys):
    (tmp_path / "blocked.jinja").write_text(BLOCKED)
    recipe = {
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "tokenizer": {"path": "bundled"},
        "data": {"kind": "chat", "source": _jsonl(tmp_path / "chat.jsonl", CHATS),
                 "chat_template": str(tmp_path / "blocked.jinja"), "eval_fraction": 0.25, "skip_bad_rows": True},
        "training": {"output_dir": str(tmp_path / "run"), "total_batch_size": 8, "max_length": 32,
                     "num_train_epochs": None, "max_training_steps": 1, "progress_bar": False, "report_to": []},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"chat template data.chat_template ({tmp_path / 'blocked.jinja'}): Transformers' template sandbox " \
           "refuses what it does (access to attribute 'update' of 'dict' object is unsafe.)" in err, err
    assert "row" not in err.split("sandbox refuses")[0] and "failed on this conversation" not in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("kind,rows,keys", [
    ("chat", CHATS, {}),
    ("preference", PAIRS, {}),
    ("preference", PAIRS, {"preparation": "trl_orpo"}),
    ("unpaired_preference", UNPAIRED, {}),
    ("prompt", PROMPTS, {}),
])
def test_every_kind_names_the_tokenizers_own_template_not_a_row(tmp_path, kind, rows, keys):
    """The tokenizer's own template (saved in its folder) refused by the sandbox: a DataError naming that folder,
    raised even with ``skip_bad_rows`` (it is no row's fault, so no row is skipped for it)."""
    tokenizer = load_processor(bundled_tokenizer_path())
    tokenizer.chat_template = BLOCKED
    tokenizer.save_pretrained(tmp_path / "tok")
    tokenizer = load_processor(str(tmp_path / "tok"))
    section = DataSection(source=_jsonl(tmp_path / "rows.jsonl", rows), kind=kind, eval_fraction=0.0,
                          skip_bad_rows=True, **keys)
    with pytest.raises(DataError) as info:
        build_datasets(section, tokenizer, max_length=64)
    message = str(info.value)
    assert message.startswith(f"chat template the tokenizer's ({tmp_path / 'tok'}): Transformers' template sandbox "
                              "refuses what it does"), message
    assert "row" not in message.split("sandbox refuses")[0], message
