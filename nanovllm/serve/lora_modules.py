"""The server's LoRA adapters (vLLM's `--lora-modules`, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`): each served under its own model name, listed in `/v1/models`, and
chosen by a request whose `model` is that name.

An adapter gets a fresh id each time it is loaded, so an adapter unloaded and loaded again from
another folder never reuses the engine's copy of the old one. The server checks the folder, its
adapter_config.json and its rank; the engine reads the weights (and checks their shapes and
target modules) at the first request that names it, which fails with a 400 saying what does
not fit.
"""

from __future__ import annotations

import itertools
import json
import os

from nanovllm.features.lora.adapter import read_config
from nanovllm.lora.request import LoRARequest


def parse_lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON {"name", "path"} -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text!r}: JSON entries need \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give name=path (or JSON with \"name\" and \"path\")")
    return name, path


class LoraModules:
    """name -> LoRARequest of the adapters the server serves; `base`: the base model's name."""

    def __init__(self, base: str, enabled: bool, modules: list[tuple[str, str]] = (), max_rank: int = 16):
        self.base, self.enabled, self.max_rank = base, enabled, max_rank
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        if modules and not enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in folder `path` as `name` (ValueError / FileNotFoundError naming the
        problem: LoRA off, a name taken, no PEFT adapter there)."""
        if not self.enabled:
            raise ValueError("this server runs without LoRA (start it with --enable-lora)")
        if not name or name == self.base or name in self.adapters:
            raise ValueError(f"the model name {name!r} is taken (or empty): unload it first or pick another")
        if not os.path.isdir(path or ""):
            raise FileNotFoundError(f"LoRA adapter {name!r}: no folder {path!r}")
        config = read_config(path)
        rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()])
        if rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above the server's --max-lora-rank {self.max_rank}")
        request = LoRARequest(name, next(self._ids), path, self.base)
        self.adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model, or no model given);
        KeyError for a name the server does not serve."""
        if model is None or model == self.base:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise KeyError(model)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "nano-vllm", "root": r.lora_path,
                 "parent": self.base, "max_model_len": max_model_len} for name, r in self.adapters.items()]
