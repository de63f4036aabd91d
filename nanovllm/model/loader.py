"""Weight loading: streaming safetensors (never pickle); random weights: dummy_weights.py."""

from __future__ import annotations

import contextlib
import glob
import os
from typing import TYPE_CHECKING, Callable

import torch
from safetensors import safe_open
from torch import nn

if TYPE_CHECKING:
    from types import ModuleType

# FP8 KV-cache scales' loading (kv_scales.py), filled by nanovllm/wiring/: loaded at the first
# checkpoint tensor named like one (<layer>.self_attn.k_scale, ...v_proj.output_scale).
KV_SCALES: Callable[[], ModuleType] | None = None
_KV_SCALE_ENDINGS = ("k_scale", "v_scale", "output_scale")


def _resolve(params: dict, mapping: dict, name: str):
    """Map a checkpoint tensor name to (parameter name, parameter or None, shard id or None)."""
    for part, (packed, shard_id) in mapping.items():
        if f".{part}." in name:
            packed_name = name.replace(f".{part}.", f".{packed}.")
            if packed_name in params:
                return packed_name, params[packed_name], shard_id
    return name, params.get(name), None


def load_model(model: nn.Module, path: str) -> None:
    """Copy the checkpoint's `*.safetensors` tensors into `model` one at a time, each parameter's
    `weight_loader` taking this rank's shard; an unknown, missing or misshapen tensor is a ValueError."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (pickle checkpoints are not loaded)")
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    mapping = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_tensors", None)
    loaded: set[str] = set()
    for file in files:
        with _open_checked(file) as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":
                    continue  # tied to the embedding, which is loaded under its own name
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed, older checkpoints carry it
                if name.endswith(_KV_SCALE_ENDINGS) and \
                        KV_SCALES().load_kv_scale(model, name, lambda: _read_checked(f, name, file)):
                    continue
                hit = experts.resolve(params, name) if experts is not None else None
                pname, param, shard_id = hit or _resolve(params, mapping, name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {os.path.basename(file)} does not "
                                     f"belong to this model")
                loader = getattr(param, "weight_loader", None)
                tensor = _read_checked(f, name, file)
                if loader is None:
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(param.shape)}")
                    param.data.copy_(tensor)
                elif shard_id is None:
                    loader(param, tensor, name)
                else:
                    loader(param, tensor, name, shard_id)
                loaded.add(name)
                if shard_id == "fused":  # stands for every per-expert tensor of this parameter
                    loaded |= experts.names(pname, param) or set()
    expected = _expected_names(mapping, experts, params, tied)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


@contextlib.contextmanager
def _open_checked(file: str):
    """safe_open, with an unreadable file (truncated, not safetensors) named in the error."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors' SafetensorError, or an OSError
        raise ValueError(f"cannot read checkpoint file {file} ({type(e).__name__}: {e})") from None
    with handle as f:
        yield f


def _read_checked(f, name: str, file: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:  # data cut short after an intact header, ...
        raise ValueError(f"cannot read tensor {name!r} from checkpoint file {file} "
                         f"({type(e).__name__}: {e})") from None


def _expected_names(mapping: dict, experts, params: dict, tied: bool) -> set[str]:
    """The tensor names a complete checkpoint holds for these parameters (experts per expert)."""
    names = set()
    for pname, param in params.items():
        if tied and pname == "lm_head.weight":
            continue
        per_expert = experts.names(pname, param) if experts is not None else None
        if per_expert is not None:
            names |= per_expert
            continue
        parts = [part for part, (packed, _) in mapping.items() if f".{packed}." in pname]
        if parts:
            packed = mapping[parts[0]][0]
            names.update(pname.replace(f".{packed}.", f".{part}.") for part in parts)
        else:
            names.add(pname)
    return names
