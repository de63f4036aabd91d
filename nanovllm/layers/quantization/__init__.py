"""Quantized weight schemes. `fp8_ops`: FP8 arithmetic (block-wise and per-tensor) in plain torch,
and the dispatchers that run it on CUDA through the kernels of nanovllm/kernels/fp8_gemm.py."""
