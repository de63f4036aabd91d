"""Structured outputs, tool calls and reasoning through the server, with the official `openai`
client (a server subprocess on 127.0.0.1, tiny random Qwen3 with a byte-level BPE tokenizer).
Outputs are checked by independent readers (json, jsonschema, re, pydantic); tool-call and
reasoning parsers also on their own. Every request is bounded in time."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nanovllm.features.reasoning import ReasoningSplitter, split_reasoning  # noqa: E402
from nanovllm.features.tools.parsers import parse_tool_calls  # noqa: E402
from nanovllm.serve.launcher import ServerProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--device", "cpu", "--kvcache-block-size", "16", "--num-kvcache-blocks", "128", "--log-level", "warning"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "hello"}]


def _server(tmp_path_factory, *flags):
    path = tm.make_tiny_qwen3(tmp_path_factory.mktemp("serve_structured"), num_layers=2, seed=11)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return path, ServerProcess(path, ARGS + list(flags), timeout=180, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, proc = _server(tmp_path_factory, "--reasoning-parser", "qwen3")
    yield path, openai.OpenAI(base_url=proc.url + "/v1", api_key="none", timeout=60, max_retries=0)
    proc.stop(30)


def chat(served, **kw):
    path, client = served
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 120)
    kw.setdefault("extra_body", {})
    kw["extra_body"].setdefault("chat_template_kwargs", {"enable_thinking": False})
    return client.chat.completions.create(model=path, **kw)


def test_response_format_json_schema_and_pydantic_parse(served):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["name", "n"]}
    for seed in range(3):
        r = chat(served, seed=seed, temperature=1.0,
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content, strict=False), schema)

    class Point(pydantic.BaseModel):
        x: int
        label: bool

    path, client = served
    r = client.beta.chat.completions.parse(model=path, messages=USER, max_tokens=120, response_format=Point,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(r.choices[0].message.parsed, Point)
    obj = chat(served, response_format={"type": "json_object"}, max_tokens=200, temperature=0.8, seed=1,
               extra_body={"structured_outputs": None})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content,
                                                                            strict=False), dict)


def test_extra_body_structured_outputs_and_the_guided_names_on_both_endpoints(served):
    path, client = served
    r = client.completions.create(model=path, prompt="hi", max_tokens=20, n=3, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert {c.text for c in r.choices} <= {"alpha", "beta"}
    r = client.completions.create(model=path, prompt="hi", max_tokens=20, extra_body={"guided_regex": r"\d{3}-[ab]"})
    assert re.fullmatch(r"\d{3}-[ab]", r.choices[0].text)
    r = chat(served, extra_body={"guided_json": SCHEMAS["add"]})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["add"])
    stream = chat(served, stream=True, extra_body={"structured_outputs": {"regex": "[xyz]{5}"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch("[xyz]{5}", text)


@pytest.mark.parametrize("body, needle", [
    ({"extra_body": {"guided_regex": "(ab"}}, "parenthesis"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"extra_body": {"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}}, "one output constraint"),
    ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "regexp"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function"}]}, "tools\\[0\\]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": None}}, "tool_choice must be"),
])
def test_bad_constraints_and_tool_choices_are_a_400_naming_them(served, body, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        chat(served, **body)
    assert chat(served, max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_named_and_required_tool_calls_have_valid_arguments(served):
    r = chat(served, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1.0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
    for seed, parallel in ((0, False), (1, True), (2, True)):
        r = chat(served, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200,
                 parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments, strict=False), SCHEMAS[c.function.name])
    stream = chat(served, tools=TOOLS, tool_choice="required", stream=True, seed=3, temperature=1.0, max_tokens=200)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert calls and deltas[-1].finish_reason == "tool_calls"
    for t in calls:
        jsonschema.validate(json.loads(t.function.arguments, strict=False), SCHEMAS[t.function.name])


def test_auto_parses_the_call_the_model_was_made_to_write(served):
    """tool_choice "auto": the model is forced (a regex) to write a Hermes call among text; the
    server reads it out into tool_calls, streamed too."""
    pattern = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'
    for stream in (False, True):
        r = chat(served, tools=TOOLS, stream=stream, extra_body={"structured_outputs": {"regex": pattern}})
        if stream:
            deltas = [c.choices[0] for c in r if c.choices]
            content = "".join(d.delta.content or "" for d in deltas)
            calls, finish = [t for d in deltas for t in (d.delta.tool_calls or [])], deltas[-1].finish_reason
        else:
            content, calls, finish = (r.choices[0].message.content, r.choices[0].message.tool_calls,
                                      r.choices[0].finish_reason)
        assert content == "Sure." and finish == "tool_calls"
        (call,) = calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])


def test_the_constraint_applies_after_the_reasoning(served):
    """--reasoning-parser qwen3, thinking on: the output is free until </think> (here made the
    first token by a logit bias), then follows the constraint; thinking off (the template closes
    the reasoning in the prompt): constrained from the first token, no reasoning_content."""
    path, _ = served
    end = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("</think>")
    r = chat(served, extra_body={"structured_outputs": {"regex": "[pq]{4}"}, "chat_template_kwargs": {}},
             logit_bias={str(end): 100.0})
    assert re.fullmatch("</think>[pq]{4}", r.choices[0].message.content), r.choices[0].message
    r = chat(served, extra_body={"structured_outputs": {"regex": "[pq]{4}"}})
    assert re.fullmatch("[pq]{4}", r.choices[0].message.content) and r.choices[0].message.reasoning_content is None


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_a_choice_with_reasoning_and_a_tool_call_streams_what_the_message_says(mode):
    """ChoiceText on its own: the message of a whole text, and the deltas of its pieces, agree
    (reasoning streamed as it comes; the answer held while tool calls may be in it)."""
    from nanovllm.serve.chat_outputs import ChatTools, ChoiceText

    text = '<think>\nweigh it\n</think>\n\nOn it. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    tools = ChatTools(mode, "hermes", "qwen3")
    whole = ChoiceText(tools)
    message = whole.message(text)
    assert message["reasoning_content"] == "weigh it\n"
    pieces = ChoiceText(tools)
    deltas = [pieces.delta(text[i:i + 3]) for i in range(0, len(text), 3)] + [pieces.last_delta()]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]
    assert (message["content"], len(calls)) == (("On it.", 1) if mode == "auto" else (text.split("\n\n", 1)[1], 0))
    assert mode != "auto" or any(d.get("content") == "On" for d in deltas[:12])  # the answer streamed before the call
    assert pieces.finish_reason("stop") == ("tool_calls" if mode == "auto" else "stop")


def test_tool_call_parsers():
    content, calls = parse_tool_calls('I will. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "g", "arguments": {}}</tool_call> done')
    assert content == "I will. done" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"y": 2}}', "llama3_json")
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"y": 2}
    assert parse_tool_calls("just text", "llama3_json") == ("just text", [])
    with pytest.raises(ValueError, match="parser"):
        parse_tool_calls("x", "mistral")


@pytest.mark.parametrize("text", ["<think>\nstep one\nstep two\n</think>\n\nThe answer.", "No thinking here.",
                                  "<think>cut off mid-thought"])
def test_reasoning_splitter_streams_what_the_whole_split_gives(text):
    whole = split_reasoning(text)
    for size in (1, 2, 3, 7):
        s = ReasoningSplitter()
        parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
        streamed = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert streamed == whole, (size, streamed, whole)


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me check.  <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>'
               '{"name": "g", "arguments": {}}</tool_call> then done'),
    ("hermes", "no call here, only a <tool mention and <tool_call"),
    ("hermes", "  <tool_call>{broken}</tool_call> after"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"y": 2}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", "  plain words {not a call}"),
    ("llama3_json", '{"name": "search", "parameters": {"q": "a; b"}} ; {"name": "g", "parameters": {}}'),
    ("llama3_json", "{ not json either"),
])
def test_tool_call_splitters_stream_what_the_whole_parse_gives(parser, text):
    from nanovllm.features.tools.parsers import splitter

    content, calls = parse_tool_calls(text, parser)
    for size in (1, 2, 5, 11):
        s = splitter(parser)
        streamed = "".join(s.feed(text[i:i + size]) for i in range(0, len(text), size))
        tail, got = s.finish(bool(streamed))
        assert ((streamed + tail) or None, got) == (content, calls), (size, streamed, tail)


def test_a_stream_ending_with_held_text_adds_up_to_the_response(served):
    """The last piece and the text held back (a partial `<tool_` that never became a call) go
    out together in the last chunk."""
    kw = dict(tools=TOOLS, temperature=0, stop=["ok <tool_X"],
              extra_body={"structured_outputs": {"regex": "Sure thing ok <tool_"}})
    whole = chat(served, **kw).choices[0].message.content
    chunks = [c.choices[0] for c in chat(served, stream=True, **kw) if c.choices]
    assert whole == "Sure thing ok <tool_" == "".join(c.delta.content or "" for c in chunks)
