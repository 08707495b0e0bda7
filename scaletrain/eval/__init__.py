"""Evaluation of what was trained: ``scaletrain eval``, lm-evaluation-harness on our models, in-loop evaluation.

- :mod:`~scaletrain.eval.targets`: load a run folder, checkpoint, HF folder or PEFT adapter.
- :mod:`~scaletrain.eval.data_eval`: loss, perplexity, bits per byte and token accuracy on a data source.
- :mod:`~scaletrain.eval.scorer`: batched, jitted continuation log-likelihoods in shape buckets.
- :mod:`~scaletrain.eval.lm_eval_model`: ``ScaletrainLM``, lm-eval's model class (imports lm-eval).
- :mod:`~scaletrain.eval.harness`: lm-eval's evaluator and result files on a ``ScaletrainLM``.
- :mod:`~scaletrain.eval.callback`: the in-loop evaluation callback (``eval_harness`` in a recipe).

Nothing here is imported by ``import scaletrain``, and only ``lm_eval_model`` imports lm-eval.
"""
