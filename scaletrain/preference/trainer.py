"""``PreferenceTrainer``: the Trainer with a preference objective and, where it needs one, its reference.

Why a subclass and not a branch in the loop: the loop, the step, checkpoints and evaluation are
the objective-generic ones; what a preference run adds is set up once, when the model is
configured — the reference (``training/frozen.py``: a copy of the starting policy, a model
folder, or LoRA adapters off), or the reference's log-probabilities precomputed and served with
the rows (``preference/precompute.py``). The frozen-model component records the reference in
checkpoints and ``summary.json`` and checks it on resume; this trainer only says which it needs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from flax import nnx

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError, DataError
from scaletrain.objectives.reference import adapters_off
from scaletrain.objectives.logps import row_logps
from scaletrain.models.common.score_head import is_sequence_classifier
from scaletrain.models.task import SEQUENCE_CLASSIFICATION
from scaletrain.objectives.registry import get_objective_type, register_trainer
from scaletrain.preference import precompute
from scaletrain.training.base import batch_sharding
from scaletrain.training.frozen import needs_reference, set_up
from scaletrain.training.lora_state import base_record
from scaletrain.training.state import FrozenModel, TrainState
from scaletrain.training.steps import rank_sharding
from scaletrain.training.trainer import Trainer

logger = logging.getLogger("scaletrain")


class PreferenceTrainer(Trainer):
    """A Trainer for a preference objective (DPO, ORPO, CPO/SimPO, KTO, a reward model's; ``objectives/``).

    ``reference``: for an objective that reads one (DPO, KTO), a model folder or a module;
    None means a frozen copy of the starting policy, or with LoRA/QLoRA the base with its
    adapters off. ``precompute_ref_log_probs``: score every row with the reference once before
    training and keep no reference model.
    """

    def __init__(self, arguments: Any, model: Any = None, *, objective: Any, reference: str | nnx.Module | None = None,
                 precompute_ref_log_probs: bool = False, **kwargs: Any):
        if objective is None:
            raise ConfigError("PreferenceTrainer needs an objective (DPOObjective, ORPOObjective, ...)")
        if not needs_reference(objective) and (reference is not None or precompute_ref_log_probs):
            raise ConfigError(f"objective {objective.name!r} reads no reference model; drop "
                              f"{'reference' if reference is not None else 'precompute_ref_log_probs'}")
        if get_objective_type(objective.name).model_task == SEQUENCE_CLASSIFICATION and model is not None \
                and not is_sequence_classifier(model):
            raise ConfigError(f"objective {objective.name!r} trains a score-head model, got {type(model).__name__}; "
                              "load it with scaletrain.AutoModelForSequenceClassification.from_pretrained(DIR)")
        self.reference_given = reference
        self.precompute_ref_log_probs = precompute_ref_log_probs
        super().__init__(arguments, model=model, objective=objective, **kwargs)

    # ---- configuration ----------------------------------------------------------------
    def configure_model(self) -> Any:
        built = super().configure_model()
        if not needs_reference(self.objective):
            return built
        state: TrainState = built.state
        self.frozen_models.declare("reference")
        setup = self.frozen_models.add(set_up("reference", self.reference_given, built.model, state.graphdef,
                                              state.params, state.frozen, self._mesh))
        source, frozen = setup.source, setup.model
        if self.precompute_ref_log_probs:
            digest = (self.reference_record or {}).get("reference_sha256") or \
                (base_record(built.model, state.frozen) or {}).get("base_sha256", "")
            self._precompute(state, frozen, source, digest)
            source, frozen = "precomputed", None  # the reference is no longer held
        self.objective = dataclasses.replace(self.objective, reference_source=source)
        if frozen is not None:
            state = state.replace(frozen_models={**state.frozen_models, "reference": frozen})
        logger.info("reference: %s", {"model": (self.reference_record or {}).get("reference"),
                                      "adapters_off": "LoRA base (adapters off, no copy)",
                                      "precomputed": "precomputed log-probabilities"}[source])
        return built._replace(state=state)

    def _precompute(self, state: TrainState, frozen: FrozenModel | None, source: str, digest: str) -> None:
        """Score the train (and eval) rows with the reference once; serve them with the values."""
        objective, args = self.objective, self.arguments
        sharding = batch_sharding(args, self._mesh)

        def score(state: TrainState, frozen: FrozenModel | None, batch: dict) -> dict:
            ref = frozen.model if frozen is not None else adapters_off(state.model)
            return {k: row_logps(ref, *rows) for k, rows in objective.reference_inputs(batch).items()}

        scorer = jax.jit(score)

        def place(batch: dict) -> dict:
            return {k: jax.make_array_from_process_local_data(rank_sharding(sharding, np.ndim(v)), np.asarray(v))
                    for k, v in batch.items()}

        def run(source_rows: Any) -> dict[str, np.ndarray]:
            if jax.process_count() > 1 and len(source_rows) % args.total_batch_size:
                raise DataError(f"precompute_ref_log_probs with {jax.process_count()} processes needs a row count "
                                f"that total_batch_size={args.total_batch_size} divides; got {len(source_rows)} rows")
            batches = self.make_iterator(source_rows, shuffle=False, num_epochs=1, drop_remainder=False)
            with jax.set_mesh(self._mesh):
                return precompute.compute(batches, lambda b: scorer(state, frozen, b), place, len(source_rows),
                                          args.total_batch_size // jax.process_count())

        names = objective.precomputed_keys
        for split in ("train", "eval"):
            rows = self._train_source if split == "train" else self._eval_source
            if rows is None:
                continue
            path = precompute.stored_path(args.output_dir, split)
            values = precompute.load_stored(path, len(rows), digest, names)
            if values is None:
                logger.info("precomputing the reference's log-probabilities of %d %s rows", len(rows), split)
                values = run(rows)
                precompute.store(path, values, len(rows), digest)
            else:
                logger.info("reusing the reference's log-probabilities in %s", path)
            wrapped = precompute.with_columns(rows, values)
            if split == "train":
                self._train_source = wrapped
                self.dataloader_train = self.make_iterator(wrapped, shuffle=args.shuffle_train_dataset,
                                                           num_epochs=self.num_epochs, drop_remainder=True)
            else:
                self._eval_source = wrapped

    # ---- checkpoints --------------------------------------------------------------------
    def checkpoint_metadata(self, state: TrainState) -> dict[str, Any]:
        meta = super().checkpoint_metadata(state)
        # the arguments as TrainingArguments (export reads them back): a DPOConfig's options go under "objective"
        meta["arguments"] = {k: v for k, v in meta["arguments"].items() if k in TrainingArguments.model_fields}
        meta["objective"] = {"name": self.objective.name, **dataclasses.asdict(self.objective)}
        return meta

    def starting_state(self, state: TrainState | None = None, model_parameters: Any = None) -> TrainState:
        """The base's, with this trainer's reference kept: a state passed to ``train(state=...)`` carries the
        policy, while the reference was set up when the model was configured."""
        if state is not None:
            state = state.replace(frozen_models=self._model_state.frozen_models)
        return super().starting_state(state, model_parameters)


register_trainer(PreferenceTrainer, "dpo", "orpo", "cpo", "simpo", "kto", "reward")
