"""What LLM.chat() checks before it renders a conversation with the tokenizer's chat template: the
messages (a template would mangle or drop a bad one without a word) and the keyword arguments
(Jinja would ignore a misspelt `enable_thinkng` silently)."""

from __future__ import annotations

from nanovllm.limits import check_unicode, clip_repr

_CHAT_ROLES = ("system", "user", "assistant", "tool")
# apply_chat_template arguments that chat() fixes (text out, generation prompt on).
_CHAT_FIXED_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
                                "truncation", "max_length"})
# Names every template sees from transformers, not options a caller would pass.
_CHAT_TEMPLATE_BUILTINS = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now",
                                     "bos_token", "eos_token", "unk_token", "pad_token"})


def check_conversation(conv, where: str) -> None:
    """A clear error for a message the template would mangle or drop without a word (a
    missing or non-text content renders as empty, an unknown role vanishes in Qwen3's)."""
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
        if not isinstance(content, str) and not (calls_tools and content is None):
            raise TypeError(f"{where}, message {j}: content must be a string, got {type(content).__name__}")
        if isinstance(content, str):
            check_unicode(content, f"{where}, message {j}: content")


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


def check_template_kwargs(template, kwargs: dict) -> None:
    """A TypeError for keywords chat() sets itself, and for ones the chat template never
    reads (Jinja would ignore a misspelt `enable_thinkng` or `sampling_param` silently)."""
    taken = sorted(_CHAT_FIXED_KWARGS & kwargs.keys())
    if taken:
        raise TypeError(f"chat() got {', '.join(taken)}: it renders the template as text with the "
                        "generation prompt itself")
    if not kwargs.keys() - {"chat_template"}:
        return  # nothing the template could fail to read; skip parsing it (milliseconds per chat request)
    given = kwargs.get("chat_template")  # a template's text, or the name of one of the tokenizer's
    if given is not None:
        template = template[given] if isinstance(template, dict) and given in template else given
    used = template_variables(template)
    if used is None:
        return  # no template, or one this check cannot parse: apply_chat_template decides
    unknown = sorted(k for k in kwargs if k not in used and k != "chat_template")
    if unknown:
        options = sorted(used - _CHAT_TEMPLATE_BUILTINS)
        raise TypeError(f"chat() got keyword arguments the chat template does not use: {', '.join(unknown)} "
                        f"(template variables: {', '.join(options) or 'none'})")
