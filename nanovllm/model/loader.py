"""Weight loading: streaming safetensors (never pickle), or random weights for benchmarks."""

from __future__ import annotations

import contextlib
import glob
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.model.quant import init_dummy_quantized


# MoE experts: the Hub stores one tensor per expert and projection, transformers' in-memory (and,
# in some versions, saved) form stacks all experts of a projection in one 3-D tensor. Beside or
# instead of `weight`, FP8 checkpoints have `weight_scale_inv` (fused: `<part>_scale_inv`), INT4
# ones `qweight`, `scales`, ...: they load into the stacked parameter's siblings (`w13_qweight`).
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<kind>\w+)$")
_FUSED_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>\w+?)(?P<kind>_scale_inv)?$")
_SCALE = "_scale_inv"
_KIND_SUFFIX = {"weight": "", "weight" + _SCALE: _SCALE}  # a per-expert tensor's kind -> the parameter's suffix
_SUFFIX_KIND = {v: k for k, v in _KIND_SUFFIX.items()}


def _resolve_expert(params: dict, experts: dict, fused: dict, name: str):
    """(parameter name, parameter, shard id) of an expert tensor, or None for other tensors.

    `experts` maps a per-expert part to (parameter part, shard): "<p>.experts.<e>.gate_proj.weight"
    -> "<p>.experts.w13" with shard (e, 0) (and ".weight_scale_inv" -> "<p>.experts.w13_scale_inv").
    `fused` maps a stacked part to a parameter part: "<p>.experts.gate_up_proj" -> "<p>.experts.w13"
    with shard "fused" (and "gate_up_proj_scale_inv" -> "w13_scale_inv").
    """
    m = _EXPERT_TENSOR.match(name)
    if m and m["part"] in experts:
        part, shard = experts[m["part"]]
        pname = f"{m['prefix']}.{part}" + _KIND_SUFFIX.get(m["kind"], f"_{m['kind']}")
        if pname in params:
            return pname, params[pname], (int(m["expert"]), shard)
    m = _FUSED_EXPERT_TENSOR.match(name)
    if m and m["part"] in fused:
        pname = f"{m['prefix']}.{fused[m['part']]}" + (m["kind"] or "")
        if pname in params:
            return pname, params[pname], "fused"
    return None


def _expert_names(pname: str, param, experts: dict) -> set[str] | None:
    """The per-expert checkpoint names behind an expert parameter ("<p>.experts.w13", its block
    scales "<p>.experts.w13_scale_inv", an INT4 tensor "<p>.experts.w13_qweight"), else None."""
    prefix, _, name = pname.rpartition(".")
    if not prefix.endswith(".experts"):
        return None
    for ours in dict.fromkeys(ours for ours, _ in experts.values()):
        suffix = name[len(ours):] if name.startswith(ours) else "?"  # "", "_scale_inv", "_qweight", ...
        kind = _SUFFIX_KIND.get(suffix, suffix[1:] if suffix[:1] == "_" else None)
        if kind is not None:
            parts = [ckpt for ckpt, (p, _) in experts.items() if p == ours]
            return {f"{prefix}.{e}.{ckpt}.{kind}" for e in range(param.shape[0]) for ckpt in parts}
    return None


def _resolve(params: dict, mapping: dict, name: str):
    """Map a checkpoint tensor name to (parameter name, parameter or None, shard id or None)."""
    for part, (packed, shard_id) in mapping.items():
        if f".{part}." in name:
            packed_name = name.replace(f".{part}.", f".{packed}.")
            if packed_name in params:
                return packed_name, params[packed_name], shard_id
    return name, params.get(name), None


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint's `*.safetensors` files into `model`.

    Tensors are read one at a time (`safe_open`), so peak host memory is one tensor, and each
    parameter's `weight_loader` takes only this rank's shard. A tensor the model does not know,
    a parameter the checkpoint lacks, or a shape mismatch is a ValueError naming the tensor.
    MoE experts load from per-expert tensors or from transformers' fused 3-D ones (the model's
    `expert_params_mapping` / `fused_expert_params_mapping`).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (pickle checkpoints are not loaded)")
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    mapping = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_params_mapping", {})
    fused = getattr(model, "fused_expert_params_mapping", {})
    loaded: set[str] = set()
    for file in files:
        with _open_checked(file) as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":
                    continue  # tied to the embedding, which is loaded under its own name
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed, older checkpoints carry it
                if _load_kv_scale(model, name, lambda: _read_checked(f, name, file)):
                    continue
                hit = _resolve_expert(params, experts, fused, name) if experts or fused else None
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
                    loaded |= _expert_names(pname, param, experts) or set()
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


# FP8 KV-cache scales, as vLLM names them: <layer>.self_attn.{k,v}_scale, or the older
# <layer>.self_attn.{k,v}_proj.output_scale. Read into the attention layer's k_scale / v_scale.
_KV_SCALE = re.compile(r"^(?P<attn>.+\.self_attn)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)$")


def _load_kv_scale(model: nn.Module, name: str, read) -> bool:
    """Whether `name` is a KV-cache scale (then copied into its attention layer when the cache is
    FP8, and ignored otherwise: a 16-bit cache needs no scale)."""
    m = _KV_SCALE.match(name)
    if m is None:
        return False
    try:
        attn = model.get_submodule(m["attn"]).attn
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale of a layer this model does not have") from None
    kind = m["kv"] or m["proj"]
    if getattr(attn, "fp8_kv_cache", False):
        value = read().float().reshape(-1)
        if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
            raise ValueError(f"{name}: a KV-cache scale must be one positive finite number, got {value.tolist()[:4]}")
        getattr(attn, f"{kind}_scale").copy_(value)
        attn.kv_scales_from_checkpoint = True
    return True


def _expected_names(mapping: dict, experts: dict, params: dict, tied: bool) -> set[str]:
    """The checkpoint tensor names a complete checkpoint holds for these parameters (experts
    in the Hub's per-expert form)."""
    names = set()
    for pname, param in params.items():
        if tied and pname == "lm_head.weight":
            continue
        per_expert = _expert_names(pname, param, experts)
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


_DUMMY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale (benchmarks without the real checkpoint); parameters in
    a quantized format (FP8 codes, block scales) are drawn by their method (model/quant.py)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dtype not in _DUMMY_DTYPES or getattr(param, "block", None):
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    init_dummy_quantized(model, seed)
