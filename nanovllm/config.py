"""Engine configuration: every `LLM(...)` keyword, validated before any work starts."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from nanovllm.model import registry
from nanovllm.model.registry import SUPPORTED_ARCHITECTURES  # noqa: F401  (re-exported)
from nanovllm.limits import clip_repr
from nanovllm.sampling_params import is_integer, is_real

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("flash_attn", "triton", "torch")
# vLLM's names. None / "mp": the engine's own processes (tensor-parallel workers, data-parallel
# replicas on this node); "ray": data-parallel replicas as Ray actors (nanovllm/distributed/
# ray_replicas.py); "external_launcher": torchrun started every tensor-parallel rank
# (nanovllm/launch/torchrun.py).
EXECUTOR_BACKENDS = (None, "mp", "ray", "external_launcher")
TOKENIZER_MODES = ("auto", "slow")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_model_path(model: str, revision: str | None = None, what: str = "model") -> str:
    """A local checkpoint folder, or a Hugging Face Hub id downloaded (at `revision`, a branch,
    tag or commit) when the machine is online."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or a Hub id, got {type(model).__name__}")
    model = os.path.expanduser(os.fspath(model))
    if os.path.isdir(model):
        return model
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model, revision=revision,
                                     allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
        except Exception as e:  # offline, unknown repo, no huggingface_hub...
            raise FileNotFoundError(
                f"{what} folder {model!r} does not exist and could not be fetched from the Hugging Face Hub "
                f"({type(e).__name__}: {e}). Pass the path of a local folder.") from None
    raise FileNotFoundError(f"{what} folder {model!r} does not exist")


# The BLAS library the decode graphs' GEMMs are captured with. cuBLASLt's heuristics pick faster
# kernels than cuBLAS's for most decode GEMM shapes (benchmarks/kernels/bench_gemm.py --blas;
# figures in BENCHMARKS.md). A graph keeps the kernels it was captured with, so the process-wide
# setting is switched for the capture only. Override with NANOVLLM_DECODE_BLAS=cublas to compare.
DECODE_BLAS_LIBRARIES = ("cublas", "cublaslt")


def decode_blas_library() -> str:
    """NANOVLLM_DECODE_BLAS (default cublaslt), checked."""
    name = os.environ.get("NANOVLLM_DECODE_BLAS", "cublaslt")
    if name not in DECODE_BLAS_LIBRARIES:
        raise ValueError(f"NANOVLLM_DECODE_BLAS must be one of {DECODE_BLAS_LIBRARIES}, got {name!r}")
    return name


