"""`SamplingParams` validation: every invalid value raises ValueError at construction, naming the field.

Pure Python (no model): defaults, the accepted edge values of every field, the rejected ones
(wrong type, bools where numbers are expected, nan/inf, out of range, inconsistent pairs), and the
normalised forms of `stop` / `stop_token_ids` the engine reads (`stop_strings`, `stop_ids`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm import SamplingParams

NAN = float("nan")
INF = float("inf")


def field_re(name: str) -> str:
    """A regex matching the field's name as a whole word (so "stop" does not match "stop_token_ids")."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


# ============================================================================================
# Defaults and valid values
# ============================================================================================


def test_defaults_match_the_spec():
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == -1
    assert p.min_p == 0.0
    assert p.max_tokens == 64
    assert p.min_tokens == 0
    assert p.ignore_eos is False
    assert p.stop is None
    assert p.stop_token_ids is None
    assert p.seed is None
    assert p.stop_strings == ()
    assert p.stop_ids == frozenset()
    assert not p.greedy


def test_field_names_are_vllm_compatible():
    names = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert {"temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "ignore_eos", "stop",
            "stop_token_ids", "seed"} <= names
    # Keyword construction of every documented field works.
    SamplingParams(temperature=0.5, top_p=0.9, top_k=10, min_p=0.1, max_tokens=8, min_tokens=2, ignore_eos=True,
                   stop=["x"], stop_token_ids=[3], seed=1)


@pytest.mark.parametrize("kw", [
    dict(temperature=0),            # greedy, as an int
    dict(temperature=0.0),
    dict(temperature=1),            # ints are numbers
    dict(temperature=0.01),
    dict(temperature=1e-3),
    dict(temperature=2.5),
    dict(temperature=100.0),
    dict(top_p=1.0),
    dict(top_p=1),
    dict(top_p=1e-6),
    dict(top_p=0.5),
    dict(top_k=-1),                 # off
    dict(top_k=0),                  # off as well
    dict(top_k=1),
    dict(top_k=50),
    dict(top_k=10**9),              # larger than any vocabulary: no filtering
    dict(min_p=0.0),
    dict(min_p=0),
    dict(min_p=0.05),
    dict(min_p=1.0),
    dict(min_p=1),
    dict(max_tokens=1),
    dict(max_tokens=4096),
    dict(min_tokens=0),
    dict(min_tokens=5, max_tokens=5),   # equal is fine
    dict(min_tokens=1, max_tokens=64),
    dict(ignore_eos=True),
    dict(ignore_eos=False),
    dict(seed=0),
    dict(seed=7),
    dict(seed=2**40),
    dict(seed=None),
    dict(stop=None),
    dict(stop="x"),
    dict(stop=[]),
    dict(stop=["a", "bc", "你好"]),
    dict(stop=("a", "b")),
    dict(stop_token_ids=None),
    dict(stop_token_ids=[]),
    dict(stop_token_ids=[0, 5, 514]),
    dict(stop_token_ids=(1, 2)),
])
def test_valid_values(kw):
    p = SamplingParams(**kw)
    for k, v in kw.items():
        assert getattr(p, k) == v


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


# ============================================================================================
# Invalid values: ValueError naming the field
# ============================================================================================

