"""FP8 KV-cache scales in a checkpoint, loaded by loader.py (through its KV_SCALES slot) into the
attention layers when the cache is FP8 (attention/fp8_cache.py); a 16-bit cache ignores them."""

from __future__ import annotations

import re

from torch import nn

from nanovllm.model.attention import paged_kv

# FP8 KV-cache scales as vLLM names them (<layer>.self_attn.{k,v}_scale, or the older
# <layer>.self_attn.{k,v}_proj.output_scale), read into the attention layer's k_scale / v_scale.
_KV_SCALE = re.compile(r"^(?P<attn>.+\.self_attn)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)$")


def load_kv_scale(model: nn.Module, name: str, read) -> bool:
    """Whether `name` is a KV-cache scale (then copied into its attention layer when the cache is
    FP8: fp8_cache.py; ignored otherwise, a 16-bit cache needs no scale)."""
    m = _KV_SCALE.match(name)
    if m is None:
        return False
    try:
        attn = model.get_submodule(m["attn"]).attn
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale of a layer this model does not "
                         "have") from None
    if getattr(attn, "fp8_kv_cache", False):
        paged_kv.FP8_CACHE().load_scale(attn, m["kv"] or m["proj"], read(), name)
    return True
