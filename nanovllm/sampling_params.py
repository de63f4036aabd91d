"""Per-request generation settings (vLLM-compatible names)."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from nanovllm.limits import clip_repr
from nanovllm.values import as_token_ids, is_integer, is_real  # noqa: F401 (imported from here too)

if TYPE_CHECKING:
    from nanovllm.vllm_params import StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What each output of a request holds: everything so far, only the new part, or only the
    final result (LLM.generate and chat return final results whatever the kind, as vLLM's)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The fields a plain request leaves at their defaults: features/sampling_checks.py checks one only
# when it is not at its default (the same object, or of its type and equal to it).
FEATURE_FIELDS = ("stop", "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias", "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs", "structured_outputs")
# What those fields' defaults give the engine (the normalised forms the properties read).
_FEATURES_OFF = {"_stop_strings": (), "_stop_ids": frozenset(), "_logit_bias": None, "_allowed": None,
                 "_bad_words": (), "_uses_penalties": False, "_processes_logits": False}


# wiring/'s loader of features/sampling_checks.py: check_fields, vllm_only, derive_sample_seed and
# this module's names that a plain request does not load (see __getattr__).
FEATURE_CHECKS: list[Callable] = []


def __getattr__(name: str):
    """NOT_IMPLEMENTED and vLLM's classes beside SamplingParams, loaded when first named."""
    if name not in ("NOT_IMPLEMENTED", "BeamSearchParams", "StructuredOutputsParams"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(FEATURE_CHECKS[0](), name)


def derive_sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n > 1` and seed `seed`: sample 0 uses the
    seed itself (so it equals the same request with n=1), another features/sampling_checks.py's."""
    return seed if index == 0 else FEATURE_CHECKS[0]().derive_sample_seed(seed, index)


def _normalised(key: str, doc: str) -> property:
    """A read-only attribute: what _validate stored under `key` (validated again if a field was set)."""
    def get(self):
        if not self.__dict__.get("_checked"):
            self._validate()
        return self.__dict__[key]

    return property(get, doc=doc)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops: vLLM's fields (docs/api.md). Fields can be
    set after construction, as in vLLM; the engine keeps its own validated copy (`snapshot()`), so
    changing one never affects requests already added. vLLM fields nano-vllm lacks
    (NOT_IMPLEMENTED) are a NotImplementedError, other unknown ones a TypeError.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self._validate()

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name!r}: this is the engine's validated copy of a request's SamplingParams "
                "(set the field on the SamplingParams you pass instead)")
        if name in _DEFAULTS:
            object.__setattr__(self, name, value)
            object.__setattr__(self, "_checked", False)
        elif not FEATURE_CHECKS[0]().vllm_only(name, value):
            raise AttributeError(f"SamplingParams has no field {name!r}")

    # ---------------------------------------------------------------- validation
    def _bad(self, name, why):
        raise ValueError(f"SamplingParams.{name}={clip_repr(getattr(self, name))}: {why}")

    def _validate(self) -> None:
        """Check every field (ValueError naming it), store numbers as Python's own (numpy's would
        reach the sampler's tensors), and derive the normalised forms the engine reads."""
        bad, is_int, is_num = self._bad, is_integer, is_real
        if not is_num(self.temperature) or not (self.temperature >= 0.0) or self.temperature == float("inf"):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.temperature != 0 and self.temperature < 1e-5:
            bad("temperature", "must be 0 (greedy) or >= 1e-5; smaller values overflow the logits")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be None (up to max_model_len) or an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        values = {name: kind(getattr(self, name)) for name, kind in _NUMBERS if getattr(self, name) is not None}
        values.update(_FEATURES_OFF)
        changed = [name for name in FEATURE_FIELDS if not _is_default(getattr(self, name), _DEFAULTS[name])]
        if changed:
            values.update(FEATURE_CHECKS[0]().check_fields(self, changed))
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_checked", True)

    def snapshot(self) -> "SamplingParams":
        """A validated, immutable copy: the one the engine reads while a request runs."""
        if self.__dict__.get("_frozen"):
            return self
        snap = copy.copy(self)
        snap._validate()
        object.__setattr__(snap, "_frozen", True)
        return snap

    def clone(self) -> "SamplingParams":
        """A mutable, independent copy (vLLM's name)."""
        fields = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return SamplingParams(**fields)

    # ---------------------------------------------------------------- what the engine reads
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    stop_strings = _normalised("_stop_strings", "`stop` as a tuple of strings.")
    stop_ids = _normalised("_stop_ids", "`stop_token_ids` as a frozenset of ints.")
    bias = _normalised("_logit_bias", "`logit_bias` with int keys and float values, or None.")
    allowed_ids = _normalised("_allowed", "`allowed_token_ids`, sorted and without repeats, or None.")
    bad_word_strings = _normalised("_bad_words", "`bad_words` without repeats.")
    uses_penalties = _normalised("_uses_penalties", "presence, frequency or repetition penalty set.")
    processes_logits = _normalised("_processes_logits", """Whether the logits are changed before temperature
        and the filters (penalties, logit_bias, allowed_token_ids, bad_words, structured outputs).""")

    @property
    def bad_word_ids(self) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token sequences, set on the engine's copy (wiring.tokenize_bad_words)."""
        return self.__dict__.get("_bad_word_ids", ())

    def _set_bad_word_ids(self, ids: tuple[tuple[int, ...], ...]) -> None:
        object.__setattr__(self, "_bad_word_ids", ids)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
_NUMBERS = (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float), ("max_tokens", int),
            ("min_tokens", int), ("seed", int))
_dataclass_init = SamplingParams.__init__


def _is_default(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    # vLLM fields nano-vllm lacks: their "off" value is dropped, any other refused (vllm_only).
    for name in kwargs.keys() - _DEFAULTS.keys():
        if FEATURE_CHECKS[0]().vllm_only(name, kwargs[name]):
            del kwargs[name]
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init
