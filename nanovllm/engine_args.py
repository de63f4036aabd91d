"""vLLM's `EngineArgs`: a model and LLM's keyword arguments, checked when made."""

from __future__ import annotations

from nanovllm.config import Config


class EngineArgs:
    """vLLM's EngineArgs: a model and LLM's keyword arguments (vLLM's names too), checked now
    with no I/O (Config.from_kwargs). `LLM(args.model, **args.kwargs)` builds the engine."""

    def __init__(self, model: str, **kwargs):
        Config.from_kwargs(model, **kwargs)
        self.model = model
        self.kwargs = dict(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
