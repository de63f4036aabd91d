"""Tests for incremental detokenization, stop strings and streaming deltas."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nanovllm.core.detokenizer import decoder, detokenize_continuation
from nanovllm.features.text_tracking import IncrementalDetokenizer, StopMatcher


def detokenize(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """The reference: `ids` decoded in one go (clean-up off, as in the engine)."""
    return decoder(tokenizer, skip_special_tokens)(list(ids))

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Small vocabulary: common words merge into single tokens while most CJK characters and all
# emoji stay split across several byte tokens.
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème, naïve façade, résumé, Zoë's piñata, Ångström, über.",
    "你好，世界。我们今天学习中文，天气很好。",
    "日本語のテキストと한국어 텍스트.",
    "emoji 😀🎉👍🏽 party 🚀 ok ❤️ 🙂 done",
    "mixed: tea 茶 and 🍵, coffee ☕ and café.",
]
ALPHABET = "abcdefghij XYZ.,!éüñçÅ你好世界中文天😀🎉👍🏽🚀🙂☕\n"


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=t,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        clean_up_tokenization_spaces=False,
    )


_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def byte_ids(tok, text):
    """One token per UTF-8 byte, so every multi-byte character is split."""
    symbols = _BYTE_LEVEL.pre_tokenize_str(text)[0][0] if text else ""
    return [tok.convert_tokens_to_ids(c) for c in symbols]


def split_randomly(tok, ids, rng):
    """Re-tokenize some tokens byte by byte: same bytes, different token boundaries."""
    out = []
    for i in ids:
        if rng.random() < 0.4 and i >= len(SPECIALS):
            out.extend(tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(i))
        else:
            out.append(i)
    return out


def chunked(ids, rng, max_chunk=3):
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def stream(det, chunks):
    """Feed chunks, collecting a delta after each; returns (deltas, add results)."""
    deltas, results = [], []
    for c in chunks:
        results.append(det.add(c))
        deltas.append(det.pop_delta(finished=det.stopped))
    deltas.append(det.pop_delta(finished=True))
    return deltas, results


def run(tok, chunks, stop=(), prompt=(), skip_special_tokens=True):
    det = IncrementalDetokenizer(tok, list(prompt), stop=stop, skip_special_tokens=skip_special_tokens)
    deltas, results = stream(det, chunks)
    assert "".join(deltas) == det.text
    return det, deltas, results


def random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


# --- incremental text == full decode ---------------------------------------------------


def test_random_token_sequences_match_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    for trial in range(400):
        if trial % 2:
            # Arbitrary ids, including specials and byte tokens forming invalid UTF-8.
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        else:
            ids = split_randomly(tok, tok.encode(random_text(rng, rng.randint(0, 30))), rng)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        skip = bool(rng.getrandbits(1))
        det, _, results = run(tok, chunked(ids, rng), prompt=prompt, skip_special_tokens=skip)
        assert det.text == tok.decode(ids, skip_special_tokens=skip), (ids, prompt)
        assert det.text == detokenize(tok, ids, skip_special_tokens=skip)
        assert not any(results) and det.stop_string is None and det.finished


def test_valid_text_never_broken_in_deltas(tok):
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(1, 40))
        ids = split_randomly(tok, tok.encode(text), rng)
        if rng.random() < 0.3:
            ids = byte_ids(tok, text)
        prompt = tok.encode(random_text(rng, 5))
        det, deltas, _ = run(tok, chunked(ids, rng), prompt=prompt)
        assert det.text == text
        assert all("\ufffd" not in d for d in deltas)


def test_incomplete_character_is_held_then_completed(tok):
    ids = byte_ids(tok, "a😀")  # 'a' then four bytes
    det = IncrementalDetokenizer(tok, [])
    seen = []
    for i in ids:
        det.add([i])
        seen.append(det.text)
    assert seen == ["a", "a", "a", "a", "a😀"]


def test_finish_flushes_incomplete_tail(tok):
    ids = byte_ids(tok, "ok中")[:-1]  # last character cut short
    det = IncrementalDetokenizer(tok, [])
    for i in ids:
        det.add([i])
    assert det.text == "ok" and det.pop_delta(finished=False) == "ok"
    assert det.pop_delta(finished=True) == "\ufffd"
    assert det.text == tok.decode(ids) == "ok\ufffd"


def test_prompt_ending_inside_a_character(tok):
    # The output must not "complete" a character started by the prompt.
    raw = byte_ids(tok, "中x")
    prompt, ids = tok.encode("hi") + raw[:2], raw[2:]
    det, _, _ = run(tok, [[i] for i in ids], prompt=prompt)
    assert det.text == tok.decode(ids) == "\ufffdx"


def test_special_tokens(tok):
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" 你好")
    ids += [tok.eos_token_id]
    for skip in (True, False):
        det, _, _ = run(tok, [[i] for i in ids], skip_special_tokens=skip)
        assert det.text == tok.decode(ids, skip_special_tokens=skip)
    assert run(tok, [ids], skip_special_tokens=True)[0].text == "Hello 你好"
    assert run(tok, [ids], skip_special_tokens=False)[0].text == "Hello<|im_end|> 你好<|endoftext|>"


def test_windows_stay_small_and_generic_tokenizers_work(tok):
    """Per-token cost must not grow with the output; also covers the non-fast decode path."""

    class Spy:
        def __init__(self):
            self.lengths = []

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
            self.lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(2)
    text = random_text(rng, 600)
    ids = split_randomly(tok, tok.encode(text), rng)
    spy = Spy()
    det, _, _ = run(spy, [[i] for i in ids], prompt=tok.encode("prompt " * 50))
    assert det.text == text
    assert len(ids) > 400 and max(spy.lengths) <= 12


def test_raw_tokenizers_tokenizer(tok):
    ids = byte_ids(tok, "naïve 🚀")
    det, _, _ = run(tok.backend_tokenizer, [[i] for i in ids])
    assert det.text == "naïve 🚀"


# --- stop strings ------------------------------------------------------------------------


def test_stop_inside_one_token(tok):
    # A merged ASCII token of 4+ characters, e.g. " and"; the stop string is its middle.
    token = next(
        i for i in range(len(SPECIALS), len(tok))
        if len(w := tok.decode([i])) >= 4 and w.isascii() and w.strip().isalpha()
    )
    word = tok.decode([token])
    ids = tok.encode("ab") + [token] + tok.encode("zz")
    det, deltas, results = run(tok, [[i] for i in ids], stop=(word[1:3],))
    assert det.stopped and det.stop_string == word[1:3]
    assert det.text == "ab" + word[0]
    assert results.index(True) == len(tok.encode("ab"))  # stopped on that very token


@pytest.mark.parametrize("n_tokens", [2, 3])
def test_stop_spanning_tokens(tok, n_tokens):
    ids = byte_ids(tok, "xyz abcdef")
    stop = "abcdef"[1 : 1 + n_tokens]  # one byte token per character
    det, deltas, results = run(tok, [[i] for i in ids], stop=(stop,))
    assert det.text == "xyz a" and det.stop_string == stop
    assert results.index(True) == len("xyz a") + n_tokens - 1


def test_stop_at_very_start(tok):
    det, deltas, results = run(tok, [[i] for i in byte_ids(tok, "Hello there")], stop=("He",))
    assert det.text == "" and det.stop_string == "He" and results[1]
    assert "".join(deltas) == ""


def test_earliest_occurrence_wins(tok):
    # "foo" is listed second but occurs first; both end inside the same chunk.
    det, _, _ = run(tok, [tok.encode("x foo bar y")], stop=("bar", "foo"))
    assert det.text == "x " and det.stop_string == "foo"
    # Same position: the first listed one is reported; the cut is the same either way.
    det, _, _ = run(tok, [tok.encode("x foo bar y")], stop=("foo b", "foo"))
    assert det.text == "x " and det.stop_string == "foo b"
    # Token by token, the stop string completed first ends the request.
    det, _, _ = run(tok, [[i] for i in byte_ids(tok, "x foo bar y")], stop=("bar", "foo"))
    assert det.text == "x " and det.stop_string == "foo"


def test_multibyte_stop_string(tok):
    ids = byte_ids(tok, "café😀 ok")
    det, deltas, results = run(tok, [[i] for i in ids], stop=("é😀",))
    assert det.text == "caf" and det.stop_string == "é😀"
    assert results.index(True) == len("caf".encode()) + len("é😀".encode()) - 1
    assert all("\ufffd" not in d for d in deltas)


def test_stop_found_before_a_character_that_is_still_incomplete(tok):
    # The chunk ends inside a character: the complete characters before it are text already,
    # so the stop string among them ends the request at once, not at finish().
    ids = tok.encode("ab") + byte_ids(tok, "c中")[:-1]
    det = IncrementalDetokenizer(tok, [], stop=("c",))
    assert det.add(ids) is True and det.text == "ab" and det.stop_string == "c"
    assert det.finished


def test_text_before_an_incomplete_character_is_released_and_the_rest_held(tok):
    ids = tok.encode("ab") + byte_ids(tok, "中")
    det = IncrementalDetokenizer(tok, [], stop=("zz",))
    assert det.add(ids[:-1]) is False and det.text == "ab"
    assert det.pop_delta(False) == "ab"  # nothing of the incomplete character leaks out
    assert det.add(ids[-1:]) is False and det.text == "ab中"
    assert det.pop_delta(True) == "中"
    assert det.text == detokenize(tok, ids)


def test_flush_of_a_character_never_completed(tok):
    ids = tok.encode("ab") + byte_ids(tok, "中")[:-1]
    det = IncrementalDetokenizer(tok, [])
    assert det.add(ids) is False and det.text == "ab"
    assert det.finish() is False and det.text == detokenize(tok, ids) and det.text.startswith("ab\ufffd")


def test_no_stop_text_equals_decode(tok):
    ids = tok.encode("Hello world, café 你好 🚀")
    det, _, results = run(tok, [[i] for i in ids], stop=("zzz", "😀"))
    assert not any(results) and not det.stopped
    assert det.text == tok.decode(ids, skip_special_tokens=True)


def test_tokens_after_stop_are_ignored(tok):
    det = IncrementalDetokenizer(tok, [], stop=("!",))
    assert det.add(tok.encode("hi!")) is True
    assert det.add(tok.encode(" more")) is True
    assert det.text == "hi" and det.pop_delta(finished=True) == "hi"


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=("ok", ""))


# --- streaming ---------------------------------------------------------------------------


def test_pop_delta_holds_back_only_possible_stop_starts(tok):
    det = IncrementalDetokenizer(tok, [], stop=("cde", "zz"))
    ids = byte_ids(tok, "abcdxyz")
    det.add(ids[:3])  # "abc": "c" may start "cde"
    assert det.pop_delta(finished=False) == "ab"
    det.add(ids[3:4])  # "abcd": "cd" may still start "cde"
    assert det.pop_delta(finished=False) == ""
    det.add(ids[4:5])  # "abcdx": no longer
    assert det.pop_delta(finished=False) == "cdx"
    det.add(ids[5:7])  # "...yz": "z" may start "zz"
    assert det.pop_delta(finished=False) == "y"
    assert det.pop_delta(finished=True) == "z"
    assert det.text == "abcdxyz" and not det.stopped


def test_pop_delta_without_stop_strings_sends_everything(tok):
    det = IncrementalDetokenizer(tok, [])
    det.add(tok.encode("Hello"))
    assert det.pop_delta(finished=False) == "Hello"
    assert det.pop_delta(finished=False) == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_and_delta_invariants(tok, data):
    text = data.draw(st.text(alphabet=ALPHABET, min_size=0, max_size=30))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    # Stop strings: pieces of the text (so they often match) and random ones.
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if text and rng.random() < 0.7:
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 4)])
        else:
            stops.append(random_text(rng, rng.randint(1, 3)))
    ids = split_randomly(tok, tok.encode(text), rng)
    det, deltas, results = run(tok, chunked(ids, rng), stop=tuple(stops))
    full = tok.decode(ids)
    if det.stopped:
        assert det.stop_string in stops
        assert full.startswith(det.text + det.stop_string)
        assert all(results[results.index(True) :])
    else:
        assert det.text == full
    # Matching as text arrives never lets a complete stop string into the output.
    assert not any(s in det.text for s in stops)
    assert all("\ufffd" not in d for d in deltas)



def test_stop_matcher_agrees_with_a_brute_force_search():
    """StopMatcher (one KMP automaton per stop string) against the plain definition, on text
    over a two-letter alphabet fed in random pieces (self-overlapping strings such as "aab" or
    "abab" exercise the automaton's fall-backs): the earliest match ending in each piece, and
    the longest end of the text read that starts a stop string."""
    rng = random.Random(11)
    for _ in range(400):
        stops = tuple(dict.fromkeys("".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                                    for _ in range(rng.randint(1, 3))))
        matcher, text = StopMatcher(stops), ""
        while len(text) < 40:
            piece = "".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
            start = len(text)
            text += piece
            found = [(text.find(st, max(0, start - len(st) + 1)), i) for i, st in enumerate(stops)]
            found = sorted((pos, i) for pos, i in found if pos >= 0)
            got = matcher.feed(piece)
            if found:
                assert got == (found[0][0] - start, stops[found[0][1]]), (stops, text)
                break
            assert got is None
            assert matcher.partial() == max((k for st in stops for k in range(1, len(st))
                                             if text.endswith(st[:k])), default=0), (stops, text)


def test_a_long_stop_string_costs_memory_linear_in_its_length(tok):
    """Before, the detokenizer built every prefix of every stop string: 40,000 characters cost
    +773 MB. Now one automaton per string: a few bytes per character."""
    import tracemalloc

    stop = "ab" * 4000 + "c"  # 8,001 characters: every prefix would be ~32 MB
    tracemalloc.start()
    try:
        det = IncrementalDetokenizer(tok, [], stop=(stop,))
        ids = byte_ids(tok, "ab" * 50)
        for i in range(0, len(ids), 3):
            det.add(ids[i:i + 3])
            det.pop_delta(finished=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak
    assert det.pop_delta(finished=False) == ""  # all of it may still become the stop string
    assert det.pop_delta(finished=True) == "ab" * 50 and not det.stopped


def word_tokenizer(decoder) -> PreTrainedTokenizerFast:
    """Words w0..w99 (whitespace-split), decoded with `decoder`: WordPiece joins with spaces,
    Metaspace (SentencePiece) drops the space at the start of a decode."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(100)}, **{f"\u2581w{i}": i + 101 for i in range(100)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["wordpiece", "metaspace", "bytelevel"])
def test_continuation_equals_the_incremental_text_and_continues_the_prompt(tok, kind):
    """generate() (one decode) and stream() (incremental) must give the same text, and that text
    continues the prompt (vLLM's convention): decode(prompt + output) == decode(prompt) + text.
    A decode of the output alone differs for these decoders (no leading space)."""
    rng = random.Random(7)
    if kind == "bytelevel":
        t = tok
        prompt, out = t.encode("Hello world"), t.encode(" the quick brown fox")
    else:
        t = word_tokenizer(decoders.WordPiece() if kind == "wordpiece" else decoders.Metaspace())
        base = 1 if kind == "wordpiece" else 101
        prompt = [base + rng.randrange(100) for _ in range(4)]
        out = [base + rng.randrange(100) for _ in range(7)]
    det = IncrementalDetokenizer(t, prompt)
    streamed = "".join(det.pop_delta(finished=False) for _ in [det.add([i]) for i in out]) + det.pop_delta(True)
    text = detokenize_continuation(t, prompt, out)
    assert streamed == det.text == text
    assert detokenize(t, prompt + out) == detokenize(t, prompt) + text
    if kind != "bytelevel":
        assert text.startswith(" ") and not detokenize(t, out).startswith(" ")
