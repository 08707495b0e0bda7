"""Reinforcement learning from verifiable rewards: rewards, group advantages, and the GRPO step around the rollout engine."""
