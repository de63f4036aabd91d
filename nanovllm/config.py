"""Engine configuration: `Config.from_kwargs(model, **kwargs)` checks every `LLM(...)` keyword with
no I/O (core fields flat, one sub-config per feature: feature_options.py); `config.resolve(...)` then
reads the checkpoint and the machine and fills the fields the engine reads (`hf_config`, `kv_dtype`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanovllm.model import registry
from nanovllm.model.checkpoint import check_model_fits, load_hf_config, resolve_model_path
from nanovllm.sampling_params import is_integer
from nanovllm.feature_options import (FEATURE_OPTIONS, KV_CACHE_DTYPES, SUB_CONFIGS, LoraConfig,  # noqa: F401
                                      ParallelConfig, PrefillGraphConfig, QuantizationConfig, SchedulingConfig,
                                      _at_least, check_options, option)

if TYPE_CHECKING:
    from nanovllm.core.hooks import ModelFeatures

logger = logging.getLogger(__name__)
CONFIG_CHECKS = None  # filled by nanovllm.wiring: loads config_checks.py (what a plain engine never runs)

ATTENTION_BACKENDS = ("flash_attn", "triton", "torch")
TOKENIZER_MODES = ("auto", "slow")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_PATH = (str, os.PathLike, type(None))


@dataclass
class Config:
    """Everything `LLM(model, **kwargs)` accepts (docs/api.md), each checked by its option() rule;
    `attention_backend` (None = automatic) forces one of ATTENTION_BACKENDS, for tests."""

    model: str
    max_num_seqs: int = option(512, "an integer >= 1", _at_least(1))
    max_num_batched_tokens: int = option(16384, "an integer >= 1", _at_least(1))
    max_model_len: int = option(4096, "an integer >= 1", _at_least(1))
    gpu_memory_utilization: float = option(0.9, "a number in (0, 1]", lambda u: 0.0 < u <= 1.0)
    kvcache_block_size: int = option(256, "a power of two >= 16", lambda b: b >= 16 and not b & (b - 1))
    num_kvcache_blocks: int = option(-1, "-1 (automatic) or an integer >= 1", lambda n: n == -1 or n >= 1)
    enforce_eager: bool = option(False, "True or False")
    enable_prefix_caching: bool = option(True, "True or False")
    device: str | None = option(None, "None, 'cpu' or 'cuda'", lambda d: d is None or str(d) in ("cpu", "cuda"))
    dtype: str | torch.dtype | None = None
    load_format: str = option("auto", f"one of {LOAD_FORMATS}", lambda f: f in LOAD_FORMATS)
    seed: int = option(0, "an integer")
    skip_tokenizer_init: bool = option(False, "True or False")
    attention_backend: str | None = option(None, f"None or one of {ATTENTION_BACKENDS}",
                                           lambda b: b is None or b in ATTENTION_BACKENDS)
    # vLLM's options of the same names from here on (docs/api.md).
    tokenizer: str | None = option(None, "None or a string", kind=_PATH)
    tokenizer_mode: str = option("auto", f"one of {TOKENIZER_MODES}", lambda m: m in TOKENIZER_MODES)
    trust_remote_code: bool = option(False, "True or False")
    revision: str | None = option(None, "None or a string", kind=_PATH)
    max_logprobs: int = option(20, "-1 (no limit) or an integer >= 0", _at_least(-1))
    generation_config: str = option("auto", "'auto' (the model's), 'vllm' (none) or a folder holding a "
                                    "generation_config.json", lambda g: g in ("auto", "vllm") or os.path.isdir(g),
                                    kind=(str, os.PathLike))
    download_dir: str | None = option(None, "None or a string", kind=_PATH)
    hf_overrides: dict | None = option(None, "None or a dict", kind=(dict, type(None)))
    disable_log_stats: bool = option(True, "True or False")
    # e.g. {"method": "ngram", "num_speculative_tokens": 4}: checked by resolve() (features/speculative/options.py)
    speculative_config: dict | None = option(None, "None or a dict", kind=(dict, type(None)))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    prefill_graphs: PrefillGraphConfig = field(default_factory=PrefillGraphConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Filled by resolve(): the checkpoint's config, the KV cache's element type, and what the features
    # answer (core/hooks.py's ModelFeatures).
    hf_config: object = field(init=False, repr=False, default=None)
    quant: object = field(init=False, repr=False, default=None)
    kv_dtype: torch.dtype | None = field(init=False, default=None)
    kv_calibrator: object = field(init=False, repr=False, default=None)
    sparse_mlp: object = field(init=False, repr=False, default=None)
    speculation: object = field(init=False, repr=False, default=None)
    adapters: object = field(init=False, repr=False, default=None)  # a factory of each rank's Adapters

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "Config":
        """Config from LLM's flat keywords (each feature's go to its sub-config; vLLM's and unknown
        ones: config_checks.known_keywords)."""
        known = set(FEATURE_OPTIONS) | {f.name for f in dataclasses.fields(cls) if f.init} - {"model", *SUB_CONFIGS}
        if kwargs.keys() - known:
            kwargs = CONFIG_CHECKS().known_keywords(kwargs, known)
        subs: dict[str, dict] = {name: {} for name in SUB_CONFIGS}
        for key in set(kwargs) & set(FEATURE_OPTIONS):
            sub, name = FEATURE_OPTIONS[key]
            subs[sub][name] = kwargs.pop(key)
        return cls(model, **kwargs, **{name: SUB_CONFIGS[name](**v) for name, v in subs.items()})

    def __post_init__(self):
        if callable(self.hf_overrides):
            raise NotImplementedError("hf_overrides as a function is not supported: pass a dict of config.json entries")
        check_options(self)
        for name, cls in SUB_CONFIGS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"Config.{name} must be a {cls.__name__}")
        if self.attention_backend is not None:
            CONFIG_CHECKS().check_backend(self)

    def resolve(self, features: ModelFeatures | None = None) -> "Config":
        """Read the checkpoint and the machine, once: the device, the model and tokenizer folders
        (a Hub download when online), config.json, the dtypes, what the model needs from the
        features the front wires in (`features`) and whether it fits. Returns self."""
        if self.hf_config is not None:
            return self
        self.device = self._resolve_device(self.device)
        if self.attention_backend is not None:
            CONFIG_CHECKS().check_backend_device(self)
        self.model = resolve_model_path(self.model, self.revision, cache_dir=self.download_dir)
        if self.tokenizer is not None and not self.skip_tokenizer_init:
            self.tokenizer = resolve_model_path(self.tokenizer, self.revision, "tokenizer", self.download_dir)
        hf = load_hf_config(self.model, self.hf_overrides)
        self.dtype = self._resolve_dtype(self.dtype, hf)
        self._resolve_features(hf, features)
        self.kv_dtype = KV_CACHE_DTYPES[self.quantization.kv_cache_dtype] or self.dtype
        if self.device == "cuda":
            CONFIG_CHECKS().check_fp8_device(self)
        if self.max_model_len > hf.max_position_embeddings:  # RoPE would silently extrapolate
            logger.warning("max_model_len=%d lowered to the model's max_position_embeddings=%d",
                           self.max_model_len, hf.max_position_embeddings)
            self.max_model_len = hf.max_position_embeddings
        if self.parallel.distributed_executor_backend != "ray":  # a Ray front's replicas check on their own
            check_model_fits(hf, self.dtype, self.quant is not None, self.device,
                             self.parallel.tensor_parallel_size, self.parallel.data_parallel_size)
        self.hf_config = hf
        return self

    def _resolve_features(self, hf, features: ModelFeatures | None) -> None:
        """The fields the features answer; without them (a bare LLMEngine) a model or option that
        needs one is a ValueError naming it."""
        p, opts = self.parallel, registry.decoder_options(hf)
        checkpoint_quant = getattr(hf, "quantization_config", None)
        if features is None:
            return CONFIG_CHECKS().refuse_bare_engine(self, checkpoint_quant, opts)
        self.quant = features.quantization_scheme(checkpoint_quant, self.quantization.method)
        if self.quant is not None:
            self.quant.check_model(hf, p.tensor_parallel_size, self.load_format)
        self.kv_calibrator = features.kv_scale_calibrator(self.quantization.calculate_kv_scales)
        self.sparse_mlp = features.sparse_mlp(opts)
        self.speculation = features.speculation(self.speculative_config, hf, p.tensor_parallel_size)
        self.adapters = features.adapters(self.lora, hf)
        if self.lora.enable_lora and (self.speculative_config or p.data_parallel_size > 1):
            raise ValueError("enable_lora=True does not go with speculative_config or data_parallel_size > 1 yet")
        features.check_processes(self, hf)

    @staticmethod
    def _resolve_device(device) -> str:
        if device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        device = str(device)
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        return device

    def _resolve_dtype(self, dtype, hf) -> torch.dtype:
        if (dtype is None or dtype == "auto") and self.device == "cpu":
            return torch.float32
        return CONFIG_CHECKS().resolve_dtype(dtype, hf)


def wants_data_parallel(kwargs: dict) -> bool:
    """Whether LLM(**kwargs) needs the data-parallel front: more than one replica, or the Ray
    backend (whose single replica may run on another node). Invalid values are left to Config."""
    dp = kwargs.get("data_parallel_size", 1)
    return kwargs.get("distributed_executor_backend") == "ray" or (is_integer(dp) and dp > 1)
