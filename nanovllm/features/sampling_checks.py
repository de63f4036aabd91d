"""The checks of SamplingParams' feature fields (stop strings and ids, n, penalties, logit_bias,
allowed_token_ids, bad_words, logprobs, structured_outputs) and of vLLM's fields nano-vllm lacks:
sampling_params.py's FEATURE_CHECKS, registered by wiring/. A plain request leaves every one of
these fields at its default, so it never loads this module (n > 1's sample seeds are here too)."""

from __future__ import annotations

import math

import xxhash

from nanovllm.limits import clip_repr
from nanovllm.values import is_integer, is_real
from nanovllm.vllm_params import BeamSearchParams, StructuredOutputsParams  # noqa: F401 (sampling_params' names)

# What one request may carry (a ValueError beyond): generous for real use, and small enough that
# no request makes the engine build huge structures or scan huge lists.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 4096
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_TOKEN_ID_ENTRIES = 1 << 18  # stop_token_ids, logit_bias, allowed_token_ids: the largest vocabularies

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
_TOKEN_ID_LISTS = (list, tuple, set, frozenset)


def vllm_only(name: str, value) -> bool:
    """True if `name` is one of NOT_IMPLEMENTED given its off value (to drop); any other value of
    one is a NotImplementedError naming it; False for a name vLLM does not have either."""
    if name not in NOT_IMPLEMENTED:
        return False
    off = NOT_IMPLEMENTED[name]
    if value is off or (is_real(off) and is_real(value) and value == off):
        return True
    raise NotImplementedError(f"SamplingParams.{name}={clip_repr(value)}: vLLM's {name} is not implemented by "
                              f"nano-vllm (leave it at {off!r})")


def derive_sample_seed(seed: int, index: int) -> int:
    """sampling_params.derive_sample_seed for sample `index` > 0: a 63-bit hash of (seed, index),
    so no two (seed, index) pairs share a random stream (as seed + index would)."""
    h = xxhash.xxh64((seed % (1 << 64)).to_bytes(8, "little"))
    h.update(index.to_bytes(8, "little"))
    return h.intdigest() >> 1


def check_size(name: str, values, limit: int, what: str = "entries", chars: int = 0) -> None:
    """A ValueError naming `name` if there are more than `limit` values or, with `chars`, a
    string value longer than that."""
    if len(values) > limit:
        raise ValueError(f"{name}: {len(values)} {what}, more than the {limit} a request may carry")
    longest = max(map(len, values), default=0) if chars else 0
    if longest > chars:
        raise ValueError(f"{name}: one of the {what} has {longest} characters, more than the {chars} allowed")


def check_fields(params, names: list[str]) -> dict:
    """Check the fields `names` of `params` (each off its default; ValueError naming the first
    bad one); returns what SamplingParams stores: those fields as Python's own numbers and the
    normalised forms its properties read."""
    out = {}
    for name in names:
        out.update(_CHECKS[name](params, params._bad))
    value = lambda name: out.get(name, getattr(params, name))  # noqa: E731
    penalties = (value("presence_penalty") != 0.0 or value("frequency_penalty") != 0.0
                 or value("repetition_penalty") != 1.0)
    out["_uses_penalties"] = penalties
    out["_processes_logits"] = (penalties or out.get("_logit_bias") is not None or out.get("_allowed") is not None
                                or bool(out.get("_bad_words")) or params.structured_outputs is not None)
    return out


def _stop(p, bad) -> dict:
    stop = p.stop
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
    if stops and not p.detokenize:
        bad("stop", "stop strings need detokenize=True")
    return {"_stop_strings": stops}


def _stop_token_ids(p, bad) -> dict:
    ids = [] if p.stop_token_ids is None else p.stop_token_ids
    if isinstance(ids, _TOKEN_ID_LISTS):
        check_size("SamplingParams.stop_token_ids", ids, MAX_TOKEN_ID_ENTRIES)
    if not isinstance(ids, _TOKEN_ID_LISTS) or not all(is_integer(t) and t >= 0 for t in ids):
        bad("stop_token_ids", "must be a list of non-negative integers or None")
    return {"_stop_ids": frozenset(int(t) for t in ids)}


def _n(p, bad) -> dict:
    if not is_integer(p.n) or p.n < 1:
        bad("n", "must be an integer >= 1")
    return {"n": int(p.n)}


def _additive_penalty(name: str):
    def check(p, bad) -> dict:
        v = getattr(p, name)
        if not is_real(v) or not (-2.0 <= v <= 2.0):
            bad(name, "must be a number in [-2, 2] (0 = off)")
        return {name: float(v)}

    return check


def _repetition_penalty(p, bad) -> dict:
    if not is_real(p.repetition_penalty) or not (0.0 < p.repetition_penalty < math.inf):
        bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
    return {"repetition_penalty": float(p.repetition_penalty)}


def _logprob_count(name: str):
    def check(p, bad) -> dict:
        v = getattr(p, name)
        if v is True:  # vLLM takes True as 1
            return {name: 1}
        if v is not None and (not is_integer(v) or v < -1):
            bad(name, "must be None (off), an integer >= 0, or -1 (the whole vocabulary)")
        return {name: None if v is None else int(v)}

    return check


def _logit_bias(p, bad) -> dict:
    bias = p.logit_bias
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        bad("logit_bias", "must be a dict {token id: bias} or None")
    check_size("SamplingParams.logit_bias", bias, MAX_TOKEN_ID_ENTRIES)
    norm = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)  # OpenAI-style JSON keys
        if not is_integer(k) or k < 0:
            bad("logit_bias", f"key {k!r} is not a token id (a non-negative integer)")
        if not is_real(v) or not math.isfinite(v):
            bad("logit_bias", f"bias {v!r} of token {k} must be a finite number")
        norm[int(k)] = float(v)
    return {"_logit_bias": norm}


def _allowed_token_ids(p, bad) -> dict:
    allowed = p.allowed_token_ids
    if allowed is None:
        return {}
    if isinstance(allowed, _TOKEN_ID_LISTS):
        check_size("SamplingParams.allowed_token_ids", allowed, MAX_TOKEN_ID_ENTRIES)
    if not isinstance(allowed, _TOKEN_ID_LISTS) or not allowed or not all(is_integer(t) and t >= 0 for t in allowed):
        bad("allowed_token_ids", "must be None or a non-empty list of non-negative integers")
    return {"_allowed": tuple(sorted({int(t) for t in allowed}))}


def _bad_words(p, bad) -> dict:
    words = p.bad_words
    if words is None:
        words = ()
    elif isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in words):
        words = tuple(dict.fromkeys(words))
    else:
        bad("bad_words", "must be None or a list of non-empty strings")
    check_size("SamplingParams.bad_words", words, MAX_BAD_WORDS, "words", MAX_BAD_WORD_CHARS)
    return {"_bad_words": words}


def _structured_outputs(p, bad) -> dict:
    if not isinstance(p.structured_outputs, (StructuredOutputsParams, type(None))):
        bad("structured_outputs", "must be a StructuredOutputsParams or None")
    return {}


_CHECKS = {
    "stop": _stop, "stop_token_ids": _stop_token_ids, "n": _n,
    "presence_penalty": _additive_penalty("presence_penalty"),
    "frequency_penalty": _additive_penalty("frequency_penalty"),
    "repetition_penalty": _repetition_penalty, "logit_bias": _logit_bias,
    "allowed_token_ids": _allowed_token_ids, "bad_words": _bad_words,
    "logprobs": _logprob_count("logprobs"), "prompt_logprobs": _logprob_count("prompt_logprobs"),
    "structured_outputs": _structured_outputs,
}
