"""Whether an engine of several processes (tensor_parallel_size or data_parallel_size > 1) fits
the model and this node, checked by Config.resolve (through wiring.check_processes) before any
process starts."""

from __future__ import annotations

import torch

from nanovllm.model import registry


def tensor_parallel_sizes(opts) -> dict[str, int]:
    """The sizes of a model's DecoderOptions that tensor parallelism splits (each must be a multiple
    of the TP size), named."""
    sizes = {"attention heads": opts.num_heads, "key/value heads": opts.num_kv_heads}
    if len(opts.moe_layers) < opts.num_layers:
        sizes["intermediate_size"] = opts.intermediate_size
    if opts.moe_layers:
        sizes["moe_intermediate_size"] = opts.moe.intermediate_size
    return sizes


def check_processes(config, hf_config) -> None:
    """tensor_parallel_size must divide the sizes the model splits; the engine's own processes
    must fit on this node's GPUs (Ray places replicas on the cluster's GPUs, and torchrun's
    ranks may span nodes: launch/torchrun.py checks those). A ValueError naming the options."""
    p = config.parallel
    tp, dp = p.tensor_parallel_size, p.data_parallel_size
    sizes = tensor_parallel_sizes(registry.decoder_options(hf_config))
    if any(n % tp for n in sizes.values()):
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                         + ", ".join(f"{what} ({n})" for what, n in sizes.items()))
    if config.device != "cuda" or p.distributed_executor_backend not in (None, "mp"):
        return
    if tp * dp > torch.cuda.device_count():
        what = f"tensor_parallel_size={tp}" if dp == 1 else \
            f"data_parallel_size={dp} x tensor_parallel_size={tp} = {tp * dp} GPUs"
        raise ValueError(f"{what} but only {torch.cuda.device_count()} GPU(s) are visible")
