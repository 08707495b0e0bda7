"""Evaluation of what was trained, as a library: lm-evaluation-harness on our models, data figures, in-loop evaluation.

It sits below ``run`` (which adds :mod:`~scaletrain.eval.callback` to a run's callbacks); the ``scaletrain eval``
command that uses it sits above ``run``: :mod:`scaletrain.eval_command` and :mod:`scaletrain.eval_preference`
(a run's objective and reference, rebuilt as the run built them).

- :mod:`~scaletrain.eval.config`: the recipe's ``eval_harness`` section (no lm-eval, no JAX).

- :mod:`~scaletrain.eval.targets`: load a run folder, checkpoint, HF folder or PEFT adapter.
- :mod:`~scaletrain.eval.data_eval`: loss, perplexity, bits per byte and token accuracy on a data source.
- :mod:`~scaletrain.eval.scorer`: batched, jitted continuation log-likelihoods in shape buckets.
- :mod:`~scaletrain.eval.lm_eval_model`: ``ScaletrainLM``, lm-eval's model class (imports lm-eval).
- :mod:`~scaletrain.eval.harness` + :mod:`~scaletrain.eval.task_loading`: lm-eval's evaluator, its tasks
  and result files on a ``ScaletrainLM``.
- :mod:`~scaletrain.eval.callback`: the in-loop evaluation callback (``eval_harness`` in a recipe).

Nothing here is imported by ``import scaletrain``, and only ``lm_eval_model`` imports lm-eval.
"""
