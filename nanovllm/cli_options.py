"""The command-line flags of every LLM option (one flag per option of option_names):
EngineArgs.add_cli_args / from_cli_args and the server's command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from nanovllm.config import FEATURE_OPTIONS, SUB_CONFIGS, Config


def option_names() -> dict[str, tuple[object, object]]:
    """LLM's keywords but `model`: name -> (type, default), the features' options included."""
    options = {}
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if f.init and f.name != "model" and f.name not in SUB_CONFIGS:
            options[f.name] = (hints[f.name], f.default)
    for key, (sub, name) in FEATURE_OPTIONS.items():
        f = next(x for x in dataclasses.fields(SUB_CONFIGS[sub]) if x.name == name)
        options[key] = (typing.get_type_hints(SUB_CONFIGS[sub])[name], f.default)
    return options


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
    for name, (hint, default) in option_names().items():
        default = defaults.get(name, default)
        text = helps.get(name, f"LLM option {name} (see docs/api.md)") + f" [default: {default!r}]"
        flag = "--" + name.replace("_", "-")
        if hint is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=text)
        else:
            group.add_argument(flag, dest=name, type=_flag_type(hint), default=argparse.SUPPRESS, help=text)


def add_cli_args(parser):
    """EngineArgs.add_cli_args: `--model` and a flag per LLM option on `parser`; returns it."""
    parser.add_argument("--model", required=True, help="a checkpoint folder (or a Hub id when online)")
    add_option_flags(parser)
    return parser


def option_values(args: argparse.Namespace) -> dict:
    """The LLM options the parsed flags give (those set on the command line)."""
    names = set(option_names())
    return {k: v for k, v in vars(args).items() if k in names}
