"""How LLM.chat() turns a conversation into a prompt, in vLLM's terms: the checks of the messages
(a template would mangle or drop a bad one without a word) and of the template's keyword
arguments (Jinja would ignore a misspelt `enable_thinkng` silently), OpenAI's content parts, and
the rendering through the tokenizer's chat template. Loaded at the first chat (wiring/): a
plain generate needs none of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.limits import check_unicode, clip_repr

_CHAT_ROLES = ("system", "user", "assistant", "tool")
CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template arguments chat() sets itself (text out), or takes as parameters of its own.
_CHAT_FIXED_KWARGS = frozenset({"conversation", "tokenize", "return_dict", "return_tensors",
                                "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
_CHAT_PARAMETERS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "documents"})
# Names every template sees from transformers, not options a caller would pass.
_CHAT_TEMPLATE_BUILTINS = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now",
                                     "bos_token", "eos_token", "unk_token", "pad_token", "tools", "documents"})


@dataclass
class ChatOptions:
    """How a conversation is rendered (vLLM's LLM.chat parameters). `template`: a template's
    text, or the name of one of the tokenizer's (None: its default). `content_format`: "auto"
    and "string" join a message's text parts with newlines (vLLM's string format); "openai"
    passes the parts to the template as they are. `kwargs`: the template's own variables
    (chat_template_kwargs), each checked to be one the template reads."""

    template: str | None = None
    content_format: str = "auto"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    documents: list | None = None
    kwargs: dict = field(default_factory=dict)

    def check(self, tokenizer_template) -> None:
        """A clear error for options that cannot render: before any work."""
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={clip_repr(self.content_format)}: must be one of "
                             f"{CONTENT_FORMATS}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt=True and continue_final_message=True cannot go together: the "
                             "one opens a new assistant turn, the other continues the last message")
        for name in ("tools", "documents"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of dicts or None, got {type(value).__name__}")
        if not isinstance(self.kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(self.kwargs).__name__}")
        own = self.template is None or (isinstance(tokenizer_template, dict) and self.template in tokenizer_template)
        check_template_kwargs(tokenizer_template if own else self.template, self.kwargs, named=self.template)

    def render(self, tokenizer, conversation: list) -> tuple[list[int], str]:
        """(token ids, text) of the prompt: the template's text, tokenized without added special
        tokens (the template writes them)."""
        messages = conversation if self.content_format == "openai" else [_as_string_content(m) for m in conversation]
        extra = {k: v for k, v in (("tools", self.tools), ("documents", self.documents)) if v is not None}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=self.add_generation_prompt,
                                                 continue_final_message=self.continue_final_message,
                                                 chat_template=self.template, **extra, **self.kwargs)
        except Exception as e:  # noqa: BLE001 (the template's raise_exception, a Jinja error: the input's fault)
            raise ValueError(f"the chat template could not render this conversation: {type(e).__name__}: "
                             f"{clip_repr(str(e), chars=300)}") from None
        return tokenizer.encode(text, add_special_tokens=False), text


def _as_string_content(message: dict) -> dict:
    content = message.get("content")
    if not isinstance(content, (list, tuple)):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def check_conversation(conv, where: str) -> None:
    """A clear error for a message the template would mangle or drop without a word (a
    missing or non-text content renders as empty, an unknown role vanishes in Qwen3's).
    Content is a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if not isinstance(conv, (list, tuple)) or not conv:
        raise TypeError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts")
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise TypeError(f"{where}, message {j}: must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise ValueError(f"{where}, message {j}: role must be one of {', '.join(_CHAT_ROLES)}, "
                             f"got {clip_repr(role)}")
        content = m.get("content")
        calls_tools = role == "assistant" and bool(m.get("tool_calls"))
        if isinstance(content, (list, tuple)):
            _check_parts(content, f"{where}, message {j}")
        elif not isinstance(content, str) and not (calls_tools and content is None):
            raise TypeError(f"{where}, message {j}: content must be a string or a list of text parts, "
                            f"got {type(content).__name__}")
        elif isinstance(content, str):
            check_unicode(content, f"{where}, message {j}: content")


def _check_parts(parts, where: str) -> None:
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if kind is not None:
                raise NotImplementedError(f"{where}, part {k}: content parts of type {clip_repr(kind)} are not "
                                          f"supported (nano-vllm runs text models: only 'text' parts)")
            raise TypeError(f"{where}, part {k}: must be a dict {{'type': 'text', 'text': ...}}")
        if not isinstance(part.get("text"), str):
            raise TypeError(f"{where}, part {k}: 'text' must be a string")
        check_unicode(part["text"], f"{where}, part {k}")


def template_variables(template) -> set[str] | None:
    """The variables a Jinja chat template reads (over all of them if the tokenizer has several
    named ones), or None when there is no template or it does not parse here."""
    if template is None:
        return None
    templates = template.values() if isinstance(template, dict) else [template]
    try:
        from jinja2 import Environment, meta

        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return set().union(*(meta.find_undeclared_variables(env.parse(t)) for t in templates))
    except Exception:  # a template using transformers' own tags, say: no check rather than a false alarm
        return None


def check_template_kwargs(template, kwargs: dict, named: str | None = None) -> None:
    """A TypeError for keywords chat() sets itself or takes as parameters, and for ones the
    template never reads (Jinja would ignore a misspelt `enable_thinkng` silently). `template`:
    the text of the template (or the tokenizer's dict of named ones, `named` picking one)."""
    taken = sorted(_CHAT_FIXED_KWARGS & kwargs.keys())
    if taken:
        raise TypeError(f"chat() got {', '.join(taken)}: it renders the template as text itself")
    own = sorted(_CHAT_PARAMETERS & kwargs.keys())
    if own:
        raise TypeError(f"{', '.join(own)}: pass as chat()'s own parameter(s), not among the template's keywords")
    if not kwargs:
        return  # nothing the template could fail to read; skip parsing it (milliseconds per chat request)
    if isinstance(template, dict) and named in template:
        template = template[named]
    used = template_variables(template)
    if used is None:
        return  # no template, or one this check cannot parse: apply_chat_template decides
    unknown = sorted(k for k in kwargs if k not in used)
    if unknown:
        options = sorted(used - _CHAT_TEMPLATE_BUILTINS)
        raise TypeError(f"chat() got keyword arguments the chat template does not use: {', '.join(unknown)} "
                        f"(template variables: {', '.join(options) or 'none'})")


def chat_requests(front, messages, sampling_params, options: ChatOptions, mm_processor_kwargs=None) -> list:
    """LLM.chat's requests: (token ids, checked params, rendered prompt) per conversation of
    `messages` (one conversation, or a list of them), every one checked before any work."""
    if mm_processor_kwargs:
        raise NotImplementedError("mm_processor_kwargs: nano-vllm runs text models only")
    if front.tokenizer is None:
        raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts or of such lists")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(conversations):
        check_conversation(conv, f"conversation {i}" if len(conversations) > 1 else "messages")
    options.check(front.tokenizer.chat_template)
    rendered = [options.render(front.tokenizer, conv) for conv in conversations]
    requests = front._normalize([{"prompt_token_ids": ids} for ids, _ in rendered], sampling_params)
    return [(ids, p, text) for (ids, p, _), (_, text) in zip(requests, rendered)]


def chat_prompt_ids(front, messages, chat_template_kwargs: dict) -> list[int]:
    """The prompt tokens chat() generates from for one conversation (checked as chat() checks
    it; keywords `chat_template` and `tools` as chat()'s): what the server renders."""
    if front.tokenizer is None:
        raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
    check_conversation(messages, "messages")
    kwargs = dict(chat_template_kwargs)
    options = ChatOptions(template=kwargs.pop("chat_template", None), tools=kwargs.pop("tools", None), kwargs=kwargs)
    options.check(front.tokenizer.chat_template)
    return options.render(front.tokenizer, messages)[0]