def fuse_kv_store_switch() -> bool:
    """NANOVLLM_FUSE_KV_STORE, checked: "1" (default) stores each layer's K/V inside the q/k-norm
    + RoPE kernel on CUDA (one launch per layer less), "0" in the store kernel of its own (to
    compare; BENCHMARKS.md, "fused K/V store")."""
    value = os.environ.get("NANOVLLM_FUSE_KV_STORE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"NANOVLLM_FUSE_KV_STORE must be 0 or 1, got {value!r}")
    return value == "1"


def _field_is(name: str, value, kind, what: str):
    """`value` checked to be a `kind` (numpy's numbers count), as Python's own type."""
    if kind is int:
        ok = is_integer(value)
    elif kind is float:
        ok = is_real(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(f"{name}={clip_repr(value)}: must be {what}")
    return kind(value) if kind in (int, float) else value


@dataclass
class Config:
    """Everything `LLM(model, **kwargs)` accepts. See README for the meaning of each field.

    `attention_backend` (None = automatic) forces one of `ATTENTION_BACKENDS`, for tests.
    `custom_all_reduce` (tensor parallelism on CUDA) fuses all-reduces up to 8 MiB with the
    RMSNorm after them in one symmetric-memory kernel (distributed/fused_all_reduce.py);
    False keeps every all-reduce on NCCL.
    """

    model: str
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    device: str | None = None
    dtype: str | torch.dtype | None = None
    load_format: str = "auto"
    seed: int = 0
    skip_tokenizer_init: bool = False
    attention_backend: str | None = None
    custom_all_reduce: bool = True
    # vLLM's options of the same names: another tokenizer folder (or Hub id); "auto" | "slow";
    # passed to transformers when loading the tokenizer; the Hub revision of model and tokenizer;
    # the most logprobs a request may ask for (-1: the whole vocabulary); where the default
    # SamplingParams come from ("auto": the model's generation_config.json, "vllm": none, or
    # a folder holding a generation_config.json).
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    quantization: str | None = None
    # Decode rows ride along with prompt chunks in one prefill-shaped step (Scheduler), so running
    # requests keep getting tokens while a long prompt prefills: the server's policy, for latency.
    mixed_steps: bool = False
    # Prefill-shaped steps (prompt chunks, mixed steps) of up to this many tokens replay
    # piecewise CUDA graphs, attention eager between the pieces (engine/prefill_graphs.py);
    # larger ones run eagerly. 0: all eagerly. On CUDA without enforce_eager only.
    max_prefill_graph_tokens: int = 2048
    hf_config: object = field(init=False, repr=False, default=None)
    # The linear layers' weight scheme (layers/quantization: an Fp8Config or None), from
    # `quantization` and the checkpoint's quantization_config; the KV cache's element type.
    quant: object = field(init=False, repr=False, default=None)
    kv_dtype: torch.dtype | None = field(init=False, default=None)
    # The decode graphs' BLAS library, from NANOVLLM_DECODE_BLAS when the config is made (TP
    # workers get this copy, whatever their environment).
    decode_blas: str = field(init=False, default="cublaslt")
    # Whether the K/V cache store is fused into the q/k-norm + RoPE kernel, from
    # NANOVLLM_FUSE_KV_STORE when the config is made (TP workers get this copy too).
    fuse_kv_store: bool = field(init=False, default=True)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "Config":
        """Like `Config(model, **kwargs)` but names every unknown keyword in one TypeError."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s): {', '.join(unknown)}. "
                            f"Known: {', '.join(sorted(known - {'model'}))}")
        return cls(model, **kwargs)

    def __post_init__(self):
        for name, kind, what in (
                ("tensor_parallel_size", int, "an integer >= 1"), ("data_parallel_size", int, "an integer >= 1"),
                ("max_num_seqs", int, "an integer >= 1"),
                ("max_num_batched_tokens", int, "an integer >= 1"), ("max_model_len", int, "an integer >= 1"),
                ("kvcache_block_size", int, "a power of two >= 16"),
                ("num_kvcache_blocks", int, "-1 (automatic) or an integer >= 1"),
                ("gpu_memory_utilization", float, "a number in (0, 1]"), ("seed", int, "an integer"),
                ("max_prefill_graph_tokens", int, "an integer >= 0")):
            setattr(self, name, _field_is(name, getattr(self, name), kind, what))
        for name in ("enforce_eager", "enable_prefix_caching", "skip_tokenizer_init", "custom_all_reduce",
                     "trust_remote_code", "calculate_kv_scales", "mixed_steps"):
            _field_is(name, getattr(self, name), bool, "True or False")
        self._check_tokenizer_options()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        self._check_executor_options()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 1")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(f"max_prefill_graph_tokens={self.max_prefill_graph_tokens}: must be >= 0 (0: no prefill graphs)")
        bs = self.kvcache_block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size={bs}: must be a power of two >= 16")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks={self.num_kvcache_blocks}: must be -1 (automatic) or >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format={clip_repr(self.load_format)}: must be 'auto', 'safetensors' or 'dummy'")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: must be None or one of {ATTENTION_BACKENDS}")
        self.device = self._resolve_device(self.device)
        self.decode_blas = decode_blas_library()  # a bad NANOVLLM_DECODE_BLAS fails here, before any work
        self.fuse_kv_store = fuse_kv_store_switch()
        if self.attention_backend in ("triton", "flash_attn") and self.device != "cuda":
            raise ValueError(f"attention_backend={self.attention_backend!r} needs CUDA; this engine runs on {self.device}")
        if self.attention_backend == "flash_attn" and bs % 256:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of 256, got {bs}")
        if self.attention_backend == "flash_attn":
            from nanovllm.model.attention import flash_attn_available

            if not flash_attn_available():
                raise ValueError("attention_backend='flash_attn' but the flash_attn package cannot be imported")
        from nanovllm.model.attention import kv_cache_torch_dtype
        from nanovllm.features.quantization import resolve_quantization

        kv_cache_torch_dtype(self.kv_cache_dtype, torch.float32)  # a bad name fails here, before the model loads
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True calibrates the scales of an FP8 KV cache: it needs "
                             "kv_cache_dtype='fp8'")
        self.model = resolve_model_path(self.model, self.revision)
        if self.tokenizer is not None and not self.skip_tokenizer_init:
            self.tokenizer = resolve_model_path(self.tokenizer, self.revision, what="tokenizer")
        self.hf_config = load_hf_config(self.model)
        self.dtype = self._resolve_dtype(self.dtype)
        self.quant = resolve_quantization(getattr(self.hf_config, "quantization_config", None), self.quantization)
        check_model_fits(self)
        self.kv_dtype = kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)
        if self.device == "cuda" and (self.quant is not None or self.kv_dtype == torch.float8_e4m3fn):
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                raise ValueError(f"FP8 weights or KV cache need a GPU of compute capability 8.9 or later "
                                 f"(Ada, Hopper); this one is {major}.{minor}")
        # A context longer than the model's positions would silently extrapolate RoPE.
        if self.max_model_len > self.hf_config.max_position_embeddings:
            logger.warning("max_model_len=%d lowered to the model's max_position_embeddings=%d",
                           self.max_model_len, self.hf_config.max_position_embeddings)
            self.max_model_len = self.hf_config.max_position_embeddings
        tp = self.tensor_parallel_size
        sizes = registry.tensor_parallel_sizes(self.hf_config)
        if any(n % tp for n in sizes.values()):
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                             + ", ".join(f"{what} ({n})" for what, n in sizes.items()))
        self._check_gpu_count()

    def _check_gpu_count(self) -> None:
        """The engine's own processes must fit on this node's GPUs; Ray places replicas on the
        cluster's GPUs, and torchrun's ranks may span nodes (external_launcher.py checks those)."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        if self.device != "cuda" or self.distributed_executor_backend not in (None, "mp"):
            return
        if tp * dp > torch.cuda.device_count():
            what = f"tensor_parallel_size={tp}" if dp == 1 else \
                f"data_parallel_size={dp} x tensor_parallel_size={tp} = {tp * dp} GPUs"
            raise ValueError(f"{what} but only {torch.cuda.device_count()} GPU(s) are visible")

    def _check_executor_options(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={clip_repr(backend)}: must be one of {EXECUTOR_BACKENDS}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size}: must be >= 1")
        if backend == "external_launcher" and self.data_parallel_size != 1:
            raise ValueError("distributed_executor_backend='external_launcher' runs one tensor-parallel engine "
                             "over torchrun's ranks; data_parallel_size must be 1 (launch one torchrun job per "
                             "replica, or use the 'mp' / 'ray' backends for data parallelism)")

    def _check_tokenizer_options(self) -> None:
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode={clip_repr(self.tokenizer_mode)}: must be one of {TOKENIZER_MODES}")
        for name in ("tokenizer", "revision"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name}={clip_repr(value)}: must be None or a string")
        gc = self.generation_config
        if not isinstance(gc, (str, os.PathLike)) or (gc not in ("auto", "vllm") and not os.path.isdir(gc)):
            raise ValueError(f"generation_config={clip_repr(gc)}: must be 'auto' (the model's), 'vllm' (none) "
                             "or a folder holding a generation_config.json")
        self.max_logprobs = _field_is("max_logprobs", self.max_logprobs, int, "-1 or an integer >= 0")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs}: must be -1 (no limit) or >= 0")

    @staticmethod
    def _resolve_device(device) -> str:
        if device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        device = str(device)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={clip_repr(device)}: must be None, 'cpu' or 'cuda'")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        return device

    def _resolve_dtype(self, dtype) -> torch.dtype:
        if dtype is None or dtype == "auto":
            if self.device == "cpu":
                return torch.float32
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None) or "bfloat16"
        if isinstance(dtype, torch.dtype):
            resolved = dtype
        else:
            resolved = _DTYPES.get(str(dtype).removeprefix("torch."))
        if resolved not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={clip_repr(dtype)}: must be None, 'auto', float32, bfloat16 or float16")
        return resolved


