"""LoRA adapters (issue 38, in progress): `adapter.py` reads and checks a PEFT adapter folder,
`stacks.py` holds a layer's adapter slots and the batched product that gives every token its own
adapter's update. Not wired into the engine yet: `LLM(..., lora_request=...)` still refuses an
adapter (nanovllm/lora/request.py)."""