INVALID = [
    # temperature
    ("temperature", -1.0),
    ("temperature", -0.5),
    ("temperature", -1e-9),
    ("temperature", 1e-9),          # tiny but > 0: would overflow the logits
    ("temperature", 1e-30),
    ("temperature", 5e-324),        # smallest positive float
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -INF),
    ("temperature", True),
    ("temperature", False),
    ("temperature", "1.0"),
    ("temperature", None),
    ("temperature", [1.0]),
    # top_p
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.0000001),
    ("top_p", 1.5),
    ("top_p", 2),
    ("top_p", NAN),
    ("top_p", INF),
    ("top_p", -INF),
    ("top_p", True),
    ("top_p", "0.9"),
    ("top_p", None),
    # top_k
    ("top_k", -2),
    ("top_k", -100),
    ("top_k", 1.0),
    ("top_k", 2.5),
    ("top_k", NAN),
    ("top_k", INF),
    ("top_k", True),
    ("top_k", False),
    ("top_k", "5"),
    ("top_k", None),
    # min_p
    ("min_p", -0.1),
    ("min_p", -1e-12),
    ("min_p", 1.0000001),
    ("min_p", 2),
    ("min_p", NAN),
    ("min_p", INF),
    ("min_p", -INF),
    ("min_p", True),
    ("min_p", "0.1"),
    ("min_p", None),
    # max_tokens
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.0),
    ("max_tokens", 16.0),
    ("max_tokens", NAN),
    ("max_tokens", INF),
    ("max_tokens", True),
    ("max_tokens", "16"),
    # min_tokens
    ("min_tokens", -1),
    ("min_tokens", 65),              # > max_tokens (64 by default)
    ("min_tokens", 1.0),
    ("min_tokens", NAN),
    ("min_tokens", True),
    ("min_tokens", "1"),
    ("min_tokens", None),
    # ignore_eos
    ("ignore_eos", 1),
    ("ignore_eos", 0),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    # stop
    ("stop", ""),
    ("stop", ["a", ""]),
    ("stop", [""]),
    ("stop", 5),
    ("stop", ["a", 5]),
    ("stop", [None]),
    ("stop", b"x"),
    ("stop", [b"x"]),
    ("stop", {"a": 1}),
    ("stop", [["a"]]),
    # stop_token_ids
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, -5]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [1, 2.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [None]),
    ("stop_token_ids", ["1"]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", [[1]]),
    # seed
    ("seed", 1.0),
    ("seed", 1.5),
    ("seed", NAN),
    ("seed", "7"),
    ("seed", True),
    ("seed", False),
    ("seed", [7]),
]


@pytest.mark.parametrize("name,value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=field_re(name)):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("kw", [
    dict(min_tokens=5, max_tokens=4),
    dict(min_tokens=2, max_tokens=1),
    dict(min_tokens=100, max_tokens=64),
])
def test_min_tokens_above_max_tokens(kw):
    with pytest.raises(ValueError, match=field_re("min_tokens")):
        SamplingParams(**kw)


def test_invalid_value_among_valid_ones_is_named():
    # The error names the bad field, not the first field or some other one.
    with pytest.raises(ValueError, match=field_re("min_p")) as e:
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=1.5, max_tokens=10, seed=3)
    assert not re.search(field_re("temperature"), str(e.value))
    with pytest.raises(ValueError, match=field_re("seed")):
        SamplingParams(temperature=0.0, stop=["x"], stop_token_ids=[1], seed="abc")


def test_greedy_still_validates_the_filters():
    # Greedy does not make the sampling filters' values irrelevant: they are still validated.
    with pytest.raises(ValueError, match=field_re("top_p")):
        SamplingParams(temperature=0.0, top_p=0.0)
    with pytest.raises(ValueError, match=field_re("top_k")):
        SamplingParams(temperature=0.0, top_k=-3)