# config.json sizes that must be positive integers where given (a family may fall back from a 0).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def check_sizes(raw: dict) -> None:
    """config.json's sizes (as parsed) that are not positive integers, as a ValueError naming the field."""
    for name in _POSITIVE_SIZES:
        value = raw.get(name)
        if value is not None and (not is_integer(value) or value < 1):
            raise ValueError(f"config.json: {name}={clip_repr(value)}: must be a positive integer")


def check_model_fits(cfg: "Config") -> None:
    """The quantization scheme's own check; rope_theta and rms_norm_eps (as the family reads
    them) positive and finite (rope_theta=0 would load and emit garbage); and, where this
    Config's device holds the weights (not a Ray front: its replicas check on their own), their size."""
    if cfg.quant is not None:
        cfg.quant.check_model(cfg.hf_config, cfg.tensor_parallel_size)
    opts = registry.model_class(cfg.hf_config).options_from_config(cfg.hf_config)
    for name, value in (("rope_theta", opts.rope_theta), ("rms_norm_eps", opts.rms_norm_eps)):
        if not 0 < value < float("inf"):
            raise ValueError(f"config.json: {name}={value!r}: must be a positive finite number")
    if cfg.distributed_executor_backend != "ray":
        check_weights_fit(cfg.hf_config, cfg.dtype, cfg.quant is not None, cfg.device, cfg.tensor_parallel_size,
                          cfg.data_parallel_size)


