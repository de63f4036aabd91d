"""Features: each a module or small package that plugs into a hook the core declares
(`nanovllm/core/hooks.py`, the `Executor` in `core/executor.py`, the linear method and attention
backend protocols in `model/`).

This file is the one place that wires them: the fronts call the functions below, which import a
feature only when a config option or a request turns it on, so a plain generate loads none.
"""
