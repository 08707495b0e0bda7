"""A tokenizer folder that names the plain fast class loads as ``AutoTokenizer`` loads it, without importing torch
(scaletrain/data/tokenizer.py): the same class, the same saved files, the same ids and chat renderings."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys

import pytest
from data_helpers import MARKED_TEMPLATE, smollm2_path
from preference_testing import word_tokenizer

from scaletrain.data import load_processor
from scaletrain.data.corpus import bundled_tokenizer_path
from scaletrain.data.tokenizer import names_the_plain_fast_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["To be, or not to be: that is the question.", "what is two plus three", "  odd   spacing\nand lines ",
         "<|endoftext|> and </s> inside", "ünïcödé ✓ 12 plus 30"]
CHAT = [{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "42"}]


def _folders(tmp_path) -> dict[str, str]:
    """The plain-class folders runs read: the bundled tokenizer, the suite's word tokenizers (one with a bos), one
    with a chat template in its config, and the prepared SmolLM2 tokenizer (its template in chat_template.jinja)."""
    word_tokenizer(str(tmp_path / "word"))
    word_tokenizer(str(tmp_path / "word_bos"), bos=True)
    shutil.copytree(bundled_tokenizer_path(), tmp_path / "templated")
    config_path = tmp_path / "templated" / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": MARKED_TEMPLATE}))
    return {"bundled": bundled_tokenizer_path(), "word": str(tmp_path / "word"), "word_bos": str(tmp_path / "word_bos"),
            "templated": str(tmp_path / "templated"), "smollm2": smollm2_path()}


def _auto(path: str):
    """What load_processor returned before: AutoTokenizer, then eos as pad when there is no pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def test_a_plain_fast_tokenizer_folder_loads_as_autotokenizer_loads_it(tmp_path):
    for name, path in _folders(tmp_path).items():
        assert names_the_plain_fast_class(path), name
        ours, theirs = load_processor(path), _auto(path)
        assert type(ours) is type(theirs), name
        assert ours(TEXTS) == theirs(TEXTS), name
        assert ours(TEXTS, add_special_tokens=False) == theirs(TEXTS, add_special_tokens=False), name
        assert ours.special_tokens_map == theirs.special_tokens_map and len(ours) == len(theirs), name
        assert (ours.padding_side, ours.truncation_side, ours.model_max_length) == (
            theirs.padding_side, theirs.truncation_side, theirs.model_max_length), name
        assert ours.chat_template == theirs.chat_template, name
        if ours.chat_template:
            kwargs = dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert ours.apply_chat_template(CHAT, **kwargs) == theirs.apply_chat_template(CHAT, **kwargs), name
        # everything the tokenizer would write is the same, file for file
        ours.save_pretrained(tmp_path / "saved" / name / "ours")
        theirs.save_pretrained(tmp_path / "saved" / name / "theirs")
        files = sorted(os.listdir(tmp_path / "saved" / name / "ours"))
        assert files == sorted(os.listdir(tmp_path / "saved" / name / "theirs")), name
        match, mismatch, errors = filecmp.cmpfiles(tmp_path / "saved" / name / "ours",
                                                   tmp_path / "saved" / name / "theirs", files, shallow=False)
        assert (mismatch, errors) == ([], []), name


def test_a_folder_with_a_model_config_or_remote_code_goes_through_autotokenizer(tmp_path):
    """A model's folder can correct its tokenizer's class (transformers' per-family rules): AutoTokenizer decides."""
    for extra in ("config", "auto_map", "other_class"):
        folder = tmp_path / extra
        shutil.copytree(bundled_tokenizer_path(), folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        if extra == "config":
            (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        elif extra == "auto_map":
            config["auto_map"] = {"AutoTokenizer": [None, "tokenization_mine.MineFast"]}
        else:
            config["tokenizer_class"] = "GPT2Tokenizer"
        config_path.write_text(json.dumps(config))
        assert not names_the_plain_fast_class(str(folder)), extra
    (tmp_path / "no_json").mkdir()
    assert not names_the_plain_fast_class(str(tmp_path / "no_json"))


def test_loading_the_bundled_tokenizer_imports_no_torch():
    """The ~1.7 s of CPU a run's start spent importing torch (through AutoTokenizer's model configurations)."""
    code = ("import sys\nfrom scaletrain.data import load_processor\nfrom scaletrain.data.corpus import "
            "bundled_tokenizer_path\ntok = load_processor(bundled_tokenizer_path())\n"
            "print(type(tok).__name__, len(tok), 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["TokenizersBackend", "4096", "False"]


@pytest.mark.parametrize("broken", ["tokenizer_config.json", "tokenizer.json"])
def test_an_unreadable_tokenizer_file_is_one_data_error_naming_the_folder(tmp_path, broken):
    from scaletrain.errors import DataError

    folder = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_path(), folder)
    (folder / broken).write_text("{not json")
    with pytest.raises(DataError, match=f"cannot load a tokenizer from {folder}"):
        load_processor(str(folder))