def weight_bytes(hf_config, dtype: torch.dtype, fp8_layers: bool) -> dict[str, int]:
    """A lower bound of the model's weight bytes, in two parts named by the config.json field
    that scales them: "vocab_size" (embedding and LM head), "num_hidden_layers" (the layers)."""
    o = registry.model_class(hf_config).options_from_config(hf_config)
    h, q, kv = o.hidden_size, o.num_heads * o.head_dim, o.num_kv_heads * o.head_dim
    dense_layers = o.num_layers - len(o.moe_layers)
    params = o.num_layers * (h * (q + 2 * kv) + q * h) + dense_layers * 3 * h * o.intermediate_size
    if o.moe is not None:
        params += len(o.moe_layers) * o.moe.num_experts * (3 * h * o.moe.intermediate_size + h)
    size = torch.tensor([], dtype=dtype).element_size()
    return {"vocab_size": o.vocab_size * h * (1 if o.tie_word_embeddings else 2) * size,
            "num_hidden_layers": params * (1 if fp8_layers else size)}


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, what they are): one GPU's total memory, or on the CPU the RAM available now."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "memory of one GPU"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "available RAM"
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available RAM"


def check_weights_fit(hf_config, dtype: torch.dtype, fp8_layers: bool, device: str, tp: int, dp: int) -> None:
    """A ValueError naming the field that makes the weights larger than the device's memory (each
    GPU holds 1/tp of them, the CPU's ranks and replicas share the RAM), before any allocation."""
    parts = weight_bytes(hf_config, dtype, fp8_layers)
    need = sum(parts.values()) * (dp if device == "cpu" else 1) // (1 if device == "cpu" else tp)
    have, what = device_memory(device)
    if need > have:
        field = max(parts, key=parts.get)
        raise ValueError(f"config.json: {field}={getattr(hf_config, field)} (hidden_size={hf_config.hidden_size}): "
                         f"the weights alone need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB "
                         f"{what}")


def read_json(path: str) -> dict:
    """One of a checkpoint's JSON files (an object); a broken one is a ValueError naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_hf_config(path: str):
    """The checkpoint's `config.json` as a transformers config, checked by its model family."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint folder {path!r} has no config.json")
    # The registry picks the family (architectures), its transformers config class reads the
    # file, and the family refuses what it does not implement.
    raw = read_json(cfg_file)
    check_sizes(raw)
    return registry.load_hf_config(path, raw)
