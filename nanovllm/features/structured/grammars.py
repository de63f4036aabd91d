"""StructuredOutputsParams -> an xgrammar CompiledGrammar, checked and compiled once per distinct
constraint, before the request runs: a bad schema, regex or grammar is a ValueError naming it.

xgrammar (an optional dependency, `pip install xgrammar`, as vLLM's default backend) compiles a
grammar against the tokenizer's vocabulary: which tokens may follow every state is worked out
once, so that each step's mask costs microseconds.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

from nanovllm.vllm_params import StructuredOutputsParams

try:
    import xgrammar as xgr
except ImportError:  # optional: refused with a clear error when a request asks for it
    xgr = None

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_CACHE_SIZE = 256  # distinct constraints kept compiled


def _message(e: Exception) -> str:
    """xgrammar's error without its C++ location prefix ("[time] /path.cc:line: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()


def constraint_of(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): the one constraint `spec` sets, checked for its type."""
    if not isinstance(spec, StructuredOutputsParams):
        raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got {type(spec).__name__}")
    kinds = [k for k in KINDS if getattr(spec, k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                         f"{', '.join(kinds) or 'none'}")
    kind, value = kinds[0], getattr(spec, kinds[0])
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return kind, json.dumps(value)  # (key order kept: it is the order properties are written in)
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return kind, json.dumps(list(value))
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be True or None")
        return kind, ""
    if kind == "structural_tag" and not isinstance(value, str):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return kind, value


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly the choices (JSON string literals are EBNF's too; kept
    unescaped, since xgrammar reads a \\u escape of a surrogate pair as two lone surrogates)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """The compiler for one tokenizer and vocabulary (the model's: padded ids are never allowed),
    with its compiled constraints. stop_ids: the tokens that end a finished output (the engine's
    EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        if xgr is None:
            raise ValueError("structured outputs need the xgrammar package: pip install xgrammar")
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init=True was given)")
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self._compiled: OrderedDict = OrderedDict()
        self.tokenizer = tokenizer

    def token_id(self, token: str) -> int | None:
        """The id of a token that is one piece of the vocabulary (e.g. "</think>"), else None."""
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def compile(self, spec: StructuredOutputsParams):
        """The CompiledGrammar of `spec` (ValueError naming what is wrong with it)."""
        kind, text = constraint_of(spec)
        key = (kind, text, bool(spec.disable_any_whitespace))
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            compiled = self._compile(kind, text, spec)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{kind}: {_message(e)}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str, spec: StructuredOutputsParams):
        c, any_ws = self.compiler, not spec.disable_any_whitespace
        if kind == "json":
            # strict: no properties beyond the schema's (xgrammar's and vLLM's default)
            return c.compile_json_schema(text, any_whitespace=any_ws)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(json.loads(text)))
        if kind == "grammar":
            return c.compile_grammar(text)
        try:
            return c.compile_structural_tag(text)
        except (TypeError, ValueError) as e:
            raise RuntimeError(str(e)) from None
