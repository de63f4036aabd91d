"""vLLM's `LoRARequest` (`generate(..., lora_request=...)` with LLM(enable_lora=True):
features/lora/). The paths that take no adapter yet (beam search, the step API) refuse one
before any work (check_no_lora)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter to apply to a request (vLLM's fields): its name, a unique positive id, and the
    folder of its PEFT checkpoint."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


def check_no_lora(lora_request) -> None:
    """None, or an empty list of them (vLLM accepts a list, one per prompt), passes; an adapter
    is a NotImplementedError naming it."""
    if lora_request is None or (isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)):
        return
    raise NotImplementedError(f"lora_request={lora_request!r}: LoRA adapters are not supported here yet "
                              f"(generate, chat and stream take them; pass lora_request=None)")
