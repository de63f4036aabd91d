"""A request's tools and tool choice: checked, and turned into what the output must follow.

- "none": no tools are called (they are still shown to the chat template, as vLLM does).
- "auto": the model may call tools in its own format; parsers.py reads the calls out.
- "required": the output is a JSON array of one or more {"name", "parameters"} objects whose
  parameters fit that function's schema (one object unless parallel_tool_calls), vLLM's form.
- a named function ({"type": "function", "function": {"name": ...}}): the output is that
  function's arguments, a JSON object fitting its `parameters`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from nanovllm.vllm_params import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def json(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls item (with `index` for a stream's delta)."""
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def functions(tools) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI's tool definitions (ValueError naming a bad one)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        out[fn["name"]] = params
    return out


def mode_of(tool_choice, tools) -> str:
    """"none", "auto", "required", or the name of the function the choice names."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice={tool_choice!r} needs tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}")
    if name not in functions(tools):
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return name


def constraint(mode: str, tools, parallel: bool) -> StructuredOutputsParams | None:
    """What the output must follow for this mode (None: "none" and "auto")."""
    if mode in ("none", "auto"):
        return None
    fns = functions(tools)
    if mode != "required":
        return StructuredOutputsParams(json=fns[mode])
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in fns.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def forced_calls(mode: str, text: str) -> list[ToolCall]:
    """The calls a constrained output spells ("required" or a named function); [] if the output
    was cut short (max_tokens) and does not parse."""
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return []
    if mode != "required":
        return [ToolCall(mode, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
