"""Whether the flash-attn package is importable: config.py checks attention_backend='flash_attn'
with it, selection.py chooses that backend by it. What a backend is: selection.py."""

from __future__ import annotations

import importlib


def flash_attn_available() -> bool:
    try:
        importlib.import_module("flash_attn")
        return True
    except Exception:
        return False
