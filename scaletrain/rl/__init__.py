"""Reinforcement learning from verifiable rewards: rewards, advantages, and the GRPO step and its variants
around the rollout engine."""
