"""vLLM's `EngineArgs`: a model and LLM's keyword arguments, checked when made, and the command-line
flags of every LLM option (one flag per option of Config.option_names; the server's too)."""

from __future__ import annotations

import argparse
import json
import typing

from nanovllm.config import Config
from nanovllm.llm import LLM


def _flag_type(hint):
    """How a flag's string becomes the option's value, from the Config field's type."""
    kinds = [k for k in (typing.get_args(hint) or (hint,)) if k is not type(None)]
    if str in kinds or not kinds:
        return str
    for kind in (int, float):
        if kind in kinds:
            return kind
    return json.loads  # anything else (a list, a dict) as JSON


def add_option_flags(group, defaults: dict | None = None, helps: dict | None = None) -> None:
    """A flag per LLM option on `group` (an argparse parser or group): `--max-num-seqs 8`,
    booleans as `--name` / `--no-name`; unset flags are absent from the parsed namespace.
    `defaults` / `helps`: what the help text says of an option's default and meaning."""
    defaults, helps = defaults or {}, helps or {}
    for name, (hint, default) in Config.option_names().items():
        default = defaults.get(name, default)
        text = helps.get(name, f"LLM option {name} (see docs/api.md)") + f" [default: {default!r}]"
        flag = "--" + name.replace("_", "-")
        if hint is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=text)
        else:
            group.add_argument(flag, dest=name, type=_flag_type(hint), default=argparse.SUPPRESS, help=text)


def option_values(args: argparse.Namespace) -> dict:
    """The LLM options the parsed flags give (those set on the command line)."""
    names = set(Config.option_names())
    return {k: v for k, v in vars(args).items() if k in names}


class EngineArgs:
    """vLLM's EngineArgs: a model and LLM's keyword arguments (vLLM's names too), checked now
    with no I/O (Config.from_kwargs). `LLM(args.model, **args.kwargs)` or
    `LLMEngine.from_engine_args(args)` builds the engine."""

    def __init__(self, model: str, **kwargs):
        Config.from_kwargs(model, **kwargs)
        self.model = model
        self.kwargs = dict(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)

    @staticmethod
    def add_cli_args(parser):
        """vLLM's: `--model` and a flag per LLM option on `parser`; returns it."""
        parser.add_argument("--model", required=True, help="a checkpoint folder (or a Hub id when online)")
        add_option_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(args.model, **option_values(args))

    def create_llm(self) -> LLM:
        """The LLM these arguments describe (what LLMEngine.from_engine_args runs on)."""
        return LLM(self.model, **self.kwargs)
