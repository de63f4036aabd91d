"""LoRA adapters per request (LLM(enable_lora=True), `lora_request=` on generate / chat /
stream): `adapter.py` reads and checks a PEFT adapter folder, `stacks.py` holds a layer's
adapter slots and the batched per-token update, `runtime.py` attaches them to the model on each
rank and loads adapters into slots before a step, `scheduling.py` decides which adapter takes
which slot (a request waits for one), `front.py` checks and registers the requests' adapters."""
