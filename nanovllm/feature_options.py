"""Each feature's LLM options (docs/api.md), one sub-config per feature, checked with no I/O: their
fields, and Config's, are `option()`s that carry their rule."""

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
    """`value` as Python's own `kind` (numpy's numbers count), or a ValueError naming the field."""
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


def option(default, what: str, ok: Callable = lambda v: True, kind=None, name: str | None = None):
    """A field `check_options` checks: a `kind` (the default's type unless given; any for a
    None default) for which `ok` holds, `what` saying so. `name`: LLM's keyword, if not the field's."""
    kind = kind or (object if default is None else type(default))
    return field(default=default, metadata={"check": (kind, what, ok)} | ({"option": name} if name else {}))


def check_options(config) -> None:
    for f in dataclasses.fields(config):
        if "check" in f.metadata:
            value = checked(f.metadata.get("option", f.name), getattr(config, f.name), *f.metadata["check"])
            setattr(config, f.name, value)


@dataclass
class ParallelConfig:
    """Tensor and data parallelism (parallel/, launch/; `custom_all_reduce`: parallel/fused_all_reduce.py)."""

    tensor_parallel_size: int = option(1, "an integer >= 1", _at_least(1))
    data_parallel_size: int = option(1, "an integer >= 1", _at_least(1))
    distributed_executor_backend: str | None = option(None, f"one of {EXECUTOR_BACKENDS}",
                                                      lambda b: b in EXECUTOR_BACKENDS)
    custom_all_reduce: bool = option(True, "True or False")

    def __post_init__(self):
        check_options(self)
        if self.distributed_executor_backend == "external_launcher" and self.data_parallel_size != 1:
            raise ValueError("distributed_executor_backend='external_launcher' runs one tensor-parallel engine "
                             "over torchrun's ranks; data_parallel_size must be 1 (launch one torchrun job per "
                             "replica, or use the 'mp' / 'ray' backends for data parallelism)")


@dataclass
class QuantizationConfig:
    """Quantized weights and KV cache (features/quantization/); `method` None follows the checkpoint."""

    method: str | None = option(None, "None or a method's name", kind=(str, type(None)), name="quantization")
    kv_cache_dtype: str = option("auto", f"one of {', '.join(map(repr, KV_CACHE_DTYPES))}",
                                 lambda d: d in KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(False, "True or False")

    def __post_init__(self):
        check_options(self)
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True calibrates the scales of an FP8 KV cache: it needs "
                             "kv_cache_dtype='fp8'")


@dataclass
class SchedulingConfig:
    """The scheduling policy: `mixed_steps` (features/mixed_steps.py), decode rows beside prompt chunks."""

    mixed_steps: bool = option(False, "True or False")
    __post_init__ = check_options


@dataclass
class PrefillGraphConfig:
    """Piecewise prefill CUDA graphs (features/prefill_graphs.py) for steps of up to `max_tokens` tokens."""

    max_tokens: int = option(2048, "an integer >= 0 (0: no prefill graphs)", _at_least(0),
                             name="max_prefill_graph_tokens")
    __post_init__ = check_options


@dataclass
class LoraConfig:
    """LoRA adapters (features/lora/); `max_cpu_loras` defaults to max_loras."""

    enable_lora: bool = option(False, "True or False")
    max_loras: int = option(1, "an integer >= 1", _at_least(1))
    max_lora_rank: int = option(16, "an integer >= 1", _at_least(1))
    max_cpu_loras: int | None = None

    def __post_init__(self):
        check_options(self)
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
