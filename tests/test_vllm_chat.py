"""vLLM's `LLM.chat()` signature (drop-in round 2): chat_template_kwargs, add_generation_prompt,
continue_final_message, tools, documents, content parts, chat_template_content_format,
lora_request=None; outputs carry the rendered prompt. The reference for every rendering is the
tokenizer's own apply_chat_template (transformers) with the same arguments."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONV = [{"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."}]

# vLLM's examples/offline_inference/basic/chat.py, with the import line and the model changed,
# and Qwen3's documented way to turn thinking off.
CHAT_SCRIPT = '''
from nanovllm import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(temperature=0.5, max_tokens=8)
conversation = CONV
outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


def rendered(tok, conv, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(conv, tokenize=False, **kwargs)


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_vllms_chat_example_runs_and_reports_the_rendered_prompt(ckpt, llm):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(CHAT_SCRIPT, "<vllm chat.py>", "exec"), {"__name__": "__main__", "MODEL": ckpt, "CONV": CONV})
    want = rendered(llm.tokenizer, CONV, enable_thinking=False)
    assert out.getvalue().startswith(f"Prompt: {want!r}, Generated text: '")


def test_chat_template_kwargs_equal_generate_on_the_rendered_prompt(llm):
    tok = llm.tokenizer
    for thinking in (False, True):
        text = rendered(tok, CONV, enable_thinking=thinking)
        out = llm.chat(CONV, greedy(8), use_tqdm=False, chat_template_kwargs={"enable_thinking": thinking})[0]
        ref = llm.generate([ids_of(tok, text)], greedy(8), use_tqdm=False)[0]
        assert out.prompt == text and out.prompt_token_ids == ids_of(tok, text)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # nano-vllm's earlier form (the variable as a keyword of chat()) renders the same
        old = llm.chat(CONV, greedy(8), use_tqdm=False, enable_thinking=thinking)[0]
        assert old.prompt == text and old.outputs[0].token_ids == out.outputs[0].token_ids
    assert_idle(llm)


def test_generation_prompt_and_continuing_the_final_message(llm):
    tok = llm.tokenizer
    no_prompt = llm.chat(CONV, greedy(4), use_tqdm=False, add_generation_prompt=False)[0]
    assert no_prompt.prompt == rendered(tok, CONV, add_generation_prompt=False)
    assert no_prompt.prompt != rendered(tok, CONV)
    partial = CONV + [{"role": "assistant", "content": "Higher education is"}]
    cont = llm.chat(partial, greedy(4), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    text = rendered(tok, partial, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt == text and text.endswith("Higher education is")
    assert cont.outputs[0].token_ids == llm.generate([ids_of(tok, text)], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt=True and continue_final_message=True"):
        llm.chat(partial, greedy(4), use_tqdm=False, continue_final_message=True)
    assert_idle(llm)


def test_tools_documents_and_a_template_that_does_not_read_them(llm):
    tok = llm.tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    out = llm.chat(CONV, greedy(4), use_tqdm=False, tools=tools, documents=[{"title": "a", "text": "b"}])[0]
    assert out.prompt == rendered(tok, CONV, tools=tools, documents=[{"title": "a", "text": "b"}])
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    plain = llm.chat(CONV, greedy(4), use_tqdm=False, chat_template=template, tools=tools)[0]
    assert plain.prompt == rendered(tok, CONV, chat_template=template)  # tools it never reads: no error, no change
    with pytest.raises(TypeError, match="tools"):
        llm.chat(CONV, greedy(4), use_tqdm=False, tools={"name": "not a list"})


def test_openai_content_parts(llm):
    tok = llm.tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    out = llm.chat(parts, greedy(4), use_tqdm=False)[0]
    assert out.prompt == rendered(tok, joined)
    template = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    raw = llm.chat(parts, greedy(4), use_tqdm=False, chat_template=template, chat_template_content_format="openai")[0]
    assert raw.prompt == "<Hello><there>"
    with pytest.raises(NotImplementedError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(4))
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(parts, greedy(4), chat_template_content_format="xml")
    assert_idle(llm)


def test_template_keywords_are_still_checked(llm, refs=None):
    with pytest.raises(TypeError, match=r"enable_thinkng.*template variables: .*enable_thinking"):
        llm.chat(CONV, greedy(4), use_tqdm=False, chat_template_kwargs={"enable_thinkng": False})
    with pytest.raises(TypeError, match="add_generation_prompt: pass as chat"):
        llm.chat(CONV, greedy(4), use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(CONV, greedy(4), use_tqdm=False, chat_template_kwargs=[("enable_thinking", False)])
    assert_idle(llm)
    assert len(llm.generate(["Hello"], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_lora_request_none_is_accepted_and_an_adapter_needs_enable_lora(llm):
    from nanovllm.lora.request import LoRARequest
    from nanovllm.sampling_params import BeamSearchParams

    out = llm.generate(["Hello"], greedy(3), use_tqdm=False, lora_request=None)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.chat(CONV, greedy(3), use_tqdm=False, lora_request=None)[0].outputs[0].token_ids
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    for call in (lambda: llm.generate(["Hello"], greedy(3), lora_request=adapter),
                 lambda: llm.chat(CONV, SamplingParams(max_tokens=3), lora_request=adapter)):
        with pytest.raises(ValueError, match="enable_lora=True"):
            call()
    with pytest.raises(NotImplementedError, match="not supported here yet"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=adapter)
    assert_idle(llm)  # (tests/test_lora.py: adapters served)
