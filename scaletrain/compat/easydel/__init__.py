"""EasyDeL compatibility: code written against EasyDeL runs with the import line changed.

- :mod:`.ray_trainer`: the ``RayDistributedTrainer`` façade (models by
  ``scaling_index``, ``train()``'s priority order, :meth:`launch` on Ray through
  :mod:`.train_job`);
- :mod:`.ray_config`: ``RayDistributedConfig``, its defaults and resolution rules;
  :mod:`.codec` and :mod:`.config_format`: its saved JSON (ours, exact; EasyDeL's, read);
- :mod:`.loading`: ``bucket_path`` checkpoints and Hugging Face folders;
- :mod:`.argument_names`: EasyDeL's and Hugging Face's ``TrainingArguments`` names and
  their translation (at the bottom layer: ``TrainingArguments`` applies it before
  validating, so its own fields and validators know only our names).

Names are imported lazily: ``import scaletrain.compat.easydel`` imports neither Ray nor JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RayDistributedTrainer": "scaletrain.compat.easydel.ray_trainer",
    "RayDistributedConfig": "scaletrain.compat.easydel.ray_config",
    "TrainerSetupError": "scaletrain.compat.easydel.ray_config",
    "TrainJob": "scaletrain.compat.easydel.train_job",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.compat.easydel', _EXPORTS, globals())
