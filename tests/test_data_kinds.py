"""``data.kind`` is a registry: an unknown kind is refused by name, a registered one is built by its builder."""

import json

import pytest

from scaletrain.data import build_datasets, bundled_tokenizer_path, load_processor
from scaletrain.data.config import DataSection
from scaletrain.data.kinds import DATA_KINDS, DataKind, data_kind, register_data_kind
from scaletrain.errors import ConfigError, DataError
from scaletrain.recipe import Recipe


def test_an_unknown_kind_names_the_field_and_the_known_kinds():
    with pytest.raises(ConfigError) as err:
        Recipe.from_dict({"data": {"kind": "reward_pairs"}}, where="r.yaml")
    known = "the known kinds are chat, preference, pretrain"
    assert f"data.kind: unknown data kind 'reward_pairs'; {known}" in str(err.value)
    with pytest.raises(DataError, match=f"data.kind: unknown data kind 'x'; {known}"):
        data_kind("x")


def test_a_registered_kind_is_valid_and_builds_through_its_builder(tmp_path):
    """A new kind is one register call: the config accepts it, and build_datasets reads the kind's column
    and calls its builder (here the pretrain builder over another column, recording the call)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i} " * 8}) + "\n" for i in range(6)))
    seen = []

    def build(data, rows, tokenizer, bad, **kw):
        seen.append(kw)
        return DATA_KINDS["pretrain"].build(data, rows, tokenizer, bad, **kw)

    register_data_kind(DataKind("prompt_test", column=lambda d: "prompt", build=build))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_data_kind(DataKind("prompt_test", column=lambda d: "prompt", build=build))
        data = DataSection(source=str(path), kind="prompt_test", eval_fraction=0.0)
        splits = build_datasets(data, load_processor(bundled_tokenizer_path()), max_length=16, seed=1)
    finally:
        del DATA_KINDS["prompt_test"]
    assert seen == [{"max_length": 16, "seed": 1, "truncation_mode": "keep_end"}]
    assert splits.stats["documents"] == 6 and len(splits.train) > 0
