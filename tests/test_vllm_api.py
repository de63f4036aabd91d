"""nano-vllm as a drop-in for scripts written against vLLM's offline API (CPU, tiny model).

vLLM's quick-start runs unchanged (import line and model path aside); generate / chat / stream
return RequestOutput objects with vLLM's fields that still read as nano-vllm's dicts; vLLM's
prompt dicts, LLM keywords, SamplingParams fields (settable after construction), stop_reason,
the text options, the model's generation defaults, get_tokenizer and reset_prefix_cache; unknown
fields are a TypeError, vLLM fields nano-vllm lacks a NotImplementedError, bad values raise
before any work and leave the engine usable.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import (  # noqa: E402
    EOS_IDS,
    assert_idle,
    copy_checkpoint,
    edit_json,
    greedy,
    make_llm,
    rand_ids,
)

import nanovllm  # noqa: E402
from nanovllm import CompletionOutput, RequestOutput, SamplingParams, StreamOutput  # noqa: E402
from nanovllm.sampling_params import NOT_IMPLEMENTED  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def count_launches(monkeypatch, llm) -> list:
    calls = []
    real = llm.model_runner.launch
    monkeypatch.setattr(llm.model_runner, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# vLLM's offline quick-start (docs: getting_started/quickstart, examples/offline_inference/basic.py),
# with only the import line's package and the model path changed.
QUICKSTART = '''
from nanovllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=MODEL)

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''

# vLLM's basic_with_model_default_sampling.py: the model's defaults, a field changed afterwards.
DEFAULT_SAMPLING = '''
from nanovllm import LLM

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
llm = LLM(model=MODEL, generation_config="auto")
sampling_params = llm.get_default_sampling_params()
sampling_params.temperature = 0.5
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


@pytest.mark.parametrize("script", [QUICKSTART, DEFAULT_SAMPLING], ids=["quickstart", "default_sampling"])
def test_vllm_offline_scripts_run_unchanged(ckpt, script):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<vllm script>", "exec"), {"__name__": "__main__", "MODEL": ckpt})
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("Prompt: '") and "Generated text: '" in line for line in lines)


def test_request_output_has_vllms_fields_and_reads_as_nanovllms_dict(llm):
    prompts = ["Hello, world!", rand_ids(9, 800)]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert len({o.request_id for o in outs}) == 2 and all(isinstance(o.request_id, str) for o in outs)
    text_out, ids_out = outs
    assert text_out.prompt == "Hello, world!" and ids_out.prompt is None  # vLLM: no text for token prompts
    assert ids_out.prompt_token_ids == prompts[1]
    for o in outs:
        assert isinstance(o, RequestOutput) and isinstance(o, dict)
        assert o.finished is True and o.prompt_logprobs is None and isinstance(o.num_cached_tokens, int)
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
        assert c.cumulative_logprob is None and c.logprobs is None
        assert c.finish_reason == "length" and c.stop_reason is None
        # nano-vllm's form: the dict reads the first completion and the prompt.
        assert o["text"] == c.text and o["token_ids"] == c.token_ids and o["finish_reason"] == c.finish_reason
        assert o["stop_reason"] is None and o["prompt_token_ids"] == o.prompt_token_ids
        assert {"text", "token_ids", "finish_reason", "prompt_token_ids"} <= set(o)
        assert dict(o)["text"] == c.text
        again = pickle.loads(pickle.dumps(o))
        assert again == o and again["text"] == o["text"] and again.outputs == o.outputs
    assert text_out.outputs[0].text == llm.tokenizer.decode(text_out.outputs[0].token_ids, skip_special_tokens=True)
    # chat() returns the same type.
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(3), use_tqdm=False)[0]
    assert isinstance(chat, RequestOutput) and len(chat.outputs[0].token_ids) == 3


def test_stream_outputs_are_vllm_deltas_with_nanovllms_fields(llm):
    prompts = ["Once upon a time", rand_ids(5, 801)]
    want = llm.generate(prompts, greedy(5), use_tqdm=False)
    incs = list(llm.stream(prompts, greedy(5)))
    for inc in incs:
        assert isinstance(inc, StreamOutput) and isinstance(inc, RequestOutput)
        assert len(inc.outputs) == 1 and inc.sample == inc.outputs[0].index == 0
        assert inc.text == inc.outputs[0].text and inc.token_ids == inc.outputs[0].token_ids
        assert inc["text"] == inc.text and inc.finish_reason == inc.outputs[0].finish_reason
    assert len({(inc.index, inc.request_id) for inc in incs}) == len({inc.request_id for inc in incs}) == 2
    for i, o in enumerate(want):
        mine = [inc for inc in incs if inc.index == i]
        assert "".join(inc.text for inc in mine) == o.outputs[0].text
        assert [t for inc in mine for t in inc.token_ids] == o.outputs[0].token_ids
        assert mine[-1].finished and not any(inc.finished for inc in mine[:-1])
        assert mine[0].prompt == (prompts[i] if isinstance(prompts[i], str) else None)


def test_vllm_prompt_dicts(llm):
    ids = rand_ids(7, 802)
    ref = llm.generate(["Hello, world!", ids], greedy(5), use_tqdm=False)
    outs = llm.generate([{"prompt": "Hello, world!"}, {"prompt_token_ids": ids}], greedy(5), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in ref]
    assert outs[0].prompt == "Hello, world!" and outs[1].prompt is None
    one = llm.generate({"prompt_token_ids": ids}, greedy(5), use_tqdm=False)  # a single dict is one prompt
    assert len(one) == 1 and one[0]["token_ids"] == ref[1]["token_ids"]
    with pytest.raises(NotImplementedError, match="multi_modal_data"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {"image": None}}], greedy(2), use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([{"prompt": "hi", "promt_token_ids": [1]}], greedy(2), use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": "1 2 3"}], greedy(2), use_tqdm=False)
    assert_idle(llm)


def _one_token(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_stop_reason_and_finish_reason_like_vllm(llm):
    """stop_reason: the stop string, or the stop token id; None for EOS and length."""
    tok = llm.tokenizer
    a = _one_token(tok, "a")
    forced = dict(allowed_token_ids=[a], temperature=0.0, max_tokens=6)
    by_string = llm.generate(["x"], SamplingParams(stop=["aa"], **forced), use_tqdm=False)[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason, by_string.text) == ("stop", "aa", "")
    assert by_string.token_ids == [a, a]
    kept = llm.generate(["x"], SamplingParams(stop=["aa"], include_stop_str_in_output=True, **forced),
                        use_tqdm=False)[0].outputs[0]
    assert (kept.finish_reason, kept.stop_reason, kept.text) == ("stop", "aa", "aa")
    streamed = "".join(i.text for i in llm.stream(["x"], SamplingParams(stop=["aa"], include_stop_str_in_output=True,
                                                                          **forced)))
    assert streamed == "aa"
    by_id = llm.generate(["x"], SamplingParams(stop_token_ids=[a], **forced), use_tqdm=False)[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids) == ("stop", a, [a])
    eos = EOS_IDS[0]
    by_eos = llm.generate(["x"], SamplingParams(allowed_token_ids=[eos], temperature=0.0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0]
    assert (by_eos.finish_reason, by_eos.stop_reason, by_eos.token_ids) == ("stop", None, [eos])
    by_length = llm.generate(["x"], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert (by_length.finish_reason, by_length.stop_reason) == ("length", None)


def test_text_options(llm):
    eos = EOS_IDS[0]
    special = dict(allowed_token_ids=[eos], ignore_eos=True, temperature=0.0, max_tokens=2)
    kept = llm.generate(["x"], SamplingParams(skip_special_tokens=False, **special), use_tqdm=False)[0]
    assert kept["text"] == "<|im_end|><|im_end|>"
    assert llm.generate(["x"], SamplingParams(**special), use_tqdm=False)[0]["text"] == ""
    streamed = "".join(i.text for i in llm.stream(["x"], SamplingParams(skip_special_tokens=False, **special)))
    assert streamed == kept["text"]
    # A fast tokenizer's decoder decides the spacing (as in vLLM): accepted, same text here.
    assert llm.generate(["x"], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False,
                                              **special), use_tqdm=False)[0]["text"] == kept["text"]
    quiet = llm.generate(["Hello"], greedy(4, detokenize=False), use_tqdm=False)[0]
    assert quiet["text"] == "" and len(quiet["token_ids"]) == 4
    assert [i.text for i in llm.stream(["Hello"], greedy(4, detokenize=False))] == [""] * 4
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_generation_config_defaults_apply_without_sampling_params(ckpt, tmp_path, monkeypatch):
    path = copy_checkpoint(ckpt, tmp_path / "defaults")
    edit_json(os.path.join(path, "generation_config.json"),
              lambda d: d.update(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.1, do_sample=True))
    llm = make_llm(path)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.min_p) == (0.6, 20, 0.95, 1.1, 0.0)
    assert llm.get_default_sampling_params() is not d  # a new object each time, free to change
    seen = []
    real = llm.requests.add
    monkeypatch.setattr(llm.requests, "add", lambda seq, *a: seen.append(seq.params) or real(seq, *a))
    llm.generate(["Hello"], use_tqdm=False)
    assert (seen[0].temperature, seen[0].top_k, seen[0].top_p, seen[0].repetition_penalty) == (0.6, 20, 0.95, 1.1)
    llm.generate(["Hello"], SamplingParams(), use_tqdm=False)  # explicit params win
    assert (seen[1].temperature, seen[1].top_k, seen[1].repetition_penalty) == (1.0, -1, 1.0)
    # Without those keys (the test checkpoints), or with generation_config="vllm": SamplingParams().
    assert make_llm(ckpt).get_default_sampling_params() == SamplingParams()
    assert make_llm(path, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    assert make_llm(ckpt, generation_config=path).get_default_sampling_params().top_k == 20  # another folder
    with pytest.raises(ValueError, match="generation_config"):
        make_llm(ckpt, generation_config="nowhere")
    edit_json(os.path.join(path, "generation_config.json"), lambda d: d.update(temperature=-1))
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        make_llm(path)


def test_llm_keywords_vllm_scripts_set(ckpt, tmp_path, llm):
    # tokenizer: another folder holds the tokenizer.
    bare = copy_checkpoint(ckpt, tmp_path / "no_tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        os.remove(os.path.join(bare, f))
    with pytest.raises(ValueError, match="tokenizer"):
        make_llm(bare)
    other = make_llm(bare, tokenizer=ckpt, tokenizer_mode="slow", trust_remote_code=True, revision="main")
    assert other.get_tokenizer() is other.tokenizer is not None
    a = other.generate(["Hello, world!"], greedy(5), use_tqdm=False)[0]
    b = llm.generate(["Hello, world!"], greedy(5), use_tqdm=False)[0]
    assert (a["token_ids"], a["text"]) == (b["token_ids"], b["text"])
    for bad in (dict(tokenizer_mode="mistral"), dict(revision=3), dict(tokenizer=5), dict(max_logprobs=-2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_llm(ckpt, **bad)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        make_llm(bare, tokenizer=str(tmp_path / "missing"))
    with pytest.raises(NotImplementedError, match="swap_space=4: nano-vllm preempts a request by recompute"):
        make_llm(ckpt, swap_space=4)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\): max_num_seq\. Known"):
        make_llm(ckpt, max_num_seq=4)


def test_reset_prefix_cache(llm):
    prompt = rand_ids(40, 803)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 32
    it = llm.stream([prompt], greedy(3))
    next(it)
    assert llm.reset_prefix_cache() is False  # blocks in use: nothing is forgotten
    it.close()
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    assert_idle(llm)


def test_sampling_params_set_after_construction(llm, monkeypatch):
    sp = SamplingParams()
    sp.max_tokens = 5
    sp.temperature = 0.0
    sp.ignore_eos = True
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0]
    assert out["token_ids"] == llm.generate(["Hello"], greedy(5), use_tqdm=False)[0]["token_ids"]
    # Changing it while its requests run changes nothing for them (the engine has its own copy).
    it = llm.stream(["Hello"], sp)
    first = next(it)
    sp.max_tokens = 1
    sp.temperature = 1.0
    rest = list(it)
    assert [t for i in [first, *rest] for t in i.token_ids] == out["token_ids"]
    # A bad value set afterwards is caught when the request is added, before any work.
    launches = count_launches(monkeypatch, llm)
    sp.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["Hello"], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.stream(["Hello"], sp)
    assert not launches
    monkeypatch.undo()
    assert_idle(llm)


def test_unknown_and_unimplemented_fields():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)
    sp = SamplingParams()
    with pytest.raises(AttributeError, match="temprature"):
        sp.temprature = 0.5
    for name in ("best_of", "logits_processors", "guided_decoding",
                 "truncate_prompt_tokens", "use_beam_search"):
        value = {"best_of": 2, "use_beam_search": True}.get(name, object())
        with pytest.raises(NotImplementedError, match=name):
            SamplingParams(**{name: value})
        with pytest.raises(NotImplementedError, match=name):
            setattr(sp, name, value)
    # Their "off" values ask for nothing and are accepted.
    SamplingParams(**NOT_IMPLEMENTED)
    assert set(nanovllm.__all__) >= {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"}


def _sp(**kw):
    kw.setdefault("max_tokens", 2)
    return SamplingParams(**kw)


BAD = {
    "logprobs_past_max": (lambda V: _sp(logprobs=21), ValueError, "max_logprobs"),
    "prompt_logprobs_whole_vocabulary": (lambda V: _sp(prompt_logprobs=-1), ValueError, "max_logprobs"),
    "logit_bias_id_past_vocab": (lambda V: _sp(logit_bias={V: 1.0}), ValueError, "logit_bias.*vocab"),
    "allowed_id_past_vocab": (lambda V: _sp(allowed_token_ids=[1, V + 3]), ValueError, "allowed_token_ids.*vocab"),
    "stop_id_past_vocab": (lambda V: _sp(stop_token_ids=[V]), ValueError, "stop_token_ids.*vocab"),
    "n_past_max_num_seqs": (lambda V: _sp(n=600), ValueError, "max_num_seqs"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_raise_before_any_work_and_the_engine_stays_usable(llm, monkeypatch, case):
    make, exc, pattern = BAD[case]
    launches = count_launches(monkeypatch, llm)
    with pytest.raises(exc, match=pattern):
        llm.generate(["Hello", rand_ids(4, 804)], [greedy(2), make(llm.vocab_size)], use_tqdm=False)
    assert not launches
    monkeypatch.undo()
    assert_idle(llm)
    assert len(llm.generate(["Hello"], greedy(2), use_tqdm=False)[0]["token_ids"]) == 2


@pytest.mark.parametrize("bad", [dict(n=0), dict(logprobs=-2), dict(logprobs=1.5), dict(logprobs=False),
                                 dict(prompt_logprobs="5"), dict(detokenize=1), dict(skip_special_tokens=None),
                                 dict(include_stop_str_in_output="yes"), dict(spaces_between_special_tokens=0)])
def test_bad_field_values_at_construction(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bad_words_need_a_tokenizer(ckpt):
    raw = make_llm(ckpt, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words"):
        raw.generate([[1, 2]], SamplingParams(bad_words=["x"], max_tokens=2), use_tqdm=False)
    out = raw.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)[0]
    assert out["text"] == "" and all(v.decoded_token is None for e in out.outputs[0].logprobs for v in e.values())
    assert_idle(raw)
