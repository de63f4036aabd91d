"""Per-request generation settings (vLLM-compatible names)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass

import xxhash

from nanovllm.limits import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                             MAX_TOKEN_ID_ENTRIES, check_size, clip_repr)
from nanovllm.values import as_token_ids, is_integer, is_real  # noqa: F401 (imported from here too)
from nanovllm.vllm_params import BeamSearchParams, RequestOutputKind, StructuredOutputsParams  # noqa: F401


# vLLM SamplingParams fields that nano-vllm does not implement, with the value that asks for
# nothing (accepted and dropped). Any other value is a NotImplementedError naming the field: a
# script that relies on one must not run silently without it.
NOT_IMPLEMENTED = {
    "best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "logits_processors": None, "guided_decoding": None,
    "truncate_prompt_tokens": None, "extra_args": None, "stream_interval": None,
    "logprob_token_ids": None, "prompt_logprob_token_ids": None, "prompt_logprob_start": None,
    "flat_logprobs": False, "thinking_token_budget": None, "repetition_detection": None,
    "skip_reading_prefix_cache": None, "trace_decode_token_ids": None, "skip_clone": False,
}


def _refuse_not_implemented(name: str, value) -> None:
    off = NOT_IMPLEMENTED[name]
    if value is off or (is_real(off) and is_real(value) and value == off):
        return
    raise NotImplementedError(f"SamplingParams.{name}={clip_repr(value)}: vLLM's {name} is not implemented by "
                              f"nano-vllm (leave it at {off!r})")


def derive_sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n > 1` and seed `seed`: sample 0 uses the
    seed itself (so it equals the same request with n=1), sample i > 0 a 63-bit hash of (seed, i),
    so no two (seed, i) pairs share a random stream (as seed + i would)."""
    if index == 0:
        return seed
    h = xxhash.xxh64((seed % (1 << 64)).to_bytes(8, "little"))
    h.update(index.to_bytes(8, "little"))
    return h.intdigest() >> 1


