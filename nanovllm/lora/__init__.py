"""LoRA adapters: vLLM's `LoRARequest` (nanovllm.lora.request), accepted in vLLM's signatures so
scripts import and run; an adapter itself is not supported yet (a clear NotImplementedError)."""
