"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl=True`
may start while the kernel before it still runs, once that one calls `gdc_launch_dependents`;
it then calls `gdc_wait` before reading what that kernel writes. The batch-1 INT4 GEMV
(kernels/w4a16_gemv.py) loads weights, which no kernel writes, before its wait; the kernels that
make its input (RMSNorm, SiLU * mul, decode attention) let it start early. Without a dependent
launched so, `gdc_launch_dependents` does nothing."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may use PDL (CUDA, compute capability 9.0+, not interpreted)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())
