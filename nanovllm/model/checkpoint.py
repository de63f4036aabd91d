"""A checkpoint folder as the engine first reads it: where it is (a local folder, or a Hugging
Face Hub id fetched when online), its JSON files, and its config.json checked by its model family."""

from __future__ import annotations

import importlib.util
import json
import os

from nanovllm.model import registry


def resolve_model_path(model: str, revision: str | None = None, what: str = "model") -> str:
    """A local checkpoint folder, or a Hugging Face Hub id downloaded (at `revision`, a branch,
    tag or commit) when the machine is online."""
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
            return huggingface_hub.snapshot_download(model, revision=revision,
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


def load_hf_config(path: str):
    """The checkpoint's `config.json` as a transformers config, checked by its model family."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint folder {path!r} has no config.json")
    # The registry picks the family (architectures), its transformers config class reads the
    # file, and the family refuses what it does not implement.
    return registry.load_hf_config(path, read_json(cfg_file))
