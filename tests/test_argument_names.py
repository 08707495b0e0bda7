"""The plugin seam for other tools' argument names: tables found through an entry-point group, not an import."""

from __future__ import annotations

import importlib.metadata

import pytest

from scaletrain import argument_names
from scaletrain.argument_names import ENTRY_POINT_GROUP, HUGGING_FACE, ArgumentNames, merge_tables, merged_table
from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError

EASYDEL = "scaletrain.compat.easydel.argument_names:TABLE"


@pytest.fixture
def entry_points(monkeypatch):
    """Install ``{name: value}`` as the group's entry points; the merged table is reloaded before and after."""

    def install(points: dict[str, str]) -> None:
        found = importlib.metadata.EntryPoints(
            importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in points.items())
        none = importlib.metadata.EntryPoints(())
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group=None: found if group == ENTRY_POINT_GROUP else none)
        merged_table.cache_clear()

    yield install
    monkeypatch.undo()
    merged_table.cache_clear()


def test_a_registered_table_is_found_through_the_entry_point_group(entry_points):
    entry_points({"easydel": EASYDEL})
    args = TrainingArguments(save_directory="/tmp/run", max_sequence_length=64, use_wandb=True, max_steps=3)
    assert (args.output_dir, args.max_length, args.report_to, args.max_training_steps) == (
        "/tmp/run", 64, ("tensorboard", "wandb"), 3)
    assert (args.save_directory, args.max_sequence_length) == ("/tmp/run", 64)  # read back, as the table says
    assert "save_directory" not in args.model_dump()  # saved under our names
    assert TrainingArguments(scheduler="warm_up_linear").scheduler == "linear"  # the plugin's scheduler names


def test_without_a_registered_table_only_the_core_names_are_known(entry_points):
    entry_points({})
    assert TrainingArguments(max_steps=3, logging_steps=2).log_steps == 2  # Hugging Face's names are the core's
    with pytest.raises(ConfigError, match=r"TrainingArguments.save_directory: unknown key"):
        TrainingArguments(save_directory="/tmp/run")
    with pytest.raises(AttributeError, match="save_directory"):
        _ = TrainingArguments().save_directory


def test_the_installed_package_registers_the_easydel_table():
    """pyproject.toml's entry point, as pip recorded it (``pip install -e .`` after editing pyproject.toml)."""
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    assert {(p.name, p.value) for p in points} == {("easydel", EASYDEL)}
    from scaletrain.compat.easydel.argument_names import TABLE
    assert points["easydel"].load() is TABLE


def test_a_name_two_tables_give_two_meanings_is_refused_naming_both():
    other = ArgumentNames(renamed={"max_steps": "max_length"})
    with pytest.raises(ValueError, match=r"'max_steps' \(renamed\) means two things: in core and in other"):
        merge_tables([("core", HUGGING_FACE), ("other", other)])
    assert merge_tables([("core", HUGGING_FACE), ("same", ArgumentNames(renamed={"max_steps": "max_training_steps"}))])


def test_an_entry_point_that_is_not_a_table_is_named(entry_points):
    entry_points({"broken": "scaletrain.argument_names:ENTRY_POINT_GROUP"})
    with pytest.raises(TypeError, match=r"entry point broken = 'scaletrain.argument_names:ENTRY_POINT_GROUP' "
                                        r"\(group scaletrain.argument_names\) is a str, not an ArgumentNames"):
        argument_names.merged_table()
