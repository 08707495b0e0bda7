"""Preference training (DPO, IPO, ORPO, CPO/SimPO, KTO): the home of the family, beside ``scaletrain.rl``.

``trainer`` (``PreferenceTrainer``: the Trainer with a preference objective and, where it reads one, its
reference, set up by ``training/frozen.py``), ``precompute`` (``precompute_ref_log_probs``: the reference's
log-probabilities stored once) and ``api`` (``DPOConfig``/``DPOTrainer`` and ORPO's, CPO's, KTO's, under TRL's
and EasyDeL's names). The objectives themselves (what a step optimises) live in ``scaletrain.objectives``.
"""
