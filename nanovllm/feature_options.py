"""Each feature's LLM options, one sub-config per feature, each checking its own fields (no I/O):
tensor / data parallelism, quantization, the scheduling policy, prefill graphs, LoRA adapters.
`FEATURE_OPTIONS` maps LLM's flat keywords onto them; config.py's Config holds one of each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from nanovllm.limits import clip_repr
from nanovllm.values import is_integer, is_real

# vLLM's names. None / "mp": the engine's own processes (tensor-parallel workers, data-parallel
# replicas on this node); "ray": data-parallel replicas as Ray actors (launch/ray_replicas.py);
# "external_launcher": torchrun started every tensor-parallel rank (launch/torchrun.py).
EXECUTOR_BACKENDS = (None, "mp", "ray", "external_launcher")
# LLM(kv_cache_dtype=...) (vLLM's names) -> the cache's element type; None: the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def checked(name: str, value, kind, what: str, ok: Callable = lambda v: True):
    """`value` as Python's own `kind` (numpy's numbers count), or a ValueError naming the field
    when it is not a `kind` or fails `ok`."""
    if kind is int:
        good = is_integer(value)
    elif kind is float:
        good = is_real(value)
    else:
        good = isinstance(value, kind)
    if good and kind in (int, float):
        value = kind(value)
    if not good or not ok(value):
        raise ValueError(f"{name}={clip_repr(value)}: must be {what}")
    return value


def _at_least(n):
    return lambda v: v >= n


@dataclass
class ParallelConfig:
    """Tensor and data parallelism (parallel/, launch/). `custom_all_reduce`: on CUDA, fuse
    all-reduces up to 8 MiB with the RMSNorm after them (parallel/fused_all_reduce.py); False
    keeps every all-reduce on NCCL."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    custom_all_reduce: bool = True

    def __post_init__(self):
        self.tensor_parallel_size = checked("tensor_parallel_size", self.tensor_parallel_size, int,
                                            "an integer >= 1", _at_least(1))
        self.data_parallel_size = checked("data_parallel_size", self.data_parallel_size, int, "an integer >= 1",
                                          _at_least(1))
        checked("custom_all_reduce", self.custom_all_reduce, bool, "True or False")
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={clip_repr(backend)}: must be one of {EXECUTOR_BACKENDS}")
        if backend == "external_launcher" and self.data_parallel_size != 1:
            raise ValueError("distributed_executor_backend='external_launcher' runs one tensor-parallel engine "
                             "over torchrun's ranks; data_parallel_size must be 1 (launch one torchrun job per "
                             "replica, or use the 'mp' / 'ray' backends for data parallelism)")


@dataclass
class QuantizationConfig:
    """Quantized weights and KV cache (features/quantization/). `method`: LLM(quantization=...),
    None to follow the checkpoint's quantization_config."""

    method: str | None = field(default=None, metadata={"option": "quantization"})
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self):
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={clip_repr(self.kv_cache_dtype)} is not supported; use one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        checked("calculate_kv_scales", self.calculate_kv_scales, bool, "True or False")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True calibrates the scales of an FP8 KV cache: it needs "
                             "kv_cache_dtype='fp8'")
        if self.method is not None and not isinstance(self.method, str):
            raise ValueError(f"quantization={clip_repr(self.method)}: must be None or a method's name")


@dataclass
class SchedulingConfig:
    """The scheduling policy (features/mixed_steps.py): with `mixed_steps`, decode rows ride
    along with prompt chunks in one step, so running requests keep getting tokens while a long
    prompt prefills (the server's policy, for latency)."""

    mixed_steps: bool = False

    def __post_init__(self):
        checked("mixed_steps", self.mixed_steps, bool, "True or False")


@dataclass
class PrefillGraphConfig:
    """Piecewise prefill CUDA graphs (features/prefill_graphs.py): prefill-shaped steps of up to
    `max_tokens` tokens replay them, attention eager between the pieces; 0 runs all eagerly."""

    max_tokens: int = field(default=2048, metadata={"option": "max_prefill_graph_tokens"})

    def __post_init__(self):
        self.max_tokens = checked("max_prefill_graph_tokens", self.max_tokens, int,
                                  "an integer >= 0 (0: no prefill graphs)", _at_least(0))


@dataclass
class LoraConfig:
    """LoRA adapters (features/lora/): `enable_lora` lets requests name one (LoRARequest);
    `max_loras` adapters sit in the model's slots at once (a request whose adapter finds no free
    slot waits), each of rank at most `max_lora_rank`; `max_cpu_loras` loaded adapters are kept
    in host memory (default: max_loras)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        checked("enable_lora", self.enable_lora, bool, "True or False")
        self.max_loras = checked("max_loras", self.max_loras, int, "an integer >= 1", _at_least(1))
        self.max_lora_rank = checked("max_lora_rank", self.max_lora_rank, int, "an integer >= 1", _at_least(1))
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        self.max_cpu_loras = checked("max_cpu_loras", self.max_cpu_loras, int,
                                     f"None or an integer >= max_loras={self.max_loras}", _at_least(self.max_loras))


SUB_CONFIGS = {"parallel": ParallelConfig, "quantization": QuantizationConfig, "scheduling": SchedulingConfig,
               "prefill_graphs": PrefillGraphConfig, "lora": LoraConfig}
# LLM keyword -> (sub-config, field) of the features' options: the field's name, unless its
# metadata names another ("option"). Every other keyword is a core field.
FEATURE_OPTIONS = {f.metadata.get("option", f.name): (sub, f.name)
                   for sub, cls in SUB_CONFIGS.items() for f in dataclasses.fields(cls)}
