"""The FP8 (e4m3) conventions the kernels and their plain-torch twins share (no Triton here, so
the CPU path can import them anywhere)."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Floor on every scale: an all-zero group still gets a finite reciprocal (1e12) and q = 0.
FP8_MIN_SCALE = 1e-12
BLOCK = 128  # Qwen's weight_block_size and activation group size; the only one the kernels take
# The fused-MoE kernel's activation quantizer floors a group's amax (not its scale) at this, so
# an all-zero group does not divide by zero; its values still quantize to 0.
FP8_MIN_AMAX = 1e-10
