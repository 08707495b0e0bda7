"""Minimal test setup (the full conftest lives on main): 8 fake CPU devices before jax loads."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
