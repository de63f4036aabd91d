"""A checkpoint given as a Hugging Face Hub id, fetched when the machine is online (checkpoint.py's
resolve_model_path, through its HUB slot: a local folder never loads this module)."""

from __future__ import annotations

import importlib.util


def download(model: str, revision: str | None, what: str, cache_dir: str | None) -> str:
    """The local folder of Hub repo `model` at `revision` (a branch, tag or commit), downloaded into
    `cache_dir`, else the Hub's cache; a FileNotFoundError when it cannot be fetched."""
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
