"""vLLM's `EngineArgs`, made from LLM's keywords or the command line's flags (cli_options.py)."""

from __future__ import annotations

import nanovllm.cli_options as cli_options
from nanovllm.config import Config
from nanovllm.llm import LLM


class EngineArgs:
    """A model and LLM's keyword arguments (vLLM's names too), checked now with no I/O;
    `LLM(args.model, **args.kwargs)` or `LLMEngine.from_engine_args(args)` builds the engine."""

    def __init__(self, model: str, **kwargs):
        Config.from_kwargs(model, **kwargs)
        self.model = model
        self.kwargs = dict(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)

    @staticmethod
    def add_cli_args(parser):
        """vLLM's: `--model` and a flag per LLM option on `parser`; returns it."""
        return cli_options.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args) -> "EngineArgs":
        """vLLM's: the EngineArgs of the parsed flags (an argparse.Namespace)."""
        return cls(args.model, **cli_options.option_values(args))

    def create_llm(self) -> LLM:
        """The LLM these arguments describe (what LLMEngine.from_engine_args runs on)."""
        return LLM(self.model, **self.kwargs)
