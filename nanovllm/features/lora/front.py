"""The front's side of LoRA: each prompt's LoRARequest (vLLM's `lora_request=`, one for all
prompts or a list) checked and registered under its id before any work: the adapter folder is
read once here (rank, target modules), and again by every rank when a slot takes it."""

from __future__ import annotations

import os

from nanovllm.features.lora.adapter import load_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.values import is_integer


def _register(llm, request) -> int:
    if not isinstance(request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest (nanovllm.lora.request) or None, got "
                        f"{type(request).__name__}")
    if not llm.config.lora.enable_lora:
        raise ValueError("lora_request needs LLM(..., enable_lora=True)")
    rid = request.lora_int_id
    if not is_integer(rid) or rid < 1:
        raise ValueError(f"LoRARequest.lora_int_id={rid!r}: must be an integer >= 1")
    known = llm.lora_registry.get(int(rid))
    if known is not None:
        if os.path.abspath(known.lora_path) != os.path.abspath(request.lora_path):
            raise ValueError(f"LoRARequest id {rid} names {request.lora_path!r}, but it was first given for "
                             f"{known.lora_path!r}")
        return int(rid)
    if not os.path.isdir(request.lora_path or ""):
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: no folder {request.lora_path!r}")
    load_adapter(request.lora_name, request.lora_path, llm.config.lora.max_lora_rank,
                 llm.config.hf_config.num_hidden_layers)  # (its checks, before any work)
    llm.lora_registry[int(rid)] = request
    return int(rid)


def adapter_ids(llm, lora_request, n: int) -> list[int]:
    """Each of `n` prompts' adapter id (0: none)."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {n} prompts")
        return [0 if r is None else _register(llm, r) for r in lora_request]
    return [_register(llm, lora_request)] * n
