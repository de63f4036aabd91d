"""A checkpoint folder as the engine first reads it, before any allocation: where it is, its JSON
files, its config.json checked by its family and against ranges (rope_theta = 0 would emit garbage),
and whether this machine can hold the weights (num_hidden_layers = 10**6 would grind for hours)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable

import torch

from nanovllm.limits import clip_repr
from nanovllm.model import registry
from nanovllm.sampling_params import is_integer

if TYPE_CHECKING:
    from types import ModuleType

HUB: Callable[[], ModuleType] | None = None  # filled by nanovllm.wiring: hub.py, for a Hub id only


def resolve_model_path(model: str, revision: str | None = None, what: str = "model",
                       cache_dir: str | None = None) -> str:
    """A local checkpoint folder, or a Hugging Face Hub id downloaded (hub.py) when the machine is online."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or a Hub id, got {type(model).__name__}")
    model = os.path.expanduser(os.fspath(model))
    if os.path.isdir(model):
        return model
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):  # looks like a Hub id
        return HUB().download(model, revision, what, cache_dir)
    raise FileNotFoundError(f"{what} folder {model!r} does not exist")


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


def load_hf_config(path: str, overrides: dict | None = None):
    """The checkpoint's `config.json` as its family's transformers config (registry.py), checked
    before any weights load. `overrides` (vLLM's hf_overrides) replace entries first, dicts merged."""
    import transformers

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint folder {path!r} has no config.json")
    raw = read_json(cfg_file)
    for key, value in (overrides or {}).items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    check_sizes(raw)
    name = registry.architecture_name(raw.get("architectures"), raw.get("model_type"), cfg_file)
    config_class = getattr(transformers, registry.ARCHITECTURES[name].config_class)
    config = config_class.from_pretrained(path, **{key: raw[key] for key in overrides or {}})
    registry.decoder_options(config)
    return config


# config.json sizes that must be positive integers where given (a family may fall back from a 0).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def check_sizes(raw: dict) -> None:
    """config.json's sizes (as parsed) that are not positive integers, as a ValueError naming the field."""
    for name in _POSITIVE_SIZES:
        value = raw.get(name)
        if value is not None and (not is_integer(value) or value < 1):
            raise ValueError(f"config.json: {name}={clip_repr(value)}: must be a positive integer")


def check_model_fits(hf_config, dtype: torch.dtype, fp8_layers: bool, device: str, tp: int, dp: int) -> None:
    """rope_theta and rms_norm_eps positive and finite, and the weights' size against the device (a
    GPU holds 1/tp of them; on the CPU ranks and replicas share the RAM): else a ValueError."""
    opts = registry.decoder_options(hf_config)
    for name, value in (("rope_theta", opts.rope_theta), ("rms_norm_eps", opts.rms_norm_eps)):
        if not 0 < value < float("inf"):
            raise ValueError(f"config.json: {name}={value!r}: must be a positive finite number")
    parts = weight_bytes(hf_config, dtype, fp8_layers)
    need = sum(parts.values()) * (dp if device == "cpu" else 1) // (1 if device == "cpu" else tp)
    have, what = device_memory(device)
    if need > have:
        field = max(parts, key=parts.get)
        raise ValueError(f"config.json: {field}={getattr(hf_config, field)} (hidden_size={hf_config.hidden_size}): "
                         f"the weights alone need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB "
                         f"{what}")


def weight_bytes(hf_config, dtype: torch.dtype, fp8_layers: bool) -> dict[str, int]:
    """A lower bound of the weight bytes, by the config.json field that scales them (vocab_size,
    num_hidden_layers)."""
    o = registry.decoder_options(hf_config)
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
