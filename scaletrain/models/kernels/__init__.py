"""The computations the model layers call: attention (einsum, cuDNN, the Pallas flash kernel and its
sharded, context-parallel wrapper), FP8 matmuls and the CPU-shaped dots."""
