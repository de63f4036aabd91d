"""Unit tests of `Config`: every `LLM(...)` keyword is validated before any work starts."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import copy_checkpoint, edit_json, tiny_checkpoint  # noqa: E402

from nanovllm.cli_options import option_names  # noqa: E402
from nanovllm.config import FEATURE_OPTIONS, Config  # noqa: E402
import nanovllm.wiring as wiring  # noqa: E402


def make(model, **kwargs) -> Config:
    """Config as LLM makes it: the keywords checked, then resolved against the checkpoint."""
    return Config.from_kwargs(model, **kwargs).resolve(wiring)


def option(cfg: Config, name: str):
    """An LLM keyword's value in `cfg` (a feature's in its sub-config)."""
    if name in FEATURE_OPTIONS:
        sub, field = FEATURE_OPTIONS[name]
        return getattr(getattr(cfg, sub), field)
    return getattr(cfg, name)

# The public keywords of SPEC.md's `LLM(...)` and their defaults.
SPEC_DEFAULTS = dict(tensor_parallel_size=1, max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096,
                     gpu_memory_utilization=0.9, kvcache_block_size=256, num_kvcache_blocks=-1,
                     enforce_eager=False, enable_prefix_caching=True, device=None, dtype=None, load_format="auto",
                     seed=0, skip_tokenizer_init=False)

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")  # max_position_embeddings=512, 4 heads, 2 kv heads


def test_keywords_and_defaults_are_the_spec(ckpt):
    fields = {name: default for name, (_, default) in option_names().items()}
    for name, default in SPEC_DEFAULTS.items():
        assert name in fields, f"LLM keyword {name} missing"
        assert fields[name] == default, f"{name} defaults to {fields[name]!r}, SPEC says {default!r}"
    cfg = make(ckpt)
    assert cfg.max_num_seqs == 512 and cfg.kvcache_block_size == 256 and cfg.num_kvcache_blocks == -1
    assert cfg.model == ckpt


@pytest.mark.parametrize("name,value", [
    ("tensor_parallel_size", 1),
    ("max_num_seqs", 1), ("max_num_seqs", 1024),
    ("max_num_batched_tokens", 1), ("max_num_batched_tokens", 8),
    ("max_model_len", 1), ("max_model_len", 512),
    ("gpu_memory_utilization", 1), ("gpu_memory_utilization", 1.0), ("gpu_memory_utilization", 0.01),
    ("kvcache_block_size", 16), ("kvcache_block_size", 32), ("kvcache_block_size", 64), ("kvcache_block_size", 256),
    ("kvcache_block_size", 1024),
    ("num_kvcache_blocks", -1), ("num_kvcache_blocks", 1), ("num_kvcache_blocks", 100000),
    ("enforce_eager", True), ("enable_prefix_caching", False), ("skip_tokenizer_init", True),
    ("custom_all_reduce", True),
    ("load_format", "auto"), ("load_format", "safetensors"), ("load_format", "dummy"),
    ("seed", 0), ("seed", 12345),
    ("device", "cpu"), ("dtype", "float32"), ("dtype", torch.float32),
])
def test_valid_values_are_kept(ckpt, name, value):
    cfg = make(ckpt, **{name: value})
    got = option(cfg, name)
    assert got == value or (name == "dtype" and got == torch.float32)


@pytest.mark.parametrize("name,value", [
    # integers >= 1
    *[(n, v) for n in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
      for v in (0, -1, 1.5, "8", True)],
    # a power of two >= 16
    *[("kvcache_block_size", v) for v in (0, 1, 8, 15, 24, 48, 100, 257, -16, 16.0, "16", True)],
    # -1 or >= 1
    *[("num_kvcache_blocks", v) for v in (0, -2, -100, 2.5, "4", None)],
    # in (0, 1]
    *[("gpu_memory_utilization", v) for v in (0, 0.0, -0.1, 1.0001, 2, "0.9", None, True, float("nan"))],
    # booleans
    *[(n, v) for n in ("enforce_eager", "enable_prefix_caching", "skip_tokenizer_init", "custom_all_reduce")
      for v in ("yes", None)],
    ("load_format", "pt"), ("load_format", "bin"), ("load_format", None),
    ("seed", 1.5), ("seed", "0"),
    ("device", "tpu"), ("device", "mps"),
    ("dtype", "int8"), ("dtype", "float64"), ("dtype", torch.int32), ("dtype", torch.float64), ("dtype", "fp8"),
    ("attention_backend", "xformers"),
])
def test_invalid_values_raise_naming_the_field(ckpt, name, value):
    with pytest.raises((ValueError, TypeError), match=name):
        make(ckpt, **{name: value})


@pytest.mark.parametrize("tp", [3, 8])
def test_tensor_parallel_size_must_divide_the_heads(ckpt, tp):
    # 4 attention heads and 2 key/value heads: 3 divides neither; 8 is more than the heads.
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make(ckpt, tensor_parallel_size=tp)


def test_unknown_keywords_are_a_type_error_naming_all_of_them(ckpt):
    with pytest.raises(TypeError) as info:
        make(ckpt, max_num_seq=4, gpu_mem=0.5, max_model_len=64)
    msg = str(info.value)
    assert "max_num_seq" in msg and "gpu_mem" in msg
    # A vLLM option nano-vllm does without is refused with the reason (vllm_keywords.py).
    with pytest.raises(NotImplementedError, match="swap_space=4: .*by recompute"):
        make(ckpt, swap_space=4)


def test_max_model_len_is_clamped_to_the_model_positions(ckpt, tmp_path):
    assert make(ckpt).max_model_len == 512
    assert make(ckpt, max_model_len=100000).max_model_len == 512
    assert make(ckpt, max_model_len=100).max_model_len == 100
    folder = copy_checkpoint(ckpt, tmp_path / "short")
    edit_json(os.path.join(folder, "config.json"), lambda c: c.update(max_position_embeddings=40))
    assert make(folder).max_model_len == 40


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU fallback")
def test_device_resolution_without_cuda(ckpt):
    assert make(ckpt).device == "cpu"
    assert make(ckpt, device=None).device == "cpu"
    assert make(ckpt, device="cpu").device == "cpu"
    assert make(ckpt, device=torch.device("cpu")).device == "cpu"
    with pytest.raises(ValueError, match="(?i)cuda"):
        make(ckpt, device="cuda")


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU defaults")
def test_dtype_resolution_on_cpu(ckpt, tmp_path_factory):
    assert make(ckpt).dtype == torch.float32
    assert make(ckpt, dtype="auto").dtype == torch.float32
    # None means float32 on CPU even for a bfloat16 checkpoint.
    bf16 = tiny_checkpoint(tmp_path_factory, "gqa", dtype=torch.bfloat16, with_tokenizer=False)
    assert make(bf16).dtype == torch.float32
    assert make(bf16, dtype="bfloat16").dtype == torch.bfloat16
    for name, dtype in [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                        (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]:
        assert make(ckpt, dtype=name).dtype == dtype, name


def test_model_path_checks(ckpt, tmp_path):
    import pathlib

    assert make(pathlib.Path(ckpt)).model == ckpt
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        make(str(tmp_path / "does-not-exist"))
    with pytest.raises(TypeError, match="model"):
        make(123)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make(str(empty))


SUPPORTED = "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM"


@pytest.mark.parametrize("changes,pattern", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "MistralForCausalLM.*supported architectures: " + SUPPORTED),
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel.*supported architectures: " + SUPPORTED),
    (dict(architectures=[]), r"architectures=\[\].*supported architectures"),
    # A supported class name with another family's model_type: refused, not read as either.
    (dict(model_type="llama"), "Qwen3ForCausalLM.*model_type='qwen3'.*got model_type='llama'"),
])
def test_unknown_architectures(ckpt, tmp_path, changes, pattern):
    folder = copy_checkpoint(ckpt, tmp_path / "arch")
    edit_json(os.path.join(folder, "config.json"), lambda c: c.update(changes))
    with pytest.raises(ValueError, match=pattern):
        make(folder)


def test_hf_config_is_loaded(ckpt):
    cfg = make(ckpt)
    hf = cfg.hf_config
    assert hf.model_type == "qwen3"
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.num_hidden_layers) == (4, 2, 16, 2)
    assert hf.max_position_embeddings == 512


def test_forced_flash_attn_without_the_package_fails_before_loading(ckpt, monkeypatch):
    import nanovllm.config_checks as config_checks

    # As on a CUDA machine without flash-attn (the H200 we test on): refused in Config, not
    # later when the backend imports it after the weights are loaded.
    monkeypatch.setattr(Config, "_resolve_device", staticmethod(lambda device: "cuda"))
    monkeypatch.setattr(config_checks, "flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match="flash_attn package"):
        make(ckpt, attention_backend="flash_attn")
    monkeypatch.setattr(config_checks, "flash_attn_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert make(ckpt, attention_backend="flash_attn", dtype="float32").attention_backend == "flash_attn"


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers(ckpt):
    np = pytest.importorskip("numpy")
    cfg = make(ckpt, max_num_seqs=np.int64(8), gpu_memory_utilization=np.float32(0.5), seed=np.int32(3))
    assert (cfg.max_num_seqs, cfg.seed) == (8, 3) and type(cfg.max_num_seqs) is int and type(cfg.seed) is int
    assert type(cfg.gpu_memory_utilization) is float
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(ckpt, max_num_seqs=np.bool_(True))



def _set_size(c, field, value):
    c[field] = value
    if field == "num_hidden_layers":
        c.pop("layer_types", None)  # (transformers checks it has one entry per layer)


def _set_rope_theta(c, value):
    c["rope_theta"] = value
    if isinstance(c.get("rope_parameters"), dict):
        c["rope_parameters"]["rope_theta"] = value


@pytest.mark.parametrize("field,value", [
    ("rope_theta", 0), ("rope_theta", -10000.0), ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0),
    ("head_dim", 0), ("head_dim", -16), ("num_key_value_heads", 0), ("num_hidden_layers", 0),
    ("vocab_size", 0), ("hidden_size", -64), ("num_attention_heads", 0),
])
def test_model_values_out_of_range_are_refused_naming_the_field(ckpt, tmp_path, field, value):
    """Before: rope_theta=0 loaded and emitted token 0, rms_norm_eps=-1 and head_dim=0 (read
    as hidden_size / heads) were accepted."""
    folder = copy_checkpoint(ckpt, tmp_path / "bad")
    edit = (lambda c: _set_rope_theta(c, value)) if field == "rope_theta" else (lambda c: _set_size(c, field, value))
    edit_json(os.path.join(folder, "config.json"), edit)
    with pytest.raises(ValueError, match=rf"{field}"):
        make(folder)


@pytest.mark.parametrize("field,value,also", [("num_hidden_layers", 10**6, dict(intermediate_size=10**5)),
                                              ("vocab_size", 10**11, {}), ("hidden_size", 10**7, {})])
def test_weights_larger_than_the_device_are_refused_before_allocating(ckpt, tmp_path, field, value, also):
    """Absurd sizes (no machine holds these weights: terabytes): before, num_hidden_layers=10^6
    ground for minutes until memory ran out and vocab_size=10^9 / hidden_size=10^6 failed in
    the allocator. Now Config (which allocates nothing) refuses them, naming the field."""
    folder = copy_checkpoint(ckpt, tmp_path / "huge")
    edit_json(os.path.join(folder, "config.json"), lambda c: _set_size(c, field, value) or c.update(also))
    with pytest.raises(ValueError, match=rf"{field}={value}\b.*the weights alone need .* GiB, more than the .* GiB"):
        make(folder, device="cpu")


def test_weight_estimate_of_the_tiny_model_is_its_parameter_bytes(ckpt):
    """The estimate is a lower bound: the real parameters (norms, biases aside) in float32."""
    from safetensors import safe_open

    from nanovllm.model.checkpoint import weight_bytes

    cfg = make(ckpt, device="cpu")
    real = 0
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt, name), "pt") as f:
                real += sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                            else math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "norm" not in k)
    estimate = sum(weight_bytes(cfg.hf_config, torch.float32, False).values())
    assert estimate == 4 * real


def test_invalid_values_are_quoted_not_echoed_whole(ckpt):
    for kw in (dict(max_num_seqs="8" * 10**6), dict(load_format="x" * 10**6), dict(device=["cpu"] * 10**5),
               dict(tokenizer_mode="s" * 10**6)):
        with pytest.raises(ValueError) as e:
            Config.from_kwargs(ckpt, **kw)
        assert len(str(e.value)) < 300, str(e.value)[:1000]


@pytest.mark.parametrize("kwargs, what", [(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                           "speculative_config"),
                                          (dict(enable_lora=True), "enable_lora=True"),
                                          (dict(quantization="fp8"), "quantized weights"),
                                          (dict(tensor_parallel_size=2), "tensor_parallel_size > 1, "
                                           "data_parallel_size > 1 or distributed_executor_backend='ray' / "
                                           "'external_launcher'")])
def test_a_bare_engine_config_refuses_what_needs_a_feature(ckpt, kwargs, what):
    """Config.resolve without the features LLM wires in (a bare LLMEngine's) says so for an
    option that needs one; a plain config resolves."""
    assert Config.from_kwargs(ckpt).resolve().hf_config is not None
    with pytest.raises(ValueError, match=f"{what} need\\(s\\) the features that LLM wires in"):
        Config.from_kwargs(ckpt, **kwargs).resolve()
