"""What every causal decoder family shares: input preparation, the attention and GLU layers, the
layer loop (unrolled or scanned, by layer kind) and the one forward with an optional KV cache."""
