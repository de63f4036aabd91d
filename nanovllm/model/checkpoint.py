"""A checkpoint folder as the engine first reads it: where it is (a local folder, or a Hugging
Face Hub id fetched when online), its JSON files, and its config.json checked by its model family."""

from __future__ import annotations

import importlib.util
import json
import os

from nanovllm.limits import clip_repr
from nanovllm.model import registry
from nanovllm.sampling_params import is_integer


def resolve_model_path(model: str, revision: str | None = None, what: str = "model",
                       cache_dir: str | None = None) -> str:
    """A local checkpoint folder, or a Hugging Face Hub id downloaded (at `revision`, a branch,
    tag or commit; into `cache_dir`, else the Hub's cache) when the machine is online."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or a Hub id, got {type(model).__name__}")
    model = os.path.expanduser(os.fspath(model))
    if os.path.isdir(model):
        return model
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):  # looks like a Hub id
        if importlib.util.find_spec("huggingface_hub") is None:
            raise FileNotFoundError(f"{what} folder {model!r} does not exist (and huggingface_hub, which could "
                                    f"fetch it from the Hub, is not installed)")
        import huggingface_hub  # an optional dependency

        try:
            return huggingface_hub.snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                                     allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
        except Exception as e:  # offline, unknown repo...
            raise FileNotFoundError(
                f"{what} folder {model!r} does not exist and could not be fetched from the Hugging Face Hub "
                f"({type(e).__name__}: {e}). Pass the path of a local folder.") from None
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
    """The checkpoint's `config.json` as a transformers config, checked by its model family;
    `overrides` (vLLM's hf_overrides) replace entries first, nested dicts merged."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint folder {path!r} has no config.json")
    # The registry picks the family (architectures), its transformers config class reads the
    # file, and the family refuses what it does not implement.
    raw = read_json(cfg_file)
    for key, value in (overrides or {}).items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    check_sizes(raw)
    return registry.load_hf_config(path, raw, {key: raw[key] for key in overrides or {}})


# config.json sizes that must be positive integers where given (a family may fall back from a 0).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def check_sizes(raw: dict) -> None:
    """config.json's sizes (as parsed) that are not positive integers, as a ValueError naming the field."""
    for name in _POSITIVE_SIZES:
        value = raw.get(name)
        if value is not None and (not is_integer(value) or value < 1):
            raise ValueError(f"config.json: {name}={clip_repr(value)}: must be a positive integer")
