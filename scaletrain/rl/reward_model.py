"""A reward model as a GRPO reward: ``reward_funcs: [{model: DIR}]`` (TRL accepts a model there).

Why a reward function and not a new path in the step: a learned reward sits beside Python rewards,
weighed by ``reward_weights`` and reported as ``rewards/<name>/mean`` like them, so it is one more entry
of the list the GRPO trainer already scores. It scores as TRL 1.16's ``GRPOTrainer`` scores with a
reward model: each prompt and completion joined as text (a conversation through the reward model's chat
template), tokenized by the reward model's own tokenizer without special tokens, right-padded, and the
score read at the last non-padding token (:mod:`scaletrain.models.common.score_head`). The forward is one
jitted program on the devices the policy trains on (the model's mesh over all of them), rows padded to a
multiple of :data:`LENGTH_BUCKET` tokens so a run compiles it a few times, not once per step.

Its tokenizer must be the policy's (the same vocabulary), else the run is refused in one line.
It is a frozen model like the reference (``training/frozen.py``): loaded when the trainer sets up its
model, its folder and a digest of its weights recorded in every checkpoint under ``reward_funcs[i].model``
(:func:`record_reward_models`), and a resume whose reward model's weights changed is refused in one line
naming that field. Limit: one process (a multi-process run scores each process's rows on the host, which a
global forward does not fit: refused in one line).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.errors import ConfigError

#: rows are padded to a multiple of this many tokens (one compiled forward per multiple)
LENGTH_BUCKET = 32


def reward_model_folder(folder: Any, field: str) -> str:
    """``folder`` checked as a reward model's folder (config.json naming a ``*ForSequenceClassification``, a
    tokenizer); ConfigError naming ``field`` otherwise."""
    from scaletrain.models.hf_config import read_hf_config

    if not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"{field}.model: give a reward model's folder (a path), got {folder!r}")
    path = os.path.expanduser(os.fspath(folder))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{field}.model={path!r}: not a model folder (no config.json); export a reward model "
                          "there (scaletrain export, or save_pretrained)")
    architecture = str((read_hf_config(path).get("architectures") or [""])[0])
    if not architecture.endswith("ForSequenceClassification"):
        raise ConfigError(f"{field}.model={path!r} is a {architecture or 'model'} without a score head; train a "
                          "reward model (objective.type: reward) and give its folder")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{field}.model={path!r} has no tokenizer; save the reward model's tokenizer beside it")
    return path


class ModelReward:
    """A TRL-signature reward function that scores with a reward model's folder (see the module)."""

    def __init__(self, folder: str, field: str = "reward_funcs[0]", policy_tokenizer: Any = None):
        self.folder = reward_model_folder(folder, field)
        self.field = f"{field}.model"  # its name among the run's frozen models (training/frozen.py)
        self.__name__ = os.path.basename(os.path.normpath(self.folder))
        self._loaded: tuple[Any, Any, Any, Any] | None = None
        if policy_tokenizer is not None:
            self.check_tokenizer(policy_tokenizer, field)

    def check_tokenizer(self, policy_tokenizer: Any, field: str) -> None:
        """ConfigError naming ``field`` unless the reward model's vocabulary is the policy's (a check TRL, which
        re-tokenizes the text, leaves to the user: a reward model of another tokenizer family is most often a
        wrong folder)."""
        from transformers import AutoTokenizer

        mine = AutoTokenizer.from_pretrained(self.folder).get_vocab()
        theirs = policy_tokenizer.get_vocab()
        if mine != theirs:
            differ = len(set(mine.items()) ^ set(theirs.items()))
            raise ConfigError(f"{field}.model={self.folder!r}: its tokenizer ({len(mine)} tokens) is not the "
                              f"policy's ({len(theirs)} tokens, {differ} entries differ); use a reward model trained "
                              "from the policy's tokenizer family")

    def loaded(self) -> tuple[Any, Any, Any, Any]:
        """``(model, mesh, tokenizer, jitted score)``, loaded once."""
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    def record(self) -> dict[str, Any]:
        """``{field: folder, field_sha256: digest of its weights}``: what checkpoints hold of it (the reference's
        form, ``training/frozen.py``)."""
        from flax import nnx

        from scaletrain.training.state import params_sha256

        return {self.field: self.folder, f"{self.field}_sha256": params_sha256(nnx.to_pure_dict(nnx.state(
            self.loaded()[0], nnx.Param)))}

    def _load(self) -> tuple[Any, Any, Any, Any]:
        import jax
        from transformers import AutoTokenizer

        from scaletrain.models.factory import place_model
        from scaletrain.models.registry import AutoModelForSequenceClassification

        if jax.process_count() > 1:
            raise ConfigError(f"reward_funcs: the reward model {self.folder} scores in one process only; run on one "
                              "process, or score with a Python reward function")
        model, mesh = place_model(AutoModelForSequenceClassification.from_pretrained(self.folder))
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        score = jax.jit(lambda m, ids, mask: m.sequence_scores(ids, attention_mask=mask))
        return model, mesh, tokenizer, score

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any], tokenizer: Any) -> list[str]:
        """What the reward model reads, as TRL joins prompt and completion."""
        if prompts and isinstance(prompts[0], list):  # conversations: through the reward model's chat template
            return [tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                    for p, c in zip(prompts, completions)]
        return [str(p) + str(c) for p, c in zip(prompts, completions)]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        import jax

        model, mesh, tokenizer, score = self.loaded()
        encoded = tokenizer(self.texts(prompts, completions, tokenizer), padding=True, padding_side="right",
                            add_special_tokens=False, return_tensors="np")
        ids, mask = np.asarray(encoded["input_ids"], np.int32), np.asarray(encoded["attention_mask"], np.int32)
        width = -(-ids.shape[1] // LENGTH_BUCKET) * LENGTH_BUCKET
        pad = ((0, 0), (0, width - ids.shape[1]))
        ids = np.pad(ids, pad, constant_values=tokenizer.pad_token_id)
        mask = np.pad(mask, pad)
        with jax.set_mesh(mesh):
            return [float(x) for x in np.asarray(score(model, ids, mask))]


def record_reward_models(frozen_models: Any, functions: Sequence[Any]) -> None:
    """Add each reward model among ``functions`` (``RewardFunction`` s) to the run's frozen models
    (``training.frozen.FrozenModels``): loaded now, recorded by digest, checked on resume."""
    from scaletrain.training.frozen import FrozenSetup

    for function in functions:
        fn = getattr(function, "fn", function)
        if isinstance(fn, ModelReward):
            frozen_models.add(FrozenSetup(fn.field, "model", None, fn.record()))
