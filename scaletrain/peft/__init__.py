"""Parameter-efficient fine-tuning: LoRA adapters on a model's projections, QLoRA's quantised base
(int8 / NF4), and PEFT adapter folders in and out. Sits in the models layer: it wraps model modules."""