def test_invalid_error_is_value_error_not_type_error():
    # Wrong types are invalid parameter values too: ValueError (as the issue asks), not TypeError.
    for kw in (dict(temperature="hot"), dict(top_k=2.0), dict(stop=7), dict(stop_token_ids=[1.5]), dict(seed=1.0)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# ============================================================================================
# stop / stop_token_ids normalisation
# ============================================================================================


@pytest.mark.parametrize("stop,expected", [
    (None, ()),
    ([], ()),
    ((), ()),
    ("x", ("x",)),
    ("</s>", ("</s>",)),
    (["a", "b"], ("a", "b")),
    (("a", "b"), ("a", "b")),
    (["你好", "😀"], ("你好", "😀")),
    (["b", "a", "b"], ("b", "a", "b")),  # order kept (the first listed wins a tie); duplicates harmless
])
def test_stop_normalised_to_tuple_of_strings(stop, expected):
    p = SamplingParams(stop=stop)
    assert isinstance(p.stop_strings, tuple)
    assert p.stop_strings == expected
    assert all(isinstance(s, str) and s for s in p.stop_strings)


def test_single_stop_string_is_not_split_into_characters():
    assert SamplingParams(stop="abc").stop_strings == ("abc",)


@pytest.mark.parametrize("ids,expected", [
    (None, frozenset()),
    ([], frozenset()),
    ([5], frozenset({5})),
    ([5, 7, 5], frozenset({5, 7})),
    ((0, 514), frozenset({0, 514})),
])
def test_stop_token_ids_normalised(ids, expected):
    p = SamplingParams(stop_token_ids=ids)
    assert p.stop_ids == expected
    assert all(type(t) is int for t in p.stop_ids)


def test_normalised_forms_do_not_alias_caller_lists():
    stop = ["a"]
    ids = [3]
    p = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("b")
    ids.append(4)
    assert p.stop_strings == ("a",)
    assert p.stop_ids == frozenset({3})


# ============================================================================================
# Property: every in-range combination is accepted, every out-of-range number is rejected
# ============================================================================================


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(1e-3, 1e3)),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.one_of(st.just(-1), st.integers(0, 10**6)),
    min_p=st.floats(0.0, 1.0),
    max_tokens=st.integers(1, 10**5),
    data=st.data(),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)
def test_valid_combinations_accepted(temperature, top_p, top_k, min_p, max_tokens, data, seed):
    min_tokens = data.draw(st.integers(0, max_tokens))
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                       min_tokens=min_tokens, seed=seed)
    assert p.min_tokens <= p.max_tokens


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(["temperature", "top_p", "min_p"]),
    value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10)),
)
def test_float_fields_range(field, value):
    valid = {
        "temperature": lambda v: math.isfinite(v) and (v == 0 or v >= 1e-2),
        "top_p": lambda v: 0 < v <= 1,
        "min_p": lambda v: 0 <= v <= 1,
    }[field]
    invalid = {
        "temperature": lambda v: not math.isfinite(v) or v < 0 or 0 < v < 1e-8,
        "top_p": lambda v: not (0 < v <= 1),
        "min_p": lambda v: not (0 <= v <= 1),
    }[field]
    if valid(value):
        SamplingParams(**{field: value})
    elif invalid(value):
        with pytest.raises(ValueError, match=field_re(field)):
            SamplingParams(**{field: value})
    # else: temperatures in [1e-8, 1e-2) may go either way (where "tiny" ends is the engine's choice)


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(["top_k", "max_tokens", "min_tokens", "seed"]), value=st.integers(-10**6, 10**6))
def test_int_fields_range(field, value):
    kw = {field: value}
    if field == "min_tokens":
        kw["max_tokens"] = 10**6
    ok = {
        "top_k": value >= -1,
        "max_tokens": value >= 1,
        "min_tokens": value >= 0,
        "seed": None,  # any integer seed is fine, negative ones included (or rejected cleanly)
    }[field]
    if ok is None:
        try:
            SamplingParams(**kw)
        except ValueError as e:
            assert re.search(field_re(field), str(e))
    elif ok:
        SamplingParams(**kw)
    else:
        with pytest.raises(ValueError, match=field_re(field)):
            SamplingParams(**kw)


