"""The ``Objective`` protocol says everything the trainers read: every registered objective declares each member
(its own value or ``ObjectiveBase``'s default), nothing in the package looks one up by ``getattr``/``hasattr``, and
callbacks read the objective's figures through ``TrainerView``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scaletrain.objectives import Objective, ObjectiveBase
from scaletrain.objectives.registry import build_objective, objective_types
from scaletrain.training.protocol import TrainerView

PACKAGE = Path(__file__).resolve().parent.parent / "scaletrain"
MEMBERS = ("name", "batch_keys", "frozen_models", "normaliser", "reference_source", "precomputed_keys",
           "logged_metrics", "sequences_per_row", "sampler_check", "batch_totals", "reference_inputs",
           "loss_and_sums", "zero_sums", "step_metrics", "eval_metrics")
RL_KINDS = ("grpo", "rloo", "reinforce_pp", "distillation", "gkd", "ppo")  # one completion a row; the others: pairs


@pytest.mark.parametrize("kind", [k for k in objective_types() if k != "lm"])
def test_every_registered_objective_declares_the_whole_protocol(kind):
    objective = build_objective(kind, {})
    assert isinstance(objective, Objective) and isinstance(objective, ObjectiveBase)
    for member in MEMBERS:
        assert hasattr(type(objective), member) or member in objective.__dataclass_fields__, member
    assert (objective.reference_source is not None) == (kind in ("dpo", "kto"))  # what the trainer sets up
    assert objective.sequences_per_row == (1 if kind in RL_KINDS else 2)


def test_the_protocol_lists_what_the_trainers_read():
    declared = set(Objective.__annotations__) | {n for n in vars(Objective) if not n.startswith("_")}
    assert set(MEMBERS) <= declared
    assert {"logged_metrics", "sequences_per_row"} <= {n for n in vars(TrainerView) if not n.startswith("_")}


def test_no_objective_member_is_looked_up_by_getattr_or_hasattr():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "objective" in target.lower() and target != "self":
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_each_objective_type_runs_under_the_trainer_its_family_package_registers():
    from types import SimpleNamespace

    from scaletrain.objectives.registry import get_objective_type, trainer_class
    from scaletrain.preference.trainer import PreferenceTrainer
    from scaletrain.rl.trainer import GRPOTrainer
    from scaletrain.rl.variants import ReinforcePPTrainer, RLOOTrainer
    from scaletrain.run import objective_trainer

    want = {"lm": None, "dpo": PreferenceTrainer, "orpo": PreferenceTrainer, "cpo": PreferenceTrainer,
            "simpo": PreferenceTrainer, "kto": PreferenceTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer,
            "reinforce_pp": ReinforcePPTrainer, "reward": PreferenceTrainer}
    assert {k: trainer_class(k) for k in want} == want
    trainer, kwargs = objective_trainer(SimpleNamespace(objective=SimpleNamespace(type="kto", options={})))
    assert trainer is PreferenceTrainer and kwargs["objective"].name == "kto"
    # the table names classes, registered from above: no "module:Class" string for the layout test to miss
    source = (PACKAGE / "objectives" / "registry.py").read_text()
    strings = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not [s for s in strings if s.startswith("scaletrain.") and ":" in s]
    assert all(get_objective_type(k).own_trainer == (v is not None) for k, v in want.items())