def _normalised(key: str, doc: str) -> property:
    """A read-only attribute of SamplingParams: the form of its fields that _validate stored
    under `key`, validated again first if a field was set since the last check."""
    def get(self):
        if not self.__dict__.get("_checked"):
            self._validate()
        return self.__dict__[key]

    return property(get, doc=doc)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops: vLLM's fields, docs/api.md says what each
    does (and which distribution logprobs describe).

    Fields can be set after construction (`sp.max_tokens = 8`), as in vLLM; every value is
    validated at construction and again when a request is added, and the engine keeps its own
    validated copy (`snapshot()`), so changing a SamplingParams never affects requests already
    added. Unknown fields are a TypeError; vLLM fields nano-vllm does not implement
    (NOT_IMPLEMENTED) are a NotImplementedError.
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
        if name in _FIELDS:
            object.__setattr__(self, name, value)
            object.__setattr__(self, "_checked", False)
        elif name in NOT_IMPLEMENTED:
            _refuse_not_implemented(name, value)
        else:
            raise AttributeError(f"SamplingParams has no field {name!r}")

    # ---------------------------------------------------------------- validation
    def _bad(self, name, why):
        raise ValueError(f"SamplingParams.{name}={clip_repr(getattr(self, name))}: {why}")

    def _validate(self) -> None:
        """Check every field (ValueError naming it), store numbers as Python's own, and derive
        the normalised forms the engine reads."""
        def put(name, value):
            object.__setattr__(self, name, value)

        self._check_numbers()
        stops, ids = self._check_stops()
        bias, allowed, words = self._check_token_lists()
        # Numbers are stored as Python's own (numpy's would reach the sampler's tensors).
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                           ("min_tokens", int), ("n", int), ("presence_penalty", float),
                           ("frequency_penalty", float), ("repetition_penalty", float)):
            put(name, kind(getattr(self, name)))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(name, int(getattr(self, name)))
        put("_stop_strings", stops)
        put("_stop_ids", frozenset(int(t) for t in ids))
        put("_logit_bias", bias)
        put("_allowed", allowed)
        put("_bad_words", words)
        put("_uses_penalties", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0)
        put("_processes_logits", self._uses_penalties or bias is not None or allowed is not None or bool(words)
            or self.structured_outputs is not None)
        put("_checked", True)

    def _check_numbers(self) -> None:
        """The sampling and length numbers, the flags, n, the penalties and the logprob counts."""
        bad, put = self._bad, lambda name, value: object.__setattr__(self, name, value)
        is_int, is_num = is_integer, is_real
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
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not (-2.0 <= v <= 2.0):
                bad(name, "must be a number in [-2, 2] (0 = off)")
        if not is_num(self.repetition_penalty) or not (0.0 < self.repetition_penalty < math.inf):
            bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is True:  # vLLM takes True as 1
                put(name, 1)
            elif v is not None and (not is_int(v) or v < -1):
                bad(name, "must be None (off), an integer >= 0, or -1 (the whole vocabulary)")

    def _check_stops(self) -> tuple[tuple[str, ...], list]:
        """(stop strings, stop token ids), checked."""
        bad, is_int = self._bad, is_integer
        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            bad("stop", "must be a string, a list of strings or None")
        if any(s == "" for s in stops):
            bad("stop", "stop strings must not be empty")
        check_size("SamplingParams.stop", stops, MAX_STOP_STRINGS, "stop strings", MAX_STOP_STRING_CHARS)
        if stops and not self.detokenize:
            bad("stop", "stop strings need detokenize=True")
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if isinstance(ids, (list, tuple, set, frozenset)):
            check_size("SamplingParams.stop_token_ids", ids, MAX_TOKEN_ID_ENTRIES)
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers or None")
        return stops, ids

    def _check_token_lists(self):
        """(logit_bias as {id: float} or None, allowed_token_ids as a sorted tuple or None,
        bad_words as a tuple), checked."""
        bad, is_int, is_num = self._bad, is_integer, is_real
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                bad("logit_bias", "must be a dict {token id: bias} or None")
            check_size("SamplingParams.logit_bias", bias, MAX_TOKEN_ID_ENTRIES)
            norm = {}
            for k, v in bias.items():
                if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                    k = int(k)  # OpenAI-style JSON keys
                if not is_int(k) or k < 0:
                    bad("logit_bias", f"key {k!r} is not a token id (a non-negative integer)")
                if not is_num(v) or not math.isfinite(v):
                    bad("logit_bias", f"bias {v!r} of token {k} must be a finite number")
                norm[int(k)] = float(v)
            bias = norm
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (list, tuple, set, frozenset)):
                check_size("SamplingParams.allowed_token_ids", allowed, MAX_TOKEN_ID_ENTRIES)
            if not isinstance(allowed, (list, tuple, set, frozenset)) or not allowed \
                    or not all(is_int(t) and t >= 0 for t in allowed):
                bad("allowed_token_ids", "must be None or a non-empty list of non-negative integers")
            allowed = tuple(sorted({int(t) for t in allowed}))
        words = self.bad_words
        if words is None:
            words = ()
        elif isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in words):
            words = tuple(dict.fromkeys(words))
        else:
            bad("bad_words", "must be None or a list of non-empty strings")
        check_size("SamplingParams.bad_words", words, MAX_BAD_WORDS, "words", MAX_BAD_WORD_CHARS)
        return bias, allowed, words

    def snapshot(self) -> "SamplingParams":
        """A validated, immutable copy for the engine to keep (ValueError if a field set after
        construction is invalid). The engine reads only this copy while a request runs."""
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
        and the filters (penalties, logit_bias, allowed_token_ids, bad_words, structured outputs): the
        sampler then needs this row's whole vocabulary, and the row's own device state for penalties.""")

    @property
    def bad_word_ids(self) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token sequences, set on the engine's copy (wiring.tokenize_bad_words)."""
        return self.__dict__.get("_bad_word_ids", ())

    def _set_bad_word_ids(self, ids: tuple[tuple[int, ...], ...]) -> None:
        object.__setattr__(self, "_bad_word_ids", ids)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    # vLLM fields nano-vllm lacks: their "off" value is dropped, any other is refused by name
    # (the dataclass's own __init__ would call them unknown).
    for name in NOT_IMPLEMENTED.keys() & kwargs.keys():
        _refuse_not_implemented(name, kwargs.pop(name))
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init
