"""Features: each a module or small package that plugs into a hook the core declares
(`core/hooks.py`, the Executor in `core/executor.py`, the linear-method and attention-backend
protocols in `model/`, what `Config.resolve` asks in `config.py`). Nothing here is imported by
core/ or model/; nanovllm/wiring/ wires each in when an option, the checkpoint or a request
turns it on.
"""
