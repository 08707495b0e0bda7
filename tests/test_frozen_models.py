"""The frozen-model component (``training/frozen.py``): one set-up for any frozen model an objective reads (a
reference, next a teacher), its record under its own name, the resume check by digest, and the trainers that use
it writing no record of their own."""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.training.frozen import POLICY_COPY, FrozenModels, set_up
from scaletrain.training.state import params_sha256
from tests.preference_testing import export, one_device_mesh, tiny_llama


@pytest.fixture(scope="module")
def policy():
    from flax import nnx

    model = tiny_llama(seed=0, mesh=one_device_mesh(), layers=1)
    graphdef, params = nnx.split(model)
    return model, graphdef, nnx.to_pure_dict(params)


def test_frozen_copy_of_the_policy_is_new_arrays_recorded_by_digest_under_its_name(policy):
    model, graphdef, params = policy
    setup = set_up("teacher", None, model, graphdef, params, None, one_device_mesh())
    assert setup.source == "model" and setup.name == "teacher"
    assert setup.record == {"teacher": POLICY_COPY, "teacher_sha256": params_sha256(params)}
    import jax

    for copied, original in zip(jax.tree.leaves(setup.model.params), jax.tree.leaves(params), strict=True):
        assert copied is not original  # new arrays: the train step donates the policy's buffers
        np.testing.assert_array_equal(np.asarray(copied), np.asarray(original))


def test_frozen_model_folder_recorded_by_path_and_refused_when_not_a_folder(policy, tmp_path):
    model, graphdef, params = policy
    other = export(tiny_llama(seed=1, mesh=one_device_mesh(), layers=1), str(tmp_path / "ref"))
    setup = set_up("reference", other, model, graphdef, params, None, one_device_mesh())
    assert setup.record["reference"] == other
    assert setup.record["reference_sha256"] == params_sha256(setup.model.params) != params_sha256(params)
    with pytest.raises(ConfigError, match="objective.reference='/nowhere' is not a folder"):
        set_up("reference", "/nowhere", model, graphdef, params, None, one_device_mesh())
    with pytest.raises(ConfigError, match="reference must be a model folder or a model, got int"):
        set_up("reference", 3, model, graphdef, params, None, one_device_mesh())


def test_frozen_models_resume_check_refuses_another_digest_naming_the_frozen_model():
    frozen = FrozenModels()
    frozen.declare("reference")
    frozen.declare("teacher")
    assert frozen.records == {"reference": None, "teacher": None}  # recorded as None until set up
    frozen.check({"reference": {"reference": "a", "reference_sha256": "0" * 64}}, "ckpt")  # nothing to compare
    frozen.records["teacher"] = {"teacher": "t", "teacher_sha256": "1" * 64}
    frozen.check({"teacher": {"teacher": "t", "teacher_sha256": "1" * 64}}, "ckpt")  # the same teacher
    with pytest.raises(CheckpointError, match=r"checkpoint ckpt was trained against the teacher 'u' \(sha256 "
                                              r"222222222222…\).*resume with the same objective.teacher"):
        frozen.check({"teacher": {"teacher": "u", "teacher_sha256": "2" * 64}}, "ckpt")


def test_preference_and_grpo_trainers_leave_summary_checkpoint_record_and_resume_check_to_the_component():
    from scaletrain.rl.trainer import GRPOTrainer
    from scaletrain.preference.trainer import PreferenceTrainer

    for cls in (PreferenceTrainer, GRPOTrainer):
        assert "write_summary" not in vars(cls), cls  # the base writes summary.json once, frozen records included
        assert "reference_record" not in vars(cls), cls