def test_fields_can_be_set_afterwards_and_are_validated_again():
    """As in vLLM, fields can be set after construction (the issue that replaced the frozen
    dataclass); a bad value is caught when the engine takes its validated copy (snapshot),
    which is immutable, and normalised forms follow the new values."""
    import dataclasses

    p = SamplingParams(temperature=0.5, stop=["x"])
    p.max_tokens = 8
    p.stop = "y"
    assert p.max_tokens == 8 and p.stop_strings == ("y",)
    snap = p.snapshot()
    assert snap.max_tokens == 8 and snap.stop_strings == ("y",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.temperature = 0.7
    p.max_tokens = 9  # the engine's copy does not change with the caller's object
    assert snap.max_tokens == 8
    p.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        p.snapshot()
    with pytest.raises(AttributeError, match="no field"):
        p.temprature = 0.5  # a typo is not a silent new attribute
    q = dataclasses.replace(SamplingParams(temperature=0.5, stop=["x"]), max_tokens=7)
    assert q.max_tokens == 7 and q.stop_strings == ("x",)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(q, temperature=-1.0)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(5), min_p=np.float16(0.25),
                       max_tokens=np.int64(16), min_tokens=np.uint8(2), seed=np.int64(3), stop_token_ids=[np.int64(7)])
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens, p.seed) == (0.5, 0.9, 5, 0.25, 16, 2, 3)
    for name in ("temperature", "top_p", "min_p"):
        assert type(getattr(p, name)) is float, name
    for name in ("top_k", "max_tokens", "min_tokens", "seed"):
        assert type(getattr(p, name)) is int, name
    assert p.stop_ids == frozenset({7}) and all(type(t) is int for t in p.stop_ids)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=np.bool_(True))  # numpy's bool is not a count


def test_as_token_ids_takes_ints_and_numpy_ints_only():
    import numpy as np

    from nanovllm.sampling_params import as_token_ids

    assert as_token_ids([3, 1, 2]) == [3, 1, 2] and as_token_ids((5, 6)) == [5, 6]
    got = as_token_ids([np.int32(4), 7, np.int64(2)])
    assert got == [4, 7, 2] and all(type(t) is int for t in got)
    assert as_token_ids([1, True]) is None and as_token_ids([1.0]) is None and as_token_ids(["1"]) is None
    src = [1, 2]
    assert as_token_ids(src) is not src  # a copy: the caller's list is not the engine's


# ============================================================================================
# What one request may carry (nanovllm/limits.py): generous limits, a clear error beyond


def test_request_size_limits_accept_the_limit_and_refuse_one_more():
    from nanovllm.features.sampling_checks import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_STOP_STRING_CHARS,
                                                   MAX_STOP_STRINGS, MAX_TOKEN_ID_ENTRIES)

    ids = list(range(MAX_TOKEN_ID_ENTRIES))
    at_limit = dict(
        stop=[f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["x" * MAX_STOP_STRING_CHARS],
        bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS - 1)] + ["y" * MAX_BAD_WORD_CHARS],
        stop_token_ids=ids, allowed_token_ids=ids, logit_bias=dict.fromkeys(ids, 1.0))
    p = SamplingParams(**at_limit)
    assert len(p.stop_strings) == MAX_STOP_STRINGS and len(p.allowed_ids) == MAX_TOKEN_ID_ENTRIES
    over = dict(
        stop=[at_limit["stop"] + ["one more"], ["x" * (MAX_STOP_STRING_CHARS + 1)]],
        bad_words=[at_limit["bad_words"] + ["one more"], ["y" * (MAX_BAD_WORD_CHARS + 1)]],
        stop_token_ids=[ids + [0]], allowed_token_ids=[ids + [0]],
        logit_bias=[{**at_limit["logit_bias"], MAX_TOKEN_ID_ENTRIES: 1.0}])
    for name, values in over.items():
        for value in values:
            with pytest.raises(ValueError, match=field_re(name)) as e:
                SamplingParams(**{name: value})
            assert "more than" in str(e.value) and len(str(e.value)) < 200


def test_a_ten_million_character_stop_string_is_refused_with_a_short_message():
    """Before: accepted, and the detokenizer built every prefix of it (the server's engine was
    killed for memory)."""
    with pytest.raises(ValueError, match=field_re("stop")) as e:
        SamplingParams(stop=["ab" * 5_000_000])
    assert "10000000" in str(e.value) and len(str(e.value)) < 200


def test_invalid_values_are_quoted_not_echoed_whole():
    for kw in (dict(temperature="x" * 10**6), dict(stop=[1] * 10**5), dict(logit_bias={i: "big" for i in range(10**5)}),
               dict(best_of=[2] * 10**5)):
        with pytest.raises((ValueError, NotImplementedError)) as e:
            SamplingParams(**kw)
        assert len(str(e.value)) < 400, str(e.value)[:1000]
