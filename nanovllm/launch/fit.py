"""Whether an engine of several processes (tensor_parallel_size or data_parallel_size > 1) fits
the model and this node, checked by Config.resolve (through wiring.check_processes) before any
process starts."""

from __future__ import annotations

import torch

from nanovllm.model import registry


def check_processes(config, hf_config) -> None:
    """tensor_parallel_size must divide the sizes the model splits; the engine's own processes
    must fit on this node's GPUs (Ray places replicas on the cluster's GPUs, and torchrun's
    ranks may span nodes: launch/torchrun.py checks those). A ValueError naming the options."""
    p = config.parallel
    tp, dp = p.tensor_parallel_size, p.data_parallel_size
    sizes = registry.decoder_options(hf_config).tensor_parallel_sizes()
    if any(n % tp for n in sizes.values()):
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                         + ", ".join(f"{what} ({n})" for what, n in sizes.items()))
    if config.device != "cuda" or p.distributed_executor_backend not in (None, "mp"):
        return
    if tp * dp > torch.cuda.device_count():
        what = f"tensor_parallel_size={tp}" if dp == 1 else \
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {tp * dp} GPUs"
        raise ValueError(f"{what} but only {torch.cuda.device_count()} GPU(s) are visible")
